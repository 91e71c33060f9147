// Every schema of the offload:: namespace, in one place. Kernels are registered
// per dispatch key in the other files of this folder.
#include <torch/library.h>

#include "ops/common/pinned_arena.h"
#include "ops/offload/activation_store.h"

TORCH_LIBRARY(offload, m) {
  m.def("offload_pack(Tensor src, bool non_blocking=False) -> Tensor");
  m.def("offload_unpack(Tensor packed, Device device) -> Tensor");

  // Arena controls take no tensor, so one kernel serves every backend.
  m.def("set_pinned_budget(int budget_bytes) -> ()", &torch_offload::set_pinned_budget_kernel);
  m.def("pinned_arena_stats() -> int[]", &torch_offload::pinned_arena_stats_kernel);

  // State of torch_offload.offload_activations(): torch.classes.offload.*.
  m.class_<torch_offload::ActivationEntry>("ActivationEntry");
  m.class_<torch_offload::SavedActivation>("SavedActivation")
      .def("unpack", &torch_offload::SavedActivation::unpack);
  m.class_<torch_offload::ActivationStore>("ActivationStore")
      .def(torch::init<int64_t, int64_t, int64_t, bool>())
      .def("pack", &torch_offload::ActivationStore::pack)
      .def("skip_storages_of", &torch_offload::ActivationStore::skip_storages_of)
      .def("clear_skipped_storages", &torch_offload::ActivationStore::clear_skipped_storages)
      .def("stats", &torch_offload::ActivationStore::stats);
}
