#pragma once
// torch_offload's public C++ API: inline calls of the offload:: ops through the
// PyTorch dispatcher. Load the library first (link it, or dlopen the .so that
// torch_offload.library_path() names); then these work like at:: functions,
// autograd included.
#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

namespace torch_offload {

namespace detail {
template <typename Signature>
c10::TypedOperatorHandle<Signature> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}
}  // namespace detail

// A new contiguous CPU tensor with src's values. On CUDA the copy runs on a
// dedicated device-to-host stream into pinned memory; with non_blocking=true the
// call returns before the copy ends (unpack waits for it by itself; do not read
// the result on the host or write src in place before unpacking it).
inline at::Tensor offload_pack(const at::Tensor& src, bool non_blocking = false) {
  TORCH_CHECK(src.defined(), "offload_pack: src is an undefined tensor; expected a defined tensor");
  static const auto handle = detail::op<at::Tensor(const at::Tensor&, bool)>("offload::offload_pack");
  return handle.call(src, non_blocking);
}

// A new contiguous tensor on `device` with packed's values, safe to use on the
// current stream.
inline at::Tensor offload_unpack(const at::Tensor& packed, c10::Device device) {
  TORCH_CHECK(packed.defined(), "offload_unpack: packed is an undefined tensor; expected a defined tensor");
  static const auto handle = detail::op<at::Tensor(const at::Tensor&, c10::Device)>("offload::offload_unpack");
  return handle.call(packed, device);
}

// Most bytes of pinned host memory the pack arena may hold (default: 1/4 of RAM).
inline void set_pinned_budget(int64_t budget_bytes) {
  static const auto handle = detail::op<void(int64_t)>("offload::set_pinned_budget");
  handle.call(budget_bytes);
}

// [budget, reserved, in_use, chunk_allocations, slice_allocations] of the arena.
inline std::vector<int64_t> pinned_arena_stats() {
  static const auto handle = detail::op<std::vector<int64_t>()>("offload::pinned_arena_stats");
  return handle.call();
}

// Writes src asynchronously to this process's anonymous spill file in `directory`
// (default: $TORCH_OFFLOAD_SPILL_DIR, else the temp directory) and returns a
// ticket at once. Freeing the ticket frees the disk space.
inline at::Tensor disk_spill(const at::Tensor& src, std::optional<std::string_view> directory = std::nullopt,
                             bool allow_tmpfs = false) {
  TORCH_CHECK(src.defined(), "disk_spill: src is an undefined tensor; expected a defined tensor");
  static const auto handle =
      detail::op<at::Tensor(const at::Tensor&, std::optional<c10::string_view>, bool)>("offload::disk_spill");
  return handle.call(src,
                     directory ? std::optional<c10::string_view>(c10::string_view(directory->data(), directory->size()))
                               : std::nullopt,
                     allow_tmpfs);
}

// The spilled tensor back on `device`; a ticket is restored once.
inline at::Tensor disk_restore(const at::Tensor& ticket, at::IntArrayRef size, c10::ScalarType dtype,
                               c10::Device device) {
  static const auto handle =
      detail::op<at::Tensor(const at::Tensor&, c10::SymIntArrayRef, c10::ScalarType, c10::Device)>(
          "offload::disk_restore");
  return handle.call(ticket, c10::fromIntArrayRefSlow(size), dtype, device);
}

// The spilled tensor back on `device`, the ticket kept: read again as often as asked, until restored or freed.
inline at::Tensor disk_read(const at::Tensor& ticket, at::IntArrayRef size, c10::ScalarType dtype, c10::Device device) {
  static const auto handle =
      detail::op<at::Tensor(const at::Tensor&, c10::SymIntArrayRef, c10::ScalarType, c10::Device)>(
          "offload::disk_read");
  return handle.call(ticket, c10::fromIntArrayRefSlow(size), dtype, device);
}

// Starts reading the ticket back so that disk_restore (or disk_read) finds it in memory.
inline void disk_prefetch(const at::Tensor& ticket) {
  static const auto handle = detail::op<void(const at::Tensor&)>("offload::disk_prefetch");
  handle.call(ticket);
}

// Blocks until the ticket is on disk; raises the write's error if it failed.
inline void disk_wait(const at::Tensor& ticket) {
  static const auto handle = detail::op<void(const at::Tensor&)>("offload::disk_wait");
  handle.call(ticket);
}

// The MLP down(act(x w_gate^T + b_gate) * (x w_up^T + b_up)) + b_down (without
// w_up: down(act(x w_gate^T + b_gate)) + b_down) over x [..., h], w_gate and w_up
// [I, h], w_down [h, I], computed in shards of tokens so that no [tokens, I]
// intermediate exists whole; backward saves only x and the weights and recomputes
// each shard. activation: "silu", "gelu", "gelu_tanh" or "relu"; num_shards <= 0
// picks the count from a memory budget.
inline at::Tensor tiled_mlp(const at::Tensor& x, const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up,
                            const at::Tensor& w_down, const std::optional<at::Tensor>& b_gate = std::nullopt,
                            const std::optional<at::Tensor>& b_up = std::nullopt,
                            const std::optional<at::Tensor>& b_down = std::nullopt,
                            std::string_view activation = "silu", c10::SymInt num_shards = 0) {
  TORCH_CHECK(x.defined(), "tiled_mlp: x is an undefined tensor; expected a defined tensor");
  static const auto handle =
      detail::op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                            const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                            const std::optional<at::Tensor>&, std::string_view, c10::SymInt)>("offload::tiled_mlp");
  return handle.call(x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, std::move(num_shards));
}

// The gradients of tiled_mlp with respect to (x, w_gate, w_up, w_down, b_gate,
// b_up, b_down), each computed only where output_mask asks for it and the input
// exists (undefined otherwise). Weight and bias gradients of bf16/fp16 weights
// add up in float32 and are rounded once.
using TiledMlpGradients =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
inline TiledMlpGradients tiled_mlp_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w_gate,
                                            const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
                                            const std::optional<at::Tensor>& b_gate,
                                            const std::optional<at::Tensor>& b_up,
                                            const std::optional<at::Tensor>& b_down, std::string_view activation,
                                            c10::SymInt num_shards, std::array<bool, 7> output_mask) {
  TORCH_CHECK(grad_out.defined(), "tiled_mlp_backward: grad_out is an undefined tensor; expected a defined tensor");
  TORCH_CHECK(x.defined(), "tiled_mlp_backward: x is an undefined tensor; expected a defined tensor");
  static const auto handle = detail::op<TiledMlpGradients(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
      std::string_view, c10::SymInt, std::array<bool, 7>)>("offload::tiled_mlp_backward");
  return handle.call(grad_out, x, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, std::move(num_shards),
                     output_mask);
}

// tiled_mlp(rms_norm(x, norm_weight, norm_eps), ...), the norm computed shard by shard: forward
// saves x, not the norm's output, and backward takes the norm's gradient shard by shard. Runs in
// its inputs' dtypes, under autocast too.
inline at::Tensor rms_norm_tiled_mlp(const at::Tensor& x, const at::Tensor& norm_weight, double norm_eps,
                                     const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up,
                                     const at::Tensor& w_down, const std::optional<at::Tensor>& b_gate = std::nullopt,
                                     const std::optional<at::Tensor>& b_up = std::nullopt,
                                     const std::optional<at::Tensor>& b_down = std::nullopt,
                                     std::string_view activation = "silu", c10::SymInt num_shards = 0) {
  TORCH_CHECK(x.defined(), "rms_norm_tiled_mlp: x is an undefined tensor; expected a defined tensor");
  TORCH_CHECK(norm_weight.defined(),
              "rms_norm_tiled_mlp: norm_weight is an undefined tensor; expected a defined tensor");
  static const auto handle = detail::op<at::Tensor(
      const at::Tensor&, const at::Tensor&, double, const at::Tensor&, const std::optional<at::Tensor>&,
      const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
      const std::optional<at::Tensor>&, std::string_view, c10::SymInt)>("offload::rms_norm_tiled_mlp");
  return handle.call(x, norm_weight, norm_eps, w_gate, w_up, w_down, b_gate, b_up, b_down, activation,
                     std::move(num_shards));
}

// The gradients of rms_norm_tiled_mlp with respect to (x, norm_weight, w_gate, w_up, w_down,
// b_gate, b_up, b_down), as output_mask asks, undefined elsewhere.
using RmsNormTiledMlpGradients =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
inline RmsNormTiledMlpGradients rms_norm_tiled_mlp_backward(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& norm_weight, double norm_eps,
    const at::Tensor& w_gate, const std::optional<at::Tensor>& w_up, const at::Tensor& w_down,
    const std::optional<at::Tensor>& b_gate, const std::optional<at::Tensor>& b_up,
    const std::optional<at::Tensor>& b_down, std::string_view activation, c10::SymInt num_shards,
    std::array<bool, 8> output_mask) {
  TORCH_CHECK(grad_out.defined(),
              "rms_norm_tiled_mlp_backward: grad_out is an undefined tensor; expected a defined tensor");
  TORCH_CHECK(x.defined(), "rms_norm_tiled_mlp_backward: x is an undefined tensor; expected a defined tensor");
  static const auto handle = detail::op<RmsNormTiledMlpGradients(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, double, const at::Tensor&,
      const std::optional<at::Tensor>&, const at::Tensor&, const std::optional<at::Tensor>&,
      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, std::string_view, c10::SymInt,
      std::array<bool, 8>)>("offload::rms_norm_tiled_mlp_backward");
  return handle.call(grad_out, x, norm_weight, norm_eps, w_gate, w_up, w_down, b_gate, b_up, b_down, activation,
                     std::move(num_shards), output_mask);
}

// The shard count tiled_mlp picks when num_shards <= 0, for `tokens` tokens of an MLP
// with `intermediate` (I) hidden units, gated (with w_up) or not, in `dtype`. It
// depends on these only, so every rank with the same shapes picks the same.
inline int64_t tiled_mlp_num_shards(int64_t tokens, int64_t intermediate, bool gated, c10::ScalarType dtype) {
  static const auto handle =
      detail::op<int64_t(int64_t, int64_t, bool, c10::ScalarType)>("offload::tiled_mlp_num_shards");
  return handle.call(tokens, intermediate, gated, dtype);
}

// The LM head's cross-entropy, cross_entropy(hidden @ weight^T + bias, target),
// computed in tiles so that no [tokens, V] logits tensor exists: either forward
// computes the gradients too from whole-vocabulary slabs (64 MiB or 512 tokens), or it
// keeps a running log-sum-exp per token and backward recomputes each tile's logits
// (gradients_in_forward, below). hidden [..., h], weight [V, h], bias [V], target [...] int64
// (int32 accepted). softcap > 0 caps the logits to softcap * tanh(logits /
// softcap); z_loss > 0 adds z_loss * logsumexp^2 per token; label_smoothing and
// ignore_index are F.cross_entropy's; reduction "mean" (over the tokens not
// ignored), "sum" or "none" (a loss per token, 0 where ignored). tile_tokens and
// tile_vocab <= 0 pick the tile from a memory budget (linear_cross_entropy_tile).
// filter_eps > 0 (label_smoothing 0 only) turns on gradient filtering: backward skips
// the tiles where every gradient entry is at most filter_eps times the token's weight
// in the reduction (plain cross-entropy: every softmax probability <= filter_eps), an
// approximation that saves two of a tile's three GEMMs there; 0 computes every tile.
// gradients_in_forward: with a gradient to compute and a scalar loss, true computes the
// gradients in forward (linear_cross_entropy_with_gradients: 3 GEMMs, backward scales
// them; not with softcap or filter_eps), false recomputes the logits in backward (4
// GEMMs); nullopt picks the former for float32/float64, and bfloat16 on CUDA (README,
// "Fused linear cross-entropy").
inline at::Tensor linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight,
                                       const std::optional<at::Tensor>& bias, const at::Tensor& target,
                                       int64_t ignore_index = -100, double label_smoothing = 0.0, double softcap = 0.0,
                                       double z_loss = 0.0, std::string_view reduction = "mean",
                                       c10::SymInt tile_tokens = 0, c10::SymInt tile_vocab = 0, double filter_eps = 0.0,
                                       std::optional<bool> gradients_in_forward = std::nullopt) {
  TORCH_CHECK(hidden.defined(), "linear_cross_entropy: hidden is an undefined tensor; expected a defined tensor");
  static const auto handle =
      detail::op<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
                            int64_t, double, double, double, std::string_view, c10::SymInt, c10::SymInt, double,
                            std::optional<bool>)>("offload::linear_cross_entropy");
  return handle.call(hidden, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss, reduction,
                     std::move(tile_tokens), std::move(tile_vocab), filter_eps, gradients_in_forward);
}

// linear_cross_entropy's loss with, from the same pass over the vocabulary, (z_loss, accuracy, entropy): the
// z-loss term z_loss * logsumexp^2 (the part of the loss it adds), whether the target is the logits' argmax
// (1 or 0; of tied logits the first counts, as argmax), and the entropy of softmax(logits) (after softcap); each
// reduced as the loss (the mean over the tokens not ignored, their sum, or one per token, 0 where ignored), in the
// loss's dtype, without gradient. The arguments and the loss are linear_cross_entropy's.
using LinearCrossEntropyStatistics = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
inline LinearCrossEntropyStatistics linear_cross_entropy_with_statistics(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias, const at::Tensor& target,
    int64_t ignore_index = -100, double label_smoothing = 0.0, double softcap = 0.0, double z_loss = 0.0,
    std::string_view reduction = "mean", c10::SymInt tile_tokens = 0, c10::SymInt tile_vocab = 0,
    double filter_eps = 0.0, std::optional<bool> gradients_in_forward = std::nullopt) {
  TORCH_CHECK(hidden.defined(), "linear_cross_entropy: hidden is an undefined tensor; expected a defined tensor");
  static const auto handle = detail::op<LinearCrossEntropyStatistics(
      const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, int64_t, double,
      double, double, std::string_view, c10::SymInt, c10::SymInt, double, std::optional<bool>)>(
      "offload::linear_cross_entropy_with_statistics");
  return handle.call(hidden, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss, reduction,
                     std::move(tile_tokens), std::move(tile_vocab), filter_eps, gradients_in_forward);
}

// The loss and its gradients (hidden, weight, bias; those output_mask asks for) for a unit
// grad_loss, computed in forward from whole-vocabulary slabs of tile_tokens tokens (<= 0:
// 64 MiB or 512 tokens, whichever is more); reduction "mean" or "sum". The gradients are in the loss's dtype.
// With statistics, the fifth tensor is the forward's per-token statistics (below), else empty.
using LinearCrossEntropyWithGradients = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
inline LinearCrossEntropyWithGradients linear_cross_entropy_with_gradients(
    const at::Tensor& hidden, const at::Tensor& weight, const std::optional<at::Tensor>& bias, const at::Tensor& target,
    int64_t ignore_index, double label_smoothing, double softcap, double z_loss, std::string_view reduction,
    c10::SymInt tile_tokens, std::array<bool, 3> output_mask, bool statistics = false) {
  TORCH_CHECK(hidden.defined(), "linear_cross_entropy: hidden is an undefined tensor; expected a defined tensor");
  static const auto handle = detail::op<LinearCrossEntropyWithGradients(
      const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, int64_t, double,
      double, double, std::string_view, c10::SymInt, std::array<bool, 3>, bool)>(
      "offload::linear_cross_entropy_with_gradients");
  return handle.call(hidden, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss, reduction,
                     std::move(tile_tokens), output_mask, statistics);
}

// The forward that the autograd formula uses: (loss, log-sum-exp of each token
// [tokens], float32, or float64 for float64 hidden, the latter for backward, and with statistics
// each token's [z-loss term, top-1 (1 or 0), entropy] as [3, tokens] in the log-sum-exp's dtype, 0
// where ignored; else an empty [0] tensor).
using LinearCrossEntropyForward = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
inline LinearCrossEntropyForward linear_cross_entropy_forward(const at::Tensor& hidden, const at::Tensor& weight,
                                                              const std::optional<at::Tensor>& bias,
                                                              const at::Tensor& target, int64_t ignore_index,
                                                              double label_smoothing, double softcap, double z_loss,
                                                              std::string_view reduction, c10::SymInt tile_tokens,
                                                              c10::SymInt tile_vocab, bool statistics = false) {
  TORCH_CHECK(hidden.defined(), "linear_cross_entropy: hidden is an undefined tensor; expected a defined tensor");
  static const auto handle = detail::op<LinearCrossEntropyForward(
      const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, int64_t, double,
      double, double, std::string_view, c10::SymInt, c10::SymInt, bool)>("offload::linear_cross_entropy_forward");
  return handle.call(hidden, weight, bias, target, ignore_index, label_smoothing, softcap, z_loss, reduction,
                     std::move(tile_tokens), std::move(tile_vocab), statistics);
}

// The gradients of linear_cross_entropy with respect to (hidden, weight, bias),
// each computed only where output_mask asks for it and the input exists
// (undefined otherwise); grad_loss has the loss's shape and lse is the forward's.
// bf16/fp16 gradients add up in float32 and are rounded once. filter_eps is
// linear_cross_entropy's.
using LinearCrossEntropyGradients = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
inline LinearCrossEntropyGradients linear_cross_entropy_backward(
    const at::Tensor& grad_loss, const at::Tensor& hidden, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias, const at::Tensor& target, const at::Tensor& lse, int64_t ignore_index,
    double label_smoothing, double softcap, double z_loss, std::string_view reduction, c10::SymInt tile_tokens,
    c10::SymInt tile_vocab, std::array<bool, 3> output_mask, double filter_eps = 0.0) {
  TORCH_CHECK(hidden.defined(),
              "linear_cross_entropy_backward: hidden is an undefined tensor; expected a defined tensor");
  static const auto handle = detail::op<LinearCrossEntropyGradients(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&,
      const at::Tensor&, int64_t, double, double, double, std::string_view, c10::SymInt, c10::SymInt,
      std::array<bool, 3>, double)>("offload::linear_cross_entropy_backward");
  return handle.call(grad_loss, hidden, weight, bias, target, lse, ignore_index, label_smoothing, softcap, z_loss,
                     reduction, std::move(tile_tokens), std::move(tile_vocab), output_mask, filter_eps);
}

// The tile [tokens, vocabulary columns] linear_cross_entropy picks when tile_tokens
// and tile_vocab are <= 0. It depends on these only, so every rank agrees.
inline std::vector<int64_t> linear_cross_entropy_tile(int64_t tokens, int64_t vocab, c10::ScalarType dtype) {
  static const auto handle =
      detail::op<std::vector<int64_t>(int64_t, int64_t, c10::ScalarType)>("offload::linear_cross_entropy_tile");
  return handle.call(tokens, vocab, dtype);
}

// Each token's log-probability of its id under softmax(scores), scores = cap(logit_scale * logits) /
// temperature (cap(z) = softcap * tanh(z / softcap) where softcap > 0, else z: Gemma 2's soft-capping),
// logits = hidden @ weight^T + bias ([..., h] against [V, h]; ids hidden's shape without h, in [0, V) or
// ignore_index), and with entropy=true each token's entropy (else an empty [0] tensor), both ids' shape, 0
// where the id is ignore_index, float32 for bf16/fp16 inputs, computed in tiles so that no [tokens, V]
// tensor exists. Differentiable through either output: backward recomputes the tiles (the upstream
// gradients per token are unknown in forward).
using TokenLogprobs = std::tuple<at::Tensor, at::Tensor>;
inline TokenLogprobs token_logprobs(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& ids,
                                    const std::optional<at::Tensor>& bias = std::nullopt, double temperature = 1.0,
                                    bool entropy = false, double softcap = 0.0, double logit_scale = 1.0,
                                    int64_t ignore_index = -100) {
  TORCH_CHECK(hidden.defined(), "token_logprobs: hidden is an undefined tensor; expected a defined tensor");
  static const auto handle =
      detail::op<TokenLogprobs(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                               const std::optional<at::Tensor>&, double, bool, double, double, int64_t)>(
          "offload::token_logprobs");
  return handle.call(hidden, weight, ids, bias, temperature, entropy, softcap, logit_scale, ignore_index);
}

// Per token, summaries of softmax(scores) (token_logprobs' scores) that carry no gradient, as RL trainers log
// them: the mean of the scores over the vocabulary, whether the id is the first maximum (argmax), and
// log sum_j p_j^2; ids' shape (the second bool), 0 (false) where the id is ignore_index, in tiles as
// token_logprobs.
using TokenLogprobSummaries = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
inline TokenLogprobSummaries token_logprob_summaries(const at::Tensor& hidden, const at::Tensor& weight,
                                                     const at::Tensor& ids,
                                                     const std::optional<at::Tensor>& bias = std::nullopt,
                                                     double temperature = 1.0, double softcap = 0.0,
                                                     double logit_scale = 1.0, int64_t ignore_index = -100) {
  TORCH_CHECK(hidden.defined(), "token_logprob_summaries: hidden is an undefined tensor; expected a defined tensor");
  static const auto handle =
      detail::op<TokenLogprobSummaries(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       const std::optional<at::Tensor>&, double, double, double, int64_t)>(
          "offload::token_logprob_summaries");
  return handle.call(hidden, weight, ids, bias, temperature, softcap, logit_scale, ignore_index);
}

// The forward token_logprobs' autograd formula runs: (log-probabilities, entropies, and each token's
// log-sum-exp of the scores, [tokens] float64, which the backward reuses).
using TokenLogprobsForward = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
inline TokenLogprobsForward token_logprobs_forward(const at::Tensor& hidden, const at::Tensor& weight,
                                                   const at::Tensor& ids, const std::optional<at::Tensor>& bias,
                                                   double temperature, bool entropy, double softcap = 0.0,
                                                   double logit_scale = 1.0, int64_t ignore_index = -100) {
  TORCH_CHECK(hidden.defined(), "token_logprobs: hidden is an undefined tensor; expected a defined tensor");
  static const auto handle =
      detail::op<TokenLogprobsForward(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                      const std::optional<at::Tensor>&, double, bool, double, double, int64_t)>(
          "offload::token_logprobs_forward");
  return handle.call(hidden, weight, ids, bias, temperature, entropy, softcap, logit_scale, ignore_index);
}

// The gradients of token_logprobs with respect to (hidden, weight, bias) for upstream gradients of the
// log-probabilities and of the entropies (either may be absent: zero), each computed only where
// output_mask asks for it and the input exists (undefined otherwise). lse and entropy are the forward's
// (entropy needed with grad_entropy), softcap, logit_scale and ignore_index its too. bf16/fp16 gradients
// add up in float32 and are rounded once.
using TokenLogprobsGradients = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
inline TokenLogprobsGradients token_logprobs_backward(
    const std::optional<at::Tensor>& grad_logprobs, const std::optional<at::Tensor>& grad_entropy,
    const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& ids, const std::optional<at::Tensor>& bias,
    const at::Tensor& lse, const std::optional<at::Tensor>& entropy, double temperature,
    std::array<bool, 3> output_mask, double softcap = 0.0, double logit_scale = 1.0, int64_t ignore_index = -100) {
  TORCH_CHECK(hidden.defined(), "token_logprobs_backward: hidden is an undefined tensor; expected a defined tensor");
  static const auto handle = detail::op<TokenLogprobsGradients(
      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const std::optional<at::Tensor>&, const at::Tensor&, const std::optional<at::Tensor>&, double,
      double, double, int64_t, std::array<bool, 3>)>("offload::token_logprobs_backward");
  return handle.call(grad_logprobs, grad_entropy, hidden, weight, ids, bias, lse, entropy, temperature, softcap,
                     logit_scale, ignore_index, output_mask);
}

// Knowledge distillation's per-token divergence between a student's and a teacher's next-token distributions,
// p_s = softmax(scores of student_hidden @ student_weight^T + student_bias) and p_t likewise with the teacher's
// head (scores as token_logprobs': cap(logit_scale * logits) / temperature, each head its own softcap and
// logit_scale, one temperature), the generalized Jensen-Shannon divergence
//   beta = 0: KL(p_t || p_s) (forward KL); beta = 1: KL(p_s || p_t) (reverse KL);
//   else beta KL(p_t || m) + (1 - beta) KL(p_s || m), m = beta p_t + (1 - beta) p_s,
// and the student's entropy (no gradient), both [...] float32 (float64 for float64), in tiles of tokens x
// vocabulary: neither model's [tokens, V] logits exist. The hidden states may differ in width, the vocabulary
// not. Tokens whose label is ignore_index get 0 and no gradient. Differentiable in the student's tensors only: the
// teacher's are constants (never given a gradient). Backward recomputes both heads' tiles.
using TokenDivergence = std::tuple<at::Tensor, at::Tensor>;
inline TokenDivergence token_divergence(const at::Tensor& student_hidden, const at::Tensor& student_weight,
                                        const at::Tensor& teacher_hidden, const at::Tensor& teacher_weight,
                                        const std::optional<at::Tensor>& student_bias = std::nullopt,
                                        const std::optional<at::Tensor>& teacher_bias = std::nullopt,
                                        const std::optional<at::Tensor>& labels = std::nullopt, double beta = 0.5,
                                        double temperature = 1.0, double student_softcap = 0.0,
                                        double student_logit_scale = 1.0, double teacher_softcap = 0.0,
                                        double teacher_logit_scale = 1.0, int64_t ignore_index = -100) {
  TORCH_CHECK(student_hidden.defined(),
              "token_divergence: student_hidden is an undefined tensor; expected a defined tensor");
  static const auto handle = detail::op<TokenDivergence(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, double, double, double, double, double,
      double, int64_t)>("offload::token_divergence");
  return handle.call(student_hidden, student_weight, teacher_hidden, teacher_weight, student_bias, teacher_bias, labels,
                     beta, temperature, student_softcap, student_logit_scale, teacher_softcap, teacher_logit_scale,
                     ignore_index);
}

// The forward token_divergence's autograd formula runs: (divergence, entropy, and per token the student's and the
// teacher's log-sum-exp of the scores and the term the backward reuses: the divergence unmasked for beta 0 and 1,
// KL(p_s || m) otherwise), the last three [tokens].
using TokenDivergenceForward = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
// The gradients of token_divergence's divergence with respect to (student_hidden, student_weight, student_bias),
// each computed only where output_mask asks for it and the input exists (undefined otherwise).
using TokenDivergenceGradients = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// transformers' RMSNorm over x's last dimension: weight * round(x / sqrt(mean(x^2) + eps)), in float32 for
// bf16/fp16, the normalized rows rounded to x's dtype before the weight's product (weight [h], x's dtype).
// Differentiable in x and weight; backward holds only the gradients it returns beside its inputs.
inline at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps = 1e-6) {
  TORCH_CHECK(x.defined(), "rms_norm: x is an undefined tensor; expected a defined tensor");
  static const auto handle = detail::op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>("offload::rms_norm");
  return handle.call(x, weight, eps);
}

// The gradients of rms_norm with respect to (x, weight) for the output's gradient grad, each computed only
// where output_mask asks for it (undefined otherwise).
using RmsNormGradients = std::tuple<at::Tensor, at::Tensor>;
inline RmsNormGradients rms_norm_backward(const at::Tensor& grad, const at::Tensor& x, const at::Tensor& weight,
                                          double eps, std::array<bool, 2> output_mask) {
  TORCH_CHECK(grad.defined(), "rms_norm_backward: grad is an undefined tensor; expected a defined tensor");
  static const auto handle = detail::op<RmsNormGradients(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                         double, std::array<bool, 2>)>("offload::rms_norm_backward");
  return handle.call(grad, x, weight, eps, output_mask);
}

// A decoder layer's attention from its normalized input x [batch, tokens, h] to its
// output: q = rope(x w_q^T + b_q), k = rope(x w_k^T + b_k), v = x w_v^T + b_v, causal
// softmax(q k^T * scale) v per head (grouped-query when w_k has fewer heads than w_q),
// then the output projection w_o [out_features, heads * head_dim] and b_o. The rotary
// embedding is transformers' apply_rotary_pos_emb with cos and sin [1 or batch, tokens,
// head_dim]; scale defaults to 1/sqrt(head_dim). It runs one group of heads at a time,
// so one group's q, k, v and attention output exist at once, and its backward saves
// only the inputs and recomputes each group. cos and sin get no gradient.
// segment_ids [batch, tokens] (int64 or int32) cuts the rows into segments: each maximal
// run of equal non-negative ids in a row is one causal sequence (a packed document, a row's
// real tokens); tokens with a negative id (padding) are no one's keys and attend to all of
// the nearest sequence before them in their row, or to nothing (output 0).
// group_name (sequence parallelism, a torch.distributed group's name): x, cos and sin are this
// rank's contiguous chunk of the rows and segment_ids the whole rows'; each head group's attention
// runs over the whole rows for a share of its heads, between two all-to-alls (heads a multiple of the ranks).
// q_norm and k_norm [head_dim] (Qwen3's per-head norms): each head's q and k go through an RMSNorm with
// that weight and norm_eps before the rotary embedding; [heads * head_dim] and [kv_heads * head_dim] (OLMo 2's):
// the RMSNorm runs over each token's whole q and k projection.
inline at::Tensor attention_block(
    const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& w_o,
    const at::Tensor& cos, const at::Tensor& sin, const std::optional<at::Tensor>& b_q = std::nullopt,
    const std::optional<at::Tensor>& b_k = std::nullopt, const std::optional<at::Tensor>& b_v = std::nullopt,
    const std::optional<at::Tensor>& b_o = std::nullopt, std::optional<double> scale = std::nullopt,
    const std::optional<at::Tensor>& segment_ids = std::nullopt,
    std::optional<std::string_view> group_name = std::nullopt, const std::optional<at::Tensor>& q_norm = std::nullopt,
    const std::optional<at::Tensor>& k_norm = std::nullopt, double norm_eps = 1e-6,
    const std::optional<at::Tensor>& attention = std::nullopt,
    const std::optional<at::Tensor>& logsumexp = std::nullopt) {
  TORCH_CHECK(x.defined(), "attention_block: x is an undefined tensor; expected a defined tensor");
  static const auto handle = detail::op<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, std::optional<double>,
      const std::optional<at::Tensor>&, std::optional<std::string_view>, const std::optional<at::Tensor>&,
      const std::optional<at::Tensor>&, double, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&)>(
      "offload::attention_block");
  return handle.call(x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o, scale, segment_ids, group_name, q_norm,
                     k_norm, norm_eps, attention, logsumexp);
}

// attention_block's forward up to its output projection, for a plan that runs each attention forward once:
// (attention [batch, tokens, heads * head_dim] in x's dtype, the heads' outputs as w_o takes them; logsumexp
// [heads / ranks, batch, tokens * ranks] in float32 (float64 for float64 x), each query's log-sum-exp over its keys,
// over the whole rows with group_name). Given both, attention_block computes the output projection alone and its
// backward uses them instead of recomputing the attention. Neither gets a gradient.
inline std::tuple<at::Tensor, at::Tensor> attention_block_attend(
    const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& cos,
    const at::Tensor& sin, const std::optional<at::Tensor>& b_q = std::nullopt,
    const std::optional<at::Tensor>& b_k = std::nullopt, const std::optional<at::Tensor>& b_v = std::nullopt,
    std::optional<double> scale = std::nullopt, const std::optional<at::Tensor>& segment_ids = std::nullopt,
    std::optional<std::string_view> group_name = std::nullopt, const std::optional<at::Tensor>& q_norm = std::nullopt,
    const std::optional<at::Tensor>& k_norm = std::nullopt, double norm_eps = 1e-6) {
  TORCH_CHECK(x.defined(), "attention_block_attend: x is an undefined tensor; expected a defined tensor");
  static const auto handle = detail::op<std::tuple<at::Tensor, at::Tensor>(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
      std::optional<double>, const std::optional<at::Tensor>&, std::optional<std::string_view>,
      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, double)>("offload::attention_block_attend");
  return handle.call(x, w_q, w_k, w_v, cos, sin, b_q, b_k, b_v, scale, segment_ids, group_name, q_norm, k_norm,
                     norm_eps);
}

// The gradients of attention_block with respect to (x, w_q, w_k, w_v, w_o, b_q, b_k,
// b_v, b_o, q_norm, k_norm), each computed only where output_mask asks for it and the input exists
// (undefined otherwise). Gradients of bf16/fp16 tensors add up in float32 and are
// rounded once.
using AttentionBlockGradients = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                           at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
inline AttentionBlockGradients attention_block_backward(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k,
    const at::Tensor& w_v, const at::Tensor& w_o, const at::Tensor& cos, const at::Tensor& sin,
    const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_k, const std::optional<at::Tensor>& b_v,
    const std::optional<at::Tensor>& b_o, std::optional<double> scale, const std::optional<at::Tensor>& segment_ids,
    std::array<bool, 11> output_mask, std::optional<std::string_view> group_name = std::nullopt,
    const std::optional<at::Tensor>& q_norm = std::nullopt, const std::optional<at::Tensor>& k_norm = std::nullopt,
    double norm_eps = 1e-6, const std::optional<at::Tensor>& attention = std::nullopt,
    const std::optional<at::Tensor>& logsumexp = std::nullopt) {
  TORCH_CHECK(grad_out.defined(),
              "attention_block_backward: grad_out is an undefined tensor; expected a defined tensor");
  TORCH_CHECK(x.defined(), "attention_block_backward: x is an undefined tensor; expected a defined tensor");
  static const auto handle = detail::op<AttentionBlockGradients(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, std::optional<double>,
      const std::optional<at::Tensor>&, std::array<bool, 11>, std::optional<std::string_view>,
      const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, double, const std::optional<at::Tensor>&,
      const std::optional<at::Tensor>&)>("offload::attention_block_backward");
  return handle.call(grad_out, x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o, scale, segment_ids, output_mask,
                     group_name, q_norm, k_norm, norm_eps, attention, logsumexp);
}

// attention_block's attention alone, for attention modules whose projections it does not
// replace: query, key and value [batch, heads, tokens, head_dim] (key/value heads repeated to
// the query's), causal within the segments of segment_ids [batch, tokens] as attention_block's,
// one attention call per segment, no [tokens, tokens] mask. scale defaults to 1/sqrt(head_dim).
// softcap caps the scores to softcap * tanh(s / softcap) (Gemma 2's); sinks [heads] are one more
// logit per head in each query's softmax, with no value (GPT-OSS's); window (sliding window) limits
// a sequence's token to the window - 1 tokens before it (padding whose sequence reaches past it is
// refused). Backward saves only the inputs and recomputes.
inline at::Tensor segment_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                    const at::Tensor& segment_ids, std::optional<double> scale = std::nullopt,
                                    std::optional<double> softcap = std::nullopt,
                                    const std::optional<at::Tensor>& sinks = std::nullopt,
                                    std::optional<int64_t> window = std::nullopt) {
  TORCH_CHECK(query.defined(), "segment_attention: query is an undefined tensor; expected a defined tensor");
  static const auto handle = detail::op<at::Tensor(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, std::optional<double>,
      std::optional<double>, const std::optional<at::Tensor>&, std::optional<int64_t>)>("offload::segment_attention");
  return handle.call(query, key, value, segment_ids, scale, softcap, sinks, window);
}

// segment_attention's gradients (query, key, value, sinks), each only where output_mask asks for it
// (and sinks are given). The sinks' gradient adds up in float32 for bf16/fp16 sinks.
using SegmentAttentionGradients = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
inline SegmentAttentionGradients segment_attention_backward(const at::Tensor& grad_out, const at::Tensor& query,
                                                            const at::Tensor& key, const at::Tensor& value,
                                                            const at::Tensor& segment_ids, std::optional<double> scale,
                                                            std::array<bool, 4> output_mask,
                                                            std::optional<double> softcap = std::nullopt,
                                                            const std::optional<at::Tensor>& sinks = std::nullopt,
                                                            std::optional<int64_t> window = std::nullopt) {
  TORCH_CHECK(grad_out.defined(),
              "segment_attention_backward: grad_out is an undefined tensor; expected a defined tensor");
  TORCH_CHECK(query.defined(), "segment_attention_backward: query is an undefined tensor; expected a defined tensor");
  static const auto handle = detail::op<SegmentAttentionGradients(
      const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
      std::optional<double>, std::array<bool, 4>, std::optional<double>, const std::optional<at::Tensor>&,
      std::optional<int64_t>)>("offload::segment_attention_backward");
  return handle.call(grad_out, query, key, value, segment_ids, scale, output_mask, softcap, sinks, window);
}

// segment_attention over a sequence split across the ranks of a process group (Ulysses), named as
// torch.distributed names it (ProcessGroup.group_name): query [batch, heads, tokens / ranks, head_dim]
// and key, value [batch, kv_heads, tokens / ranks, head_dim] (value's head_dim may differ) are this
// rank's contiguous chunk of the rows, segment_ids [batch, tokens] the whole rows'. heads must be a
// multiple of the ranks; key/value heads that are not are repeated. softcap, sinks [heads] and window
// are segment_attention's: each rank attends its share of the heads over the whole rows, with those
// heads' sinks as the group's first rank holds them (which so gets the whole sinks gradient, the
// others zero: summed over the ranks it is the whole one). Every rank calls it with the same shapes. Differentiable
// (the exchanges' gradients are the inverse exchanges, in C++).
inline at::Tensor ulysses_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                    const at::Tensor& segment_ids, const std::string& group_name,
                                    std::optional<double> scale = std::nullopt,
                                    std::optional<double> softcap = std::nullopt,
                                    const std::optional<at::Tensor>& sinks = std::nullopt,
                                    std::optional<int64_t> window = std::nullopt) {
  TORCH_CHECK(query.defined(), "ulysses_attention: query is an undefined tensor; expected a defined tensor");
  static const auto handle =
      detail::op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const std::string&, std::optional<double>, std::optional<double>,
                            const std::optional<at::Tensor>&, std::optional<int64_t>)>("offload::ulysses_attention");
  return handle.call(query, key, value, segment_ids, group_name, scale, softcap, sinks, window);
}

}  // namespace torch_offload
