#pragma once
// tiled_mlp / tiled_mlp_backward kernels. The sharding loop (tiled_mlp.cpp) is the
// same on every device; each device brings its fused elementwise kernels.
// Registration lives in registration/.
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

// The device-generic forward and backward: the sharding loop, with GEMMs by ATen.
at::Tensor tiled_mlp_impl(const HiddenKernels& kernels, const at::Tensor& x, const at::Tensor& w_gate,
                          const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
                          const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& b_up,
                          const std::optional<at::Tensor>& b_down, std::string_view activation,
                          const c10::SymInt& num_shards);
TiledMlpGradients tiled_mlp_backward_impl(const HiddenKernels& kernels, const at::Tensor& grad_out, const at::Tensor& x,
                                          const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up,
                                          const at::Tensor& w_down, const std::optional<at::Tensor>& b_gate,
                                          const std::optional<at::Tensor>& b_up,
                                          const std::optional<at::Tensor>& b_down, std::string_view activation,
                                          const c10::SymInt& num_shards, std::array<bool, 7> output_mask);

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

#ifdef TORCH_OFFLOAD_WITH_CUDA
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
