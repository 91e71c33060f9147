#pragma once
// Head tensors [B, H, T, ...] seen as other batches, for attention kernels that give each thread whole
// batch entries (PyTorch's CPU flash backward): a call cut into pieces of equal work, one piece an entry.
#include <vector>

#include <ATen/core/Tensor.h>

namespace torch_offload {

// [B, H, 2m, ...] as [2B, H, m, ...]: sequence b's first half at 2b, its second at 2b + 1. A view of the
// token-major tensors the projections and kernels make (and of any with B = 1); a copy otherwise.
inline at::Tensor halves_as_batch(const at::Tensor& t) {
  return t.unflatten(2, {2, t.size(2) / 2}).transpose(1, 2).flatten(0, 1);
}

// halves_as_batch's inverse.
inline at::Tensor batch_as_halves(const at::Tensor& t) {
  return t.unflatten(0, {t.size(0) / 2, 2}).transpose(1, 2).flatten(2, 3);
}

// [B, H, m, ...] as [2B, H, m, ...], each sequence twice (a view when B = 1).
inline at::Tensor twice_as_batch(const at::Tensor& t) {
  std::vector<int64_t> sizes = t.sizes().vec();
  sizes.insert(sizes.begin() + 1, 2);
  return t.unsqueeze(1).expand(sizes).flatten(0, 1);
}

// twice_as_batch's gradient: the two copies of each sequence added.
inline at::Tensor sum_twice(const at::Tensor& t) {
  return t.unflatten(0, {t.size(0) / 2, 2}).sum(1);
}

}  // namespace torch_offload
