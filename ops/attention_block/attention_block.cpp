// The head-group loop of attention_block, the same on every device: projections,
// rotary embedding and the output projection through ATen, causal attention by
// the device's kernels (AttentionKernels).
#include "ops/attention_block/attention_block.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/OpMathType.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/SymBool.h>
#include <c10/util/Exception.h>

#include "ops/attention_block/head_batches.h"
#include "ops/attention_block/query_chunks.h"
#include "ops/attention_block/row_norms.h"
#include "ops/attention_block/segments.h"
#include "ops/common/checks.h"
#include "ops/common/gemm.h"
#include "ops/sequence_parallel/ulysses_attention.h"

namespace torch_offload {

int64_t head_group_bytes(c10::DeviceType device_type, int64_t device_memory) {
  // Tuned on a CPU, whose GEMMs lose little at a single head's width.
  constexpr int64_t kCpuBytes = int64_t{16} << 20;
  // A GPU's GEMMs want width, and with sequence parallelism each group is an exchange: 16 MiB would
  // run Llama-8B's shapes (32 query heads over 8 key/value heads of 128) one key/value head per group
  // from about 2K tokens in bf16; 256 MiB keeps 3 per group at 8K tokens. A small GPU gives the
  // groups no more than 1/64 of its memory.
  constexpr int64_t kGpuBytes = int64_t{256} << 20;
  if (device_type == c10::DeviceType::CPU) {
    return kCpuBytes;
  }
  return std::clamp(device_memory / 64, kCpuBytes, kGpuBytes);
}

namespace {

// The head-group budget of x's device (head_group_bytes).
int64_t group_bytes_of(const at::Tensor& x) {
#ifdef TORCH_OFFLOAD_WITH_CUDA
  if (x.is_cuda()) {
    return head_group_bytes(c10::DeviceType::CUDA, cuda_device_memory(x.device().index()));
  }
#endif
  return head_group_bytes(x.device().type(), 0);
}

// The RMSNorms of q and k before the rotary embedding, undefined where absent: per head (Qwen3's q_norm and
// k_norm, weights [head_dim]) or over each token's whole projection (OLMo 2's, weights [heads * head_dim]
// and [kv_heads * head_dim]; row_norms.h), whose rows' scales (q_rstd, k_rstd) a call computes first.
struct HeadNorms {
  at::Tensor q, k;
  double eps;
  at::Tensor q_rstd, k_rstd;

  HeadNorms(const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double norm_eps)
      : q(value_or_undefined(q_norm)), k(value_or_undefined(k_norm)), eps(norm_eps) {}
};

// A norm weight over the whole projection rather than one head (with one head the two are the same).
bool over_whole_rows(const at::Tensor& weight, int64_t head_dim) {
  return weight.defined() && weight.size(0) != head_dim;
}

// Every argument against x [B, T, h] and cos [1 or B, T, D], w_o and b_o where output_projection says the op has
// them (attention_block_attend has not); works on symbolic shapes.
void check_arguments(const char* op, const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k,
                     const at::Tensor& w_v, const at::Tensor& w_o, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& b_q, const at::Tensor& b_k, const at::Tensor& b_v, const at::Tensor& b_o,
                     std::optional<double> scale, const HeadNorms& norms, bool output_projection = true) {
  check_defined(x, op, "x");
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf, op,
              ": x has dtype ", dtype, "; expected float32, float64, bfloat16 or float16");
  TORCH_CHECK(x.dim() == 3, op, ": x has shape ", x.sym_sizes(), "; expected [batch, tokens, h]");
  const c10::SymInt batch = x.sym_size(0);
  const c10::SymInt tokens = x.sym_size(1);
  const c10::SymInt h = x.sym_size(2);
  check_defined(cos, op, "cos");
  TORCH_CHECK(cos.dim() == 3, op, ": cos has shape ", cos.sym_sizes(), "; expected [1 or batch, tokens, head_dim]");
  const c10::SymInt cos_batch = cos.sym_size(0);
  const c10::SymInt head_dim = cos.sym_size(2);
  TORCH_SYM_CHECK(cos_batch.sym_eq(1).sym_or(cos_batch.sym_eq(batch)), op, ": cos has shape ", cos.sym_sizes(),
                  "; expected [1 or batch, tokens, head_dim] with batch = ", batch);
  TORCH_SYM_CHECK(head_dim.sym_gt(0).sym_and((head_dim % 2).sym_eq(0)), op, ": cos has shape ", cos.sym_sizes(),
                  "; its last dimension is the head dimension, which must be even and > 0");
  check_tensor(op, "cos", cos, x, "x", dtype, {cos_batch, tokens, head_dim}, "[1 or batch, tokens, head_dim]");
  check_tensor(op, "sin", sin, x, "x", dtype, cos.sym_sizes(), "cos's shape");
  check_defined(w_q, op, "w_q");
  check_defined(w_k, op, "w_k");
  TORCH_CHECK(w_q.dim() == 2, op, ": w_q has shape ", w_q.sym_sizes(), "; expected [heads * head_dim, h]");
  TORCH_CHECK(w_k.dim() == 2, op, ": w_k has shape ", w_k.sym_sizes(), "; expected [kv_heads * head_dim, h]");
  const c10::SymInt q_rows = w_q.sym_size(0);
  const c10::SymInt kv_rows = w_k.sym_size(0);
  check_tensor(op, "w_q", w_q, x, "x", dtype, {q_rows, h}, "[heads * head_dim, h]");
  check_tensor(op, "w_k", w_k, x, "x", dtype, {kv_rows, h}, "[kv_heads * head_dim, h]");
  check_tensor(op, "w_v", w_v, x, "x", dtype, {kv_rows, h}, "w_k's shape [kv_heads * head_dim, h]");
  TORCH_SYM_CHECK(q_rows.sym_gt(0).sym_and((q_rows % head_dim).sym_eq(0)), op, ": w_q has ", q_rows,
                  " rows; expected a multiple > 0 of the head dimension ", head_dim, " (cos's last dimension)");
  TORCH_SYM_CHECK(kv_rows.sym_gt(0).sym_and((kv_rows % head_dim).sym_eq(0)), op, ": w_k has ", kv_rows,
                  " rows; expected a multiple > 0 of the head dimension ", head_dim, " (cos's last dimension)");
  TORCH_SYM_CHECK(((q_rows / head_dim) % (kv_rows / head_dim)).sym_eq(0), op, ": w_q has ", q_rows / head_dim,
                  " heads and w_k ", kv_rows / head_dim, "; the query heads must be a multiple of the key/value heads");
  if (output_projection) {
    check_defined(w_o, op, "w_o");
    TORCH_CHECK(w_o.dim() == 2, op, ": w_o has shape ", w_o.sym_sizes(), "; expected [out_features, heads * head_dim]");
    check_tensor(op, "w_o", w_o, x, "x", dtype, {w_o.sym_size(0), q_rows}, "[out_features, heads * head_dim]");
  }
  if (b_q.defined()) {
    check_tensor(op, "b_q", b_q, x, "x", dtype, {q_rows}, "[heads * head_dim]");
  }
  if (b_k.defined()) {
    check_tensor(op, "b_k", b_k, x, "x", dtype, {kv_rows}, "[kv_heads * head_dim]");
  }
  if (b_v.defined()) {
    check_tensor(op, "b_v", b_v, x, "x", dtype, {kv_rows}, "[kv_heads * head_dim]");
  }
  if (output_projection && b_o.defined()) {
    check_tensor(op, "b_o", b_o, x, "x", dtype, {w_o.sym_size(0)}, "[out_features]");
  }
  TORCH_CHECK(!scale.has_value() || (std::isfinite(*scale) && *scale > 0), op, ": scale is ", *scale,
              "; expected a finite value > 0 (or None for 1/sqrt(head_dim))");
  // [head_dim]: per head; the projection's width: over each token's whole projection.
  const auto check_norm = [&](const char* name, const at::Tensor& weight, const c10::SymInt& rows,
                              const char* expected) {
    if (!weight.defined()) {
      return;
    }
    TORCH_CHECK(weight.dim() == 1, op, ": ", name, " has shape ", weight.sym_sizes(), "; expected ", expected);
    const c10::SymInt width = weight.sym_size(0);
    TORCH_SYM_CHECK(width.sym_eq(head_dim).sym_or(width.sym_eq(rows)), op, ": ", name, " has shape ",
                    weight.sym_sizes(), "; expected ", expected);
    check_tensor(op, name, weight, x, "x", dtype, {width}, expected);
  };
  check_norm("q_norm", norms.q, q_rows, "[head_dim] or [heads * head_dim]");
  check_norm("k_norm", norms.k, kv_rows, "[head_dim] or [kv_heads * head_dim]");
  TORCH_CHECK(std::isfinite(norms.eps) && norms.eps >= 0, op, ": norm_eps is ", norms.eps,
              "; expected a finite value >= 0");
}

// segment_ids: integers on ref's device.
void check_segment_id_values(const char* op, const at::Tensor& segment_ids, const at::Tensor& ref,
                             const char* ref_name) {
  TORCH_CHECK(segment_ids.scalar_type() == at::kLong || segment_ids.scalar_type() == at::kInt, op,
              ": segment_ids has dtype ", segment_ids.scalar_type(), "; expected int64 or int32");
  TORCH_CHECK(segment_ids.device() == ref.device(), op, ": segment_ids is on ", segment_ids.device(), " but ", ref_name,
              " is on ", ref.device());
}

// segment_ids, when given: integers [batch, tokens] for a call of `batch` rows of `tokens` on ref's device.
void check_segment_ids(const char* op, const at::Tensor& segment_ids, const at::Tensor& ref, const char* ref_name,
                       const c10::SymInt& batch, const c10::SymInt& tokens) {
  if (!segment_ids.defined()) {
    return;
  }
  check_segment_id_values(op, segment_ids, ref, ref_name);
  TORCH_CHECK(segment_ids.dim() == 2, op, ": segment_ids has shape ", segment_ids.sym_sizes(),
              "; expected [batch, tokens] = [", batch, ", ", tokens, "]");
  TORCH_SYM_CHECK(segment_ids.sym_size(0).sym_eq(batch).sym_and(segment_ids.sym_size(1).sym_eq(tokens)), op,
                  ": segment_ids has shape ", segment_ids.sym_sizes(), "; expected [batch, tokens] = [", batch, ", ",
                  tokens, "]");
}

// attention_block's: [batch, tokens] of the whole rows, x's tokens times the ranks of a sequence-parallel group.
void check_segment_ids(const char* op, const at::Tensor& segment_ids, const at::Tensor& x, int64_t ranks) {
  check_segment_ids(op, segment_ids, x, "x", x.sym_size(0), x.sym_size(1) * ranks);
}

// attention_block's saved attention (attention_block_attend's outputs for the same arguments), both or neither:
// attention [batch, tokens, heads * head_dim] in x's dtype and logsumexp [heads / ranks, batch, tokens * ranks] in its
// op-math type.
void check_saved_attention(const char* op, const at::Tensor& attention, const at::Tensor& logsumexp,
                           const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& cos, int64_t ranks) {
  TORCH_CHECK(attention.defined() == logsumexp.defined(), op, ": attention is ", attention.defined() ? "given" : "None",
              " but logsumexp is ", logsumexp.defined() ? "given" : "None",
              "; expected both (attention_block_attend's outputs) or neither");
  if (!attention.defined()) {
    return;
  }
  const c10::SymInt heads = w_q.sym_size(0) / cos.sym_size(2);
  check_tensor(op, "attention", attention, x, "x", x.scalar_type(), {x.sym_size(0), x.sym_size(1), w_q.sym_size(0)},
               "[batch, tokens, heads * head_dim]");
  check_tensor(op, "logsumexp", logsumexp, x, "x", at::toOpMathType(x.scalar_type()),
               {heads / ranks, x.sym_size(0), x.sym_size(1) * ranks}, "[heads / ranks, batch, tokens * ranks]");
}

// segment_attention's checks of query, segment_ids and scale but their shapes.
void check_segment_attention_values(const char* op, const at::Tensor& q, const at::Tensor& segment_ids,
                                    std::optional<double> scale) {
  TORCH_CHECK(at::isFloatingType(q.scalar_type()), op, ": query has dtype ", q.scalar_type(),
              "; expected a floating point dtype");
  TORCH_CHECK(segment_ids.defined(), op, ": segment_ids is undefined; expected [batch, tokens] integer ids");
  check_segment_id_values(op, segment_ids, q, "query");
  TORCH_CHECK(!scale.has_value() || (std::isfinite(*scale) && *scale > 0), op, ": scale is ", scale.value_or(0),
              "; expected a finite value > 0 (or None for 1/sqrt(head_dim))");
}

// segment_attention's arguments: query and key [batch, heads, tokens, head_dim] alike, value [batch, heads,
// tokens, value_head_dim] (multi-head latent attention's differs from the query's), floating point on one
// device, segment_ids [batch, tokens] (required), scale. Symbolic shapes work.
void check_segment_attention(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& segment_ids, std::optional<double> scale) {
  TORCH_CHECK(q.dim() == 4, op, ": query has shape ", q.sym_sizes(), "; expected [batch, heads, tokens, head_dim]");
  check_segment_attention_values(op, q, segment_ids, scale);
  check_tensor(op, "key", k, q, "query", q.scalar_type(), q.sym_sizes(), "query's [batch, heads, tokens, head_dim]");
  const c10::SymInt value_head_dim = v.dim() == 4 ? v.sym_size(3) : q.sym_size(3);
  check_tensor(op, "value", v, q, "query", q.scalar_type(),
               {q.sym_size(0), q.sym_size(1), q.sym_size(2), value_head_dim},
               "query's [batch, heads, tokens] and a head dimension");
  check_segment_ids(op, segment_ids, q, "query", q.sym_size(0), q.sym_size(2));
}

// The shapes of one call, and the head groups it runs.
struct Layout {
  int64_t batch, tokens, h, head_dim, heads, kv_heads, repeats, out_features, kv_heads_per_group;
  double scale;

  Layout(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_o,
         const at::Tensor& cos, std::optional<double> scale_opt)
      : batch(x.size(0)),
        tokens(x.size(1)),
        h(x.size(2)),
        head_dim(cos.size(2)),
        heads(w_q.size(0) / head_dim),
        kv_heads(w_k.size(0) / head_dim),
        repeats(heads / kv_heads),
        out_features(w_o.defined() ? w_o.size(0) : 0),
        scale(scale_opt.value_or(1.0 / std::sqrt(static_cast<double>(head_dim)))) {
    // Per key/value head: q, out, dq, dout and the repeated k, v, dk, dv (repeats each),
    // plus k and v themselves.
    const int64_t bytes =
        std::max<int64_t>(1, (8 * repeats + 2) * batch * tokens * head_dim * static_cast<int64_t>(x.element_size()));
    kv_heads_per_group = std::clamp<int64_t>(group_bytes_of(x) / bytes, 1, kv_heads);
  }
};

at::Tensor rotate_half(const at::Tensor& t) {
  const int64_t half = t.size(-1) / 2;
  return at::cat({-t.narrow(-1, half, half), t.narrow(-1, 0, half)}, -1);
}

// rotate_half's transpose: what its gradient applies.
at::Tensor rotate_half_transposed(const at::Tensor& t) {
  const int64_t half = t.size(-1) / 2;
  return at::cat({t.narrow(-1, half, half), -t.narrow(-1, 0, half)}, -1);
}

// rows [B * T, n * D] as heads [B, n, T, D] with the rotary embedding applied (cos,
// sin [1 or B, T, D]), as transformers' apply_rotary_pos_emb computes it.
at::Tensor rotary(const at::Tensor& rows, const Layout& l, const at::Tensor& cos, const at::Tensor& sin) {
  const at::Tensor heads = rows.view({l.batch, l.tokens, -1, l.head_dim}).transpose(1, 2);
  return heads * cos.unsqueeze(1) + rotate_half(heads) * sin.unsqueeze(1);
}

// Heads [B, n, T, D] as rows [B * T, n * D].
at::Tensor as_rows(const at::Tensor& heads, const Layout& l) {
  return heads.transpose(1, 2).reshape({l.batch * l.tokens, -1});
}

// The gradient of rotary's input as rows [B * T, n * D], given the gradient of its output [B, n, T, D].
at::Tensor rotary_backward(const at::Tensor& grad, const Layout& l, const at::Tensor& cos, const at::Tensor& sin) {
  return as_rows(grad * cos.unsqueeze(1) + rotate_half_transposed(grad * sin.unsqueeze(1)), l);
}

// rows [B * T, n * D] through an RMSNorm over each head's D values, as transformers' Qwen3RMSNorm: in
// the op-math type (float32 for bf16/fp16), rounded to the rows' dtype, then times weight [D].
at::Tensor head_rms_norm(const at::Tensor& rows, const at::Tensor& weight, double eps) {
  const at::Tensor heads = rows.view({rows.size(0), -1, weight.size(0)}).to(at::toOpMathType(rows.scalar_type()));
  const at::Tensor normalized = heads * (heads.square().mean(-1, true) + eps).rsqrt();
  return (normalized.to(rows.scalar_type()) * weight).view(rows.sizes());
}

// The gradient of head_rms_norm's input rows, given its output's (rows); weight's added into grad_weight
// (op-math type) when it is defined.
at::Tensor head_rms_norm_backward(const at::Tensor& grad, const at::Tensor& rows, const at::Tensor& weight, double eps,
                                  const at::Tensor& grad_weight) {
  const at::ScalarType acc_type = at::toOpMathType(rows.scalar_type());
  const at::Tensor heads = rows.view({rows.size(0), -1, weight.size(0)}).to(acc_type);
  const at::Tensor rstd = (heads.square().mean(-1, true) + eps).rsqrt();
  const at::Tensor normalized = heads * rstd;
  const at::Tensor g = grad.reshape(heads.sizes()).to(acc_type);
  if (grad_weight.defined()) {
    grad_weight.add_((g * normalized.to(rows.scalar_type())).sum(at::IntArrayRef{0, 1}));
  }
  const at::Tensor g_normalized = g * weight.to(acc_type);
  const at::Tensor grad_heads = rstd * (g_normalized - normalized * (g_normalized * normalized).mean(-1, true));
  return grad_heads.to(rows.scalar_type()).view(rows.sizes());
}

// [B, n, T, D] key/value heads repeated for the `repeats` query heads that share each.
at::Tensor repeat_kv(const at::Tensor& t, const Layout& l) {
  if (l.repeats == 1) {
    return t;
  }
  const int64_t n = t.size(1);
  return t.unsqueeze(2)
      .expand({l.batch, n, l.repeats, l.tokens, l.head_dim})
      .reshape({l.batch, n * l.repeats, l.tokens, l.head_dim});
}

// The gradient of repeat_kv's input.
at::Tensor sum_repeats(const at::Tensor& t, const Layout& l) {
  if (l.repeats == 1) {
    return t;
  }
  return t.view({l.batch, -1, l.repeats, l.tokens, l.head_dim}).sum(2);
}

at::Tensor narrow_or_undefined(const at::Tensor& t, int64_t dim, int64_t start, int64_t length) {
  return t.defined() ? t.narrow(dim, start, length) : t;
}

// Sequence parallelism (a group name given): x holds this rank's contiguous chunk of every row. Each
// head group's q, k and v go to the whole rows for a share of the group's heads (to_tokens), and its
// attention output comes back (to_heads). Without a group both are the identity.
struct Shards {
  std::string group_name;
  int64_t ranks;

  explicit Shards(std::optional<c10::string_view> name)
      : group_name(name.has_value() ? std::string(*name) : std::string()),
        ranks(name.has_value() ? group_size(group_name) : 1) {}
  bool active() const { return !group_name.empty(); }
  at::Tensor to_tokens(const at::Tensor& t) const {
    return active() ? heads_to_tokens(t, ranks, group_name, /*differentiable=*/false) : t;
  }
  at::Tensor to_heads(const at::Tensor& t) const {
    return active() ? tokens_to_heads(t, ranks, group_name, /*differentiable=*/false) : t;
  }
};

// Key/value heads per group: the layout's, rounded up so that each rank gets whole query heads of a group.
int64_t kv_heads_per_group(const char* op, const Layout& l, const Shards& shards) {
  if (!shards.active()) {
    return l.kv_heads_per_group;
  }
  TORCH_CHECK_VALUE(l.heads % shards.ranks == 0, op, ": ", l.heads, " query heads cannot be split over ", shards.ranks,
                    " ranks; the query heads must be a multiple of the number of ranks");
  const int64_t step = shards.ranks / std::gcd(shards.ranks, l.repeats);
  return std::min(l.kv_heads, (l.kv_heads_per_group + step - 1) / step * step);
}

// x's rows through rows [start, start + count) of a projection's weight (and bias).
at::Tensor linear_rows(const at::Tensor& x_rows, const at::Tensor& w, const at::Tensor& b, int64_t start,
                       int64_t count) {
  at::Tensor out = at::empty({x_rows.size(0), count}, x_rows.options());
  linear_into(out, x_rows, w.narrow(0, start, count), narrow_or_undefined(b, 0, start, count));
  return out;
}

// A projection's rows (its columns from `start`) through its norm: per head, over whole rows (by their
// scales rstd), or none.
at::Tensor normed_rows(const at::Tensor& rows, const at::Tensor& weight, const at::Tensor& rstd, int64_t start,
                       double eps) {
  if (rstd.defined()) {
    return row_rms_norm(rows, rstd, weight.narrow(0, start, rows.size(1)));
  }
  return weight.defined() ? head_rms_norm(rows, weight, eps) : rows;
}

// One group of key/value heads [first, first + count) and the query heads that share them.
struct Group {
  int64_t q_start, q_rows, kv_start, kv_rows;
  at::Tensor q, k, v;  // [B, heads, T, D], rotary applied, k and v repeated
  at::Tensor q_unnormed,
      k_unnormed;  // the projections' rows before their norms, kept for backward where norms are given

  Group(const Layout& l, int64_t first, int64_t count)
      : q_start(first * l.repeats * l.head_dim),
        q_rows(count * l.repeats * l.head_dim),
        kv_start(first * l.head_dim),
        kv_rows(count * l.head_dim) {}
};

// Projects x's rows to the group's queries (rows' layout l: all of x's rows, or a chunk of them with cos and sin
// narrowed to its tokens and the norms' row scales to its rows).
void project_queries(Group& g, const Layout& l, const at::Tensor& x_rows, const at::Tensor& w_q, const at::Tensor& b_q,
                     const at::Tensor& cos, const at::Tensor& sin, const HeadNorms& norms, bool keep_rows,
                     const Shards& shards) {
  const at::Tensor q_rows = linear_rows(x_rows, w_q, b_q, g.q_start, g.q_rows);
  if (keep_rows) {
    g.q_unnormed = norms.q.defined() ? q_rows : at::Tensor();
  }
  g.q = shards.to_tokens(rotary(normed_rows(q_rows, norms.q, norms.q_rstd, g.q_start, norms.eps), l, cos, sin));
}

// Projects x's rows to the group's keys and values (for the whole rows and a share of the heads, with shards).
void project_keys_values(Group& g, const Layout& l, const at::Tensor& x_rows, const at::Tensor& w_k,
                         const at::Tensor& w_v, const at::Tensor& b_k, const at::Tensor& b_v, const at::Tensor& cos,
                         const at::Tensor& sin, const HeadNorms& norms, bool keep_rows, const Shards& shards) {
  const at::Tensor k_rows = linear_rows(x_rows, w_k, b_k, g.kv_start, g.kv_rows);
  if (keep_rows) {
    g.k_unnormed = norms.k.defined() ? k_rows : at::Tensor();
  }
  g.k = repeat_kv(rotary(normed_rows(k_rows, norms.k, norms.k_rstd, g.kv_start, norms.eps), l, cos, sin), l);
  g.v = repeat_kv(
      linear_rows(x_rows, w_v, b_v, g.kv_start, g.kv_rows).view({l.batch, l.tokens, -1, l.head_dim}).transpose(1, 2),
      l);
  g.k = shards.to_tokens(g.k);
  g.v = shards.to_tokens(g.v);
}

// Projects x's rows to the group's q, k and v.
void project(Group& g, const Layout& l, const at::Tensor& x_rows, const at::Tensor& w_q, const at::Tensor& w_k,
             const at::Tensor& w_v, const at::Tensor& b_q, const at::Tensor& b_k, const at::Tensor& b_v,
             const at::Tensor& cos, const at::Tensor& sin, const HeadNorms& norms, bool keep_rows,
             const Shards& shards) {
  project_queries(g, l, x_rows, w_q, b_q, cos, sin, norms, keep_rows, shards);
  project_keys_values(g, l, x_rows, w_k, w_v, b_k, b_v, cos, sin, norms, keep_rows, shards);
}

// Rows of x's projection at a time for the whole-row norms' passes: each holds a few float32 tensors of
// that width, an eighth of the head-group budget each (2 MiB on the CPU), whatever the tokens.
int64_t row_chunk(const at::Tensor& x, int64_t width) {
  return std::max<int64_t>(1, group_bytes_of(x) / 8 / std::max<int64_t>(1, width * 4));
}

// The whole-row norms' scales of x_rows' q and k projections (HeadNorms).
void compute_row_scales(HeadNorms& norms, const Layout& l, const at::Tensor& x_rows, const at::Tensor& w_q,
                        const at::Tensor& w_k, const at::Tensor& b_q, const at::Tensor& b_k) {
  if (over_whole_rows(norms.q, l.head_dim)) {
    norms.q_rstd = row_rms_rstd(x_rows, w_q, b_q, norms.eps, row_chunk(x_rows, w_q.size(0)));
  }
  if (over_whole_rows(norms.k, l.head_dim)) {
    norms.k_rstd = row_rms_rstd(x_rows, w_k, b_k, norms.eps, row_chunk(x_rows, w_k.size(0)));
  }
}

}  // namespace

at::Tensor attention_block_impl(const AttentionKernels& kernels, const at::Tensor& x, const at::Tensor& w_q,
                                const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& w_o,
                                const at::Tensor& cos, const at::Tensor& sin, const std::optional<at::Tensor>& b_q,
                                const std::optional<at::Tensor>& b_k, const std::optional<at::Tensor>& b_v,
                                const std::optional<at::Tensor>& b_o, std::optional<double> scale,
                                const std::optional<at::Tensor>& segment_ids,
                                std::optional<c10::string_view> group_name, const std::optional<at::Tensor>& q_norm,
                                const std::optional<at::Tensor>& k_norm, double norm_eps,
                                const std::optional<at::Tensor>& attention_opt,
                                const std::optional<at::Tensor>& logsumexp_opt) {
  const at::Tensor bq = value_or_undefined(b_q), bk = value_or_undefined(b_k), bv = value_or_undefined(b_v),
                   bo = value_or_undefined(b_o), segments = value_or_undefined(segment_ids);
  HeadNorms norms(q_norm, k_norm, norm_eps);
  check_arguments("attention_block", x, w_q, w_k, w_v, w_o, cos, sin, bq, bk, bv, bo, scale, norms);
  const Shards shards(group_name);
  check_segment_ids("attention_block", segments, x, shards.ranks);
  const at::Tensor saved = value_or_undefined(attention_opt);
  check_saved_attention("attention_block", saved, value_or_undefined(logsumexp_opt), x, w_q, cos, shards.ranks);
  const Layout l(x, w_q, w_k, w_o, cos, scale);
  if (saved.defined()) {  // the attention is attention_block_attend's: the output projection alone, one GEMM
    at::Tensor out = at::empty({l.batch * l.tokens, l.out_features}, x.options());
    linear_into(out, saved.reshape({l.batch * l.tokens, -1}), w_o, bo);
    return out.view({l.batch, l.tokens, l.out_features});
  }
  const int64_t per_group = kv_heads_per_group("attention_block", l, shards);
  const SegmentRuns runs = segment_runs("attention_block", segments);
  const int64_t rows = l.batch * l.tokens;
  // The groups' output projections add up in float32 for bf16/fp16 and are rounded once.
  const at::ScalarType acc_type = at::toOpMathType(x.scalar_type());
  at::Tensor out = at::zeros({rows, l.out_features}, x.options().dtype(acc_type));
  if (bo.defined()) {
    out.add_(bo);
  }
  if (rows > 0) {
    const at::Tensor x_rows = x.reshape({rows, l.h}).contiguous();
    compute_row_scales(norms, l, x_rows, w_q, w_k, bq, bk);
    for (int64_t first = 0; first < l.kv_heads; first += per_group) {
      Group g(l, first, std::min(per_group, l.kv_heads - first));
      project(g, l, x_rows, w_q, w_k, w_v, bq, bk, bv, cos, sin, norms, /*keep_rows=*/false, shards);
      const AttentionResult attention = attend(kernels, g.q, g.k, g.v, l.scale, runs);
      accumulate_mm(out, as_rows(shards.to_heads(attention.out), l), w_o.narrow(1, g.q_start, g.q_rows).t());
    }
  }
  return out.to(x.scalar_type()).view({l.batch, l.tokens, l.out_features});
}

std::tuple<at::Tensor, at::Tensor> attention_block_attend_impl(
    const AttentionKernels& kernels, const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k,
    const at::Tensor& w_v, const at::Tensor& cos, const at::Tensor& sin, const std::optional<at::Tensor>& b_q,
    const std::optional<at::Tensor>& b_k, const std::optional<at::Tensor>& b_v, std::optional<double> scale,
    const std::optional<at::Tensor>& segment_ids, std::optional<c10::string_view> group_name,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double norm_eps) {
  const char* op = "attention_block_attend";
  const at::Tensor bq = value_or_undefined(b_q), bk = value_or_undefined(b_k), bv = value_or_undefined(b_v),
                   segments = value_or_undefined(segment_ids);
  HeadNorms norms(q_norm, k_norm, norm_eps);
  check_arguments(op, x, w_q, w_k, w_v, at::Tensor(), cos, sin, bq, bk, bv, at::Tensor(), scale, norms,
                  /*output_projection=*/false);
  const Shards shards(group_name);
  check_segment_ids(op, segments, x, shards.ranks);
  const Layout l(x, w_q, w_k, at::Tensor(), cos, scale);
  const int64_t per_group = kv_heads_per_group(op, l, shards);
  const SegmentRuns runs = segment_runs(op, segments);
  const int64_t rows = l.batch * l.tokens;
  at::Tensor attention = at::empty({l.batch, l.tokens, l.heads * l.head_dim}, x.options());
  // Zeros where no kernel writes: padding that sees no key.
  at::Tensor logsumexp = at::zeros({l.heads / shards.ranks, l.batch, l.tokens * shards.ranks},
                                   x.options().dtype(at::toOpMathType(x.scalar_type())));
  if (rows > 0) {
    const at::Tensor x_rows = x.reshape({rows, l.h}).contiguous();
    const at::Tensor attention_rows = attention.view({rows, -1});
    compute_row_scales(norms, l, x_rows, w_q, w_k, bq, bk);
    for (int64_t first = 0; first < l.kv_heads; first += per_group) {
      Group g(l, first, std::min(per_group, l.kv_heads - first));
      project(g, l, x_rows, w_q, w_k, w_v, bq, bk, bv, cos, sin, norms, /*keep_rows=*/false, shards);
      const AttentionResult result = attend(kernels, g.q, g.k, g.v, l.scale, runs);
      attention_rows.narrow(1, g.q_start, g.q_rows).copy_(as_rows(shards.to_heads(result.out), l));
      // The rank's share of the group's heads: a whole number of them (kv_heads_per_group).
      store_logsumexp(logsumexp.narrow(0, g.q_start / l.head_dim / shards.ranks, g.q.size(1)), result, kernels, g.q,
                      runs);
    }
  }
  return {attention, logsumexp};
}

AttentionBlockGradients attention_block_backward_impl(
    const AttentionKernels& kernels, const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w_q,
    const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& w_o, const at::Tensor& cos, const at::Tensor& sin,
    const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_k, const std::optional<at::Tensor>& b_v,
    const std::optional<at::Tensor>& b_o, std::optional<double> scale, const std::optional<at::Tensor>& segment_ids,
    std::array<bool, 11> output_mask, std::optional<c10::string_view> group_name,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double norm_eps,
    const std::optional<at::Tensor>& attention_opt, const std::optional<at::Tensor>& logsumexp_opt) {
  const char* op = "attention_block_backward";
  const at::Tensor bq = value_or_undefined(b_q), bk = value_or_undefined(b_k), bv = value_or_undefined(b_v),
                   bo = value_or_undefined(b_o), segments = value_or_undefined(segment_ids);
  HeadNorms norms(q_norm, k_norm, norm_eps);
  check_arguments(op, x, w_q, w_k, w_v, w_o, cos, sin, bq, bk, bv, bo, scale, norms);
  const Shards shards(group_name);
  check_segment_ids(op, segments, x, shards.ranks);
  // The forward's attention and log-sum-exps (attention_block_attend's), when given: no attention forward runs here.
  const at::Tensor saved = value_or_undefined(attention_opt), saved_logsumexp = value_or_undefined(logsumexp_opt);
  check_saved_attention(op, saved, saved_logsumexp, x, w_q, cos, shards.ranks);
  const Layout l(x, w_q, w_k, w_o, cos, scale);
  const int64_t per_group = kv_heads_per_group(op, l, shards);
  check_tensor(op, "grad_out", grad_out, x, "x", x.scalar_type(), {l.batch, l.tokens, l.out_features},
               "[batch, tokens, out_features]");
  const int64_t rows = l.batch * l.tokens;

  // What is asked for, and present. Nothing else is computed.
  const bool want_x = output_mask[0], want_w_q = output_mask[1], want_w_k = output_mask[2], want_w_v = output_mask[3],
             want_w_o = output_mask[4];
  const bool want_b_q = output_mask[5] && bq.defined(), want_b_k = output_mask[6] && bk.defined(),
             want_b_v = output_mask[7] && bv.defined(), want_b_o = output_mask[8] && bo.defined();
  const bool want_q_norm = output_mask[9] && norms.q.defined(), want_k_norm = output_mask[10] && norms.k.defined();
  // Every gradient but w_o's and b_o's goes back through the attention.
  const bool want_inner =
      want_x || want_w_q || want_w_k || want_w_v || want_b_q || want_b_k || want_b_v || want_q_norm || want_k_norm;

  // Gradients of bf16/fp16 tensors add up in float32 and are rounded once.
  const at::ScalarType acc_type = at::toOpMathType(x.scalar_type());
  const auto zeros_like = [&](bool wanted, const at::Tensor& t) {
    return wanted ? at::zeros(t.sizes(), t.options().dtype(acc_type)) : at::Tensor();
  };
  at::Tensor grad_x = want_x ? at::zeros({rows, l.h}, x.options().dtype(acc_type)) : at::Tensor();
  at::Tensor grad_w_q = zeros_like(want_w_q, w_q), grad_w_k = zeros_like(want_w_k, w_k),
             grad_w_v = zeros_like(want_w_v, w_v), grad_w_o = zeros_like(want_w_o, w_o);
  at::Tensor grad_b_q = zeros_like(want_b_q, bq), grad_b_k = zeros_like(want_b_k, bk),
             grad_b_v = zeros_like(want_b_v, bv);
  const at::Tensor grad_q_norm = zeros_like(want_q_norm, norms.q), grad_k_norm = zeros_like(want_k_norm, norms.k);
  const at::Tensor grad_rows = grad_out.reshape({rows, l.out_features}).contiguous();
  // b_o's gradient needs no recompute: it is grad_out summed over the tokens.
  at::Tensor grad_b_o = want_b_o ? at::sum(grad_rows, {0}, false, acc_type) : at::Tensor();

  if (rows > 0 && want_w_o && saved.defined()) {  // every head's output at hand: one GEMM
    accumulate_mm(grad_w_o, grad_rows.t(), saved.reshape({rows, -1}));
  }
  if (rows > 0 && (want_inner || (want_w_o && !saved.defined()))) {
    const SegmentRuns runs = segment_runs(op, segments);
    const at::Tensor x_rows = x.reshape({rows, l.h}).contiguous();
    // x is every weight gradient's second operand: where accumulate_mm would convert it to
    // float32 on every call, convert it once.
    const bool convert_x = acc_type != x.scalar_type() && !x.is_cuda();
    const at::Tensor x_operand = convert_x ? x_rows.to(acc_type) : x_rows;
    // A projection's gradient (grad [n, count], its rows from first_row) into x's, its weight's and its bias's.
    const auto projection_backward = [&](const at::Tensor& grad, const at::Tensor& w, const at::Tensor& grad_w,
                                         const at::Tensor& grad_b, int64_t start, int64_t count, int64_t first_row) {
      const int64_t n = grad.size(0);
      if (want_x) {
        accumulate_mm(grad_x.narrow(0, first_row, n), grad, w.narrow(0, start, count));
      }
      if (grad_w.defined()) {
        accumulate_mm(grad_w.narrow(0, start, count), grad.t(), x_operand.narrow(0, first_row, n));
      }
      if (grad_b.defined()) {
        grad_b.narrow(0, start, count).add_(at::sum(grad, {0}, false, acc_type));
      }
    };
    compute_row_scales(norms, l, x_rows, w_q, w_k, bq, bk);
    // Whole-row norms: the gradient of their output, every group's columns, finished after the groups.
    const bool defer_q = norms.q_rstd.defined() && (want_x || want_w_q || want_b_q || want_q_norm);
    const bool defer_k = norms.k_rstd.defined() && (want_x || want_w_k || want_b_k || want_k_norm);
    const at::Tensor grad_q_normed = defer_q ? at::empty({rows, w_q.size(0)}, x.options()) : at::Tensor();
    const at::Tensor grad_k_normed = defer_k ? at::empty({rows, w_k.size(0)}, x.options()) : at::Tensor();
    // q's and k's gradients through their per-head norms and projections, or kept for their whole-row norms.
    const auto norm_and_projection_backward =
        [&](at::Tensor grad, const at::Tensor& kept, const at::Tensor& rows, const at::Tensor& weight,
            const at::Tensor& grad_weight, const at::Tensor& w, const at::Tensor& grad_w, const at::Tensor& grad_b,
            int64_t start, int64_t count, int64_t first_row) {
          if (kept.defined()) {
            kept.narrow(0, first_row, grad.size(0)).narrow(1, start, count).copy_(grad);
            return;
          }
          if (over_whole_rows(weight, l.head_dim)) {  // and nothing on this side wants a gradient
            return;
          }
          if (weight.defined()) {
            grad = head_rms_norm_backward(grad, rows, weight, norms.eps, grad_weight);
          }
          projection_backward(grad, w, grad_w, grad_b, start, count, first_row);
        };
    // One causal sequence a row on the CPU: the queries' side a chunk of rows at a time (query_chunks.h), so that
    // a group holds its keys and values and their gradients whole but not its queries, output and their gradients.
    const int64_t query_chunk =
        x.is_cpu() && !shards.active() && runs.empty() && l.batch == 1 && want_inner ? query_chunk_rows(l.tokens) : 0;
    const auto chunk_layout = [&](int64_t length) {
      Layout chunk = l;
      chunk.tokens = length;
      return chunk;
    };
    // The keys' and values' gradients of tokens [start, start + length) (dk, dv [B, kv heads repeated, length, D];
    // B = 1 where start > 0) through the rotary embedding, the keys' norm and the projections.
    const auto keys_values_backward = [&](const Group& g, const at::Tensor& dk, const at::Tensor& dv, int64_t start,
                                          int64_t length) {
      const Layout rows_layout = chunk_layout(length);
      const at::Tensor cos_rows = cos.narrow(1, start, length), sin_rows = sin.narrow(1, start, length);
      norm_and_projection_backward(rotary_backward(sum_repeats(dk, rows_layout), rows_layout, cos_rows, sin_rows),
                                   grad_k_normed, narrow_or_undefined(g.k_unnormed, 0, start, l.batch * length),
                                   norms.k, grad_k_norm, w_k, grad_w_k, grad_b_k, g.kv_start, g.kv_rows, start);
      projection_backward(as_rows(sum_repeats(dv, rows_layout), rows_layout), w_v, grad_w_v, grad_b_v, g.kv_start,
                          g.kv_rows, start);
    };
    for (int64_t first = 0; first < l.kv_heads; first += per_group) {
      Group g(l, first, std::min(per_group, l.kv_heads - first));
      const at::Tensor w_o_group = w_o.narrow(1, g.q_start, g.q_rows);
      if (query_chunk > 0) {
        project_keys_values(g, l, x_rows, w_k, w_v, bk, bv, cos, sin, norms, /*keep_rows=*/true, shards);
        QueryChunkSteps steps;
        steps.queries = [&](int64_t start, int64_t length) {
          HeadNorms chunk_norms = norms;
          chunk_norms.q_rstd = narrow_or_undefined(norms.q_rstd, 0, start, length);
          project_queries(g, chunk_layout(length), x_rows.narrow(0, start, length), w_q, bq,
                          cos.narrow(1, start, length), sin.narrow(1, start, length), chunk_norms,
                          /*keep_rows=*/true, shards);
          return std::exchange(g.q, at::Tensor());
        };
        steps.output_gradient = [&](int64_t start, int64_t length, const at::Tensor& out) {
          const at::Tensor grad_chunk = grad_rows.narrow(0, start, length);
          if (want_w_o && !saved.defined()) {
            accumulate_mm(grad_w_o.narrow(1, g.q_start, g.q_rows), grad_chunk.t(), as_rows(out, chunk_layout(length)));
          }
          return at::mm(grad_chunk, w_o_group).view({l.batch, length, -1, l.head_dim}).transpose(1, 2);
        };
        if (saved.defined()) {  // the forward's output and log-sum-exps of the chunk's queries, over all their keys
          steps.saved = [&](int64_t start, int64_t length) {
            return restored_result(
                saved_logsumexp.narrow(0, g.q_start / l.head_dim, g.q_rows / l.head_dim).narrow(2, start, length),
                saved.narrow(1, start, length)
                    .narrow(2, g.q_start, g.q_rows)
                    .view({l.batch, length, -1, l.head_dim})
                    .transpose(1, 2),
                kernels, g.k, runs);
          };
        }
        steps.query_gradient = [&](int64_t start, int64_t length, const at::Tensor& dq) {
          const at::Tensor grad = rotary_backward(dq.to(x.scalar_type()), chunk_layout(length),
                                                  cos.narrow(1, start, length), sin.narrow(1, start, length));
          norm_and_projection_backward(grad, grad_q_normed, g.q_unnormed, norms.q, grad_q_norm, w_q, grad_w_q, grad_b_q,
                                       g.q_start, g.q_rows, start);
        };
        auto [dk, dv] = attend_backward_in_query_chunks(kernels, g.k, g.v, l.scale, query_chunk, steps);
        g.k.reset(), g.v.reset(), g.q_unnormed.reset();
        // A chunk of rows at a time too: whole, the rotary embedding's backward would hold a few keys' sizes.
        for (int64_t start = 0; start < l.tokens; start += query_chunk) {
          const int64_t length = std::min(query_chunk, l.tokens - start);
          keys_values_backward(g, dk.narrow(2, start, length).to(x.scalar_type()),
                               dv.narrow(2, start, length).to(x.scalar_type()), start, length);
        }
        continue;
      }
      project(g, l, x_rows, w_q, w_k, w_v, bq, bk, bv, cos, sin, norms, /*keep_rows=*/true, shards);
      AttentionResult attention =
          saved.defined()
              ? restored_result(
                    saved_logsumexp.narrow(0, g.q_start / l.head_dim / shards.ranks, g.q.size(1)),
                    shards.to_tokens(
                        saved.narrow(2, g.q_start, g.q_rows).view({l.batch, l.tokens, -1, l.head_dim}).transpose(1, 2)),
                    kernels, g.q, runs)
              : attend(kernels, g.q, g.k, g.v, l.scale, runs);
      if (want_w_o && !saved.defined()) {
        accumulate_mm(grad_w_o.narrow(1, g.q_start, g.q_rows), grad_rows.t(),
                      as_rows(shards.to_heads(attention.out), l));
      }
      if (!want_inner) {
        continue;
      }
      at::Tensor grad_attention =
          shards.to_tokens(at::mm(grad_rows, w_o_group).view({l.batch, l.tokens, -1, l.head_dim}).transpose(1, 2));
      auto [dq, dk, dv] = attend_backward(kernels, grad_attention, g.q, g.k, g.v, attention, l.scale, runs);
      // Freed before the gradients go back to the rank's tokens: the exchanges allocate their size again.
      g.q.reset(), g.k.reset(), g.v.reset(), grad_attention.reset();
      attention = AttentionResult{};
      dq = shards.to_heads(dq);
      dk = shards.to_heads(dk);
      dv = shards.to_heads(dv);
      norm_and_projection_backward(rotary_backward(dq, l, cos, sin), grad_q_normed, g.q_unnormed, norms.q, grad_q_norm,
                                   w_q, grad_w_q, grad_b_q, g.q_start, g.q_rows, 0);
      keys_values_backward(g, dk, dv, 0, l.tokens);
    }
    // The whole-row norms' gradients, then their projections', a chunk of rows at a time (the projection
    // recomputed).
    const struct {
      bool deferred;
      const at::Tensor &grad_normed, &w, &b, &weight, &rstd, &grad_w, &grad_b, &grad_weight;
    } whole_row_norms[] = {{defer_q, grad_q_normed, w_q, bq, norms.q, norms.q_rstd, grad_w_q, grad_b_q, grad_q_norm},
                           {defer_k, grad_k_normed, w_k, bk, norms.k, norms.k_rstd, grad_w_k, grad_b_k, grad_k_norm}};
    for (const auto& n : whole_row_norms) {
      if (!n.deferred) {
        continue;
      }
      const int64_t width = n.w.size(0), chunk = row_chunk(x_rows, width);
      for (int64_t start = 0; start < rows; start += chunk) {
        const int64_t count = std::min(chunk, rows - start);
        at::Tensor projected = at::empty({count, width}, x.options());
        linear_into(projected, x_rows.narrow(0, start, count), n.w, n.b);
        const at::Tensor grad_projected = row_rms_norm_backward(
            n.grad_normed.narrow(0, start, count), projected, n.rstd.narrow(0, start, count), n.weight, n.grad_weight);
        projection_backward(grad_projected.to(x.scalar_type()), n.w, n.grad_w, n.grad_b, 0, width, start);
      }
    }
  }

  const auto to_dtype = [&](const at::Tensor& t) { return t.defined() ? t.to(x.scalar_type()) : t; };
  return {want_x ? to_dtype(grad_x).view(x.sizes()) : grad_x,
          to_dtype(grad_w_q),
          to_dtype(grad_w_k),
          to_dtype(grad_w_v),
          to_dtype(grad_w_o),
          to_dtype(grad_b_q),
          to_dtype(grad_b_k),
          to_dtype(grad_b_v),
          to_dtype(grad_b_o),
          to_dtype(grad_q_norm),
          to_dtype(grad_k_norm)};
}

namespace {

// t, in the layout at::empty_like(like) has (what the Meta kernels promise: like's own strides when
// like is dense), copied only if the kernels returned another (CPU flash attention's gradients come
// token-major).
at::Tensor in_layout_of(const at::Tensor& t, const at::Tensor& like) {
  if (like.is_non_overlapping_and_dense() && t.strides() == like.strides()) {
    return t;
  }
  at::Tensor out = at::empty_like(like);
  return out.strides() == t.strides() ? t : out.copy_(t);
}

// segment_attention's softcap (finite, > 0), sinks (floating point [heads] on query's device) and window (> 0),
// as ScoreMods.
ScoreMods score_mods(const char* op, const at::Tensor& q, std::optional<double> softcap,
                     const std::optional<at::Tensor>& sinks_opt, std::optional<int64_t> window) {
  TORCH_CHECK(!softcap.has_value() || (std::isfinite(*softcap) && *softcap > 0), op, ": softcap is ",
              softcap.value_or(0), "; expected a finite value > 0 (or None for no cap)");
  TORCH_CHECK(!window.has_value() || *window > 0, op, ": window is ", window.value_or(0),
              "; expected a number of tokens > 0 (or None for no window)");
  const at::Tensor sinks = value_or_undefined(sinks_opt);
  if (sinks.defined()) {
    TORCH_CHECK(at::isFloatingType(sinks.scalar_type()), op, ": sinks has dtype ", sinks.scalar_type(),
                "; expected a floating point dtype");
    TORCH_CHECK(sinks.device() == q.device(), op, ": sinks is on ", sinks.device(), " but query is on ", q.device());
    TORCH_SYM_CHECK(sinks.sym_sizes().size() == 1 ? sinks.sym_size(0).sym_eq(q.sym_size(1)) : c10::SymBool(false), op,
                    ": sinks has shape ", sinks.sym_sizes(), "; expected [heads] = [", q.sym_size(1), "]");
  }
  return {softcap.value_or(0), sinks, window.value_or(0)};
}

// Errors where a padding run's queries would see past the window: the op gives padding all of the
// sequence before it, which a window would cut per query.
void check_window_over_padding(const char* op, const SegmentRuns& runs, int64_t window) {
  for (const SegmentRun& run : runs) {
    if (window > 0 && run.padding && run.keys >= 0 && run.start + run.length - 1 - runs[run.keys].start >= window) {
      TORCH_CHECK(false, op, ": the padding at tokens ", run.start, " to ", run.start + run.length - 1, " of row ",
                  run.row, " would see its sequence (from token ", runs[run.keys].start, ") past the window of ",
                  window, " tokens, which segment_attention does not compute");
    }
  }
}

}  // namespace

// The tensor whose shape and layout the attention output takes: query, or value where their head dimensions differ.
const at::Tensor& output_like(const at::Tensor& q, const at::Tensor& v) {
  return v.sym_size(3) == q.sym_size(3) ? q : v;
}

// A query without head dimension has no scale, and would have nothing to compute but for the value's.
void check_query_head_dim(const char* op, const at::Tensor& q, const at::Tensor& v) {
  TORCH_CHECK(q.size(3) > 0 || v.size(3) == 0, op, ": query and key have head dimension 0 and value ", v.size(3),
              "; expected a query head dimension > 0");
}

// Query, key and value with one head dimension, as the kernels take them: where value's differs (multi-head
// latent attention), the narrower side gets zero columns, which add exact zeros to every score and output
// element; the caller cuts them off again.
struct EqualHeadDims {
  at::Tensor q, k, v;
  int64_t qk_dim, v_dim;

  EqualHeadDims(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value)
      : qk_dim(query.size(3)), v_dim(value.size(3)) {
    const int64_t dim = std::max(qk_dim, v_dim);
    const auto widen = [dim](const at::Tensor& t) {
      return t.size(3) == dim ? t : at::constant_pad_nd(t, {0, dim - t.size(3)});
    };
    q = widen(query), k = widen(key), v = widen(value);
  }
  at::Tensor widen_like_v(const at::Tensor& t) const {
    return t.size(3) == v.size(3) ? t : at::constant_pad_nd(t, {0, v.size(3) - t.size(3)});
  }
  static at::Tensor cut(const at::Tensor& t, int64_t dim) { return t.size(3) == dim ? t : t.narrow(3, 0, dim); }
};

at::Tensor segment_attention_impl(const AttentionKernels& kernels, const at::Tensor& q, const at::Tensor& k,
                                  const at::Tensor& v, const at::Tensor& segment_ids, std::optional<double> scale,
                                  std::optional<double> softcap, const std::optional<at::Tensor>& sinks,
                                  std::optional<int64_t> window) {
  check_segment_attention("segment_attention", q, k, v, segment_ids, scale);
  const ScoreMods mods = score_mods("segment_attention", q, softcap, sinks, window);
  check_query_head_dim("segment_attention", q, v);
  if (q.numel() == 0) {
    return at::empty_like(output_like(q, v));  // no element
  }
  const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(3))));
  const AttentionKernels used = mods.any() ? score_mod_kernels(mods, at::Tensor()) : kernels;
  const SegmentRuns runs = segment_runs("segment_attention", segment_ids);
  check_window_over_padding("segment_attention", runs, mods.window);
  const EqualHeadDims e(q, k, v);
  return in_layout_of(EqualHeadDims::cut(attend(used, e.q, e.k, e.v, s, runs).out, e.v_dim), output_like(q, v));
}

SegmentAttentionGradients segment_attention_backward_impl(
    const AttentionKernels& kernels, const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
    const at::Tensor& v, const at::Tensor& segment_ids, std::optional<double> scale, std::array<bool, 4> output_mask,
    std::optional<double> softcap, const std::optional<at::Tensor>& sinks, std::optional<int64_t> window) {
  const char* op = "segment_attention_backward";
  check_segment_attention(op, q, k, v, segment_ids, scale);
  check_tensor(op, "grad_out", grad_out, q, "query", q.scalar_type(), v.sym_sizes(),
               "value's [batch, heads, tokens, head_dim]");
  const ScoreMods mods = score_mods(op, q, softcap, sinks, window);
  // The sinks' gradient adds up over the runs in float32 (float64 for float64 sinks) and is rounded once.
  const at::Tensor grad_sinks =
      output_mask[3] && mods.sinks.defined()
          ? at::zeros(mods.sinks.sizes(), mods.sinks.options().dtype(at::toOpMathType(mods.sinks.scalar_type())))
          : at::Tensor();
  const AttentionKernels used = mods.any() ? score_mod_kernels(mods, grad_sinks) : kernels;
  check_query_head_dim(op, q, v);
  at::Tensor dq, dk, dv;
  if (q.numel() == 0) {
    dq = at::zeros_like(q);
    dk = at::zeros_like(k);
    dv = at::zeros_like(v);
  } else {
    const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(q.size(3))));
    const SegmentRuns runs = segment_runs(op, segment_ids);
    check_window_over_padding(op, runs, mods.window);
    // Forward saved nothing but its inputs: the log-sum-exp each run's backward needs is recomputed.
    const EqualHeadDims e(q, k, v);
    const AttentionResult result = attend(used, e.q, e.k, e.v, s, runs);
    std::tie(dq, dk, dv) = attend_backward(used, e.widen_like_v(grad_out), e.q, e.k, e.v, result, s, runs);
    dq = EqualHeadDims::cut(dq, e.qk_dim), dk = EqualHeadDims::cut(dk, e.qk_dim), dv = EqualHeadDims::cut(dv, e.v_dim);
  }
  const auto asked = [&](const at::Tensor& t, const at::Tensor& like, size_t i) {
    return output_mask[i] ? in_layout_of(t, like) : at::Tensor();
  };
  return {asked(dq, q, 0), asked(dk, k, 1), asked(dv, v, 2),
          grad_sinks.defined() ? grad_sinks.to(mods.sinks.scalar_type()) : grad_sinks};
}

void check_segment_attention_inputs(const char* op, const at::Tensor& q, const at::Tensor& segment_ids,
                                    std::optional<double> scale, std::optional<double> softcap,
                                    const std::optional<at::Tensor>& sinks, std::optional<int64_t> window) {
  check_segment_attention_values(op, q, segment_ids, scale);
  score_mods(op, q, softcap, sinks, window);
#ifdef TORCH_OFFLOAD_WITH_CUDA
  if (q.is_cuda()) {
    check_cuda_support(op, q, "query", q.size(-1), "query's last dimension");
  }
#endif
}

void check_rotary_needs_no_grad(const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(!cos.requires_grad() && !sin.requires_grad(), "attention_block: ", cos.requires_grad() ? "cos" : "sin",
              " requires grad; the op computes no gradient for the rotary tables (detach them)");
}

namespace {

// PyTorch's CPU flash kernels give each thread a contiguous range of (batch x heads) in backward and of
// (batch x heads x query blocks) in forward. A causal head's later query blocks cost more, so an odd
// batch x heads (one head per group, at long sequences) leaves one of two threads with 3/4 of a lone
// head's forward and its whole backward (bar the small GEMMs inside). Such a call is computed instead as
// pieces of equal work, an even number of them: each sequence's two causal halves, and its second half's
// queries against its first half's keys (split by key halves in backward). Forward merges the pieces by
// their log-sum-exp; backward runs each piece with the whole call's output and log-sum-exp, which gives
// exactly its share of the gradients. The rule depends on shapes only, not on the thread count.
// The cross piece runs in chunks, kCrossChunks of its queries (by as many of its keys in backward), so
// that its temporaries (a chunk's output, dq, dk and dv) stay a fraction of one [tokens, head_dim]
// tensor, where one call held twice that: sequence-parallel ranks attend such a head over whole rows.
constexpr int64_t kBalancedSplitMinTokens = 1024;
constexpr int64_t kCrossChunks = 4;

bool split_into_balanced_pieces(const at::Tensor& q) {
  const int64_t tokens = q.size(2);
  return (q.size(0) * q.size(1)) % 2 == 1 && tokens >= kBalancedSplitMinTokens && tokens % 4 == 0;
}

AttentionResult cpu_attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                                      bool causal) {
  const auto flash = [&](const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, bool causal_) {
    return at::_scaled_dot_product_flash_attention_for_cpu(q_, k_, v_, 0.0, causal_, {}, scale);
  };
  if (!causal || !split_into_balanced_pieces(q)) {
    auto [out, logsumexp] = flash(q, k, v, causal);
    return {out, logsumexp, {}, {}};
  }
  const int64_t m = q.size(2) / 2, chunk = (m + kCrossChunks - 1) / kCrossChunks;
  const auto [halves_out, halves_lse] =
      flash(halves_as_batch(q), halves_as_batch(k), halves_as_batch(v), /*causal=*/true);
  at::Tensor out = batch_as_halves(halves_out), logsumexp = batch_as_halves(halves_lse);
  // The second half's queries: their own half's keys (causal) and the first half's, merged.
  for (int64_t start = m; start < 2 * m; start += chunk) {
    const int64_t length = std::min(chunk, 2 * m - start);
    const auto [cross_out, cross_lse] =
        flash(q.narrow(2, start, length), k.narrow(2, 0, m), v.narrow(2, 0, m), /*causal=*/false);
    at::Tensor second_out = out.narrow(2, start, length), second_lse = logsumexp.narrow(2, start, length);
    const at::Tensor merged_lse = second_lse.logaddexp(cross_lse);
    // Merged in the log-sum-exp's precision (float32 for bf16/fp16), the sum rounded once into out.
    second_out.copy_(second_out * (second_lse - merged_lse).exp().unsqueeze(-1) +
                     cross_out * (cross_lse - merged_lse).exp().unsqueeze(-1));
    second_lse.copy_(merged_lse);
  }
  return {out, logsumexp, {}, {}};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cpu_attention_backward(const at::Tensor& grad_out, const at::Tensor& q,
                                                                      const at::Tensor& k, const at::Tensor& v,
                                                                      const AttentionResult& result, double scale,
                                                                      bool causal) {
  const auto flash_backward = [&](const at::Tensor& g, const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_,
                                  const at::Tensor& out, const at::Tensor& lse, bool causal_) {
    return at::_scaled_dot_product_flash_attention_for_cpu_backward(g, q_, k_, v_, out, lse, 0.0, causal_, {}, scale);
  };
  if (!causal || !split_into_balanced_pieces(q)) {
    return flash_backward(grad_out, q, k, v, result.out, result.logsumexp, causal);
  }
  const int64_t m = q.size(2) / 2, chunk = (m + kCrossChunks - 1) / kCrossChunks;
  const auto [halves_dq, halves_dk, halves_dv] =
      flash_backward(halves_as_batch(grad_out), halves_as_batch(q), halves_as_batch(k), halves_as_batch(v),
                     halves_as_batch(result.out), halves_as_batch(result.logsumexp), /*causal=*/true);
  at::Tensor dq = batch_as_halves(halves_dq), dk = batch_as_halves(halves_dk), dv = batch_as_halves(halves_dv);
  // The second half's queries against the first half's keys, chunk by chunk of each, every call as two
  // pieces: one per half of its keys (key chunks have an even length, as m has).
  const int64_t key_chunk = (chunk + 1) / 2 * 2;
  for (int64_t key_start = 0; key_start < m; key_start += key_chunk) {
    const int64_t key_length = std::min(key_chunk, m - key_start);
    const auto keys = [&](const at::Tensor& t) { return halves_as_batch(t.narrow(2, key_start, key_length)); };
    for (int64_t start = m; start < 2 * m; start += chunk) {
      const int64_t length = std::min(chunk, 2 * m - start);
      const auto queries = [&](const at::Tensor& t) { return twice_as_batch(t.narrow(2, start, length)); };
      const auto [cross_dq, cross_dk, cross_dv] =
          flash_backward(queries(grad_out), queries(q), keys(k), keys(v), queries(result.out),
                         queries(result.logsumexp), /*causal=*/false);
      dq.narrow(2, start, length).add_(sum_twice(cross_dq));
      dk.narrow(2, key_start, key_length).add_(batch_as_halves(cross_dk));
      dv.narrow(2, key_start, key_length).add_(batch_as_halves(cross_dv));
    }
  }
  return {dq, dk, dv};
}

const AttentionKernels cpu_attention_kernels{cpu_attention_forward, cpu_attention_backward};

}  // namespace

at::Tensor attention_block_cpu(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v,
                               const at::Tensor& w_o, const at::Tensor& cos, const at::Tensor& sin,
                               const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_k,
                               const std::optional<at::Tensor>& b_v, const std::optional<at::Tensor>& b_o,
                               std::optional<double> scale, const std::optional<at::Tensor>& segment_ids,
                               std::optional<c10::string_view> group_name, const std::optional<at::Tensor>& q_norm,
                               const std::optional<at::Tensor>& k_norm, double norm_eps,
                               const std::optional<at::Tensor>& attention, const std::optional<at::Tensor>& logsumexp) {
  return attention_block_impl(cpu_attention_kernels, x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o, scale,
                              segment_ids, group_name, q_norm, k_norm, norm_eps, attention, logsumexp);
}

std::tuple<at::Tensor, at::Tensor> attention_block_attend_cpu(
    const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& cos,
    const at::Tensor& sin, const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_k,
    const std::optional<at::Tensor>& b_v, std::optional<double> scale, const std::optional<at::Tensor>& segment_ids,
    std::optional<c10::string_view> group_name, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, double norm_eps) {
  return attention_block_attend_impl(cpu_attention_kernels, x, w_q, w_k, w_v, cos, sin, b_q, b_k, b_v, scale,
                                     segment_ids, group_name, q_norm, k_norm, norm_eps);
}

AttentionBlockGradients attention_block_backward_cpu(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k,
    const at::Tensor& w_v, const at::Tensor& w_o, const at::Tensor& cos, const at::Tensor& sin,
    const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_k, const std::optional<at::Tensor>& b_v,
    const std::optional<at::Tensor>& b_o, std::optional<double> scale, const std::optional<at::Tensor>& segment_ids,
    std::array<bool, 11> output_mask, std::optional<c10::string_view> group_name,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double norm_eps,
    const std::optional<at::Tensor>& attention, const std::optional<at::Tensor>& logsumexp) {
  return attention_block_backward_impl(cpu_attention_kernels, grad_out, x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v,
                                       b_o, scale, segment_ids, output_mask, group_name, q_norm, k_norm, norm_eps,
                                       attention, logsumexp);
}

// Meta: the same checks (on symbolic shapes), then results shaped like the real ones.
at::Tensor attention_block_meta(const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k,
                                const at::Tensor& w_v, const at::Tensor& w_o, const at::Tensor& cos,
                                const at::Tensor& sin, const std::optional<at::Tensor>& b_q,
                                const std::optional<at::Tensor>& b_k, const std::optional<at::Tensor>& b_v,
                                const std::optional<at::Tensor>& b_o, std::optional<double> scale,
                                const std::optional<at::Tensor>& segment_ids,
                                std::optional<c10::string_view> group_name, const std::optional<at::Tensor>& q_norm,
                                const std::optional<at::Tensor>& k_norm, double norm_eps,
                                const std::optional<at::Tensor>& attention,
                                const std::optional<at::Tensor>& logsumexp) {
  check_arguments("attention_block", x, w_q, w_k, w_v, w_o, cos, sin, value_or_undefined(b_q), value_or_undefined(b_k),
                  value_or_undefined(b_v), value_or_undefined(b_o), scale, HeadNorms(q_norm, k_norm, norm_eps));
  const Shards shards(group_name);
  check_segment_ids("attention_block", value_or_undefined(segment_ids), x, shards.ranks);
  check_saved_attention("attention_block", value_or_undefined(attention), value_or_undefined(logsumexp), x, w_q, cos,
                        shards.ranks);
  return at::empty_symint({x.sym_size(0), x.sym_size(1), w_o.sym_size(0)}, x.options());
}

std::tuple<at::Tensor, at::Tensor> attention_block_attend_meta(
    const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k, const at::Tensor& w_v, const at::Tensor& cos,
    const at::Tensor& sin, const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_k,
    const std::optional<at::Tensor>& b_v, std::optional<double> scale, const std::optional<at::Tensor>& segment_ids,
    std::optional<c10::string_view> group_name, const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, double norm_eps) {
  const char* op = "attention_block_attend";
  check_arguments(op, x, w_q, w_k, w_v, at::Tensor(), cos, sin, value_or_undefined(b_q), value_or_undefined(b_k),
                  value_or_undefined(b_v), at::Tensor(), scale, HeadNorms(q_norm, k_norm, norm_eps),
                  /*output_projection=*/false);
  const Shards shards(group_name);
  check_segment_ids(op, value_or_undefined(segment_ids), x, shards.ranks);
  const c10::SymInt heads = w_q.sym_size(0) / cos.sym_size(2);
  return {at::empty_symint({x.sym_size(0), x.sym_size(1), w_q.sym_size(0)}, x.options()),
          at::empty_symint({heads / shards.ranks, x.sym_size(0), x.sym_size(1) * shards.ranks},
                           x.options().dtype(at::toOpMathType(x.scalar_type())))};
}

AttentionBlockGradients attention_block_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& w_q, const at::Tensor& w_k,
    const at::Tensor& w_v, const at::Tensor& w_o, const at::Tensor& cos, const at::Tensor& sin,
    const std::optional<at::Tensor>& b_q, const std::optional<at::Tensor>& b_k, const std::optional<at::Tensor>& b_v,
    const std::optional<at::Tensor>& b_o, std::optional<double> scale, const std::optional<at::Tensor>& segment_ids,
    std::array<bool, 11> output_mask, std::optional<c10::string_view> group_name,
    const std::optional<at::Tensor>& q_norm, const std::optional<at::Tensor>& k_norm, double norm_eps,
    const std::optional<at::Tensor>& attention, const std::optional<at::Tensor>& logsumexp) {
  const char* op = "attention_block_backward";
  const Shards shards(group_name);
  check_segment_ids(op, value_or_undefined(segment_ids), x, shards.ranks);
  check_saved_attention(op, value_or_undefined(attention), value_or_undefined(logsumexp), x, w_q, cos, shards.ranks);
  const HeadNorms norms(q_norm, k_norm, norm_eps);
  const std::array<at::Tensor, 11> inputs{x,
                                          w_q,
                                          w_k,
                                          w_v,
                                          w_o,
                                          value_or_undefined(b_q),
                                          value_or_undefined(b_k),
                                          value_or_undefined(b_v),
                                          value_or_undefined(b_o),
                                          norms.q,
                                          norms.k};
  check_arguments(op, x, w_q, w_k, w_v, w_o, cos, sin, inputs[5], inputs[6], inputs[7], inputs[8], scale, norms);
  check_tensor(op, "grad_out", grad_out, x, "x", x.scalar_type(), {x.sym_size(0), x.sym_size(1), w_o.sym_size(0)},
               "[batch, tokens, out_features]");
  std::array<at::Tensor, 11> grads;
  for (size_t i = 0; i < grads.size(); ++i) {
    if (output_mask[i] && inputs[i].defined()) {
      grads[i] = at::empty_symint(inputs[i].sym_sizes(), inputs[i].options());
    }
  }
  return {grads[0], grads[1], grads[2], grads[3], grads[4], grads[5],
          grads[6], grads[7], grads[8], grads[9], grads[10]};
}

at::Tensor segment_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const at::Tensor& segment_ids, std::optional<double> scale,
                                 std::optional<double> softcap, const std::optional<at::Tensor>& sinks,
                                 std::optional<int64_t> window) {
  return segment_attention_impl(cpu_attention_kernels, q, k, v, segment_ids, scale, softcap, sinks, window);
}

SegmentAttentionGradients segment_attention_backward_cpu(const at::Tensor& grad_out, const at::Tensor& q,
                                                         const at::Tensor& k, const at::Tensor& v,
                                                         const at::Tensor& segment_ids, std::optional<double> scale,
                                                         std::array<bool, 4> output_mask, std::optional<double> softcap,
                                                         const std::optional<at::Tensor>& sinks,
                                                         std::optional<int64_t> window) {
  return segment_attention_backward_impl(cpu_attention_kernels, grad_out, q, k, v, segment_ids, scale, output_mask,
                                         softcap, sinks, window);
}

at::Tensor segment_attention_meta(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& segment_ids, std::optional<double> scale,
                                  std::optional<double> softcap, const std::optional<at::Tensor>& sinks,
                                  std::optional<int64_t> window) {
  check_segment_attention("segment_attention", q, k, v, segment_ids, scale);
  score_mods("segment_attention", q, softcap, sinks, window);
  return at::empty_like(output_like(q, v));
}

SegmentAttentionGradients segment_attention_backward_meta(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& segment_ids, std::optional<double> scale, std::array<bool, 4> output_mask,
    std::optional<double> softcap, const std::optional<at::Tensor>& sinks, std::optional<int64_t> window) {
  const char* op = "segment_attention_backward";
  check_segment_attention(op, q, k, v, segment_ids, scale);
  check_tensor(op, "grad_out", grad_out, q, "query", q.scalar_type(), v.sym_sizes(),
               "value's [batch, heads, tokens, head_dim]");
  const ScoreMods mods = score_mods(op, q, softcap, sinks, window);
  const auto asked = [&](const at::Tensor& t, size_t i) {
    return output_mask[i] && t.defined() ? at::empty_like(t) : at::Tensor();
  };
  return {asked(q, 0), asked(k, 1), asked(v, 2), asked(mods.sinks, 3)};
}

}  // namespace torch_offload
