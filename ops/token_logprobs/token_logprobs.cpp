// The tiling loops of token_logprobs. With the scores s = cap(logit_scale * (hidden @ weight^T + bias)) /
// temperature over the vocabulary (cap(z) = softcap tanh(z / softcap) where softcap > 0, else z), a token's
// log-probability of its id t is s_t - lse and its entropy H = -sum_j p_j log p_j, p = softmax(s).
// Forward folds tile by tile each token's running max m, S = sum_j exp(s_j - m) and Q = sum_j exp(s_j - m)
// (s_j - m), so that lse = m + log S and H = log S - Q / S without a cancellation between two large terms.
// Backward recomputes each tile; for upstream gradients a (log-probability) and b (entropy),
//   d/ds_j = a ([j = t] - p_j) - b p_j (log p_j + H),
//   d/dlogit_j = d/ds_j logit_scale (1 - (s_j temperature / softcap)^2) / temperature (the tanh from s itself).
// Tokens whose id is ignore_index get 0 for every output and give no gradient.
// token_logprobs also takes K ids a token (ids [..., K]: a teacher's candidates): K log-probabilities under the one
// softmax, still one pass over the vocabulary, and d/ds_j = sum_k a_k [j = t_k] - (sum_k a_k) p_j for the first
// term; a token's entropy counts where any of its ids is not ignore_index.
// Elementwise work is ATen's on [rows, cols] tiles, so every device runs the same code; only the GEMMs
// touch the [V, h] weight.
#include "ops/token_logprobs/token_logprobs.h"

#include <cmath>
#include <limits>
#include <vector>

#include <ATen/OpMathType.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/full.h>
#include <ATen/ops/log.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include "ops/common/checks.h"
#include "ops/common/gemm.h"
#include "ops/common/logit_scores.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"

namespace torch_offload {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// The scores' settings, and the tokens whose id is ignore_index.
struct Scoring : LogitScores {
  int64_t ignore_index;
};

// The tokens' shape: hidden's without h.
c10::SymIntArrayRef token_shape(const at::Tensor& hidden) {
  return hidden.sym_sizes().slice(0, hidden.dim() - 1);
}

// Whether ids holds K ids a token ([..., K]) rather than one ([...]).
bool several_ids(const at::Tensor& hidden, const at::Tensor& ids) {
  return ids.dim() == hidden.dim();
}

// The number of tokens, symbolic: hidden's size without h (h may be 0).
c10::SymInt token_count(const at::Tensor& hidden) {
  c10::SymInt count = 1;
  for (const c10::SymInt& size : token_shape(hidden)) {
    count = count * size;
  }
  return count;
}

// The forward's log-sum-exps, one a token, float64.
void check_lse(const char* op, const at::Tensor& lse, const at::Tensor& hidden) {
  check_tensor(op, "lse", lse, hidden, "hidden", at::kDouble, {token_count(hidden)}, "[tokens]");
}

// Every argument against hidden [..., h] and weight [V, h]; ids [...] or, where the op takes several, [..., K];
// works on symbolic shapes.
void check_arguments(const char* op, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& ids,
                     const at::Tensor& bias, const Scoring& scoring, bool takes_several) {
  check_lm_head(op, hidden, weight, bias);
  check_defined(ids, op, "ids");
  TORCH_CHECK(ids.scalar_type() == at::kLong || ids.scalar_type() == at::kInt, op, ": ids has dtype ",
              ids.scalar_type(), "; expected int64 (or int32) token ids");
  if (takes_several && several_ids(hidden, ids)) {
    std::vector<c10::SymInt> want(token_shape(hidden).begin(), token_shape(hidden).end());
    want.push_back(ids.sym_size(-1));
    check_tensor(op, "ids", ids, hidden, "hidden", ids.scalar_type(), want, "hidden's shape without h, then K");
  } else {
    check_tensor(op, "ids", ids, hidden, "hidden", ids.scalar_type(), token_shape(hidden),
                 takes_several ? "hidden's shape without h (one id a token), or that and K ids a token"
                               : "hidden's shape without h");
  }
  scoring.check(op);
}

// An id outside [0, V) that is not ignore_index would pick no logit: an error naming it, before any work.
void check_id_values(const char* op, const at::Tensor& ids, int64_t vocab, int64_t ignore_index) {
  check_not_capturing(op, ids.device(), "it reads the ids on the host to check their values");
  const at::Tensor bad = ids.ne(ignore_index).logical_and(ids.lt(0).logical_or(ids.ge(vocab)));
  if (bad.any().item<bool>()) {
    const int64_t index = at::nonzero(bad.reshape({-1}))[0][0].item<int64_t>();
    TORCH_CHECK(false, op, ": ids holds ", ids.reshape({-1})[index].item<int64_t>(), " at (flattened) index ", index,
                "; expected token ids in [0, ", vocab, ") or ignore_index (", ignore_index, ")");
  }
}

// The problem flattened: hidden [T, h] contiguous, ids [T, K] int64 (K = 1 for one id a token; checked, then
// ignored ones as 0: they pick column 0, whose result is dropped), whether each id counts and each token (any of
// its ids), and the tile shape.
struct Tiles {
  at::Tensor hidden, ids, counted, token_counted;
  int64_t tokens, vocab, rows, cols;

  Tiles(const char* op, const at::Tensor& hidden_in, const at::Tensor& weight, const at::Tensor& ids_in,
        int64_t ignore_index)
      : hidden(token_rows(hidden_in)) {
    tokens = hidden.size(0);
    ids = ids_in.reshape({tokens, several_ids(hidden_in, ids_in) ? ids_in.size(-1) : 1}).to(at::kLong).contiguous();
    vocab = weight.size(0);
    const auto tile = linear_cross_entropy_tile_kernel(tokens, vocab, hidden.scalar_type());
    rows = tile[0];
    cols = tile[1];
    check_id_values(op, ids, vocab, ignore_index);
    counted = ids.ne(ignore_index);
    token_counted = counted.any(1);
    ids = ids.masked_fill(counted.logical_not(), 0);
  }
};

// Where each of the rows' ids ([rows, K]) falls in the columns [col0, col0 + cols): the mask and the column
// (clamped) to gather.
std::pair<at::Tensor, at::Tensor> ids_in_tile(const at::Tensor& ids, int64_t col0, int64_t cols) {
  const at::Tensor in_tile = ids.ge(col0).logical_and(ids.lt(col0 + cols));
  return {in_tile, (ids - col0).clamp(0, cols - 1)};
}

// What a pass over the vocabulary folds per token besides max, S and the id's s, each where asked.
struct Wanted {
  bool entropy = false, mean = false, top1 = false, squares = false;
};

// Per token, folded tile by tile: max m, S = sum exp(s - m), the ids' s ([T, K]), and where asked
// Q = sum exp(s - m)(s - m) (entropy), sum s (mean logit), the max of s before the id's column (top-1: the first
// maximum, as argmax), and sum exp(2 (s - m)) (log sum p^2).
struct VocabularyFold {
  at::Tensor max, sum_exp, picked, shifted_sum, sum_s, max_before, sum_exp2;
};

// With the flattened problem, whose `counted` says which tokens' results to keep.
std::pair<VocabularyFold, Tiles> fold_vocabulary(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
                                                 const at::Tensor& ids, const at::Tensor& b, const Scoring& scoring,
                                                 Wanted wanted) {
  // The summaries' top-1 is one id's.
  check_arguments(op, hidden, weight, ids, b, scoring, /*takes_several=*/!wanted.top1);
  const Tiles t(op, hidden, weight, ids, scoring.ignore_index);
  const auto acc_type = at::toOpMathType(hidden.scalar_type());
  const auto acc = hidden.options().dtype(acc_type);
  const auto optional = [&](bool want, double value) { return want ? at::full({t.tokens}, value, acc) : at::Tensor(); };
  VocabularyFold f{at::full({t.tokens}, -kInf, acc), at::zeros({t.tokens}, acc), at::zeros(t.ids.sizes(), acc),
                   optional(wanted.entropy, 0.0),    optional(wanted.mean, 0.0), optional(wanted.top1, -kInf),
                   optional(wanted.squares, 0.0)};
  if (t.tokens > 0 && t.vocab > 0) {
    const at::Tensor buffer = at::empty({t.rows * t.cols}, acc);
    const at::Tensor zero = at::zeros({}, acc);
    for (int64_t start = 0; start < t.tokens; start += t.rows) {
      const int64_t rows = std::min(t.rows, t.tokens - start);
      const at::Tensor hidden_tile = t.hidden.narrow(0, start, rows), ids_tile = t.ids.narrow(0, start, rows);
      const auto part = [&](const at::Tensor& x) { return x.narrow(0, start, rows); };
      at::Tensor m = part(f.max), s_sum = part(f.sum_exp);
      for (int64_t col0 = 0; col0 < t.vocab; col0 += t.cols) {
        const int64_t cols = std::min(t.cols, t.vocab - col0);
        const at::Tensor s = tile_scores(buffer, hidden_tile, weight, b, col0, cols, scoring);
        const at::Tensor new_max = at::maximum(m, std::get<0>(s.max(1)));
        // A row whose every s so far is -inf (a bias masking the vocabulary) keeps m = -inf and S = 0.
        const at::Tensor reference = at::where(new_max.eq(-kInf), zero, new_max);
        const at::Tensor rescale = at::exp(m - reference);
        const at::Tensor shifted = s - reference.unsqueeze(1);
        const at::Tensor e = at::exp(shifted);
        if (wanted.entropy) {
          // Q relative to the new max: exp(m - m') (Q + S (m - m')); nothing where S is still 0.
          at::Tensor q = part(f.shifted_sum);
          const at::Tensor carried = at::where(s_sum.gt(0), rescale * (q + s_sum * (m - reference)), zero);
          q.copy_(carried + at::where(e.gt(0), e * shifted, zero).sum(1));
        }
        if (wanted.squares) {
          at::Tensor q2 = part(f.sum_exp2);
          q2.copy_(q2 * rescale * rescale + (e * e).sum(1));
        }
        if (wanted.mean) {
          part(f.sum_s).add_(s.sum(1));
        }
        const auto [in_tile, column] = ids_in_tile(ids_tile, col0, cols);
        if (wanted.top1) {
          const at::Tensor before = at::arange(cols, t.ids.options()).unsqueeze(0).lt(ids_tile - col0);
          at::Tensor before_max = part(f.max_before);
          before_max.copy_(at::maximum(before_max, s.masked_fill(before.logical_not(), -kInf).amax(1)));
        }
        s_sum.copy_(s_sum * rescale + e.sum(1));
        m.copy_(new_max);
        at::Tensor p = part(f.picked);
        p.copy_(at::where(in_tile, s.gather(1, column), p));
      }
    }
  }
  return {f, t};
}

// x ([T, K]) with the ignored ids' entries 0, in ids' shape.
at::Tensor kept_per_id(const at::Tensor& x, const Tiles& t, const at::Tensor& ids) {
  return x.masked_fill(t.counted.logical_not(), 0).view(ids.sizes());
}

// x ([T]) with the tokens none of whose ids counts 0, in the tokens' shape.
at::Tensor kept_per_token(const at::Tensor& x, const Tiles& t, const at::Tensor& hidden) {
  return x.masked_fill(t.token_counted.logical_not(), 0).view(hidden.sizes().slice(0, hidden.dim() - 1));
}

}  // namespace

TokenLogprobsForward token_logprobs_forward_kernel(TORCH_OFFLOAD_TOKEN_LOGPROBS_ARGS) {
  const auto [f, t] = fold_vocabulary("token_logprobs", hidden, weight, ids, value_or_undefined(bias),
                                      {temperature, softcap, logit_scale, ignore_index}, {entropy});
  const at::Tensor log_sum = at::log(f.sum_exp);
  // At large logits (1e4 in float32: a unit in the last place of 1e-3) m + log S rounds off what a log-probability
  // is made of: the id's s - m is exact (two close floats), then log S. The log-sum-exp kept for backward is
  // float64 for the same reason (token_logprobs_backward).
  const at::Tensor lse = f.max.to(at::kDouble) + log_sum.to(at::kDouble);
  const at::Tensor logprobs = kept_per_id((f.picked - f.max.unsqueeze(1)) - log_sum.unsqueeze(1), t, ids);
  const at::Tensor entropies =
      entropy ? kept_per_token(log_sum - f.shifted_sum / f.sum_exp, t, hidden) : at::empty({0}, log_sum.options());
  return {logprobs, entropies, lse};
}

TokenLogprobSummaries token_logprob_summaries_kernel(TORCH_OFFLOAD_TOKEN_LOGPROB_SUMMARIES_ARGS) {
  const auto [f, t] = fold_vocabulary("token_logprob_summaries", hidden, weight, ids, value_or_undefined(bias),
                                      {temperature, softcap, logit_scale, ignore_index}, {false, true, true, true});
  const int64_t vocab = weight.size(0);
  const at::Tensor picked = f.picked.squeeze(1);  // one id a token
  return {kept_per_token(f.sum_s / static_cast<double>(vocab), t, hidden),
          picked.ge(f.max).logical_and(picked.gt(f.max_before)).logical_and(t.token_counted).view(ids.sizes()),
          kept_per_token(at::log(f.sum_exp2) - 2 * at::log(f.sum_exp), t, hidden)};
}

TokenLogprobs token_logprobs_kernel(TORCH_OFFLOAD_TOKEN_LOGPROBS_ARGS) {
  auto [logprobs, entropies, lse] = token_logprobs_forward_kernel(hidden, weight, ids, bias, temperature, entropy,
                                                                  softcap, logit_scale, ignore_index);
  return {logprobs, entropies};
}

TokenLogprobsGradients token_logprobs_backward_kernel(TORCH_OFFLOAD_TOKEN_LOGPROBS_BACKWARD_ARGS) {
  const char* op = "token_logprobs_backward";
  const at::Tensor b = value_or_undefined(bias);
  const Scoring scoring{temperature, softcap, logit_scale, ignore_index};
  check_arguments(op, hidden, weight, ids, b, scoring, /*takes_several=*/true);
  const auto dtype = hidden.scalar_type();
  const auto acc_type = at::toOpMathType(dtype);
  const auto acc = hidden.options().dtype(acc_type);
  check_lse(op, lse, hidden);
  const at::Tensor a = value_or_undefined(grad_logprobs), g = value_or_undefined(grad_entropy);
  const at::Tensor h_values = value_or_undefined(entropy);
  if (a.defined()) {
    check_tensor(op, "grad_logprobs", a, hidden, "hidden", a.scalar_type(), ids.sym_sizes(), "ids' shape");
  }
  if (g.defined()) {
    check_tensor(op, "grad_entropy", g, hidden, "hidden", g.scalar_type(), token_shape(hidden),
                 "hidden's shape without h");
    TORCH_CHECK(h_values.defined(), op, ": grad_entropy is given without entropy; expected the forward's entropies");
    check_tensor(op, "entropy", h_values, hidden, "hidden", acc_type, token_shape(hidden), "hidden's shape without h");
  }
  const Tiles t(op, hidden, weight, ids, ignore_index);
  HeadGradients gradients(t.hidden, hidden.sizes(), weight, b.defined(), output_mask, t.rows);

  if (t.tokens > 0 && t.vocab > 0 && (a.defined() || g.defined()) && gradients.any()) {
    // The ignored ids' (and tokens') upstream gradients count as 0.
    const at::Tensor a_flat =
        a.defined() ? a.reshape(t.ids.sizes()).to(acc_type).masked_fill(t.counted.logical_not(), 0) : at::Tensor();
    const at::Tensor g_flat =
        g.defined() ? g.reshape({t.tokens}).to(acc_type).masked_fill(t.token_counted.logical_not(), 0) : at::Tensor();
    const at::Tensor h_flat = g.defined() ? h_values.reshape({-1}) : at::Tensor();
    const at::Tensor buffer = at::empty({t.rows * t.cols}, acc);
    const at::Tensor zero = at::zeros({}, acc);
    // log p = (s - lse_high) - lse_low: lse's float64 split in two of the accumulation type, so that s - lse_high
    // is exact where p is not negligible (two close floats) and log p is as good as eager's s - m - log S.
    const at::Tensor lse_high = lse.to(acc_type), lse_low = (lse - lse_high.to(at::kDouble)).to(acc_type);
    for (int64_t start = 0; start < t.tokens; start += t.rows) {
      const int64_t rows = std::min(t.rows, t.tokens - start);
      const at::Tensor hidden_tile = t.hidden.narrow(0, start, rows), ids_tile = t.ids.narrow(0, start, rows);
      const at::Tensor lse_high_tile = lse_high.narrow(0, start, rows).unsqueeze(1);
      const at::Tensor lse_low_tile = lse_low.narrow(0, start, rows).unsqueeze(1);
      gradients.begin_token_tile(start, rows);
      for (int64_t col0 = 0; col0 < t.vocab; col0 += t.cols) {
        const int64_t cols = std::min(t.cols, t.vocab - col0);
        at::Tensor s = tile_scores(buffer, hidden_tile, weight, b, col0, cols, scoring);
        // A softcap's gradient reads s again; otherwise log p takes its place.
        const at::Tensor log_p = (scoring.softcap > 0.0 ? s - lse_high_tile : s.sub_(lse_high_tile)).sub_(lse_low_tile);
        const at::Tensor p = at::exp(log_p);
        at::Tensor d_s;
        if (a.defined()) {
          const at::Tensor a_tile = a_flat.narrow(0, start, rows);
          d_s = p * a_tile.sum(1, /*keepdim=*/true).neg();
          const auto [in_tile, column] = ids_in_tile(ids_tile, col0, cols);
          d_s.scatter_add_(1, column, at::where(in_tile, a_tile, zero));
        }
        if (g.defined()) {
          // p log p is 0 where p is (a masked logit's log p is -inf).
          const at::Tensor h_tile = h_flat.narrow(0, start, rows).unsqueeze(1);
          const at::Tensor term =
              g_flat.narrow(0, start, rows).unsqueeze(1) * at::where(p.gt(0), p * (log_p + h_tile), zero);
          d_s = d_s.defined() ? d_s.sub_(term) : term.neg_();
        }
        scoring.to_logits_gradient(d_s, s);
        gradients.add(d_s, col0);
      }
      gradients.end_token_tile();
    }
  }
  return gradients.gradients();
}

// Meta: the same checks (on symbolic shapes), then results shaped like the real ones.
TokenLogprobsForward token_logprobs_forward_meta(TORCH_OFFLOAD_TOKEN_LOGPROBS_ARGS) {
  check_arguments("token_logprobs", hidden, weight, ids, value_or_undefined(bias),
                  {temperature, softcap, logit_scale, ignore_index}, /*takes_several=*/true);
  const auto acc = hidden.options().dtype(at::toOpMathType(hidden.scalar_type()));
  return {at::empty_symint(ids.sym_sizes(), acc),
          entropy ? at::empty_symint(token_shape(hidden), acc) : at::empty({0}, acc),
          at::empty_symint({token_count(hidden)}, acc.dtype(at::kDouble))};
}

TokenLogprobs token_logprobs_meta(TORCH_OFFLOAD_TOKEN_LOGPROBS_ARGS) {
  auto [logprobs, entropies, lse] =
      token_logprobs_forward_meta(hidden, weight, ids, bias, temperature, entropy, softcap, logit_scale, ignore_index);
  return {logprobs, entropies};
}

TokenLogprobSummaries token_logprob_summaries_meta(TORCH_OFFLOAD_TOKEN_LOGPROB_SUMMARIES_ARGS) {
  check_arguments("token_logprob_summaries", hidden, weight, ids, value_or_undefined(bias),
                  {temperature, softcap, logit_scale, ignore_index}, /*takes_several=*/false);
  const auto acc = hidden.options().dtype(at::toOpMathType(hidden.scalar_type()));
  return {at::empty_symint(ids.sym_sizes(), acc), at::empty_symint(ids.sym_sizes(), acc.dtype(at::kBool)),
          at::empty_symint(ids.sym_sizes(), acc)};
}

TokenLogprobsGradients token_logprobs_backward_meta(TORCH_OFFLOAD_TOKEN_LOGPROBS_BACKWARD_ARGS) {
  const char* op = "token_logprobs_backward";
  const at::Tensor b = value_or_undefined(bias);
  check_arguments(op, hidden, weight, ids, b, {temperature, softcap, logit_scale, ignore_index},
                  /*takes_several=*/true);
  check_lse(op, lse, hidden);
  (void)grad_logprobs, (void)grad_entropy, (void)entropy;
  const auto like = [](bool want, const at::Tensor& x) {
    return want && x.defined() ? at::empty_symint(x.sym_sizes(), x.options()) : at::Tensor();
  };
  return {like(output_mask[0], hidden), like(output_mask[1], weight), like(output_mask[2], b)};
}

}  // namespace torch_offload
