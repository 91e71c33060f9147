// Attention whose scores are soft-capped or get a learned sink per head (ScoreMods), for any device in
// ATen: PyTorch's flash and memory-efficient kernels compute neither. Each chunk of queries has its scores
// [chunk, keys] written out, within a byte budget, in the op-math type (float32 for bf16/fp16); forward
// keeps each query's log-sum-exp (the sink's term included) and backward recomputes a chunk's scores from
// it, as flash attention's backward does. A loop of chunks, not a fused kernel: memory-bounded, not fast.
#include <algorithm>
#include <tuple>
#include <utility>

#include <ATen/OpMathType.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/zeros.h>

#include "ops/attention_block/attention_block.h"

namespace torch_offload {
namespace {

// The queries of one chunk: as many as keep the chunk's score-sized tensors (six [B, H, chunk, keys] live at
// once in backward, in the op-math type) within attention_block's head-group budget (16 MiB on the CPU, up to
// 256 MiB on a GPU); at least one.
int64_t chunk_queries(const at::Tensor& q, int64_t keys, const ScoreMods& mods) {
  int64_t budget = head_group_bytes(q.device().type(), 0);
#ifdef TORCH_OFFLOAD_WITH_CUDA
  if (q.is_cuda()) {
    budget = head_group_bytes(c10::DeviceType::CUDA, cuda_device_memory(q.device().index()));
  }
#endif
  const int64_t element = q.scalar_type() == at::kDouble ? 8 : 4;
  // With a window, chunks of at most the window's length see fewer than twice that many keys.
  const int64_t seen = mods.window > 0 ? std::min<int64_t>(keys, 2 * mods.window) : keys;
  const int64_t most = mods.window > 0 ? std::min<int64_t>(q.size(2), mods.window) : q.size(2);
  const int64_t per_query = 6 * q.size(0) * q.size(1) * std::max<int64_t>(seen, 1) * element;
  return std::clamp<int64_t>(budget / per_query, 1, std::max<int64_t>(most, 1));
}

// The keys [first, end) a chunk of queries [start, start + length) sees: a causal chunk none past its last
// query, nor, with a window, before its first query's window.
std::pair<int64_t, int64_t> chunk_keys(int64_t start, int64_t length, int64_t keys, bool causal,
                                       const ScoreMods& mods) {
  if (!causal) {
    return {0, keys};
  }
  return {mods.window > 0 ? std::max<int64_t>(0, start - mods.window + 1) : 0, start + length};
}

// One chunk's scores (queries start..start + length of a run against its keys first.. of k, which holds
// those keys only), in the op-math type: (the scores the softmax takes, masked; d(capped)/d(raw),
// undefined without a cap).
std::tuple<at::Tensor, at::Tensor> chunk_scores(const at::Tensor& q_chunk, const at::Tensor& k, double scale,
                                                bool causal, int64_t start, int64_t first, const ScoreMods& mods) {
  at::Tensor scores = at::matmul(q_chunk, k.transpose(-2, -1)) * scale;
  at::Tensor cap_slope;
  if (mods.softcap > 0) {
    const at::Tensor t = (scores / mods.softcap).tanh();
    scores = t * mods.softcap;
    cap_slope = 1 - t * t;
  }
  if (causal) {
    // Query start + i (of a causal run, queries and keys alike) sees keys up to start + i, and with a window
    // none at or before start + i - window.
    const auto options = at::TensorOptions().dtype(at::kLong).device(q_chunk.device());
    const at::Tensor query = at::arange(start, start + q_chunk.size(2), options).unsqueeze(1);
    const at::Tensor key = at::arange(first, first + k.size(2), options).unsqueeze(0);
    at::Tensor hidden = key > query;
    if (mods.window > 0) {
      hidden = hidden.logical_or(key <= query - mods.window);
    }
    scores = scores.masked_fill(hidden, -std::numeric_limits<double>::infinity());
  }
  return {scores, cap_slope};
}

// The sinks as one more logit per query: [B, H, length, 1].
at::Tensor sink_logits(const ScoreMods& mods, const at::Tensor& scores) {
  return mods.sinks.to(scores.scalar_type()).view({1, -1, 1, 1}).expand({scores.size(0), -1, scores.size(2), 1});
}

AttentionResult score_mod_forward(const ScoreMods& mods, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  double scale, bool causal) {
  const at::ScalarType acc_type = at::toOpMathType(q.scalar_type());
  const int64_t n = q.size(2), chunk = chunk_queries(q, k.size(2), mods);
  // Token-major, as the other kernels' outputs (segments.cpp's per-run copies expect no other layout).
  at::Tensor out = at::empty({q.size(0), n, q.size(1), v.size(3)}, q.options()).transpose(1, 2);
  at::Tensor logsumexp = at::empty({q.size(0), q.size(1), n}, q.options().dtype(acc_type));
  const at::Tensor k_acc = k.to(acc_type), v_acc = v.to(acc_type);
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t length = std::min(chunk, n - start);
    const auto [first, end] = chunk_keys(start, length, k.size(2), causal, mods);
    const auto [scores, cap_slope] =
        chunk_scores(q.narrow(2, start, length).to(acc_type), k_acc.narrow(2, first, end - first), scale, causal, start,
                     first, mods);
    const at::Tensor lse = mods.sinks.defined()
                               ? at::logsumexp(at::cat({scores, sink_logits(mods, scores)}, -1), -1, true)
                               : at::logsumexp(scores, -1, true);
    out.narrow(2, start, length).copy_(at::matmul((scores - lse).exp(), v_acc.narrow(2, first, end - first)));
    logsumexp.narrow(2, start, length).copy_(lse.squeeze(-1));
  }
  return {out, logsumexp, {}, {}};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> score_mod_backward(const ScoreMods& mods, const at::Tensor& grad_sinks,
                                                                  const at::Tensor& grad_out, const at::Tensor& q,
                                                                  const at::Tensor& k, const at::Tensor& v,
                                                                  const AttentionResult& result, double scale,
                                                                  bool causal) {
  const at::ScalarType acc_type = at::toOpMathType(q.scalar_type());
  const int64_t n = q.size(2), chunk = chunk_queries(q, k.size(2), mods);
  const at::Tensor k_acc = k.to(acc_type), v_acc = v.to(acc_type), grad_acc = grad_out.to(acc_type);
  // Each query's dO . O: the softmax's gradient subtracts it from every key's (the sink's has no value).
  const at::Tensor delta = (grad_acc * result.out.to(acc_type)).sum(-1, true);
  at::Tensor dq = at::empty(q.sizes(), q.options().dtype(acc_type));
  at::Tensor dk = at::zeros(k.sizes(), k.options().dtype(acc_type)),
             dv = at::zeros(v.sizes(), v.options().dtype(acc_type));
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t length = std::min(chunk, n - start);
    const auto [first, end] = chunk_keys(start, length, k.size(2), causal, mods);
    const at::Tensor q_chunk = q.narrow(2, start, length).to(acc_type);
    const at::Tensor k_keys = k_acc.narrow(2, first, end - first), v_keys = v_acc.narrow(2, first, end - first);
    const at::Tensor grad_chunk = grad_acc.narrow(2, start, length), delta_chunk = delta.narrow(2, start, length);
    const at::Tensor lse = result.logsumexp.narrow(2, start, length).unsqueeze(-1);
    const auto [scores, cap_slope] = chunk_scores(q_chunk, k_keys, scale, causal, start, first, mods);
    const at::Tensor probs = (scores - lse).exp();
    at::Tensor grad_scores = probs * (at::matmul(grad_chunk, v_keys.transpose(-2, -1)) - delta_chunk);
    if (cap_slope.defined()) {
      grad_scores = grad_scores * cap_slope;
    }
    dq.narrow(2, start, length).copy_(at::matmul(grad_scores, k_keys) * scale);
    dk.narrow(2, first, end - first).add_(at::matmul(grad_scores.transpose(-2, -1), q_chunk) * scale);
    dv.narrow(2, first, end - first).add_(at::matmul(probs.transpose(-2, -1), grad_chunk));
    if (grad_sinks.defined()) {
      // d out_i / d sink = -p_sink_i * out_i: the sink's gradient is -sum_i p_sink_i (dO_i . O_i).
      const at::Tensor sink_probs = (sink_logits(mods, lse) - lse).exp();
      grad_sinks.sub_((sink_probs * delta_chunk).sum(at::IntArrayRef{0, 2, 3}).to(grad_sinks.scalar_type()));
    }
  }
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type())};
}

}  // namespace

AttentionKernels score_mod_kernels(const ScoreMods& mods, const at::Tensor& grad_sinks) {
  AttentionKernels kernels;
  kernels.forward = [mods](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool causal) {
    return score_mod_forward(mods, q, k, v, scale, causal);
  };
  kernels.backward = [mods, grad_sinks](const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                                        const at::Tensor& v, const AttentionResult& result, double scale, bool causal) {
    return score_mod_backward(mods, grad_sinks, grad_out, q, k, v, result, scale, causal);
  };
  return kernels;
}

}  // namespace torch_offload
