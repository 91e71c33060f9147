// Every schema of the offload:: namespace, in one place. Kernels are registered
// per dispatch key in the other files of this folder.
#include <torch/library.h>

#include "ops/common/pinned_arena.h"

TORCH_LIBRARY(offload, m) {
  m.def("offload_pack(Tensor src, bool non_blocking=False) -> Tensor");
  m.def("offload_unpack(Tensor packed, Device device) -> Tensor");

  // Arena controls take no tensor, so one kernel serves every backend.
  m.def("set_pinned_budget(int budget_bytes) -> ()", &torch_offload::set_pinned_budget_kernel);
  m.def("pinned_arena_stats() -> int[]", &torch_offload::pinned_arena_stats_kernel);
}
