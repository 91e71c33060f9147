// attention_block on CUDA: the device-generic head-group loop with PyTorch's flash
// attention kernels for bfloat16 and float16 on sm80 and sm90, and its memory-efficient
// ones otherwise (float32, other GPUs; no float64; head dimensions a multiple of 4 in
// float32, of 8 in bf16/fp16).
#include <algorithm>
#include <array>
#include <mutex>

#include <ATen/ops/_flash_attention_backward.h>
#include <ATen/ops/_flash_attention_forward.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention.h>
#include <ATen/ops/_scaled_dot_product_efficient_attention_backward.h>
#include <ATen/ops/_scaled_dot_product_flash_attention.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_backward.h>
#include <ATen/ops/constant_pad_nd.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>
#include <cuda_runtime_api.h>

#include "ops/attention_block/attention_block.h"

namespace torch_offload {

// Checked before any work: SDPA's own front end checks the same; these private entry points do not.
void check_cuda_support(const char* op, const at::Tensor& x, const char* name, int64_t head_dim, const char* where) {
  TORCH_CHECK(x.scalar_type() != at::kDouble, op, ": ", name,
              " is float64, which CUDA's attention kernels do not support; use float32, bfloat16 or float16");
  const int64_t alignment = x.element_size() == 4 ? 4 : 8;
  TORCH_CHECK(head_dim % alignment == 0, op, ": the head dimension (", where, ") is ", head_dim,
              "; CUDA's attention kernels need a multiple of ", alignment, " for ", x.scalar_type());
}

int64_t cuda_device_memory(c10::DeviceIndex index) {
  // Asked once per device: cudaGetDeviceProperties is slow, and the answer never changes.
  static std::array<std::once_flag, C10_COMPILE_TIME_MAX_GPUS> asked;
  static std::array<int64_t, C10_COMPILE_TIME_MAX_GPUS> bytes;
  std::call_once(asked.at(index), [index] {
    cudaDeviceProp properties;
    C10_CUDA_CHECK(cudaGetDeviceProperties(&properties, index));
    bytes[index] = static_cast<int64_t>(properties.totalGlobalMem);
  });
  return bytes[index];
}

namespace {

void check_block_cuda_support(const char* op, const at::Tensor& x, const at::Tensor& cos) {
  // A cos of another rank: check_arguments names the problem.
  check_cuda_support(op, x, "x", cos.dim() == 3 ? cos.size(2) : 8, "cos's last dimension");
}

// Flash attention, as SDPA itself picks it: bf16/fp16 on the GPUs whose flash kernels
// ATen builds for every head dimension up to 256 (sm80 and sm90; sm86/sm89 lack the
// backward of the widest); q, k and v of one dtype, so the choice depends on q alone and
// backward makes the same one.
bool uses_flash(const at::Tensor& q) {
  if (q.scalar_type() != at::kHalf && q.scalar_type() != at::kBFloat16) {
    return false;
  }
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, q.get_device()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, q.get_device()));
  const bool flash_gpu = (major == 8 && minor == 0) || major == 9;
  return flash_gpu && q.size(-1) <= 256 && q.size(-1) % 8 == 0;
}

AttentionResult cuda_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                       bool causal) {
  if (uses_flash(q)) {
    auto [out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, seed, offset, debug_mask] =
        at::_scaled_dot_product_flash_attention(q, k, v, 0.0, causal, /*return_debug_mask=*/false, scale);
    return {out, logsumexp, {seed, offset}, {}};
  }
  auto [out, logsumexp, seed, offset] = at::_scaled_dot_product_efficient_attention(
      q, k, v, std::nullopt, /*compute_log_sumexp=*/true, 0.0, causal, scale);
  return {out, logsumexp, {seed, offset}, {}};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cuda_attention_backward(const at::Tensor& grad_out, const at::Tensor& q,
                                                                       const at::Tensor& k, const at::Tensor& v,
                                                                       const AttentionResult& result, double scale,
                                                                       bool causal) {
  const auto& [seed, offset] = result.aux;
  if (uses_flash(q)) {
    // Without cumulative sequence lengths (one sequence per batch row), the longest rows are the tensors' own.
    return at::_scaled_dot_product_flash_attention_backward(grad_out, q, k, v, result.out, result.logsumexp,
                                                            at::Tensor(), at::Tensor(), q.size(2), k.size(2), 0.0,
                                                            causal, seed, offset, scale);
  }
  // The memory-efficient kernels' log-sum-exp has its queries padded to a multiple of 32; one handed back by
  // attention_block_attend (restored_result) has the queries alone.
  const int64_t queries = result.logsumexp.size(-1), padded = (q.size(2) + 31) / 32 * 32;
  const at::Tensor logsumexp =
      queries < padded ? at::constant_pad_nd(result.logsumexp, {0, padded - queries}) : result.logsumexp;
  auto [dq, dk, dv, unused_bias_grad] =
      at::_scaled_dot_product_efficient_attention_backward(grad_out, q, k, v, at::Tensor(), result.out, logsumexp, seed,
                                                           offset, 0.0, {true, true, true, false}, causal, scale);
  return {dq, dk, dv};
}

// Flash attention's variable-length entry points, for the segments (packed documents, padding).
AttentionResult cuda_varlen_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const VarlenSequences& sequences, double scale, bool causal) {
  auto [out, logsumexp, seed, offset, debug_mask] = at::_flash_attention_forward(
      q, k, v, sequences.cut_q, sequences.cut_k, sequences.max_q, sequences.max_k, 0.0, causal,
      /*return_debug_mask=*/false, std::optional<double>(scale));
  return {out, logsumexp, {seed, offset}, {}};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cuda_varlen_backward(const at::Tensor& grad_out, const at::Tensor& q,
                                                                    const at::Tensor& k, const at::Tensor& v,
                                                                    const AttentionResult& result,
                                                                    const VarlenSequences& sequences, double scale,
                                                                    bool causal) {
  const auto& [seed, offset] = result.aux;
  return at::_flash_attention_backward(grad_out, q, k, v, result.out, result.logsumexp, sequences.cut_q,
                                       sequences.cut_k, sequences.max_q, sequences.max_k, 0.0, causal, seed, offset,
                                       std::optional<double>(scale));
}

const AttentionKernels cuda_attention_kernels{cuda_attention_forward, cuda_attention_backward, uses_flash,
                                              cuda_varlen_forward, cuda_varlen_backward};

}  // namespace

at::Tensor attention_block_cuda(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k,
                                const at::Tensor& w_v, const at::Tensor& w_o, const at::Tensor& cos,
                                const at::Tensor& sin, const std::optional<at::Tensor>& b_q,
                                const std::optional<at::Tensor>& b_k, const std::optional<at::Tensor>& b_v,
                                const std::optional<at::Tensor>& b_o, std::optional<double> scale,
                                const std::optional<at::Tensor>& segment_ids,
                                std::optional<c10::string_view> group_name, const std::optional<at::Tensor>& q_norm,
                                const std::optional<at::Tensor>& k_norm, double norm_eps,
                                const std::optional<at::Tensor>& attention,
                                const std::optional<at::Tensor>& logsumexp) {
  check_block_cuda_support("attention_block", x, cos);
  return attention_block_impl(cuda_attention_kernels, x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o, scale,
                              segment_ids, group_name, q_norm, k_norm, norm_eps, attention, logsumexp);
}

std::tuple<at::Tensor, at::Tensor> attention_block_attend_cuda(
    const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& cos,
    const at::Tensor& sin, const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_k,
    const std::optional<at::Tensor>& b_v, std::optional<double> scale, const std::optional<at::Tensor>& segment_ids,
    std::optional<c10::string_view> group_name, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, double norm_eps) {
  check_block_cuda_support("attention_block_attend", x, cos);
  return attention_block_attend_impl(cuda_attention_kernels, x, w_q, w_k, w_v, cos, sin, b_q, b_k, b_v, scale,
                                     segment_ids, group_name, q_norm, k_norm, norm_eps);
}

AttentionBlockGradients attention_block_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k,
    const at::Tensor& w_v, const at::Tensor& w_o, const at::Tensor& cos, const at::Tensor& sin,
    const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_k, const std::optional<at::Tensor>& b_v,
    const std::optional<at::Tensor>& b_o, std::optional<double> scale, const std::optional<at::Tensor>& segment_ids,
    std::array<bool, 11> output_mask, std::optional<c10::string_view> group_name,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double norm_eps,
    const std::optional<at::Tensor>& attention, const std::optional<at::Tensor>& logsumexp) {
  check_block_cuda_support("attention_block_backward", x, cos);
  return attention_block_backward_impl(cuda_attention_kernels, grad_out, x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v,
                                       b_o, scale, segment_ids, output_mask, group_name, q_norm, k_norm, norm_eps,
                                       attention, logsumexp);
}

at::Tensor segment_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& segment_ids, std::optional<double> scale,
                                  std::optional<double> softcap, const std::optional<at::Tensor>& sinks,
                                  std::optional<int64_t> window) {
  if (q.dim() == 4 && v.dim() == 4) {  // else the shared checks name the problem
    // The kernels run the wider of the two head dimensions (value's is padded to query's, or the reverse).
    check_cuda_support("segment_attention", q, "query", std::max(q.size(3), v.size(3)),
                       "query's or value's last dimension");
  }
  return segment_attention_impl(cuda_attention_kernels, q, k, v, segment_ids, scale, softcap, sinks, window);
}

SegmentAttentionGradients segment_attention_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& segment_ids, std::optional<double> scale, std::array<bool, 4> output_mask,
    std::optional<double> softcap, const std::optional<at::Tensor>& sinks, std::optional<int64_t> window) {
  if (q.dim() == 4 && v.dim() == 4) {
    // The kernels run the wider of the two head dimensions (value's is padded to query's, or the reverse).
    check_cuda_support("segment_attention_backward", q, "query", std::max(q.size(3), v.size(3)),
                       "query's or value's last dimension");
  }
  return segment_attention_backward_impl(cuda_attention_kernels, grad_out, q, k, v, segment_ids, scale, output_mask,
                                         softcap, sinks, window);
}

}  // namespace torch_offload
