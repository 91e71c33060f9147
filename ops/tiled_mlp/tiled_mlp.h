#pragma once
// tiled_mlp / tiled_mlp_backward kernels. The sharding loop (tiled_mlp.cpp) is the
// same on every device; each device brings its fused elementwise kernels.
// Registration: tiled_mlp_registration.cpp.
#include <array>
#include <optional>
#include <string_view>

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include "ops/common/activation_math.h"
#include "torch_offload/torch_offload.h"

namespace torch_offload {

// The fused elementwise steps of one shard, on contiguous [tokens, I] buffers of
// one device. `up` is undefined for a plain (ungated) MLP.
struct HiddenKernels {
  // gate <- act(gate) * up, or act(gate).
  void (*forward)(Activation act, const at::Tensor& gate, const at::Tensor& up);
  // In place: gate <- d_gate, up <- d_up, d_hidden <- the hidden activation.
  void (*backward)(Activation act, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& d_hidden);
};

// The RMSNorm rms_norm_tiled_mlp applies to each shard of x before the MLP; no weight: none (tiled_mlp).
struct ShardNorm {
  at::Tensor weight;
  double eps = 0.0;
};

// The gradients of (x, norm weight, w_gate, w_up, w_down, b_gate, b_up, b_down), as the mask of the same order asks.
using MlpGradientArray = std::array<at::Tensor, 8>;

// The device-generic forward and backward: the sharding loop, with GEMMs by ATen. `op` names the op in errors.
at::Tensor tiled_mlp_impl(const char* op, const HiddenKernels& kernels, const at::Tensor& x, const ShardNorm& norm,
                          const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
                          const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& b_up,
                          const std::optional<at::Tensor>& b_down, std::string_view activation,
                          const c10::SymInt& num_shards);
MlpGradientArray tiled_mlp_backward_impl(const char* op, const HiddenKernels& kernels, const at::Tensor& grad_out,
                                         const at::Tensor& x, const ShardNorm& norm, const at::Tensor& w_gate,
                                         const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
                                         const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& b_up,
                                         const std::optional<at::Tensor>& b_down, std::string_view activation,
                                         const c10::SymInt& num_shards, std::array<bool, 8> output_mask);

// Meta: the checks, then results shaped like the real ones.
at::Tensor tiled_mlp_meta_impl(const char* op, const at::Tensor& x, const ShardNorm& norm, const at::Tensor& w_gate,
                               const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
                               const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& b_up,
                               const std::optional<at::Tensor>& b_down, std::string_view activation);
MlpGradientArray tiled_mlp_backward_meta_impl(const char* op, const at::Tensor& grad_out, const at::Tensor& x,
                                              const ShardNorm& norm, const at::Tensor& w_gate,
                                              const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
                                              const std::optional<at::Tensor>& b_gate,
                                              const std::optional<at::Tensor>& b_up,
                                              const std::optional<at::Tensor>& b_down, std::string_view activation,
                                              std::array<bool, 8> output_mask);

// tiled_mlp_backward's 7 gradients and mask against the 8 of the impl (no norm weight).
std::array<bool, 8> with_norm_mask(std::array<bool, 7> mlp_mask);
TiledMlpGradients without_norm_gradient(const MlpGradientArray& grads);

// The automatic shard count (num_shards <= 0) for `tokens` tokens of an MLP with
// `intermediate` (I) hidden units, gated or not, in `dtype`: a pure function of these.
int64_t tiled_mlp_num_shards_kernel(int64_t tokens, int64_t intermediate, bool gated, c10::ScalarType dtype);

// The kernels registered per dispatch key.
at::Tensor tiled_mlp_cpu(const at::Tensor& x, const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up,
                         const at::Tensor& w_down, const std::optional<at::Tensor>& b_gate,
                         const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& b_down,
                         c10::string_view activation, c10::SymInt num_shards);
at::Tensor tiled_mlp_meta(const at::Tensor& x, const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up,
                          const at::Tensor& w_down, const std::optional<at::Tensor>& b_gate,
                          const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& b_down,
                          c10::string_view activation, c10::SymInt num_shards);
TiledMlpGradients tiled_mlp_backward_cpu(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w_gate,
                                         const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
                                         const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& b_up,
                                         const std::optional<at::Tensor>& b_down, c10::string_view activation,
                                         c10::SymInt num_shards, std::array<bool, 7> output_mask);
TiledMlpGradients tiled_mlp_backward_meta(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w_gate,
                                          const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
                                          const std::optional<at::Tensor>& b_gate,
                                          const std::optional<at::Tensor>& b_up,
                                          const std::optional<at::Tensor>& b_down, c10::string_view activation,
                                          c10::SymInt num_shards, std::array<bool, 7> output_mask);

// rms_norm_tiled_mlp: tiled_mlp of rms_norm(x, norm_weight, norm_eps), the norm computed per shard
// (rms_norm_tiled_mlp.cpp).
at::Tensor rms_norm_tiled_mlp_cpu(const at::Tensor& x, const at::Tensor& norm_weight, double norm_eps,
                                  const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up,
                                  const at::Tensor& w_down, const std::optional<at::Tensor>& b_gate,
                                  const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& b_down,
                                  c10::string_view activation, c10::SymInt num_shards);
at::Tensor rms_norm_tiled_mlp_meta(const at::Tensor& x, const at::Tensor& norm_weight, double norm_eps,
                                   const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up,
                                   const at::Tensor& w_down, const std::optional<at::Tensor>& b_gate,
                                   const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& b_down,
                                   c10::string_view activation, c10::SymInt num_shards);
RmsNormTiledMlpGradients rms_norm_tiled_mlp_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& norm_weight, double norm_eps,
    const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
    const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& b_up,
    const std::optional<at::Tensor>& b_down, c10::string_view activation, c10::SymInt num_shards,
    std::array<bool, 8> output_mask);
RmsNormTiledMlpGradients rms_norm_tiled_mlp_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& norm_weight, double norm_eps,
    const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
    const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& b_up,
    const std::optional<at::Tensor>& b_down, c10::string_view activation, c10::SymInt num_shards,
    std::array<bool, 8> output_mask);
RmsNormTiledMlpGradients as_tuple(const MlpGradientArray& grads);
// The norm of rms_norm_tiled_mlp's arguments; `op` names it if norm_weight is undefined.
ShardNorm shard_norm(const char* op, const at::Tensor& norm_weight, double norm_eps);

#ifdef TORCH_OFFLOAD_WITH_CUDA
at::Tensor rms_norm_tiled_mlp_cuda(const at::Tensor& x, const at::Tensor& norm_weight, double norm_eps,
                                   const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up,
                                   const at::Tensor& w_down, const std::optional<at::Tensor>& b_gate,
                                   const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& b_down,
                                   c10::string_view activation, c10::SymInt num_shards);
RmsNormTiledMlpGradients rms_norm_tiled_mlp_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& norm_weight, double norm_eps,
    const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
    const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& b_up,
    const std::optional<at::Tensor>& b_down, c10::string_view activation, c10::SymInt num_shards,
    std::array<bool, 8> output_mask);
at::Tensor tiled_mlp_cuda(const at::Tensor& x, const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up,
                          const at::Tensor& w_down, const std::optional<at::Tensor>& b_gate,
                          const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& b_down,
                          c10::string_view activation, c10::SymInt num_shards);
TiledMlpGradients tiled_mlp_backward_cuda(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w_gate,
                                          const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
                                          const std::optional<at::Tensor>& b_gate,
                                          const std::optional<at::Tensor>& b_up,
                                          const std::optional<at::Tensor>& b_down, c10::string_view activation,
                                          c10::SymInt num_shards, std::array<bool, 7> output_mask);
#endif

}  // namespace torch_offload
