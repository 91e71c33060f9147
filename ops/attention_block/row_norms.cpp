#include "ops/attention_block/row_norms.h"

#include <algorithm>

#include <ATen/OpMathType.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>

#include "ops/common/gemm.h"

namespace torch_offload {

at::Tensor row_rms_rstd(const at::Tensor& x_rows, const at::Tensor& w, const at::Tensor& b, double eps,
                        int64_t chunk_rows) {
  const int64_t rows = x_rows.size(0);
  const at::Tensor rstd = at::empty({rows}, x_rows.options().dtype(at::toOpMathType(x_rows.scalar_type())));
  const int64_t step = std::max<int64_t>(1, chunk_rows);
  for (int64_t start = 0; start < rows; start += step) {
    const int64_t count = std::min(step, rows - start);
    at::Tensor projected = at::empty({count, w.size(0)}, x_rows.options());
    linear_into(projected, x_rows.narrow(0, start, count), w, b);
    rstd.narrow(0, start, count).copy_((projected.to(rstd.scalar_type()).square().mean(-1) + eps).rsqrt());
  }
  return rstd;
}

at::Tensor row_rms_norm(const at::Tensor& rows, const at::Tensor& rstd, const at::Tensor& weight) {
  const at::ScalarType acc_type = rstd.scalar_type();
  return (rows.to(acc_type) * rstd.unsqueeze(1) * weight.to(acc_type)).to(rows.scalar_type());
}

at::Tensor row_rms_norm_backward(const at::Tensor& grad, const at::Tensor& rows, const at::Tensor& rstd,
                                 const at::Tensor& weight, const at::Tensor& grad_weight) {
  const at::ScalarType acc_type = rstd.scalar_type();
  const at::Tensor r = rstd.unsqueeze(1);
  const at::Tensor normalized = rows.to(acc_type) * r, g = grad.to(acc_type);
  if (grad_weight.defined()) {
    grad_weight.add_((g * normalized).sum(0));
  }
  const at::Tensor g_normalized = g * weight.to(acc_type);
  return r * (g_normalized - normalized * (g_normalized * normalized).mean(-1, true));
}

}  // namespace torch_offload
