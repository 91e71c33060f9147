#pragma once
// GEMMs through ATen into preallocated slices, shared by the tiled ops.
#include <algorithm>
#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/accumulate.h>

namespace torch_offload {

// t [..., h] as contiguous [tokens, h]. reshape({-1, h}) cannot infer the tokens
// when h is 0, and a layer of hidden size 0 is as well defined as a Linear(0, n).
inline at::Tensor token_rows(const at::Tensor& t) {
  const at::IntArrayRef sizes = t.sizes();
  return t.reshape({c10::multiply_integers(sizes.begin(), sizes.end() - 1), sizes.back()}).contiguous();
}

// out <- in @ w^T + b (b may be undefined), in place: out is a slice of a bigger buffer.
inline void linear_into(const at::Tensor& out, const at::Tensor& in, const at::Tensor& w, const at::Tensor& b) {
  at::Tensor result = out;
  if (b.defined()) {
    at::addmm_out(result, b, in, w.t());
  } else {
    at::mm_out(result, in, w.t());
  }
}

// Bytes of the float32 product a CUDA accumulate_mm holds at once, whatever acc's size.
inline constexpr int64_t kAccumulateScratchBytes = int64_t{16} << 20;

// acc += a @ b. Products of bf16/fp16 go unrounded into a float32 acc: on CUDA by
// GEMMs with a float32 result, a block of acc's rows at a time into one scratch of at
// most kAccumulateScratchBytes (a whole [rows, cols] float32 product would be a
// transient as large as the accumulator the tiled ops bound); elsewhere by float32
// operands (callers may pass operands already converted, to convert a shared one once).
inline void accumulate_mm(at::Tensor acc, const at::Tensor& a, const at::Tensor& b) {
  if (acc.scalar_type() == a.scalar_type()) {
    acc.addmm_(a, b);
  } else if (a.is_cuda()) {
    const int64_t rows = acc.size(0), cols = acc.size(1);
    if (rows == 0 || cols == 0) {
      return;
    }
    const int64_t block = std::clamp<int64_t>(kAccumulateScratchBytes / (cols * 4), 1, rows);
    const at::Tensor scratch = at::empty({block, cols}, acc.options());
    for (int64_t first = 0; first < rows; first += block) {
      const int64_t count = std::min(block, rows - first);
      at::Tensor product = scratch.narrow(0, 0, count);
      at::mm_out(product, a.narrow(0, first, count), b, acc.scalar_type());
      acc.narrow(0, first, count).add_(product);
    }
  } else {
    acc.addmm_(a.to(acc.scalar_type()), b.to(acc.scalar_type()));
  }
}

inline at::Tensor value_or_undefined(const std::optional<at::Tensor>& t) {
  return t.has_value() ? *t : at::Tensor();
}

}  // namespace torch_offload
