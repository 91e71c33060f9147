#pragma once
// attention_block / attention_block_backward: a decoder layer's attention from its
// normalized input to its output projection (q/k/v projections, rotary embedding,
// causal attention, output projection), computed one group of heads at a time so
// that only one group's q, k, v and attention output exist at once. Backward saves
// only the inputs and recomputes each group. The loop (attention_block.cpp) is the
// same on every device; each device brings its attention kernels.
#include <functional>
#include <optional>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>

#include "torch_offload/torch_offload.h"

namespace torch_offload {

// Attention of one head group on one device: q [B, H, Tq, D], k and v [B, H, Tk, D]
// (already repeated for grouped-query attention), causal (Tq = Tk: each row, or segment of a
// row, a call per segment, is one causal sequence) or not (padding's queries over the real
// tokens before them). `aux` is whatever
// the device's backward needs besides out and the log-sum-exp.
struct AttentionResult {
  at::Tensor out, logsumexp;
  std::tuple<at::Tensor, at::Tensor> aux;
  // When the rows are cut into segments (segment_ids): one result per run, each without
  // its out (a view of the whole out); the whole's logsumexp and aux are then unused.
  std::vector<AttentionResult> pieces;
  // A variable-length piece's queries: their rows of the group's [B * T] (undefined: every row, in order).
  at::Tensor rows = {};
};
// Many sequences packed in one call's rows: q [total_q, H, D], k and v [total_k, H, D], the i-th
// sequence's queries rows cut_q[i] to cut_q[i + 1] (int32, on the device), its keys likewise.
struct VarlenSequences {
  at::Tensor cut_q, cut_k;
  int64_t max_q = 0, max_k = 0;  // the longest sequence's queries and keys
};
// Functions, not pointers: score_mod_kernels' carry their arguments.
struct AttentionKernels {
  std::function<AttentionResult(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                bool causal)>
      forward;
  // (dq, dk, dv)
  std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
      const AttentionResult& result, double scale, bool causal)>
      backward;
  // Variable-length kernels, for inputs like q where has_varlen says so (empty: never).
  std::function<bool(const at::Tensor& q)> has_varlen;
  std::function<AttentionResult(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const VarlenSequences& sequences, double scale, bool causal)>
      varlen_forward;
  std::function<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
      const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
      const AttentionResult& result, const VarlenSequences& sequences, double scale, bool causal)>
      varlen_backward;
};

// What changes attention's scores beyond the scale (segment_attention): logits soft-capped to
// softcap * tanh(s / softcap) (Gemma 2's; 0: none), a learned sink per head [heads] (GPT-OSS's):
// one more logit in each query's softmax, with no value, so it only takes weight from the keys, and a
// sliding window (0: none): in a causal run, query i sees keys i - window < j <= i.
struct ScoreMods {
  double softcap = 0;
  at::Tensor sinks;
  int64_t window = 0;

  bool any() const { return softcap > 0 || sinks.defined() || window > 0; }
};

// Attention with score mods on any device, in ATen: each query chunk's scores written out within a byte
// budget, so no [tokens, tokens] tensor exists. Backward adds the sinks' gradient into grad_sinks (float32
// or float64 [heads]) when it is defined.
AttentionKernels score_mod_kernels(const ScoreMods& mods, const at::Tensor& grad_sinks);

at::Tensor attention_block_impl(const AttentionKernels& kernels, const at::Tensor& x, const at::Tensor& w_q,
                                const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& w_o,
                                const at::Tensor& cos, const at::Tensor& sin, const std::optional<at::Tensor>& b_q,
                                const std::optional<at::Tensor>& b_k, const std::optional<at::Tensor>& b_v,
                                const std::optional<at::Tensor>& b_o, std::optional<double> scale,
                                const std::optional<at::Tensor>& segment_ids,
                                std::optional<c10::string_view> group_name, const std::optional<at::Tensor>& q_norm,
                                const std::optional<at::Tensor>& k_norm, double norm_eps,
                                const std::optional<at::Tensor>& attention, const std::optional<at::Tensor>& logsumexp);
AttentionBlockGradients attention_block_backward_impl(
    const AttentionKernels& kernels, const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w_q,
    const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& w_o, const at::Tensor& cos, const at::Tensor& sin,
    const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_k, const std::optional<at::Tensor>& b_v,
    const std::optional<at::Tensor>& b_o, std::optional<double> scale, const std::optional<at::Tensor>& segment_ids,
    std::array<bool, 11> output_mask, std::optional<c10::string_view> group_name,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double norm_eps,
    const std::optional<at::Tensor>& attention, const std::optional<at::Tensor>& logsumexp);

// attention_block_attend: attention_block's forward up to its output projection, for the plan that runs each
// layer's attention forward once: (attention [batch, tokens, heads * head_dim] in x's dtype, the heads' outputs
// as the output projection takes them; logsumexp [heads / ranks, batch, tokens * ranks] in the op-math type, each
// query's log-sum-exp over its keys, as the rank's kernels computed it over the whole rows). attention_block given
// both computes the output projection alone, and its backward hands them to the kernels' backward instead of
// recomputing the attention.
std::tuple<at::Tensor, at::Tensor> attention_block_attend_impl(
    const AttentionKernels& kernels, const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k,
    const at::Tensor& w_v, const at::Tensor& cos, const at::Tensor& sin, const std::optional<at::Tensor>& b_q,
    const std::optional<at::Tensor>& b_k, const std::optional<at::Tensor>& b_v, std::optional<double> scale,
    const std::optional<at::Tensor>& segment_ids, std::optional<c10::string_view> group_name,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double norm_eps);

// segment_attention / segment_attention_backward: the attention of attention_block alone, for
// attention modules it does not replace (their own projections and norms): query, key and value
// [batch, heads, tokens, head_dim] (key/value heads already repeated), causal within the segments
// of segment_ids as attention_block's, scale defaulting to 1/sqrt(head_dim). Backward saves the
// inputs only and recomputes the forward's log-sum-exp.
at::Tensor segment_attention_impl(const AttentionKernels& kernels, const at::Tensor& q, const at::Tensor& k,
                                  const at::Tensor& v, const at::Tensor& segment_ids, std::optional<double> scale,
                                  std::optional<double> softcap, const std::optional<at::Tensor>& sinks,
                                  std::optional<int64_t> window);
SegmentAttentionGradients segment_attention_backward_impl(
    const AttentionKernels& kernels, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& segment_ids, std::optional<double> scale, std::array<bool, 4> output_mask,
    std::optional<double> softcap, const std::optional<at::Tensor>& sinks, std::optional<int64_t> window);

// segment_attention's checks of query, segment_ids, scale and the score mods (sinks against query's heads)
// but the shapes of key and value, and what the kernels of query's device take (CUDA: dtype, head dimension):
// ulysses_attention runs them before its first exchange, where a rank that threw would leave the others waiting.
void check_segment_attention_inputs(const char* op, const at::Tensor& q, const at::Tensor& segment_ids,
                                    std::optional<double> scale, std::optional<double> softcap,
                                    const std::optional<at::Tensor>& sinks, std::optional<int64_t> window);

// Errors unless cos and sin are constants for autograd: the op computes no gradient for them.
void check_rotary_needs_no_grad(const at::Tensor& cos, const at::Tensor& sin);

// The bytes one head group's q, k, v, attention output and their gradients may take on a device of
// this type with `device_memory` bytes (unused for the CPU): the most heads that fit run as one group, so the
// memory of attention does not grow with the number of heads.
int64_t head_group_bytes(c10::DeviceType device_type, int64_t device_memory);

// The kernels registered per dispatch key.
at::Tensor attention_block_cpu(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v,
                               const at::Tensor& w_o, const at::Tensor& cos, const at::Tensor& sin,
                               const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_k,
                               const std::optional<at::Tensor>& b_v, const std::optional<at::Tensor>& b_o,
                               std::optional<double> scale, const std::optional<at::Tensor>& segment_ids,
                               std::optional<c10::string_view> group_name, const std::optional<at::Tensor>& q_norm,
                               const std::optional<at::Tensor>& k_norm, double norm_eps,
                               const std::optional<at::Tensor>& attention, const std::optional<at::Tensor>& logsumexp);
at::Tensor attention_block_meta(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k,
                                const at::Tensor& w_v, const at::Tensor& w_o, const at::Tensor& cos,
                                const at::Tensor& sin, const std::optional<at::Tensor>& b_q,
                                const std::optional<at::Tensor>& b_k, const std::optional<at::Tensor>& b_v,
                                const std::optional<at::Tensor>& b_o, std::optional<double> scale,
                                const std::optional<at::Tensor>& segment_ids,
                                std::optional<c10::string_view> group_name, const std::optional<at::Tensor>& q_norm,
                                const std::optional<at::Tensor>& k_norm, double norm_eps,
                                const std::optional<at::Tensor>& attention, const std::optional<at::Tensor>& logsumexp);
AttentionBlockGradients attention_block_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k,
    const at::Tensor& w_v, const at::Tensor& w_o, const at::Tensor& cos, const at::Tensor& sin,
    const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_k, const std::optional<at::Tensor>& b_v,
    const std::optional<at::Tensor>& b_o, std::optional<double> scale, const std::optional<at::Tensor>& segment_ids,
    std::array<bool, 11> output_mask, std::optional<c10::string_view> group_name,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double norm_eps,
    const std::optional<at::Tensor>& attention, const std::optional<at::Tensor>& logsumexp);
AttentionBlockGradients attention_block_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k,
    const at::Tensor& w_v, const at::Tensor& w_o, const at::Tensor& cos, const at::Tensor& sin,
    const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_k, const std::optional<at::Tensor>& b_v,
    const std::optional<at::Tensor>& b_o, std::optional<double> scale, const std::optional<at::Tensor>& segment_ids,
    std::array<bool, 11> output_mask, std::optional<c10::string_view> group_name,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double norm_eps,
    const std::optional<at::Tensor>& attention, const std::optional<at::Tensor>& logsumexp);

at::Tensor segment_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& segment_ids, std::optional<double> scale,
                                 std::optional<double> softcap, const std::optional<at::Tensor>& sinks,
                                 std::optional<int64_t> window);
SegmentAttentionGradients segment_attention_backward_cpu(const at::Tensor& grad_out, const at::Tensor& q,
                                                         const at::Tensor& k, const at::Tensor& v,
                                                         const at::Tensor& segment_ids, std::optional<double> scale,
                                                         std::array<bool, 4> output_mask, std::optional<double> softcap,
                                                         const std::optional<at::Tensor>& sinks,
                                                         std::optional<int64_t> window);
at::Tensor segment_attention_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& segment_ids, std::optional<double> scale,
                                  std::optional<double> softcap, const std::optional<at::Tensor>& sinks,
                                  std::optional<int64_t> window);
SegmentAttentionGradients segment_attention_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& segment_ids, std::optional<double> scale, std::array<bool, 4> output_mask,
    std::optional<double> softcap, const std::optional<at::Tensor>& sinks, std::optional<int64_t> window);

std::tuple<at::Tensor, at::Tensor> attention_block_attend_cpu(
    const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& cos,
    const at::Tensor& sin, const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_k,
    const std::optional<at::Tensor>& b_v, std::optional<double> scale, const std::optional<at::Tensor>& segment_ids,
    std::optional<c10::string_view> group_name, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, double norm_eps);
std::tuple<at::Tensor, at::Tensor> attention_block_attend_meta(
    const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& cos,
    const at::Tensor& sin, const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_k,
    const std::optional<at::Tensor>& b_v, std::optional<double> scale, const std::optional<at::Tensor>& segment_ids,
    std::optional<c10::string_view> group_name, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, double norm_eps);

#ifdef TORCH_OFFLOAD_WITH_CUDA
// What CUDA's attention kernels take: x (called `name`) not float64, head_dim (read from `where`) aligned.
void check_cuda_support(const char* op, const at::Tensor& x, const char* name, int64_t head_dim, const char* where);
// The memory of CUDA device `index`, in bytes.
int64_t cuda_device_memory(c10::DeviceIndex index);

at::Tensor attention_block_cuda(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k,
                                const at::Tensor& w_v, const at::Tensor& w_o, const at::Tensor& cos,
                                const at::Tensor& sin, const std::optional<at::Tensor>& b_q,
                                const std::optional<at::Tensor>& b_k, const std::optional<at::Tensor>& b_v,
                                const std::optional<at::Tensor>& b_o, std::optional<double> scale,
                                const std::optional<at::Tensor>& segment_ids,
                                std::optional<c10::string_view> group_name, const std::optional<at::Tensor>& q_norm,
                                const std::optional<at::Tensor>& k_norm, double norm_eps,
                                const std::optional<at::Tensor>& attention, const std::optional<at::Tensor>& logsumexp);
AttentionBlockGradients attention_block_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k,
    const at::Tensor& w_v, const at::Tensor& w_o, const at::Tensor& cos, const at::Tensor& sin,
    const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_k, const std::optional<at::Tensor>& b_v,
    const std::optional<at::Tensor>& b_o, std::optional<double> scale, const std::optional<at::Tensor>& segment_ids,
    std::array<bool, 11> output_mask, std::optional<c10::string_view> group_name,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double norm_eps,
    const std::optional<at::Tensor>& attention, const std::optional<at::Tensor>& logsumexp);
std::tuple<at::Tensor, at::Tensor> attention_block_attend_cuda(
    const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& cos,
    const at::Tensor& sin, const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_k,
    const std::optional<at::Tensor>& b_v, std::optional<double> scale, const std::optional<at::Tensor>& segment_ids,
    std::optional<c10::string_view> group_name, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, double norm_eps);
at::Tensor segment_attention_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& segment_ids, std::optional<double> scale,
                                  std::optional<double> softcap, const std::optional<at::Tensor>& sinks,
                                  std::optional<int64_t> window);
SegmentAttentionGradients segment_attention_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& segment_ids, std::optional<double> scale, std::array<bool, 4> output_mask,
    std::optional<double> softcap, const std::optional<at::Tensor>& sinks, std::optional<int64_t> window);
#endif

}  // namespace torch_offload
