// The ops that belong to no op folder: the pinned arena's controls and _assert_all.
#include <torch/library.h>

#include "ops/common/checks.h"
#include "ops/common/op_rules.h"
#include "ops/common/pinned_arena.h"

TORCH_LIBRARY_FRAGMENT(offload, m) {
  // Arena controls take no tensor, so one kernel serves every backend.
  m.def("set_pinned_budget(int budget_bytes) -> ()", &torch_offload::set_pinned_budget_kernel);
  m.def("pinned_arena_stats() -> int[]", &torch_offload::pinned_arena_stats_kernel);

  // A copy of value once every element of condition is true, else the error message (ops/common/checks.h):
  // apply()'s masks check with it under torch.compile what only the data shows.
  m.def("_assert_all(Tensor value, Tensor condition, str message) -> Tensor");
}

TORCH_LIBRARY_IMPL(offload, CompositeExplicitAutograd, m) {
  m.impl("_assert_all", &torch_offload::assert_all_kernel);
}

TORCH_LIBRARY_IMPL(offload, Meta, m) {
  m.impl("_assert_all", &torch_offload::assert_all_meta);
}

namespace torch_offload {
namespace {

// A copy, in value's dtype.
const SharedOpRules common_rules({"_assert_all"}, UnderAutocast::kInputDtypes);

}  // namespace
}  // namespace torch_offload
