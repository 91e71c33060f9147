// rms_norm over x's last dimension, per row, in the op-math type (float32 for bf16/fp16):
//   rstd = 1 / sqrt(mean(x^2) + eps),   y = weight * round(x * rstd)
// where round is to x's dtype, as transformers' RMSNorm computes it (the normalized row rounded before the
// weight multiplies it). Backward recomputes rstd from x (one reduction per row) rather than saving it;
// with d = grad * weight in the op-math type,
//   grad_x = rstd * d - x * rstd^3 * mean(d * x),   grad_weight = sum over rows of grad * round(x * rstd).
// Both run over chunks of rows: apart from the results, nothing larger than a chunk exists. The op makes at most
// kOpChunks chunks, whatever its tokens, so that its kernel launches (about 10 a chunk forward, 20 backward) do not
// grow with the sequence: chunks of a fixed size took ~10,000 launches a layer at 32K tokens on a GPU, bound by
// launch cost. Its float32 temporaries then take 1/kOpChunks of x's rows at a time: backward's few of them
// under a third of a bf16 x's bytes at 32.
#include "ops/rms_norm/rms_norm.h"

#include <algorithm>
#include <cmath>

#include <ATen/OpMathType.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/rsqrt.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include "ops/common/checks.h"
#include "ops/common/gemm.h"

namespace torch_offload {

void check_rms_norm_eps(const char* op, const char* arg, double eps) {
  TORCH_CHECK(std::isfinite(eps) && eps >= 0.0, op, ": ", arg, " is ", eps, "; expected a finite value >= 0");
}

namespace {

constexpr int64_t kOpChunks = 32;
constexpr int64_t kMinChunkElements = int64_t{1} << 16;  // below this a chunk's launches cost more than its bytes

void check_arguments(const char* op, const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_defined(x, op, "x");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), op, ": x has dtype ", x.scalar_type(),
              "; expected a floating-point tensor");
  TORCH_CHECK(x.dim() >= 1, op, ": x is a 0-dimensional tensor; expected [..., h]");
  check_tensor(op, "weight", weight, x, "x", x.scalar_type(), {x.sym_size(-1)}, "[h], x's last dimension");
  check_rms_norm_eps(op, "eps", eps);
}

void check_backward_arguments(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const char* op = "rms_norm_backward";
  check_arguments(op, x, weight, eps);
  check_tensor(op, "grad", grad, x, "x", x.scalar_type(), x.sym_sizes(), "x's shape");
}

int64_t chunk_rows(int64_t tokens, int64_t h, int64_t chunks) {
  TORCH_INTERNAL_ASSERT(chunks > 0);
  const int64_t fewest_rows = std::max<int64_t>(1, kMinChunkElements / std::max<int64_t>(h, 1));
  return std::max(fewest_rows, (tokens + chunks - 1) / chunks);
}

// x's rows [rows, h] in the op-math type, and each row's rstd [rows, 1].
std::tuple<at::Tensor, at::Tensor> rows_and_rstd(const at::Tensor& rows, double eps) {
  const at::Tensor xf = rows.to(at::toOpMathType(rows.scalar_type()));
  return {xf, at::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true).add_(eps))};
}

}  // namespace

void rms_norm_rows_into(const at::Tensor& out, const at::Tensor& rows, const at::Tensor& weight, double eps,
                        int64_t chunks) {
  const int64_t tokens = rows.size(0), step = chunk_rows(tokens, rows.size(1), chunks);
  for (int64_t start = 0; start < tokens; start += step) {
    const int64_t n = std::min(step, tokens - start);
    const auto [xf, rstd] = rows_and_rstd(rows.narrow(0, start, n), eps);
    out.narrow(0, start, n).copy_(weight * (xf * rstd).to(rows.scalar_type()));
  }
}

at::Tensor rms_norm_kernel(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_arguments("rms_norm", x, weight, eps);
  const at::Tensor rows = token_rows(x);
  at::Tensor out = at::empty_like(rows);
  rms_norm_rows_into(out, rows, weight, eps, kOpChunks);
  return out.view(x.sizes());
}

void rms_norm_backward_rows(const at::Tensor& grads, const at::Tensor& rows, const at::Tensor& weight, double eps,
                            const at::Tensor& grad_x_rows, const at::Tensor& grad_weight_sum, int64_t chunks) {
  const int64_t tokens = rows.size(0), step = chunk_rows(tokens, rows.size(1), chunks);
  const auto dtype = rows.scalar_type(), acc_type = at::toOpMathType(dtype);
  const bool weight_grad = grad_weight_sum.defined();
  for (int64_t start = 0; start < tokens && (grad_x_rows.defined() || weight_grad); start += step) {
    const int64_t n = std::min(step, tokens - start);
    const auto [xf, rstd] = rows_and_rstd(rows.narrow(0, start, n), eps);
    const at::Tensor g = grads.narrow(0, start, n);
    if (weight_grad) {
      grad_weight_sum.add_((g.to(acc_type) * (xf * rstd).to(dtype).to(acc_type)).sum(0));
    }
    if (grad_x_rows.defined()) {
      // The eager module's order: the weight's product in x's dtype, then the op-math type.
      const at::Tensor d = (g * weight).to(acc_type);
      const at::Tensor dot = (d * xf).mean(-1, /*keepdim=*/true);
      grad_x_rows.narrow(0, start, n).copy_(d.mul_(rstd).sub_(xf * (rstd * rstd * rstd * dot)));
    }
  }
}

namespace {

// The backward over rows [tokens, h], as rms_norm_backward_rows, with the weight's gradient (if asked) returned in
// the weight's dtype, added up in the op-math type.
at::Tensor backward_rows(const at::Tensor& grads, const at::Tensor& rows, const at::Tensor& weight, double eps,
                         const at::Tensor& grad_x_rows, bool weight_grad) {
  const at::Tensor grad_weight =
      weight_grad ? at::zeros(weight.sizes(), weight.options().dtype(at::toOpMathType(rows.scalar_type())))
                  : at::Tensor();
  rms_norm_backward_rows(grads, rows, weight, eps, grad_x_rows, grad_weight, kOpChunks);
  return weight_grad ? grad_weight.to(weight.scalar_type()) : grad_weight;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_kernel(const at::Tensor& grad, const at::Tensor& x,
                                                            const at::Tensor& weight, double eps,
                                                            std::array<bool, 2> output_mask) {
  check_backward_arguments(grad, x, weight, eps);
  const at::Tensor rows = token_rows(x);
  const at::Tensor grad_x = output_mask[0] ? at::empty_like(rows) : at::Tensor();
  at::Tensor grad_weight = backward_rows(token_rows(grad), rows, weight, eps, grad_x, output_mask[1]);
  return {output_mask[0] ? grad_x.view(x.sizes()) : grad_x, std::move(grad_weight)};
}

at::Tensor rms_norm_backward_into_grad(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                       double eps, bool weight_grad) {
  check_backward_arguments(grad, x, weight, eps);
  TORCH_CHECK(grad.is_contiguous(),
              "rms_norm_backward_into_grad: grad is not contiguous; expected a tensor whose "
              "rows it can overwrite");
  const at::Tensor grad_rows = token_rows(grad);  // a view: grad is contiguous
  return backward_rows(grad_rows, token_rows(x), weight, eps, grad_rows, weight_grad);
}

// Meta: the same checks (on symbolic shapes), then results shaped like the real ones (contiguous).
at::Tensor rms_norm_meta(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_arguments("rms_norm", x, weight, eps);
  return at::empty_symint(x.sym_sizes(), x.options());
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward_meta(const at::Tensor& grad, const at::Tensor& x,
                                                          const at::Tensor& weight, double eps,
                                                          std::array<bool, 2> output_mask) {
  check_backward_arguments(grad, x, weight, eps);
  return {output_mask[0] ? at::empty_symint(x.sym_sizes(), x.options()) : at::Tensor(),
          output_mask[1] ? at::empty_symint(weight.sym_sizes(), weight.options()) : at::Tensor()};
}

}  // namespace torch_offload
