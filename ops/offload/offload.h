#pragma once
// offload_pack / offload_unpack kernels. Registration: offload_registration.cpp.
#include <memory>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "ops/common/device_event.h"

namespace torch_offload {

// pack: a new contiguous CPU tensor with src's values.
at::Tensor offload_pack_cpu(const at::Tensor& src, bool non_blocking);
at::Tensor offload_pack_meta(const at::Tensor& src, bool non_blocking);

// unpack: a new contiguous tensor on `device` with packed's values. The kernel is
// chosen by packed's device (the dispatcher ignores `device`), so the CPU kernel
// serves host-to-device copies.
at::Tensor offload_unpack_cpu(const at::Tensor& packed, c10::Device device);
at::Tensor offload_unpack_meta(const at::Tensor& packed, c10::Device device);

// An unpack started ahead of need (a prefetch): on a GPU the copy is queued on a copy
// stream that no other stream waits for yet, and `ready` says when it lands; elsewhere it
// is done and `ready` is null. The consumer takes it with finish_unpack, on the stream
// it reads it from, which may not be the stream current when the unpack started.
struct PendingUnpack {
  at::Tensor tensor;
  std::shared_ptr<DeviceEvent> ready;
};
PendingUnpack start_unpack(const at::Tensor& packed, c10::Device device);
// The tensor, once the current stream waits for its copy and is recorded as a user of its memory.
at::Tensor finish_unpack(const PendingUnpack& pending);

#ifdef TORCH_OFFLOAD_WITH_CUDA
// Device-to-host copy on a dedicated stream into the pinned arena.
at::Tensor offload_pack_cuda(const at::Tensor& src, bool non_blocking);
// packed already on a GPU: a plain copy to `device`.
at::Tensor offload_unpack_cuda(const at::Tensor& packed, c10::Device device);
// Host-to-device copy on a dedicated stream, into memory allocated for that stream.
PendingUnpack start_host_to_cuda(const at::Tensor& packed, c10::Device device);
// The current stream waits for the copy and is recorded as a user of the tensor's memory.
void use_on_current_stream(const PendingUnpack& pending);
// Blocks the host until copies still writing into `packed` (a non-blocking pack) finish.
void wait_for_pending_pack(const at::Tensor& packed);
// Whether t is CUDA pinned host memory, asked without making a CUDA context when there is none.
bool is_pinned_host_memory(const at::Tensor& t);
#endif

}  // namespace torch_offload
