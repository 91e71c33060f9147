#pragma once
// A causal head group's attention backward one chunk of queries at a time (attention_block_backward on the CPU,
// one sequence a row): the queries, the recomputed output, its gradient and the queries' gradient exist a chunk
// at a time; the keys and values are whole, with their gradients. A chunk's queries see its own keys (causal)
// and every key before it (all of them): its output and log-sum-exp merge the two pieces' by their log-sum-exps,
// and each piece's backward with the merged ones gives exactly its share of the gradients.
#include <cstdint>
#include <functional>

#include <ATen/core/Tensor.h>

#include "ops/attention_block/attention_block.h"

namespace torch_offload {

// What the caller computes for the chunk of rows [start, start + length).
struct QueryChunkSteps {
  // The chunk's queries, [B, H, length, D].
  std::function<at::Tensor(int64_t start, int64_t length)> queries;
  // The gradient of the chunk's attention output, given that output ([B, H, length, D], token-major).
  std::function<at::Tensor(int64_t start, int64_t length, const at::Tensor& out)> output_gradient;
  // Takes the chunk's queries' gradient (float32 for bf16/fp16 queries) back through their projection.
  std::function<void(int64_t start, int64_t length, const at::Tensor& dq)> query_gradient;
  // The chunk's output and log-sum-exp over all of its keys as the forward computed them (attention_block_attend's);
  // empty: recomputed from its own keys and the keys before them.
  std::function<AttentionResult(int64_t start, int64_t length)> saved;
};

// Rows per query chunk of a causal call over `tokens` rows, about an eighth of them; 0 where the call is too short
// to be worth cutting.
int64_t query_chunk_rows(int64_t tokens);

// k's and v's gradients ([B, H, T, D], float32 for bf16/fp16 keys) for keys and values k and v, every chunk's
// queries, outputs and gradients going through `steps`.
std::tuple<at::Tensor, at::Tensor> attend_backward_in_query_chunks(const AttentionKernels& kernels, const at::Tensor& k,
                                                                   const at::Tensor& v, double scale, int64_t chunk,
                                                                   const QueryChunkSteps& steps);

}  // namespace torch_offload
