// CUDA side of offload_pack / offload_unpack: copies on dedicated streams, ordered
// against the caller's stream with events, never with a device-wide sync.
#include "ops/offload/offload.h"

#include <map>
#include <mutex>
#include <utility>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/accumulate.h>

#include "ops/common/checks.h"
#include "ops/common/device_event.h"
#include "ops/common/pinned_arena.h"

namespace torch_offload {
namespace {

enum class Direction { kDeviceToHost, kHostToDevice };

// One stream per device and direction for the life of the process, so packs and
// unpacks overlap compute and each other and never queue behind the caller.
c10::cuda::CUDAStream copy_stream(c10::DeviceIndex device, Direction direction) {
  static std::mutex mutex;
  static std::map<std::pair<c10::DeviceIndex, Direction>, cudaStream_t> streams;
  std::lock_guard<std::mutex> lock(mutex);
  cudaStream_t& stream = streams[{device, direction}];
  if (stream == nullptr) {
    const c10::cuda::CUDAGuard guard(device);
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }
  return c10::cuda::getStreamFromExternal(stream, device);
}

// Copies that wait on events and reuse pinned slices cannot be captured into a CUDA graph
// (event queries are illegal while capturing, and replays would reuse the slices).
constexpr const char* kNotCapturable = "its copies wait on events and reuse pinned slices";

void make_stream_wait(const Fence& fence, const c10::cuda::CUDAStream& stream) {
  // Every fence in the arena is made in this file, so the cast cannot fail.
  static_cast<const DeviceEvent&>(fence).make_wait(stream);
}

// An uninitialized CPU tensor over a new slice of the pinned arena, which gets the slice back
// when the tensor is freed (and reuses it once the slice's fences are done); undefined when
// the tensor is empty or the pinned budget has no room for it.
at::Tensor empty_pinned(at::IntArrayRef sizes, const at::TensorOptions& options) {
  const size_t nbytes = static_cast<size_t>(c10::multiply_integers(sizes)) * options.dtype().itemsize();
  void* slice = nbytes > 0 ? host_arena().allocate(nbytes) : nullptr;
  if (slice == nullptr) {
    return {};
  }
  return at::from_blob(slice, sizes, [](void* ptr) { host_arena().release(ptr); }, options.device(at::kCPU));
}

// host's values where a copy stream can read them without the host: host itself when pinned,
// else a pinned copy (a disk restore's read buffer, any pageable tensor). A copy from pageable
// memory holds the calling thread until the transfer is done; the pinned copy costs a memcpy.
// Over the pinned budget, host itself.
at::Tensor pinned_source(const at::Tensor& host) {
  if (host.numel() == 0 || host.is_pinned()) {
    return host;
  }
  at::Tensor pinned = empty_pinned(host.sizes(), host.options());
  return pinned.defined() ? pinned.copy_(host) : host;
}

}  // namespace

at::Tensor offload_pack_cuda(const at::Tensor& src, bool non_blocking) {
  check_defined(src, "offload_pack", "src");
  const c10::cuda::CUDAGuard device_guard(src.device());
  check_not_capturing("offload_pack", src.device(), kNotCapturable);
  const c10::DeviceIndex device = src.device().index();
  const auto current = c10::cuda::getCurrentCUDAStream(device);
  const auto d2h = copy_stream(device, Direction::kDeviceToHost);

  // The copy starts only after everything already queued on the caller's stream,
  // including whatever produced src.
  DeviceEvent(current).make_wait(d2h);

  // Over the pinned budget the copy goes to pageable memory and is synchronous
  // with the host: slower, never a failure.
  at::Tensor packed = empty_pinned(src.sizes(), src.options());
  const bool pinned = packed.defined();
  if (!pinned) {
    packed = at::empty(src.sizes(), src.options().device(at::kCPU));
  }
  if (src.numel() == 0) {
    return packed;
  }
  {
    const c10::cuda::CUDAStreamGuard stream_guard(d2h);
    packed.copy_(src, /*non_blocking=*/pinned);
  }
  // src's block is not handed to other work until the copy stream has read it,
  // even if the caller frees src right now.
  c10::cuda::CUDACachingAllocator::recordStream(src.storage().data_ptr(), d2h);
  if (pinned) {
    auto fence = std::make_shared<DeviceEvent>(d2h);
    host_arena().add_fence(packed.data_ptr(), fence);
    if (!non_blocking) {
      fence->wait();  // this copy only, not the device
    }
  }
  return packed;
}

PendingUnpack start_host_to_cuda(const at::Tensor& packed, c10::Device device) {
  const c10::DeviceIndex index = device.has_index() ? device.index() : c10::cuda::current_device();
  const c10::cuda::CUDAGuard device_guard(index);
  check_not_capturing("offload_unpack", c10::Device(c10::kCUDA, index), kNotCapturable);
  const auto h2d = copy_stream(index, Direction::kHostToDevice);
  PinnedArena& arena = host_arena();

  // A non-blocking pack may still be writing packed's slice.
  at::Tensor host = packed;
  if (packed.is_contiguous()) {
    for (const auto& fence : arena.pending_fences(packed.data_ptr())) {
      make_stream_wait(*fence, h2d);
    }
  } else {
    wait_for_pending_pack(packed);  // the host reads it to make it contiguous
    host = packed.contiguous();
  }
  host = pinned_source(host);

  // Allocated under the copy stream, which writes it: a block from the consumer's pool
  // may still be read or written by kernels queued there, which the copy does not wait for.
  // The consumer's stream is recorded when it takes the tensor (finish_unpack), so the
  // block is not reused while it reads.
  PendingUnpack pending;
  {
    const c10::cuda::CUDAStreamGuard stream_guard(h2d);
    pending.tensor = at::empty(packed.sizes(), packed.options().device(at::Device(at::kCUDA, index)));
    if (pending.tensor.numel() == 0) {
      return pending;
    }
    pending.tensor.copy_(host, /*non_blocking=*/true);
  }
  pending.ready = std::make_shared<DeviceEvent>(h2d);
  arena.add_fence(host.data_ptr(), pending.ready);  // the slice is not reused before it is read
  return pending;
}

void use_on_current_stream(const PendingUnpack& pending) {
  const c10::Device device = pending.tensor.device();
  const c10::cuda::CUDAGuard device_guard(device);
  const auto current = c10::cuda::getCurrentCUDAStream(device.index());
  pending.ready->make_wait(current);  // the consumer waits for this copy, nothing else
  c10::cuda::CUDACachingAllocator::recordStream(pending.tensor.storage().data_ptr(), current);
}

at::Tensor offload_unpack_cuda(const at::Tensor& packed, c10::Device device) {
  check_defined(packed, "offload_unpack", "packed");
  check_device_available(device, "offload_unpack", "device");
  return packed.to(packed.options().device(device), /*non_blocking=*/false, /*copy=*/true,
                   at::MemoryFormat::Contiguous);
}

void wait_for_pending_pack(const at::Tensor& packed) {
  if (packed.numel() == 0) {
    return;
  }
  for (const auto& fence : host_arena().pending_fences(packed.data_ptr())) {
    fence->wait();
  }
}

bool is_pinned_host_memory(const at::Tensor& t) {
  // Pinned memory exists only once some device has a context: asking CUDA before that
  // would make one on device 0. No device (or no driver) is a CPU-only process.
  return t.is_cpu() && c10::cuda::device_count() > 0 && c10::cuda::getDeviceIndexWithPrimaryContext().has_value() &&
         t.is_pinned();
}

}  // namespace torch_offload
