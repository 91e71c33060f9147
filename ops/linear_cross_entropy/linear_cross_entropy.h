#pragma once
// linear_cross_entropy kernels: the LM head's cross-entropy computed in tiles of
// tokens x vocabulary, so that no [tokens, V] logits tensor exists: tiles of a few MiB
// (the recompute path) or whole-vocabulary slabs of 64 MiB or 512 tokens (gradients
// in forward). The tiling loops (linear_cross_entropy.cpp) are the same on every device;
// each device brings its fused per-tile kernels. Registration: linear_cross_entropy_registration.cpp.
#include <array>
#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/SymInt.h>

#include "torch_offload/torch_offload.h"

namespace torch_offload {

// What the per-tile kernels need besides tensors.
struct CrossEntropyOptions {
  double softcap;          // 0: no softcap
  double label_smoothing;  // eps in [0, 1]
  double z_loss;           // 0: no z-loss
  int64_t vocab;           // V, for eps / V
  double filter_eps;       // backward: > 0 skips the tiles whose gradient is negligible
};

// The fused steps on one contiguous [rows, cols] tile of logits, columns [col0,
// col0 + cols) of the vocabulary; target and the per-row tensors are the tile's rows.
struct CrossEntropyTileKernels {
  // Folds the tile into the rows' running max and sum of exp(z - max) (online
  // log-sum-exp), writes z of the target into target_z where the target falls in
  // the tile, and adds the tile's sum of z into sum_z when label smoothing needs it.
  // May overwrite the logits.
  void (*forward)(const CrossEntropyOptions& options, const at::Tensor& logits, const at::Tensor& target, int64_t col0,
                  const at::Tensor& max, const at::Tensor& sum_exp, const at::Tensor& target_z,
                  const at::Tensor& sum_z);
  // Logits <- the loss's gradient by them, given each row's log-sum-exp and
  // weight g in the reduction (0 for ignored tokens). Returns whether the tile's
  // gradient counts: false only when options.filter_eps > 0 and every entry of
  // every row is negligible (gradient_is_negligible), so its GEMMs can be skipped.
  bool (*backward)(const CrossEntropyOptions& options, const at::Tensor& logits, const at::Tensor& target, int64_t col0,
                   const at::Tensor& lse, const at::Tensor& grad_scale);
};

// The device-generic forward: (loss, log-sum-exp per token [T] in float32, or float64 for float64 inputs,
// statistics: [3, T] with `statistics` (see linear_cross_entropy_forward), else [0]), and the backward that
// reuses the log-sum-exp.
LinearCrossEntropyForward linear_cross_entropy_forward_impl(const CrossEntropyTileKernels& kernels,
                                                            const at::Tensor& hidden, const at::Tensor& weight,
                                                            const std::optional<at::Tensor>& bias,
                                                            const at::Tensor& target, int64_t ignore_index,
                                                            double label_smoothing, double softcap, double z_loss,
                                                            std::string_view reduction, const c10::SymInt& tile_tokens,
                                                            const c10::SymInt& tile_vocab, bool statistics);
LinearCrossEntropyGradients linear_cross_entropy_backward_impl(
    const CrossEntropyTileKernels& kernels, const at::Tensor& grad_loss, const at::Tensor& hidden,
    const at::Tensor& weight, const std::optional<at::Tensor>& bias, const at::Tensor& target, const at::Tensor& lse,
    int64_t ignore_index, double label_smoothing, double softcap, double z_loss, std::string_view reduction,
    const c10::SymInt& tile_tokens, const c10::SymInt& tile_vocab, std::array<bool, 3> output_mask, double filter_eps);

// The 3-GEMM path for a scalar loss ("mean" or "sum"): (loss, and the gradients output_mask asks for with
// respect to hidden (in hidden's dtype), weight and bias (in the accumulation type), for a unit grad_loss;
// undefined where not asked; statistics as the forward's), computed in forward from one slab of whole-vocabulary logits
// per tile of tokens.
LinearCrossEntropyWithGradients linear_cross_entropy_with_gradients_impl(
    const CrossEntropyTileKernels& kernels, const at::Tensor& hidden, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& target, int64_t ignore_index, double label_smoothing,
    double softcap, double z_loss, std::string_view reduction, const c10::SymInt& tile_tokens,
    std::array<bool, 3> output_mask, bool statistics);

// The per-token statistics [3, T] (z-loss term, top-1, entropy) of the forward companions, reduced as the loss:
// (z_loss, accuracy, entropy), each the mean over the counted tokens ("mean"), their sum ("sum"), or target's
// shape ("none"). Works on symbolic shapes.
std::tuple<at::Tensor, at::Tensor, at::Tensor> reduce_cross_entropy_statistics(const at::Tensor& statistics,
                                                                               const at::Tensor& target,
                                                                               int64_t ignore_index,
                                                                               std::string_view reduction);

// gradients_in_forward, when given, asks for the 3-GEMM path or the recompute; true is
// refused (ValueError) for reduction "none", filter_eps > 0 or softcap > 0. Returns
// whether the path applies by default: a scalar loss without filter_eps or softcap, in
// float32/float64, or bfloat16 on CUDA (float16's small gradients would underflow in the
// slab, which holds d loss / d logits before the loss scale multiplies them).
bool gradients_in_forward_by_default(const char* op, const at::Tensor& hidden, double softcap,
                                     std::string_view reduction, double filter_eps,
                                     std::optional<bool> gradients_in_forward);

// filter_eps (gradient filtering's threshold) is finite and >= 0, and 0 with label
// smoothing, whose gradient reaches every logit. Errors name the argument.
void check_filter_eps(const char* op, double filter_eps, double label_smoothing);

// hidden [..., h] (float32, float64, bfloat16 or float16), weight [V, h] and bias [V] (undefined: none) alike,
// on one device: the LM head's arguments, as linear_cross_entropy and token_logprobs take them. Works on
// symbolic shapes; errors name `op` and the argument, as `names` calls them (token_divergence has two heads).
struct LmHeadNames {
  const char *hidden = "hidden", *weight = "weight", *bias = "bias";
};
void check_lm_head(const char* op, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                   const LmHeadNames& names = {});

// The automatic tile ([tokens, vocabulary]) for `tokens` tokens, a vocabulary of
// `vocab` and `dtype`: a pure function of these, so every rank agrees on it.
std::vector<int64_t> linear_cross_entropy_tile_kernel(int64_t tokens, int64_t vocab, c10::ScalarType dtype);

// The kernels registered per dispatch key.
#define TORCH_OFFLOAD_LCE_ARGS                                                                                        \
  const at::Tensor &hidden, const at::Tensor &weight, const std::optional<at::Tensor>&bias, const at::Tensor &target, \
      int64_t ignore_index, double label_smoothing, double softcap, double z_loss, c10::string_view reduction,        \
      c10::SymInt tile_tokens, c10::SymInt tile_vocab
#define TORCH_OFFLOAD_LCE_BACKWARD_ARGS                                                                            \
  const at::Tensor &grad_loss, const at::Tensor &hidden, const at::Tensor &weight,                                 \
      const std::optional<at::Tensor>&bias, const at::Tensor &target, const at::Tensor &lse, int64_t ignore_index, \
      double label_smoothing, double softcap, double z_loss, c10::string_view reduction, c10::SymInt tile_tokens,  \
      c10::SymInt tile_vocab, std::array<bool, 3> output_mask, double filter_eps
#define TORCH_OFFLOAD_LCE_WITH_GRADIENTS_ARGS                                                                         \
  const at::Tensor &hidden, const at::Tensor &weight, const std::optional<at::Tensor>&bias, const at::Tensor &target, \
      int64_t ignore_index, double label_smoothing, double softcap, double z_loss, c10::string_view reduction,        \
      c10::SymInt tile_tokens, std::array<bool, 3> output_mask, bool statistics

at::Tensor linear_cross_entropy_cpu(TORCH_OFFLOAD_LCE_ARGS, double filter_eps,
                                    std::optional<bool> gradients_in_forward);
LinearCrossEntropyWithGradients linear_cross_entropy_with_gradients_cpu(TORCH_OFFLOAD_LCE_WITH_GRADIENTS_ARGS);
LinearCrossEntropyForward linear_cross_entropy_forward_cpu(TORCH_OFFLOAD_LCE_ARGS, bool statistics);
LinearCrossEntropyGradients linear_cross_entropy_backward_cpu(TORCH_OFFLOAD_LCE_BACKWARD_ARGS);
at::Tensor linear_cross_entropy_meta(TORCH_OFFLOAD_LCE_ARGS, double filter_eps,
                                     std::optional<bool> gradients_in_forward);
LinearCrossEntropyWithGradients linear_cross_entropy_with_gradients_meta(TORCH_OFFLOAD_LCE_WITH_GRADIENTS_ARGS);
LinearCrossEntropyForward linear_cross_entropy_forward_meta(TORCH_OFFLOAD_LCE_ARGS, bool statistics);
LinearCrossEntropyGradients linear_cross_entropy_backward_meta(TORCH_OFFLOAD_LCE_BACKWARD_ARGS);
#ifdef TORCH_OFFLOAD_WITH_CUDA
at::Tensor linear_cross_entropy_cuda(TORCH_OFFLOAD_LCE_ARGS, double filter_eps,
                                     std::optional<bool> gradients_in_forward);
LinearCrossEntropyWithGradients linear_cross_entropy_with_gradients_cuda(TORCH_OFFLOAD_LCE_WITH_GRADIENTS_ARGS);
LinearCrossEntropyForward linear_cross_entropy_forward_cuda(TORCH_OFFLOAD_LCE_ARGS, bool statistics);
LinearCrossEntropyGradients linear_cross_entropy_backward_cuda(TORCH_OFFLOAD_LCE_BACKWARD_ARGS);
#endif

// The fused CPU tile kernels, compiled once per x86 vector capability as
// tiled_mlp's are (linear_cross_entropy_cpu_kernel.cpp), and the pick for this machine.
namespace DEFAULT {
extern const CrossEntropyTileKernels cross_entropy_kernels_cpu;
}
namespace AVX2 {
extern const CrossEntropyTileKernels cross_entropy_kernels_cpu;
}
namespace AVX512 {
extern const CrossEntropyTileKernels cross_entropy_kernels_cpu;
}
const CrossEntropyTileKernels& cpu_cross_entropy_kernels();

}  // namespace torch_offload
