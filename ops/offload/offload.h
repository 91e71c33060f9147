#pragma once
// offload_pack / offload_unpack kernels. Registration lives in registration/.
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

namespace torch_offload {

// pack: a new contiguous CPU tensor with src's values.
at::Tensor offload_pack_cpu(const at::Tensor& src, bool non_blocking);
at::Tensor offload_pack_meta(const at::Tensor& src, bool non_blocking);

// unpack: a new contiguous tensor on `device` with packed's values. The kernel is
// chosen by packed's device (the dispatcher ignores `device`), so the CPU kernel
// serves host-to-device copies.
at::Tensor offload_unpack_cpu(const at::Tensor& packed, c10::Device device);
at::Tensor offload_unpack_meta(const at::Tensor& packed, c10::Device device);

#ifdef TORCH_OFFLOAD_WITH_CUDA
// Device-to-host copy on a dedicated stream into the pinned arena.
at::Tensor offload_pack_cuda(const at::Tensor& src, bool non_blocking);
// packed already on a GPU: a plain copy to `device`.
at::Tensor offload_unpack_cuda(const at::Tensor& packed, c10::Device device);
// Host-to-device copy on a dedicated stream; the current stream waits on it.
at::Tensor unpack_host_to_cuda(const at::Tensor& packed, c10::Device device);
// Blocks the host until copies still writing into `packed` (a non-blocking pack) finish.
void wait_for_pending_pack(const at::Tensor& packed);
#endif

}  // namespace torch_offload
