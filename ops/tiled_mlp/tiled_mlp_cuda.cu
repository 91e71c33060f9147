// CUDA side of tiled_mlp: one fused elementwise kernel each way (the arithmetic is
// activation_math.h's, shared with the CPU), and the entry points that run the
// device-generic sharding loop with them. GEMMs go through ATen.
#include "ops/tiled_mlp/tiled_mlp.h"

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "ops/common/activation_math.h"

namespace torch_offload {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;  // a grid-stride loop covers the rest

// gate <- mlp_hidden(gate, up).
template <Activation kAct, bool kGated, typename scalar_t>
__global__ void hidden_forward_kernel(scalar_t* gate, const scalar_t* up, int64_t n) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{blockDim.x} * gridDim.x) {
    hidden_forward_element<kAct, kGated, opmath_t>(gate, up, i);
  }
}

// (gate, up, d_hidden) <- (d_gate, d_up, hidden).
template <Activation kAct, bool kGated, typename scalar_t>
__global__ void hidden_backward_kernel(scalar_t* gate, scalar_t* up, scalar_t* d_hidden, int64_t n) {
  using opmath_t = at::opmath_type<scalar_t>;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{blockDim.x} * gridDim.x) {
    hidden_backward_element<kAct, kGated, opmath_t>(gate, up, d_hidden, i);
  }
}

int blocks_for(int64_t n) {
  return static_cast<int>(std::min<int64_t>(kMaxBlocks, (n + kThreads - 1) / kThreads));
}

void hidden_forward_cuda(Activation act, const at::Tensor& gate, const at::Tensor& up) {
  const int64_t n = gate.numel();
  if (n == 0) {
    return;
  }
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "tiled_mlp_cuda", [&] {
    dispatch_activation(act, [&](auto kind) {
      constexpr Activation kAct = decltype(kind)::value;
      if (up.defined()) {
        hidden_forward_kernel<kAct, true>
            <<<blocks_for(n), kThreads, 0, stream>>>(gate.data_ptr<scalar_t>(), up.const_data_ptr<scalar_t>(), n);
      } else {
        hidden_forward_kernel<kAct, false, scalar_t>
            <<<blocks_for(n), kThreads, 0, stream>>>(gate.data_ptr<scalar_t>(), nullptr, n);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

void hidden_backward_cuda(Activation act, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& d_hidden) {
  const int64_t n = gate.numel();
  if (n == 0) {
    return;
  }
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "tiled_mlp_backward_cuda", [&] {
    dispatch_activation(act, [&](auto kind) {
      constexpr Activation kAct = decltype(kind)::value;
      if (up.defined()) {
        hidden_backward_kernel<kAct, true><<<blocks_for(n), kThreads, 0, stream>>>(
            gate.data_ptr<scalar_t>(), up.data_ptr<scalar_t>(), d_hidden.data_ptr<scalar_t>(), n);
      } else {
        hidden_backward_kernel<kAct, false, scalar_t><<<blocks_for(n), kThreads, 0, stream>>>(
            gate.data_ptr<scalar_t>(), nullptr, d_hidden.data_ptr<scalar_t>(), n);
      }
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
}

const HiddenKernels kCudaKernels{&hidden_forward_cuda, &hidden_backward_cuda};

}  // namespace

at::Tensor tiled_mlp_cuda(const at::Tensor& x, const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up,
                          const at::Tensor& w_down, const std::optional<at::Tensor>& b_gate,
                          const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& b_down,
                          c10::string_view activation, c10::SymInt num_shards) {
  const c10::cuda::CUDAGuard device_guard(x.device());
  return tiled_mlp_impl("tiled_mlp", kCudaKernels, x, {}, w_gate, w_up, w_down, b_gate, b_up, b_down, activation,
                        num_shards);
}

TiledMlpGradients tiled_mlp_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w_gate,
                                          const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
                                          const std::optional<at::Tensor>& b_gate,
                                          const std::optional<at::Tensor>& b_up,
                                          const std::optional<at::Tensor>& b_down, c10::string_view activation,
                                          c10::SymInt num_shards, std::array<bool, 7> output_mask) {
  const c10::cuda::CUDAGuard device_guard(x.device());
  return without_norm_gradient(tiled_mlp_backward_impl("tiled_mlp_backward", kCudaKernels, grad_out, x, {}, w_gate,
                                                       w_up, w_down, b_gate, b_up, b_down, activation, num_shards,
                                                       with_norm_mask(output_mask)));
}

at::Tensor rms_norm_tiled_mlp_cuda(const at::Tensor& x, const at::Tensor& norm_weight, double norm_eps,
                                   const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up,
                                   const at::Tensor& w_down, const std::optional<at::Tensor>& b_gate,
                                   const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& b_down,
                                   c10::string_view activation, c10::SymInt num_shards) {
  const c10::cuda::CUDAGuard device_guard(x.device());
  return tiled_mlp_impl("rms_norm_tiled_mlp", kCudaKernels, x, shard_norm("rms_norm_tiled_mlp", norm_weight, norm_eps),
                        w_gate, w_up, w_down, b_gate, b_up, b_down, activation, num_shards);
}

RmsNormTiledMlpGradients rms_norm_tiled_mlp_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& norm_weight, double norm_eps,
    const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
    const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& b_up,
    const std::optional<at::Tensor>& b_down, c10::string_view activation, c10::SymInt num_shards,
    std::array<bool, 8> output_mask) {
  const c10::cuda::CUDAGuard device_guard(x.device());
  const char* op = "rms_norm_tiled_mlp_backward";
  return as_tuple(tiled_mlp_backward_impl(op, kCudaKernels, grad_out, x, shard_norm(op, norm_weight, norm_eps), w_gate,
                                          w_up, w_down, b_gate, b_up, b_down, activation, num_shards, output_mask));
}

}  // namespace torch_offload
