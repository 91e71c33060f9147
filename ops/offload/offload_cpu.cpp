#include "ops/offload/offload.h"

#include <ATen/ops/empty.h>

#include "ops/common/checks.h"

namespace torch_offload {

at::Tensor offload_pack_cpu(const at::Tensor& src, bool /*non_blocking: a CPU copy is synchronous*/) {
  check_defined(src, "offload_pack", "src");
  return src.clone(at::MemoryFormat::Contiguous);
}

at::Tensor offload_pack_meta(const at::Tensor& src, bool /*non_blocking*/) {
  return at::empty_symint(src.sym_sizes(), src.options());
}

at::Tensor offload_unpack_cpu(const at::Tensor& packed, c10::Device device) {
  check_defined(packed, "offload_unpack", "packed");
  check_device_available(device, "offload_unpack", "device");
  return finish_unpack(start_unpack(packed, device));
}

PendingUnpack start_unpack(const at::Tensor& packed, c10::Device device) {
#ifdef TORCH_OFFLOAD_WITH_CUDA
  if (device.is_cuda() && packed.is_cpu()) {
    return start_host_to_cuda(packed, device);
  }
  if (packed.is_cpu()) {
    wait_for_pending_pack(packed);
  }
#endif
  return {
      packed.to(packed.options().device(device), /*non_blocking=*/false, /*copy=*/true, at::MemoryFormat::Contiguous),
      nullptr};
}

at::Tensor finish_unpack(const PendingUnpack& pending) {
#ifdef TORCH_OFFLOAD_WITH_CUDA
  if (pending.ready) {
    use_on_current_stream(pending);
  }
#endif
  return pending.tensor;
}

// Meta in, meta out: a meta kernel never allocates on `device`. FakeTensor needs the
// real result device; the Python package registers that fake impl.
at::Tensor offload_unpack_meta(const at::Tensor& packed, c10::Device /*device*/) {
  return at::empty_symint(packed.sym_sizes(), packed.options());
}

}  // namespace torch_offload
