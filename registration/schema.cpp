// Every schema of the offload:: namespace, in one place. Kernels are registered
// per dispatch key in the other files of this folder.
#include <torch/library.h>

#include "ops/attention_block/attention_block.h"
#include "ops/common/checks.h"
#include "ops/common/pinned_arena.h"
#include "ops/disk_spill/disk_spill.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"
#include "ops/offload/activation_store.h"
#include "ops/sequence_parallel/ulysses_attention.h"
#include "ops/tiled_mlp/tiled_mlp.h"

TORCH_LIBRARY(offload, m) {
  m.def("offload_pack(Tensor src, bool non_blocking=False) -> Tensor");
  m.def("offload_unpack(Tensor packed, Device device) -> Tensor");

  // The MLP down(act(x w_gate^T + b_gate) * (x w_up^T + b_up)) + b_down, or
  // down(act(x w_gate^T + b_gate)) + b_down without w_up, computed in shards of
  // tokens. The backward op returns the gradients output_mask asks for (x, w_gate,
  // w_up, w_down, b_gate, b_up, b_down), undefined where not asked or absent.
  m.def(
      "tiled_mlp(Tensor x, Tensor w_gate, Tensor? w_up, Tensor w_down, Tensor? b_gate=None, Tensor? b_up=None, "
      "Tensor? b_down=None, str activation=\"silu\", SymInt num_shards=0) -> Tensor");
  m.def(
      "tiled_mlp_backward(Tensor grad_out, Tensor x, Tensor w_gate, Tensor? w_up, Tensor w_down, Tensor? b_gate, "
      "Tensor? b_up, Tensor? b_down, str activation, SymInt num_shards, bool[7] output_mask) "
      "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // tiled_mlp of rms_norm(x, norm_weight, norm_eps), the norm computed per shard: the norm's output is never
  // whole nor saved. The backward's output_mask and results: (x, norm_weight, w_gate, w_up, w_down, b_gate, b_up,
  // b_down).
  m.def(
      "rms_norm_tiled_mlp(Tensor x, Tensor norm_weight, float norm_eps, Tensor w_gate, Tensor? w_up, Tensor w_down, "
      "Tensor? b_gate=None, Tensor? b_up=None, Tensor? b_down=None, str activation=\"silu\", SymInt num_shards=0) "
      "-> Tensor");
  m.def(
      "rms_norm_tiled_mlp_backward(Tensor grad_out, Tensor x, Tensor norm_weight, float norm_eps, Tensor w_gate, "
      "Tensor? w_up, Tensor w_down, Tensor? b_gate, Tensor? b_up, Tensor? b_down, str activation, SymInt num_shards, "
      "bool[8] output_mask) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // tiled_mlp's automatic shard count for these shapes; takes no tensor, so one kernel serves every backend.
  m.def("tiled_mlp_num_shards(int tokens, int intermediate, bool gated, ScalarType dtype) -> int",
        &torch_offload::tiled_mlp_num_shards_kernel);

  // Arena controls take no tensor, so one kernel serves every backend.
  m.def("set_pinned_budget(int budget_bytes) -> ()", &torch_offload::set_pinned_budget_kernel);
  m.def("pinned_arena_stats() -> int[]", &torch_offload::pinned_arena_stats_kernel);

  // The disk tier. disk_spill returns a ticket (a CPU int64 tensor [2]) at once
  // and writes asynchronously; disk_restore takes the size, dtype and device so
  // fake kernels know its result. A failed write raises in disk_wait or
  // disk_restore. _disk_ticket_location ([fd, extent offset,
  // payload offset within the extent]) is for tests.
  m.def("disk_spill(Tensor src, str? directory=None, bool allow_tmpfs=False) -> Tensor");
  m.def("disk_restore(Tensor ticket, SymInt[] size, ScalarType dtype, Device device) -> Tensor");
  // disk_restore without consuming the ticket: read again as often as asked, until restored or freed.
  m.def("disk_read(Tensor ticket, SymInt[] size, ScalarType dtype, Device device) -> Tensor");
  m.def("disk_prefetch(Tensor ticket) -> ()");
  m.def("disk_wait(Tensor ticket) -> ()");
  m.def("_disk_ticket_location(Tensor ticket) -> int[]");
  m.def(
      "disk_spill_configure(int num_threads=4, int extent_bytes=33554432, bool checksums=True, "
      "int max_in_flight_bytes=536870912, int restore_cache_bytes=0) -> ()",
      &torch_offload::disk_spill_configure_kernel);
  m.def("disk_spill_stats() -> int[]", &torch_offload::disk_spill_stats_kernel);

  // State of torch_offload.offload_activations(): torch.classes.offload.*.
  m.class_<torch_offload::ActivationEntry>("ActivationEntry");
  m.class_<torch_offload::SavedActivation>("SavedActivation").def("unpack", &torch_offload::SavedActivation::unpack);
  m.class_<torch_offload::ActivationStore>("ActivationStore")
      .def(torch::init<int64_t, int64_t, int64_t, bool, bool, bool, std::optional<std::string>, bool>())
      .def("pack", &torch_offload::ActivationStore::pack)
      .def("skip_storages_of", &torch_offload::ActivationStore::skip_storages_of)
      .def("clear_skipped_storages", &torch_offload::ActivationStore::clear_skipped_storages)
      .def("stats", &torch_offload::ActivationStore::stats);

  // The LM head's cross-entropy in tiles of tokens x vocabulary (no [tokens, V]
  // logits). The loss, and the log-sum-exp per token that linear_cross_entropy_forward
  // also returns for the backward op, are float32 (float64 for float64 inputs); the backward
  // op returns the gradients output_mask asks for (hidden, weight, bias). filter_eps > 0
  // turns on gradient filtering in backward (tiles whose gradient is negligible are skipped).
  m.def(
      "linear_cross_entropy(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, int ignore_index=-100, "
      "float label_smoothing=0.0, float softcap=0.0, float z_loss=0.0, str reduction=\"mean\", "
      "SymInt tile_tokens=0, SymInt tile_vocab=0, float filter_eps=0.0, bool? gradients_in_forward=None) -> Tensor");
  m.def(
      "linear_cross_entropy_forward(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, int ignore_index, "
      "float label_smoothing, float softcap, float z_loss, str reduction, SymInt tile_tokens, SymInt tile_vocab) "
      "-> (Tensor, Tensor)");
  m.def(
      "linear_cross_entropy_backward(Tensor grad_loss, Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
      "Tensor lse, int ignore_index, float label_smoothing, float softcap, float z_loss, str reduction, "
      "SymInt tile_tokens, SymInt tile_vocab, bool[3] output_mask, float filter_eps=0.0) -> (Tensor, Tensor, Tensor)");
  // For a scalar loss ("mean", "sum"): the loss and its gradients by (hidden, weight, bias) for a unit
  // grad_loss, those output_mask asks for (undefined otherwise), in the loss's dtype, computed in forward
  // (3 GEMMs; the autograd formula then only scales them). tile_tokens: the tokens of a whole-vocabulary
  // slab of logits, <= 0 for a 64 MiB budget (at least 512 tokens).
  m.def(
      "linear_cross_entropy_with_gradients(Tensor hidden, Tensor weight, Tensor? bias, Tensor target, "
      "int ignore_index, float label_smoothing, float softcap, float z_loss, str reduction, SymInt tile_tokens, "
      "bool[3] output_mask) -> (Tensor, Tensor, Tensor, Tensor)");
  // Each token's log-probability of its id under softmax(scores) and, with entropy=True, its entropy (else an
  // empty [0] tensor), scores = cap(logit_scale * logits) / temperature (cap: softcap * tanh(x / softcap) where
  // softcap > 0), logits = hidden @ weight^T + bias in tiles (no [tokens, V]), float32 for bf16/fp16 inputs;
  // 0 for ids equal to ignore_index. The forward op also returns each token's log-sum-exp of the scores
  // (float64) for the backward op, which takes either upstream gradient (or both) and returns the gradients
  // output_mask asks for (hidden, weight, bias); it needs the forward's entropies with grad_entropy.
  m.def(
      "token_logprobs(Tensor hidden, Tensor weight, Tensor ids, *, Tensor? bias=None, float temperature=1.0, "
      "bool entropy=False, float softcap=0.0, float logit_scale=1.0, int ignore_index=-100) -> (Tensor, Tensor)");
  m.def(
      "token_logprobs_forward(Tensor hidden, Tensor weight, Tensor ids, Tensor? bias, float temperature, "
      "bool entropy, float softcap, float logit_scale, int ignore_index) -> (Tensor, Tensor, Tensor)");
  m.def(
      "token_logprobs_backward(Tensor? grad_logprobs, Tensor? grad_entropy, Tensor hidden, Tensor weight, "
      "Tensor ids, Tensor? bias, Tensor lse, Tensor? entropy, float temperature, float softcap, "
      "float logit_scale, int ignore_index, bool[3] output_mask) -> (Tensor, Tensor, Tensor)");
  // Per token, without gradients: the mean of the scores, whether the id is the first maximum, and log sum p^2
  // (float32 for bf16/fp16; the second bool); 0 (False) for ids equal to ignore_index.
  m.def(
      "token_logprob_summaries(Tensor hidden, Tensor weight, Tensor ids, *, Tensor? bias=None, "
      "float temperature=1.0, float softcap=0.0, float logit_scale=1.0, int ignore_index=-100) "
      "-> (Tensor, Tensor, Tensor)");
  // transformers' RMSNorm over x's last dimension: weight * round(x / sqrt(mean(x^2) + eps)), in float32 for
  // bf16/fp16 and rounded to x's dtype before the weight's product; weight [h] in x's dtype. The backward op
  // returns the gradients output_mask asks for (x, weight), recomputing each row's scale from x.
  m.def("rms_norm(Tensor x, Tensor weight, float eps=1e-06) -> Tensor");
  m.def("rms_norm_backward(Tensor grad, Tensor x, Tensor weight, float eps, bool[2] output_mask) -> (Tensor, Tensor)");
  // The automatic tile [tokens, vocabulary columns]; takes no tensor, so one kernel serves every backend.
  m.def("linear_cross_entropy_tile(int tokens, int vocab, ScalarType dtype) -> int[]",
        &torch_offload::linear_cross_entropy_tile_kernel);

  // A decoder layer's attention from its normalized input x [batch, tokens, h] to its
  // output projection: q/k/v projections, the rotary embedding (cos, sin [1 or batch,
  // tokens, head_dim]), causal attention (grouped-query when w_k has fewer heads than
  // w_q) and w_o, one group of heads at a time; backward saves only the inputs and
  // recomputes each group. The backward op returns the gradients output_mask asks for
  // (x, w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o, q_norm, k_norm), undefined where not asked or absent.
  // q_norm and k_norm [head_dim] (Qwen3's): each head's q and k through an RMSNorm (norm_eps) before the
  // rotary embedding; [heads * head_dim] and [kv_heads * head_dim] (OLMo 2's): over each token's whole
  // q and k projection.
  // With group_name (sequence parallelism), x and cos/sin are this rank's contiguous chunk of the
  // rows, segment_ids the whole rows', and each head group's attention runs over the whole rows
  // for a share of its heads, between two all-to-alls (ops/sequence_parallel).
  m.def(
      "attention_block(Tensor x, Tensor w_q, Tensor w_k, Tensor w_v, Tensor w_o, Tensor cos, Tensor sin, "
      "Tensor? b_q=None, Tensor? b_k=None, Tensor? b_v=None, Tensor? b_o=None, float? scale=None, "
      "Tensor? segment_ids=None, str? group_name=None, Tensor? q_norm=None, Tensor? k_norm=None, "
      "float norm_eps=1e-06) -> Tensor");
  m.def(
      "attention_block_backward(Tensor grad_out, Tensor x, Tensor w_q, Tensor w_k, Tensor w_v, Tensor w_o, "
      "Tensor cos, Tensor sin, Tensor? b_q, Tensor? b_k, Tensor? b_v, Tensor? b_o, float? scale, "
      "Tensor? segment_ids, bool[11] output_mask, str? group_name=None, Tensor? q_norm=None, Tensor? k_norm=None, "
      "float norm_eps=1e-06) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, "
      "Tensor)");

  // attention_block's attention alone, for attention modules it does not replace: query and key
  // [batch, heads, tokens, head_dim], value [batch, heads, tokens, value_head_dim] (the output's),
  // causal within the segments of segment_ids [batch, tokens]. Backward saves only the inputs; it returns (query, key,
  // value)'s gradients, undefined where output_mask does not ask. softcap caps the scores (softcap * tanh(s /
  // softcap)); sinks [heads] add one logit per head to each query's softmax, with no value; window is a sliding window
  // within each sequence. The backward also returns sinks' gradient.
  m.def(
      "segment_attention(Tensor query, Tensor key, Tensor value, Tensor segment_ids, float? scale=None, "
      "float? softcap=None, Tensor? sinks=None, int? window=None) -> Tensor");
  m.def(
      "segment_attention_backward(Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor segment_ids, "
      "float? scale, bool[4] output_mask, float? softcap=None, Tensor? sinks=None, int? window=None) "
      "-> (Tensor, Tensor, Tensor, Tensor)");

  // segment_attention over a sequence split across the ranks of the process group named group_name
  // (Ulysses): query [batch, heads, tokens / ranks, head_dim] and key, value [batch, kv_heads, tokens
  // / ranks, head_dim] are this rank's contiguous chunk of the rows, segment_ids [batch, tokens] the
  // whole rows'; returns this rank's chunk of the output. softcap, sinks [heads] and window are
  // segment_attention's. A composite of functional collectives and segment_attention
  // (ulysses_attention.cpp): no kernels of its own.
  m.def(
      "ulysses_attention(Tensor query, Tensor key, Tensor value, Tensor segment_ids, str group_name, "
      "float? scale=None, float? softcap=None, Tensor? sinks=None, int? window=None) -> Tensor");

  // A copy of value once every element of condition is true, else the error message (ops/common/checks.h):
  // apply()'s masks check with it under torch.compile what only the data shows.
  m.def("_assert_all(Tensor value, Tensor condition, str message) -> Tensor");
}

TORCH_LIBRARY_IMPL(offload, CompositeExplicitAutograd, m) {
  m.impl("_assert_all", &torch_offload::assert_all_kernel);
}

TORCH_LIBRARY_IMPL(offload, CompositeImplicitAutograd, m) {
  m.impl("ulysses_attention", &torch_offload::ulysses_attention_composite);
}
