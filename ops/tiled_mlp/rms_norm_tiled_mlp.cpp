// rms_norm_tiled_mlp: a decoder layer's RMSNorm and the MLP after it as one op, tiled_mlp's sharding loop with
// the norm applied to each shard of x. It saves x (the norm's input) and the weights, never the norm's output:
// a [tokens, h] tensor less to keep for backward than rms_norm then tiled_mlp, and backward takes the norm's
// gradient shard by shard, so no [tokens, h] gradient of the norm's output exists either.
#include <ATen/core/Tensor.h>

#include "ops/common/checks.h"
#include "ops/tiled_mlp/tiled_mlp.h"
#include "ops/tiled_mlp/tiled_mlp_cpu_kernel.h"

namespace torch_offload {

ShardNorm shard_norm(const char* op, const at::Tensor& norm_weight, double norm_eps) {
  check_defined(norm_weight, op, "norm_weight");  // an undefined weight would mean no norm at all
  return {norm_weight, norm_eps};
}

RmsNormTiledMlpGradients as_tuple(const MlpGradientArray& grads) {
  return {grads[0], grads[1], grads[2], grads[3], grads[4], grads[5], grads[6], grads[7]};
}

at::Tensor rms_norm_tiled_mlp_cpu(const at::Tensor& x, const at::Tensor& norm_weight, double norm_eps,
                                  const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up,
                                  const at::Tensor& w_down, const std::optional<at::Tensor>& b_gate,
                                  const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& b_down,
                                  c10::string_view activation, c10::SymInt num_shards) {
  return tiled_mlp_impl("rms_norm_tiled_mlp", cpu_hidden_kernels(), x,
                        shard_norm("rms_norm_tiled_mlp", norm_weight, norm_eps), w_gate, w_up, w_down, b_gate, b_up,
                        b_down, activation, num_shards);
}

RmsNormTiledMlpGradients rms_norm_tiled_mlp_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& norm_weight, double norm_eps,
    const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
    const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& b_up,
    const std::optional<at::Tensor>& b_down, c10::string_view activation, c10::SymInt num_shards,
    std::array<bool, 8> output_mask) {
  const char* op = "rms_norm_tiled_mlp_backward";
  return as_tuple(tiled_mlp_backward_impl(op, cpu_hidden_kernels(), grad_out, x, shard_norm(op, norm_weight, norm_eps),
                                          w_gate, w_up, w_down, b_gate, b_up, b_down, activation, num_shards,
                                          output_mask));
}

at::Tensor rms_norm_tiled_mlp_meta(const at::Tensor& x, const at::Tensor& norm_weight, double norm_eps,
                                   const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up,
                                   const at::Tensor& w_down, const std::optional<at::Tensor>& b_gate,
                                   const std::optional<at::Tensor>& b_up, const std::optional<at::Tensor>& b_down,
                                   c10::string_view activation, c10::SymInt /*num_shards*/) {
  return tiled_mlp_meta_impl("rms_norm_tiled_mlp", x, shard_norm("rms_norm_tiled_mlp", norm_weight, norm_eps), w_gate,
                             w_up, w_down, b_gate, b_up, b_down, activation);
}

RmsNormTiledMlpGradients rms_norm_tiled_mlp_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& norm_weight, double norm_eps,
    const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
    const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& b_up,
    const std::optional<at::Tensor>& b_down, c10::string_view activation, c10::SymInt /*num_shards*/,
    std::array<bool, 8> output_mask) {
  const char* op = "rms_norm_tiled_mlp_backward";
  return as_tuple(tiled_mlp_backward_meta_impl(op, grad_out, x, shard_norm(op, norm_weight, norm_eps), w_gate, w_up,
                                               w_down, b_gate, b_up, b_down, activation, output_mask));
}

}  // namespace torch_offload
