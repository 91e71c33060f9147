#pragma once
// token_logprobs: each token's log-probability of its id (or of each of K ids) under softmax(scores), and its
// entropy, with scores = cap(logit_scale * logits) / temperature (cap: softcap tanh(x / softcap) where
// softcap > 0) and logits = hidden @ weight^T + bias computed in tiles of tokens x vocabulary, so that no
// [tokens, V] tensor exists (what RL trainers take from the LM head). The tiles' arithmetic is ATen's,
// the same on every device; the tile shape is linear_cross_entropy's. Registration: token_logprobs_registration.cpp.
#include <array>
#include <optional>
#include <tuple>

#include <ATen/core/Tensor.h>

#include "torch_offload/torch_offload.h"

namespace torch_offload {

#define TORCH_OFFLOAD_TOKEN_LOGPROBS_ARGS                                                                          \
  const at::Tensor &hidden, const at::Tensor &weight, const at::Tensor &ids, const std::optional<at::Tensor>&bias, \
      double temperature, bool entropy, double softcap, double logit_scale, int64_t ignore_index
#define TORCH_OFFLOAD_TOKEN_LOGPROBS_BACKWARD_ARGS                                                                     \
  const std::optional<at::Tensor>&grad_logprobs, const std::optional<at::Tensor>&grad_entropy,                         \
      const at::Tensor &hidden, const at::Tensor &weight, const at::Tensor &ids, const std::optional<at::Tensor>&bias, \
      const at::Tensor &lse, const std::optional<at::Tensor>&entropy, double temperature, double softcap,              \
      double logit_scale, int64_t ignore_index, std::array<bool, 3> output_mask

#define TORCH_OFFLOAD_TOKEN_LOGPROB_SUMMARIES_ARGS                                                                 \
  const at::Tensor &hidden, const at::Tensor &weight, const at::Tensor &ids, const std::optional<at::Tensor>&bias, \
      double temperature, double softcap, double logit_scale, int64_t ignore_index

// The kernels of every dense device (CPU and CUDA: ATen on tiles) and the shapes for Meta.
TokenLogprobs token_logprobs_kernel(TORCH_OFFLOAD_TOKEN_LOGPROBS_ARGS);
TokenLogprobsForward token_logprobs_forward_kernel(TORCH_OFFLOAD_TOKEN_LOGPROBS_ARGS);
TokenLogprobsGradients token_logprobs_backward_kernel(TORCH_OFFLOAD_TOKEN_LOGPROBS_BACKWARD_ARGS);
TokenLogprobSummaries token_logprob_summaries_kernel(TORCH_OFFLOAD_TOKEN_LOGPROB_SUMMARIES_ARGS);
TokenLogprobSummaries token_logprob_summaries_meta(TORCH_OFFLOAD_TOKEN_LOGPROB_SUMMARIES_ARGS);
TokenLogprobs token_logprobs_meta(TORCH_OFFLOAD_TOKEN_LOGPROBS_ARGS);
TokenLogprobsForward token_logprobs_forward_meta(TORCH_OFFLOAD_TOKEN_LOGPROBS_ARGS);
TokenLogprobsGradients token_logprobs_backward_meta(TORCH_OFFLOAD_TOKEN_LOGPROBS_BACKWARD_ARGS);

}  // namespace torch_offload
