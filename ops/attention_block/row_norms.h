#pragma once
// RMSNorms over each token's whole q or k projection, every head at once (OLMo 2's q_norm and k_norm,
// weights [heads * head_dim]), for attention_block, which projects one group of heads at a time. Each
// row's scale comes from a pass over the whole projection in chunks of rows; backward holds the gradient
// of the normed rows whole until every group's attention has given its columns, then finishes the norm
// and the projection's gradients in chunks of rows.
#include <cstdint>

#include <ATen/core/Tensor.h>

namespace torch_offload {

// Each row's 1 / sqrt(mean(square) + eps) of x_rows @ w^T + b (b may be undefined) [rows], in the
// op-math type (float32 for bf16/fp16), computed at most chunk_rows rows at a time.
at::Tensor row_rms_rstd(const at::Tensor& x_rows, const at::Tensor& w, const at::Tensor& b, double eps,
                        int64_t chunk_rows);

// rows [n, width] (some columns of the projection) normed by the rows' rstd [n] and those columns'
// weight [width], as transformers' Olmo2RMSNorm: in the op-math type, times weight, rounded once.
at::Tensor row_rms_norm(const at::Tensor& rows, const at::Tensor& rstd, const at::Tensor& weight);

// The gradient of the projection's rows [n, width] (the whole width) before the norm, in the op-math type,
// given the normed rows' gradient grad [n, width]; weight's gradient is added into
// grad_weight (op-math type) when that is defined.
at::Tensor row_rms_norm_backward(const at::Tensor& grad, const at::Tensor& rows, const at::Tensor& rstd,
                                 const at::Tensor& weight, const at::Tensor& grad_weight);

}  // namespace torch_offload
