// offload_pack and offload_unpack: their schemas, kernels, autograd and shared rules, and the classes of
// torch_offload.offload_activations()' state (torch.classes.offload.*).
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include "ops/common/op_rules.h"
#include "ops/offload/activation_store.h"
#include "ops/offload/offload.h"
#include "torch_offload/torch_offload.h"

TORCH_LIBRARY_FRAGMENT(offload, m) {
  m.def("offload_pack(Tensor src, bool non_blocking=False) -> Tensor");
  m.def("offload_unpack(Tensor packed, Device device) -> Tensor");

  // State of torch_offload.offload_activations(): torch.classes.offload.*.
  m.class_<torch_offload::ActivationEntry>("ActivationEntry");
  m.class_<torch_offload::SavedActivation>("SavedActivation").def("unpack", &torch_offload::SavedActivation::unpack);
  m.class_<torch_offload::ActivationStore>("ActivationStore")
      .def(torch::init<int64_t, int64_t, int64_t, bool, bool, bool, std::optional<std::string>, bool>())
      .def("pack", &torch_offload::ActivationStore::pack)
      .def("skip_storages_of", &torch_offload::ActivationStore::skip_storages_of)
      .def("clear_skipped_storages", &torch_offload::ActivationStore::clear_skipped_storages)
      .def("stats", &torch_offload::ActivationStore::stats);
}

TORCH_LIBRARY_IMPL(offload, CPU, m) {
  m.impl("offload_pack", &torch_offload::offload_pack_cpu);
  m.impl("offload_unpack", &torch_offload::offload_unpack_cpu);
}

#ifdef TORCH_OFFLOAD_WITH_CUDA
TORCH_LIBRARY_IMPL(offload, CUDA, m) {
  m.impl("offload_pack", &torch_offload::offload_pack_cuda);
  m.impl("offload_unpack", &torch_offload::offload_unpack_cuda);
}
#endif

// Meta kernels keep meta tensors on meta. Under FakeTensor (torch.compile) the ops need their real result
// device: torch_offload/_fake.py registers those fake impls over these (keeping meta inputs on meta too).
TORCH_LIBRARY_IMPL(offload, Meta, m) {
  m.impl("offload_pack", &torch_offload::offload_pack_meta);
  m.impl("offload_unpack", &torch_offload::offload_unpack_meta);
}

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

// They move tensors as they are, in their dtypes.
const SharedOpRules offload_rules({"offload_pack", "offload_unpack"}, UnderAutocast::kInputDtypes);

}  // namespace
}  // namespace torch_offload

TORCH_LIBRARY_IMPL(offload, Autograd, m) {
  m.impl("offload_pack", &torch_offload::offload_pack_autograd);
  m.impl("offload_unpack", &torch_offload::offload_unpack_autograd);
}
