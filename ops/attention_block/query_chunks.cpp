// attend_backward_in_query_chunks: causal attention's backward a chunk of queries at a time, through the
// device's kernels (AttentionKernels), each call a piece of whole batch entries.
#include "ops/attention_block/query_chunks.h"

#include <algorithm>

#include <ATen/OpMathType.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include "ops/attention_block/head_batches.h"

namespace torch_offload {

namespace {

// A chunk holds at least this many rows (PyTorch's CPU flash kernels split a causal call of 1024 and more
// rows into pieces of equal work), and there are about kChunks of them: a chunk's tensors are an eighth of a
// head's.
constexpr int64_t kMinChunkRows = 2048;
constexpr int64_t kChunks = 8;

// Zeros like t [B, H, T, D] in the op-math type, token-major ([B, T, H, D] memory) as the kernels' outputs.
at::Tensor accumulator_like(const at::Tensor& t) {
  return at::zeros({t.size(0), t.size(2), t.size(1), t.size(3)}, t.options().dtype(at::toOpMathType(t.scalar_type())))
      .transpose(1, 2);
}

// The chunk's output and log-sum-exp over its own keys (causal) and the keys before them.
AttentionResult attend_chunk(const AttentionKernels& kernels, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& v, double scale, int64_t start) {
  const int64_t length = q.size(2);
  AttentionResult own = kernels.forward(q, k.narrow(2, start, length), v.narrow(2, start, length), scale, true);
  if (start == 0) {
    return {own.out, own.logsumexp, {}, {}};
  }
  const AttentionResult before = kernels.forward(q, k.narrow(2, 0, start), v.narrow(2, 0, start), scale, false);
  const at::Tensor lse = own.logsumexp.logaddexp(before.logsumexp);
  // Merged in the log-sum-exp's precision (float32 for bf16/fp16), the sum rounded once into out.
  own.out.copy_(own.out * (own.logsumexp - lse).exp().unsqueeze(-1) +
                before.out * (before.logsumexp - lse).exp().unsqueeze(-1));
  return {own.out, lse, {}, {}};
}

}  // namespace

int64_t query_chunk_rows(int64_t tokens) {
  if (tokens < 2 * kMinChunkRows) {
    return 0;
  }
  const int64_t rows = (tokens + kChunks - 1) / kChunks;
  return std::max(kMinChunkRows, (rows + 3) / 4 * 4);  // a multiple of 4: the CPU kernels' split wants one
}

std::tuple<at::Tensor, at::Tensor> attend_backward_in_query_chunks(const AttentionKernels& kernels, const at::Tensor& k,
                                                                   const at::Tensor& v, double scale, int64_t chunk,
                                                                   const QueryChunkSteps& steps) {
  const int64_t tokens = k.size(2);
  at::Tensor dk = accumulator_like(k), dv = accumulator_like(v);
  for (int64_t start = 0; start < tokens; start += chunk) {
    const int64_t length = std::min(chunk, tokens - start);
    at::Tensor q = steps.queries(start, length);
    AttentionResult result = steps.saved ? steps.saved(start, length) : attend_chunk(kernels, q, k, v, scale, start);
    const at::Tensor grad_out = steps.output_gradient(start, length, result.out);
    auto [dq_own, dk_own, dv_own] = kernels.backward(grad_out, q, k.narrow(2, start, length),
                                                     v.narrow(2, start, length), result, scale, /*causal=*/true);
    at::Tensor dq = accumulator_like(q).copy_(dq_own);
    dq_own.reset();
    dk.narrow(2, start, length).add_(dk_own);
    dv.narrow(2, start, length).add_(dv_own);
    dk_own.reset(), dv_own.reset();
    // The keys before the chunk, `chunk` of them a call (start is a multiple of chunk), as two halves in a
    // batch of two: whole entries for two threads, and key gradients of a chunk's size.
    const AttentionResult twice{twice_as_batch(result.out), twice_as_batch(result.logsumexp), {}, {}};
    const at::Tensor grad_out_twice = twice_as_batch(grad_out), q_twice = twice_as_batch(q);
    for (int64_t key_start = 0; key_start < start; key_start += chunk) {
      const auto [piece_dq, piece_dk, piece_dv] =
          kernels.backward(grad_out_twice, q_twice, halves_as_batch(k.narrow(2, key_start, chunk)),
                           halves_as_batch(v.narrow(2, key_start, chunk)), twice, scale, /*causal=*/false);
      dq.add_(sum_twice(piece_dq));
      dk.narrow(2, key_start, chunk).add_(batch_as_halves(piece_dk));
      dv.narrow(2, key_start, chunk).add_(batch_as_halves(piece_dv));
    }
    steps.query_gradient(start, length, dq);
  }
  return {dk, dv};
}

}  // namespace torch_offload
