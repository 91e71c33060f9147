#include <torch/library.h>

#include "ops/attention_block/attention_block.h"
#include "ops/disk_spill/disk_spill.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"
#include "ops/offload/offload.h"
#include "ops/rms_norm/rms_norm.h"
#include "ops/tiled_mlp/tiled_mlp.h"
#include "ops/token_logprobs/token_logprobs.h"

TORCH_LIBRARY_IMPL(offload, CPU, m) {
  m.impl("offload_pack", &torch_offload::offload_pack_cpu);
  m.impl("offload_unpack", &torch_offload::offload_unpack_cpu);
  m.impl("disk_spill", &torch_offload::disk_spill_cpu);
  m.impl("disk_restore", &torch_offload::disk_restore_cpu);
  m.impl("disk_read", &torch_offload::disk_read_cpu);
  m.impl("disk_prefetch", &torch_offload::disk_prefetch_cpu);
  m.impl("disk_wait", &torch_offload::disk_wait_cpu);
  m.impl("_disk_ticket_location", &torch_offload::disk_ticket_location_cpu);
  m.impl("tiled_mlp", &torch_offload::tiled_mlp_cpu);
  m.impl("tiled_mlp_backward", &torch_offload::tiled_mlp_backward_cpu);
  m.impl("rms_norm_tiled_mlp", &torch_offload::rms_norm_tiled_mlp_cpu);
  m.impl("rms_norm_tiled_mlp_backward", &torch_offload::rms_norm_tiled_mlp_backward_cpu);
}

TORCH_LIBRARY_IMPL(offload, CPU, m) {
  m.impl("linear_cross_entropy", &torch_offload::linear_cross_entropy_cpu);
  m.impl("linear_cross_entropy_forward", &torch_offload::linear_cross_entropy_forward_cpu);
  m.impl("linear_cross_entropy_backward", &torch_offload::linear_cross_entropy_backward_cpu);
  m.impl("linear_cross_entropy_with_gradients", &torch_offload::linear_cross_entropy_with_gradients_cpu);
}

TORCH_LIBRARY_IMPL(offload, CPU, m) {
  m.impl("attention_block", &torch_offload::attention_block_cpu);
  m.impl("attention_block_backward", &torch_offload::attention_block_backward_cpu);
  m.impl("segment_attention", &torch_offload::segment_attention_cpu);
  m.impl("segment_attention_backward", &torch_offload::segment_attention_backward_cpu);
}

// token_logprobs' tiles are ATen's: one kernel serves every dense device.
TORCH_LIBRARY_IMPL(offload, CPU, m) {
  m.impl("token_logprobs", &torch_offload::token_logprobs_kernel);
  m.impl("token_logprobs_forward", &torch_offload::token_logprobs_forward_kernel);
  m.impl("token_logprobs_backward", &torch_offload::token_logprobs_backward_kernel);
  m.impl("token_logprob_summaries", &torch_offload::token_logprob_summaries_kernel);
}

// rms_norm's rows are ATen's: one kernel serves every dense device.
TORCH_LIBRARY_IMPL(offload, CPU, m) {
  m.impl("rms_norm", &torch_offload::rms_norm_kernel);
  m.impl("rms_norm_backward", &torch_offload::rms_norm_backward_kernel);
}
