// The disk tier's ops: their schemas, kernels and shared rules.
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include "ops/common/op_rules.h"
#include "ops/disk_spill/disk_spill.h"

TORCH_LIBRARY_FRAGMENT(offload, m) {
  // The disk tier. disk_spill returns a ticket (a CPU int64 tensor [2]) at once
  // and writes asynchronously; disk_restore takes the size, dtype and device so
  // fake kernels know its result. A failed write raises in disk_wait or
  // disk_restore. _disk_ticket_location ([fd, extent offset,
  // payload offset within the extent]) is for tests.
  m.def("disk_spill(Tensor src, str? directory=None, bool allow_tmpfs=False) -> Tensor");
  m.def("disk_restore(Tensor ticket, SymInt[] size, ScalarType dtype, Device device) -> Tensor");
  // disk_restore without consuming the ticket: read again as often as asked, until restored or freed.
  m.def("disk_read(Tensor ticket, SymInt[] size, ScalarType dtype, Device device) -> Tensor");
  m.def("disk_prefetch(Tensor ticket) -> ()");
  m.def("disk_wait(Tensor ticket) -> ()");
  m.def("_disk_ticket_location(Tensor ticket) -> int[]");
  m.def(
      "disk_spill_configure(int num_threads=4, int extent_bytes=33554432, bool checksums=True, "
      "int max_in_flight_bytes=536870912, int restore_cache_bytes=0) -> ()",
      &torch_offload::disk_spill_configure_kernel);
  m.def("disk_spill_stats() -> int[]", &torch_offload::disk_spill_stats_kernel);
}

TORCH_LIBRARY_IMPL(offload, CPU, m) {
  m.impl("disk_spill", &torch_offload::disk_spill_cpu);
  m.impl("disk_restore", &torch_offload::disk_restore_cpu);
  m.impl("disk_read", &torch_offload::disk_read_cpu);
  m.impl("disk_prefetch", &torch_offload::disk_prefetch_cpu);
  m.impl("disk_wait", &torch_offload::disk_wait_cpu);
  m.impl("_disk_ticket_location", &torch_offload::disk_ticket_location_cpu);
}

#ifdef TORCH_OFFLOAD_WITH_CUDA
// A CUDA tensor is spilled from the device; tickets and restores are the CPU kernels' (restores take the device).
TORCH_LIBRARY_IMPL(offload, CUDA, m) {
  m.impl("disk_spill", &torch_offload::disk_spill_cuda);
}
#endif

// Meta kernels keep meta tensors on meta. Under FakeTensor (torch.compile) the ops need their real result
// device: torch_offload/_fake.py registers those fake impls over these (keeping meta inputs on meta too).
TORCH_LIBRARY_IMPL(offload, Meta, m) {
  m.impl("disk_spill", &torch_offload::disk_spill_meta);
  m.impl("disk_restore", &torch_offload::disk_restore_meta);
  m.impl("disk_read", &torch_offload::disk_restore_meta);
  m.impl("disk_prefetch", &torch_offload::disk_prefetch_meta);
  m.impl("disk_wait", &torch_offload::disk_wait_meta);
}

// Tickets carry no gradient: run below autograd, nothing to record.
TORCH_LIBRARY_IMPL(offload, Autograd, m) {
  m.impl("disk_spill", torch::autograd::autogradNotImplementedFallback());
  m.impl("disk_restore", torch::autograd::autogradNotImplementedFallback());
  m.impl("disk_read", torch::autograd::autogradNotImplementedFallback());
}

namespace torch_offload {
namespace {

// The tier stores and returns tensors in their own dtypes.
const SharedOpRules disk_spill_rules({"disk_spill", "disk_restore", "disk_read", "disk_prefetch", "disk_wait",
                                      "_disk_ticket_location"},
                                     UnderAutocast::kInputDtypes);

}  // namespace
}  // namespace torch_offload
