#include <torch/library.h>

#include "ops/attention_block/attention_block.h"
#include "ops/common/checks.h"
#include "ops/disk_spill/disk_spill.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"
#include "ops/offload/offload.h"
#include "ops/rms_norm/rms_norm.h"
#include "ops/tiled_mlp/tiled_mlp.h"
#include "ops/token_logprobs/token_logprobs.h"

// Meta kernels keep meta tensors on meta. Under FakeTensor (torch.compile) the
// device-moving ops need their real result device: torch_offload/_fake.py
// registers those fake impls over these (keeping meta inputs on meta too).
TORCH_LIBRARY_IMPL(offload, Meta, m) {
  m.impl("offload_pack", &torch_offload::offload_pack_meta);
  m.impl("offload_unpack", &torch_offload::offload_unpack_meta);
  m.impl("disk_spill", &torch_offload::disk_spill_meta);
  m.impl("disk_restore", &torch_offload::disk_restore_meta);
  m.impl("disk_read", &torch_offload::disk_restore_meta);
  m.impl("disk_prefetch", &torch_offload::disk_prefetch_meta);
  m.impl("disk_wait", &torch_offload::disk_wait_meta);
  // tiled_mlp's results live on x's device, which FakeTensor derives by itself.
  m.impl("tiled_mlp", &torch_offload::tiled_mlp_meta);
  m.impl("tiled_mlp_backward", &torch_offload::tiled_mlp_backward_meta);
  m.impl("rms_norm_tiled_mlp", &torch_offload::rms_norm_tiled_mlp_meta);
  m.impl("rms_norm_tiled_mlp_backward", &torch_offload::rms_norm_tiled_mlp_backward_meta);
  m.impl("_assert_all", &torch_offload::assert_all_meta);
}

TORCH_LIBRARY_IMPL(offload, Meta, m) {
  m.impl("linear_cross_entropy", &torch_offload::linear_cross_entropy_meta);
  m.impl("linear_cross_entropy_forward", &torch_offload::linear_cross_entropy_forward_meta);
  m.impl("linear_cross_entropy_backward", &torch_offload::linear_cross_entropy_backward_meta);
  m.impl("linear_cross_entropy_with_gradients", &torch_offload::linear_cross_entropy_with_gradients_meta);
}

TORCH_LIBRARY_IMPL(offload, Meta, m) {
  m.impl("attention_block", &torch_offload::attention_block_meta);
  m.impl("attention_block_backward", &torch_offload::attention_block_backward_meta);
  m.impl("segment_attention", &torch_offload::segment_attention_meta);
  m.impl("segment_attention_backward", &torch_offload::segment_attention_backward_meta);
}

TORCH_LIBRARY_IMPL(offload, Meta, m) {
  m.impl("token_logprobs", &torch_offload::token_logprobs_meta);
  m.impl("token_logprobs_forward", &torch_offload::token_logprobs_forward_meta);
  m.impl("token_logprobs_backward", &torch_offload::token_logprobs_backward_meta);
  m.impl("token_logprob_summaries", &torch_offload::token_logprob_summaries_meta);
}

TORCH_LIBRARY_IMPL(offload, Meta, m) {
  m.impl("rms_norm", &torch_offload::rms_norm_meta);
  m.impl("rms_norm_backward", &torch_offload::rms_norm_backward_meta);
}
