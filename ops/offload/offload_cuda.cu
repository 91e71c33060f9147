// CUDA side of offload_pack / offload_unpack: copies on dedicated streams, ordered
// against the caller's stream with events, never with a device-wide sync.
#include "ops/offload/offload.h"

#include <map>
#include <mutex>
#include <utility>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "ops/common/checks.h"
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

// An event recorded on a stream. Raw CUDA events (no timing) keep this file free
// of ATen's CUDA context headers, which pull in cuBLAS and friends. It is queried,
// waited for and destroyed on any thread (the spill workers, whoever frees a packed
// tensor): each call sets the event's device first, since a CUDA call on a thread that
// never set one makes a context on device 0 (hundreds of MB there for every DDP rank).
class StreamEvent final : public Fence {
 public:
  explicit StreamEvent(const c10::cuda::CUDAStream& stream) : device_(stream.device_index()) {
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(event_, stream.stream()));
  }
  ~StreamEvent() override {
    try {
      const c10::cuda::CUDAGuard guard(device_);
      cudaEventDestroy(event_);
    } catch (const c10::Error&) {  // the runtime is shutting down: no context left to make
      cudaEventDestroy(event_);
    }
  }
  StreamEvent(const StreamEvent&) = delete;
  StreamEvent& operator=(const StreamEvent&) = delete;

  bool done() const override {
    const c10::cuda::CUDAGuard guard(device_);
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not-ready is an answer, not an error
      return false;
    }
    C10_CUDA_CHECK(status);
    return true;
  }
  void wait() const override {
    const c10::cuda::CUDAGuard guard(device_);
    C10_CUDA_CHECK(cudaEventSynchronize(event_));
  }
  // Work queued on `stream` after this call starts only once the event completed.
  void make_wait(const c10::cuda::CUDAStream& stream) const {
    C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), event_, 0));
  }

 private:
  const c10::DeviceIndex device_;
  cudaEvent_t event_ = nullptr;
};

// Copies that wait on events and reuse pinned slices cannot be captured into a CUDA graph
// (event queries are illegal while capturing, and replays would reuse the slices).
void check_not_capturing(const char* op) {
  TORCH_CHECK(c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None, op,
              ": cannot run while a CUDA graph is being captured (torch.cuda.graph, torch.compile's "
              "mode='reduce-overhead'); offload outside the captured region");
}

void make_stream_wait(const Fence& fence, const c10::cuda::CUDAStream& stream) {
  // Every fence in the arena is made in this file, so the cast cannot fail.
  static_cast<const StreamEvent&>(fence).make_wait(stream);
}

}  // namespace

at::Tensor offload_pack_cuda(const at::Tensor& src, bool non_blocking) {
  check_defined(src, "offload_pack", "src");
  const c10::cuda::CUDAGuard device_guard(src.device());
  check_not_capturing("offload_pack");
  const c10::DeviceIndex device = src.device().index();
  const auto current = c10::cuda::getCurrentCUDAStream(device);
  const auto d2h = copy_stream(device, Direction::kDeviceToHost);

  // The copy starts only after everything already queued on the caller's stream,
  // including whatever produced src.
  StreamEvent(current).make_wait(d2h);

  const auto host_options = src.options().device(at::kCPU);
  const size_t nbytes = static_cast<size_t>(src.numel()) * src.element_size();
  PinnedArena& arena = host_arena();
  void* slice = nbytes > 0 ? arena.allocate(nbytes) : nullptr;
  // Over the pinned budget the copy goes to pageable memory and is synchronous
  // with the host: slower, never a failure.
  at::Tensor packed = slice != nullptr
      ? at::from_blob(slice, src.sizes(), [](void* ptr) { host_arena().release(ptr); }, host_options)
      : at::empty(src.sizes(), host_options);
  if (nbytes == 0) {
    return packed;
  }
  {
    const c10::cuda::CUDAStreamGuard stream_guard(d2h);
    packed.copy_(src, /*non_blocking=*/slice != nullptr);
  }
  // src's block is not handed to other work until the copy stream has read it,
  // even if the caller frees src right now.
  c10::cuda::CUDACachingAllocator::recordStream(src.storage().data_ptr(), d2h);
  if (slice != nullptr) {
    auto fence = std::make_shared<StreamEvent>(d2h);
    arena.add_fence(slice, fence);
    if (!non_blocking) {
      fence->wait();  // this copy only, not the device
    }
  }
  return packed;
}

at::Tensor unpack_host_to_cuda(const at::Tensor& packed, c10::Device device) {
  const c10::DeviceIndex index = device.has_index() ? device.index() : c10::cuda::current_device();
  const c10::cuda::CUDAGuard device_guard(index);
  check_not_capturing("offload_unpack");
  const auto current = c10::cuda::getCurrentCUDAStream(index);
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

  // Allocated under the copy stream, which writes it: a block from the current stream's pool
  // may still be read or written by kernels queued there, which the copy does not wait for.
  // The consumer's stream is recorded below, so the block is not reused while it reads.
  at::Tensor out;
  {
    const c10::cuda::CUDAStreamGuard stream_guard(h2d);
    out = at::empty(packed.sizes(), packed.options().device(at::Device(at::kCUDA, index)));
    if (out.numel() == 0) {
      return out;
    }
    out.copy_(host, /*non_blocking=*/true);
  }
  c10::cuda::CUDACachingAllocator::recordStream(out.storage().data_ptr(), current);
  auto fence = std::make_shared<StreamEvent>(h2d);
  fence->make_wait(current);  // the consumer waits for this copy, nothing else
  arena.add_fence(host.data_ptr(), fence);  // the slice is not reused before it is read
  return out;
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

}  // namespace torch_offload
