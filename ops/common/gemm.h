#pragma once
// GEMMs through ATen into preallocated slices, shared by the tiled ops.
#include <optional>

#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
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

// acc += a @ b. Products of bf16/fp16 go unrounded into a float32 acc: on CUDA by
// a GEMM with a float32 result, elsewhere by float32 operands (callers may pass
// operands already converted, to convert a shared one once).
inline void accumulate_mm(at::Tensor acc, const at::Tensor& a, const at::Tensor& b) {
  if (acc.scalar_type() == a.scalar_type()) {
    acc.addmm_(a, b);
  } else if (a.is_cuda()) {
    acc.add_(at::mm(a, b, acc.scalar_type()));
  } else {
    acc.addmm_(a.to(acc.scalar_type()), b.to(acc.scalar_type()));
  }
}

inline at::Tensor value_or_undefined(const std::optional<at::Tensor>& t) {
  return t.has_value() ? *t : at::Tensor();
}

}  // namespace torch_offload
