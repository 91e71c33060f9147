#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "ops/attention_block/attention_block.h"
#include "ops/common/checks.h"
#include "ops/disk_spill/disk_spill.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"
#include "ops/offload/offload.h"
#include "ops/rms_norm/rms_norm.h"
#include "ops/tiled_mlp/tiled_mlp.h"
#include "ops/token_logprobs/token_logprobs.h"

namespace {

// check_not_capturing's question for a CUDA device: is its current stream capturing?
bool cuda_stream_capturing(c10::Device device) {
  if (!device.is_cuda()) {
    return false;
  }
  const c10::cuda::CUDAGuard guard(device);
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

const bool capture_query_set = (torch_offload::set_stream_capture_query(&cuda_stream_capturing), true);

}  // namespace

TORCH_LIBRARY_IMPL(offload, CUDA, m) {
  m.impl("offload_pack", &torch_offload::offload_pack_cuda);
  m.impl("offload_unpack", &torch_offload::offload_unpack_cuda);
  m.impl("disk_spill", &torch_offload::disk_spill_cuda);
  m.impl("tiled_mlp", &torch_offload::tiled_mlp_cuda);
  m.impl("tiled_mlp_backward", &torch_offload::tiled_mlp_backward_cuda);
  m.impl("rms_norm_tiled_mlp", &torch_offload::rms_norm_tiled_mlp_cuda);
  m.impl("rms_norm_tiled_mlp_backward", &torch_offload::rms_norm_tiled_mlp_backward_cuda);
}

TORCH_LIBRARY_IMPL(offload, CUDA, m) {
  m.impl("linear_cross_entropy", &torch_offload::linear_cross_entropy_cuda);
  m.impl("linear_cross_entropy_forward", &torch_offload::linear_cross_entropy_forward_cuda);
  m.impl("linear_cross_entropy_backward", &torch_offload::linear_cross_entropy_backward_cuda);
  m.impl("linear_cross_entropy_with_gradients", &torch_offload::linear_cross_entropy_with_gradients_cuda);
}

TORCH_LIBRARY_IMPL(offload, CUDA, m) {
  m.impl("attention_block", &torch_offload::attention_block_cuda);
  m.impl("attention_block_backward", &torch_offload::attention_block_backward_cuda);
  m.impl("segment_attention", &torch_offload::segment_attention_cuda);
  m.impl("segment_attention_backward", &torch_offload::segment_attention_backward_cuda);
}

// token_logprobs' tiles are ATen's: one kernel serves every dense device.
TORCH_LIBRARY_IMPL(offload, CUDA, m) {
  m.impl("token_logprobs", &torch_offload::token_logprobs_kernel);
  m.impl("token_logprobs_forward", &torch_offload::token_logprobs_forward_kernel);
  m.impl("token_logprobs_backward", &torch_offload::token_logprobs_backward_kernel);
  m.impl("token_logprob_summaries", &torch_offload::token_logprob_summaries_kernel);
}

// rms_norm's rows are ATen's: one kernel serves every dense device.
TORCH_LIBRARY_IMPL(offload, CUDA, m) {
  m.impl("rms_norm", &torch_offload::rms_norm_kernel);
  m.impl("rms_norm_backward", &torch_offload::rms_norm_backward_kernel);
}
