// Autograd formulas, registered in C++ so that C++ callers get gradients too.
// Each forward re-dispatches below autograd; each backward calls the ops again,
// so higher-order gradients work as well.
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "torch_offload/torch_offload.h"

namespace torch_offload {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// pack moves to the CPU: its gradient moves back to the source device.
class PackFunction : public torch::autograd::Function<PackFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& src, bool non_blocking) {
    ctx->saved_data["device"] = src.device();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return offload_pack(src, non_blocking);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& grad = grads[0];
    const c10::Device device = ctx->saved_data["device"].toDevice();
    return {grad.defined() ? offload_unpack(grad, device) : grad, at::Tensor()};
  }
};

// unpack moves from packed's device: its gradient is packed back to the CPU, or
// copied back to packed's device when that is not the CPU.
class UnpackFunction : public torch::autograd::Function<UnpackFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& packed, c10::Device device) {
    ctx->saved_data["device"] = packed.device();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return offload_unpack(packed, device);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor& grad = grads[0];
    const c10::Device device = ctx->saved_data["device"].toDevice();
    if (!grad.defined()) {
      return {grad, at::Tensor()};
    }
    return {device.is_cpu() ? offload_pack(grad) : offload_unpack(grad, device), at::Tensor()};
  }
};

at::Tensor offload_pack_autograd(const at::Tensor& src, bool non_blocking) {
  return PackFunction::apply(src, non_blocking);
}

at::Tensor offload_unpack_autograd(const at::Tensor& packed, c10::Device device) {
  return UnpackFunction::apply(packed, device);
}

}  // namespace
}  // namespace torch_offload

TORCH_LIBRARY_IMPL(offload, Autograd, m) {
  m.impl("offload_pack", &torch_offload::offload_pack_autograd);
  m.impl("offload_unpack", &torch_offload::offload_unpack_autograd);
  // Tickets carry no gradient: run below autograd, nothing to record.
  m.impl("disk_spill", torch::autograd::autogradNotImplementedFallback());
  m.impl("disk_restore", torch::autograd::autogradNotImplementedFallback());
}
