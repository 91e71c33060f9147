#pragma once
// ulysses_attention: causal segment attention of a sequence split over the ranks of a process
// group (DeepSpeed Ulysses). Each rank holds a contiguous chunk of every row's tokens; one
// all-to-all per tensor gives every rank the whole rows for its share of the heads, segment_attention
// runs there, and one more all-to-all sends the outputs back. The collectives are torch.distributed's
// functional ones (_c10d_functional::all_to_all_single + wait_tensor, differentiable through a small
// C++ autograd function), so the op is a composite: Meta and dynamo/AOT tracing come from its parts,
// on every backend the group runs (Gloo, NCCL).
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>

namespace torch_offload {

// [B, heads, tokens / ranks, D] on each rank -> [B, heads / ranks, tokens, D]: rank r keeps the r-th share of
// the heads, with every rank's tokens in rank order; tokens_to_heads is its inverse. `differentiable`:
// through a C++ autograd function (whose gradient is the inverse exchange); else for kernels, below autograd.
at::Tensor heads_to_tokens(const at::Tensor& t, int64_t ranks, const std::string& group_name, bool differentiable);
at::Tensor tokens_to_heads(const at::Tensor& t, int64_t ranks, const std::string& group_name, bool differentiable);

// The number of ranks of the process group torch.distributed registered under group_name.
int64_t group_size(const std::string& group_name);

at::Tensor ulysses_attention_composite(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                       const at::Tensor& segment_ids, const std::string& group_name,
                                       std::optional<double> scale, std::optional<double> softcap,
                                       const std::optional<at::Tensor>& sinks, std::optional<int64_t> window);

}  // namespace torch_offload
