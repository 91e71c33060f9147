#pragma once
// GEMMs through ATen into preallocated slices, shared by the tiled ops.
#include <cstdint>
#include <optional>

#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <c10/util/accumulate.h>
#include <torch/version.h>

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

// acc += a @ b. Products of bf16/fp16 go unrounded into a float32 acc: on CUDA by one
// GEMM that adds into acc (beta = 1), so no float32 product is stored and read back;
// elsewhere by float32 operands (callers may pass operands already converted, to
// convert a shared one once). addmm's out_dtype overload takes a float32 acc as the
// matrix it adds to from torch 2.10 on (pytorch#167931; 2.8 and 2.9 wanted it in the
// operands' dtype): every torch this project supports (2.11 to 2.15) takes that path.
static_assert(TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 10),
              "accumulate_mm needs torch >= 2.10: addmm with out_dtype and a float32 self");
inline void accumulate_mm(at::Tensor acc, const at::Tensor& a, const at::Tensor& b) {
  if (acc.scalar_type() == a.scalar_type()) {
    acc.addmm_(a, b);
  } else if (a.is_cuda()) {
    at::addmm_out(acc, acc, a, b, acc.scalar_type());
  } else {
    acc.addmm_(a.to(acc.scalar_type()), b.to(acc.scalar_type()));
  }
}

// The gradient by a tile of logits (float32 for bf16/fp16 inputs) as the backward GEMMs' operand: rounded to the
// input dtype where those GEMMs take the input dtype's operands and accumulate in float32 (CUDA; eager's bf16
// gradient of the logits is rounded likewise); where the other operands are converted to float32 (`convert`, off
// CUDA) it stays float32.
inline at::Tensor logits_gradient_operand(const at::Tensor& d_logits, c10::ScalarType dtype, bool convert) {
  return d_logits.scalar_type() != dtype && !convert ? d_logits.to(dtype) : d_logits;
}

inline at::Tensor value_or_undefined(const std::optional<at::Tensor>& t) {
  return t.has_value() ? *t : at::Tensor();
}

// out <- in @ w^T + b in out's dtype: for bf16/fp16 operands a float32 out gets their products unrounded and
// the bias added in float32 (accumulate_mm onto the bias, or onto zeros), where linear_into would round each
// logit to the operands' dtype.
inline void linear_into_accumulator(const at::Tensor& out, const at::Tensor& in, const at::Tensor& w,
                                    const at::Tensor& b) {
  if (out.scalar_type() == in.scalar_type()) {
    linear_into(out, in, w, b);
    return;
  }
  at::Tensor result = out;
  if (b.defined()) {
    result.copy_(b.unsqueeze(0).expand_as(result));
  } else {
    result.zero_();
  }
  accumulate_mm(result, in, w.t());
}

}  // namespace torch_offload
