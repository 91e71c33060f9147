#pragma once
// The segments of attention_block and segment_attention (segment_ids): their runs, read on the
// host, and a head group's attention within them by the device's kernels, one call per run, or
// one variable-length call for all the sequences (and one for the padding) where the device's
// kernels have it.
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>

#include "ops/attention_block/attention_block.h"

namespace torch_offload {

// The segments of a call: each maximal run of equal segment ids, in order. A run of
// non-negative ids is a causal sequence. A run of negative ids (padding) is no one's keys; its
// queries see all of the nearest non-negative run before it in the row, or nothing (output 0,
// as SDPA gives a query whose every key is masked): transformers' padding mask, whose padding
// queries attend to the row's real tokens before them. Empty when every row is one causal
// sequence (no segment_ids, or one non-negative run each): the kernels then take the whole
// batch in one call. Read on the host (a device-to-host copy of the ids on a GPU, refused while a CUDA
// graph is being captured: the capture cannot record it, nor a replay redo it).
struct SegmentRun {
  int64_t row, start, length;
  bool padding;
  int64_t keys;  // the run whose tokens are its keys: itself, the one padding sees, or -1 (none)

  bool operator==(const SegmentRun&) const = default;
};
using SegmentRuns = std::vector<SegmentRun>;

// The runs of segment_ids (undefined: none); op names the caller in errors.
SegmentRuns segment_runs(const char* op, const at::Tensor& segment_ids);

// A head group's attention (q, k, v [B, H, T, D]) within the runs; out is token-major
// ([B, T, H, D] memory). The pieces keep what each call's backward needs but its out.
AttentionResult attend(const AttentionKernels& kernels, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       double scale, const SegmentRuns& runs);
// attend's gradients (dq, dk, dv).
std::tuple<at::Tensor, at::Tensor, at::Tensor> attend_backward(const AttentionKernels& kernels,
                                                               const at::Tensor& grad_out, const at::Tensor& q,
                                                               const at::Tensor& k, const at::Tensor& v,
                                                               const AttentionResult& result, double scale,
                                                               const SegmentRuns& runs);

// A head group's attend() result's log-sum-exps into lse [heads, B, T] (the group's share of
// attention_block_attend's logsumexp, which leaves padding that sees no key at 0), from each kernel call's own layout.
void store_logsumexp(const at::Tensor& lse, const AttentionResult& result, const AttentionKernels& kernels,
                     const at::Tensor& q, const SegmentRuns& runs);
// What attend() returned, rebuilt from the group's output out [B, H, T, D] and store_logsumexp's lse, for
// attend_backward (the kernels' random state is absent: no dropout).
AttentionResult restored_result(const at::Tensor& lse, const at::Tensor& out, const AttentionKernels& kernels,
                                const at::Tensor& q, const SegmentRuns& runs);

}  // namespace torch_offload
