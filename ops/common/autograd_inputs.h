#pragma once
// What the ops' autograd formulas share: optional inputs saved for backward (an undefined tensor where absent)
// and the output mask of a backward op.
#include <array>
#include <cstddef>
#include <optional>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/custom_function.h>

namespace torch_offload {

inline at::Tensor or_undefined(const std::optional<at::Tensor>& t) {
  return t.value_or(at::Tensor());
}

inline std::optional<at::Tensor> or_nullopt(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// The output mask of a backward whose saved tensors are its forward's tensor inputs in order, undefined where
// an optional one was absent: absent inputs have no autograd edge, so count the edges of those given.
template <size_t N>
std::array<bool, N> mask_of_given(torch::autograd::AutogradContext* ctx, const torch::autograd::variable_list& saved) {
  std::array<bool, N> output_mask{};
  size_t edge = 0;
  for (size_t i = 0; i < N; ++i) {
    if (saved[i].defined()) {
      output_mask[i] = ctx->needs_input_grad(edge++);
    }
  }
  return output_mask;
}

}  // namespace torch_offload
