// rms_norm: its schema, kernels, autograd and shared rules. Its rows are ATen's: one kernel serves every dense
// device.
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "ops/common/op_rules.h"
#include "ops/rms_norm/rms_norm.h"
#include "torch_offload/torch_offload.h"

TORCH_LIBRARY_FRAGMENT(offload, m) {
  // transformers' RMSNorm over x's last dimension: weight * round(x / sqrt(mean(x^2) + eps)), in float32 for
  // bf16/fp16 and rounded to x's dtype before the weight's product; weight [h] in x's dtype. The backward op
  // returns the gradients output_mask asks for (x, weight), recomputing each row's scale from x.
  m.def("rms_norm(Tensor x, Tensor weight, float eps=1e-06) -> Tensor");
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor weight, float eps, bool[2] output_mask) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(offload, CPU, m) {
  m.impl("rms_norm", &torch_offload::rms_norm_kernel);
  m.impl("rms_norm_backward", &torch_offload::rms_norm_backward_kernel);
}

#ifdef TORCH_OFFLOAD_WITH_CUDA
TORCH_LIBRARY_IMPL(offload, CUDA, m) {
  m.impl("rms_norm", &torch_offload::rms_norm_kernel);
  m.impl("rms_norm_backward", &torch_offload::rms_norm_backward_kernel);
}
#endif

TORCH_LIBRARY_IMPL(offload, Meta, m) {
  m.impl("rms_norm", &torch_offload::rms_norm_meta);
  m.impl("rms_norm_backward", &torch_offload::rms_norm_backward_meta);
}

namespace torch_offload {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether x's gradient may be written over `grad`, the gradient coming in: nothing else can see it (this is
// its only reference and its memory's), it is a plain dense tensor shaped as x, no graph is being recorded
// (create_graph), and no dispatch mode, tensor subclass or functionalization (torch.compile's tracing) would
// have to see the write.
bool can_overwrite(const at::Tensor& grad, const at::Tensor& x) {
  constexpr c10::DispatchKeySet kTraced(
      {c10::DispatchKey::Python, c10::DispatchKey::Functionalize, c10::DispatchKey::PythonTLSSnapshot});
  return !at::GradMode::is_enabled() && grad.defined() && grad.layout() == at::kStrided && grad.use_count() == 1 &&
         grad.storage().use_count() == 1 && !grad.is_view() && !grad.requires_grad() && !grad.is_inference() &&
         !grad.is_neg() && !grad._is_zerotensor() && grad.is_contiguous() && grad.sizes() == x.sizes() &&
         grad.scalar_type() == x.scalar_type() && grad.device() == x.device() && !grad.key_set().has_any(kTraced) &&
         !c10::impl::dispatch_mode_enabled() && !c10::impl::tls_local_dispatch_key_set().included_.has_any(kTraced);
}

// rms_norm saves x and weight; backward recomputes each row's scale from x. No double backward. Where the
// incoming gradient is the autograd engine's alone (the usual case: the norm's output feeds one module),
// x's gradient is written over it, so the backward allocates no [tokens, h] tensor: one hidden vector per
// token less while a decoder layer's norm runs backward (not yet at an applied step's peak, the MLP's
// backward: BENCHMARKS.md, "Live tensors at the peak"). `grads` by reference: a copy would hold a second one.
class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    ctx->save_for_backward({x, weight});
    ctx->saved_data["eps"] = eps;
    return rms_norm(x, weight, eps);
  }
  static variable_list backward(AutogradContext* ctx, variable_list& grads) {
    const variable_list saved = ctx->get_saved_variables();
    const double eps = ctx->saved_data.at("eps").toDouble();
    at::Tensor grad = std::move(grads[0]);
    if (ctx->needs_input_grad(0) && can_overwrite(grad, saved[0])) {
      // The kernel's own code, called directly: with the dispatcher's autocast keys it would recast its steps.
      const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
      at::Tensor grad_weight = rms_norm_backward_into_grad(grad, saved[0], saved[1], eps, ctx->needs_input_grad(1));
      return {std::move(grad), std::move(grad_weight), at::Tensor()};
    }
    const auto [grad_x, grad_weight] =
        rms_norm_backward(grad, saved[0], saved[1], eps, {ctx->needs_input_grad(0), ctx->needs_input_grad(1)});
    return {grad_x, grad_weight, at::Tensor()};
  }
};

at::Tensor rms_norm_autograd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return RmsNormFunction::apply(x, weight, eps);
}

// The norm computes in float32 for bf16/fp16 itself: no matrix product for autocast to cast.
const SharedOpRules rms_norm_rules({"rms_norm"}, UnderAutocast::kInputDtypes);
const SharedOpRules rms_norm_rules_without_autocast({"rms_norm_backward"}, UnderAutocast::kOff);

}  // namespace
}  // namespace torch_offload

TORCH_LIBRARY_IMPL(offload, Autograd, m) {
  m.impl("rms_norm", &torch_offload::rms_norm_autograd);
  m.impl("rms_norm_backward", torch::autograd::autogradNotImplementedFallback());
}
