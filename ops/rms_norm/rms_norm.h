#pragma once
// rms_norm: transformers' RMSNorm (LlamaRMSNorm and the families that copy it) as one op whose backward
// holds, beside its inputs, only the gradients it returns; the eager module's autograd holds five
// [tokens, h] float32 gradients at once. The rows' arithmetic is ATen's, in chunks of rows (at most 32, so the
// launches do not grow with the tokens), so every device runs the same code. Registration: rms_norm_registration.cpp.
#include <array>
#include <tuple>

#include <ATen/core/Tensor.h>

namespace torch_offload {

at::Tensor rms_norm_kernel(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_kernel(const at::Tensor& grad, const at::Tensor& x,
                                                            const at::Tensor& weight, double eps,
                                                            std::array<bool, 2> output_mask);
// rms_norm_backward with x's gradient written over `grad` (contiguous, x's shape), chunk by chunk; returns
// the weight's gradient if `weight_grad`. Not an op: the autograd kernel calls it, in eager mode, when it holds
// the only reference to the incoming gradient, which then costs no second [tokens, h] tensor.
at::Tensor rms_norm_backward_into_grad(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                       double eps, bool weight_grad);
// Checks that `eps` (named `arg` in the message) is finite and >= 0; shared with the ops that apply the norm.
void check_rms_norm_eps(const char* op, const char* arg, double eps);
// The rows' arithmetic, for callers that own the buffers (tiled_mlp's shards, rms_norm_tiled_mlp): `rows` and
// `out` are [n, h], taken in at most `chunks` chunks of rows (fewer where a chunk would be tiny). The backward writes
// x's gradient to grad_x_rows where defined (it may be `grads` itself: each chunk of grads is read whole before its
// rows are written) and adds the weight's to grad_weight_sum (op-math type) where defined.
void rms_norm_rows_into(const at::Tensor& out, const at::Tensor& rows, const at::Tensor& weight, double eps,
                        int64_t chunks);
void rms_norm_backward_rows(const at::Tensor& grads, const at::Tensor& rows, const at::Tensor& weight, double eps,
                            const at::Tensor& grad_x_rows, const at::Tensor& grad_weight_sum, int64_t chunks);
at::Tensor rms_norm_meta(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> rms_norm_backward_meta(const at::Tensor& grad, const at::Tensor& x,
                                                          const at::Tensor& weight, double eps,
                                                          std::array<bool, 2> output_mask);

}  // namespace torch_offload
