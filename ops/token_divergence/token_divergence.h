#pragma once
// token_divergence: per token, the generalized Jensen-Shannon divergence between a student's and a teacher's
// next-token distributions, each from its own LM head (hidden @ weight^T + bias) in tiles of tokens x vocabulary,
// so that neither model's [tokens, V] logits exist (knowledge and on-policy distillation). The tiles' arithmetic
// is ATen's, the same on every device; the tile shape is linear_cross_entropy's. Registration:
// token_divergence_registration.cpp.
#include <array>
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>

#include "torch_offload/torch_offload.h"

namespace torch_offload {

#define TORCH_OFFLOAD_TOKEN_DIVERGENCE_ARGS                                                              \
  const at::Tensor &student_hidden, const at::Tensor &student_weight, const at::Tensor &teacher_hidden,  \
      const at::Tensor &teacher_weight, const std::optional<at::Tensor>&student_bias,                    \
      const std::optional<at::Tensor>&teacher_bias, const std::optional<at::Tensor>&labels, double beta, \
      double temperature, double student_softcap, double student_logit_scale, double teacher_softcap,    \
      double teacher_logit_scale, int64_t ignore_index
#define TORCH_OFFLOAD_TOKEN_DIVERGENCE_BACKWARD_ARGS                                                              \
  const at::Tensor &grad_divergence, const at::Tensor &student_hidden, const at::Tensor &student_weight,          \
      const at::Tensor &teacher_hidden, const at::Tensor &teacher_weight,                                         \
      const std::optional<at::Tensor>&student_bias, const std::optional<at::Tensor>&teacher_bias,                 \
      const std::optional<at::Tensor>&labels, const at::Tensor &student_lse, const at::Tensor &teacher_lse,       \
      const at::Tensor &aux, double beta, double temperature, double student_softcap, double student_logit_scale, \
      double teacher_softcap, double teacher_logit_scale, int64_t ignore_index, std::array<bool, 3> output_mask

// The kernels of every dense device (CPU and CUDA: ATen on tiles) and the shapes for Meta.
TokenDivergence token_divergence_kernel(TORCH_OFFLOAD_TOKEN_DIVERGENCE_ARGS);
TokenDivergenceForward token_divergence_forward_kernel(TORCH_OFFLOAD_TOKEN_DIVERGENCE_ARGS);
TokenDivergenceGradients token_divergence_backward_kernel(TORCH_OFFLOAD_TOKEN_DIVERGENCE_BACKWARD_ARGS);
TokenDivergence token_divergence_meta(TORCH_OFFLOAD_TOKEN_DIVERGENCE_ARGS);
TokenDivergenceForward token_divergence_forward_meta(TORCH_OFFLOAD_TOKEN_DIVERGENCE_ARGS);
TokenDivergenceGradients token_divergence_backward_meta(TORCH_OFFLOAD_TOKEN_DIVERGENCE_BACKWARD_ARGS);

}  // namespace torch_offload
