// The CUDA build's answer to check_not_capturing's question (ops/common/checks.h): is a CUDA device's current
// stream recording a graph? Set once, when the library loads.
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>

#include "ops/common/checks.h"

namespace {

bool cuda_stream_capturing(c10::Device device) {
  if (!device.is_cuda()) {
    return false;
  }
  const c10::cuda::CUDAGuard guard(device);
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

const bool capture_query_set = (torch_offload::set_stream_capture_query(&cuda_stream_capturing), true);

}  // namespace
