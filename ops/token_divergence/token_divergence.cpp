// The tiling loops of token_divergence. Per token, with the student's scores zs and the teacher's zt over the
// vocabulary (LogitScores: cap(logit_scale * logits) / temperature), log p_s = zs - lse_s, log p_t = zt - lse_t:
//   beta = 0: D = KL(p_t || p_s) = sum p_t (zt - zs) - lse_t + lse_s,
//   beta = 1: D = KL(p_s || p_t) = sum p_s (zs - zt) - lse_s + lse_t,
//   else, log m = logaddexp(log p_s + log(1 - beta), log p_t + log beta),
//        D = beta sum p_t (log p_t - log m) + (1 - beta) K, K = KL(p_s || m) = sum p_s (log p_s - log m).
// The first pass folds tile by tile each model's running max M, S = sum exp(z - M) and, for the two KLs, the
// exp-weighted sum of zt - zs (or zs - zt), and the student's Q = sum exp(zs - M)(zs - M) for its entropy
// log S - Q / S; the JSD takes a second pass, which needs both normalizers. The gradient by zs (d/dzs_j):
//   beta = 0: p_s - p_t;  beta = 1: p_s (log p_s - log p_t - D);  else (1 - beta) p_s (log p_s - log m - K),
// which backward recomputes tile by tile from the forward's lse_s, lse_t and D (or K). The teacher's tensors are
// constants. Elementwise work is ATen's on [rows, cols] tiles, so every device runs the same code; only the GEMMs
// touch the [V, h] weights.
#include "ops/token_divergence/token_divergence.h"

#include <cmath>
#include <limits>
#include <vector>

#include <ATen/OpMathType.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/full.h>
#include <ATen/ops/log.h>
#include <ATen/ops/logaddexp.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/ones.h>
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
constexpr LmHeadNames kStudent{"student_hidden", "student_weight", "student_bias"};
constexpr LmHeadNames kTeacher{"teacher_hidden", "teacher_weight", "teacher_bias"};

enum class Divergence { kForwardKl, kReverseKl, kJsd };

// The op's settings, as its schema takes them.
struct Settings {
  double beta;
  LogitScores student, teacher;
  int64_t ignore_index;

  // From the op's arguments, in the schema's order.
  static Settings of(double beta, double temperature, double student_softcap, double student_logit_scale,
                     double teacher_softcap, double teacher_logit_scale, int64_t ignore_index) {
    return {beta,
            {temperature, student_softcap, student_logit_scale},
            {temperature, teacher_softcap, teacher_logit_scale},
            ignore_index};
  }
  Divergence divergence() const {
    return beta == 0.0 ? Divergence::kForwardKl : beta == 1.0 ? Divergence::kReverseKl : Divergence::kJsd;
  }
};

// Every argument; works on symbolic shapes.
void check_arguments(const char* op, const at::Tensor& student_hidden, const at::Tensor& student_weight,
                     const at::Tensor& student_bias, const at::Tensor& teacher_hidden, const at::Tensor& teacher_weight,
                     const at::Tensor& teacher_bias, const at::Tensor& labels, const Settings& settings) {
  check_lm_head(op, student_hidden, student_weight, student_bias, kStudent);
  // The teacher's hidden states: the student's tokens and dtype, a width of their own.
  check_defined(teacher_hidden, op, "teacher_hidden");
  const c10::SymIntArrayRef leading = student_hidden.sym_sizes().slice(0, student_hidden.dim() - 1);
  std::vector<c10::SymInt> teacher_shape(leading.begin(), leading.end());
  teacher_shape.push_back(teacher_hidden.dim() >= 1 ? teacher_hidden.sym_size(-1) : c10::SymInt(0));
  check_tensor(op, "teacher_hidden", teacher_hidden, student_hidden, "student_hidden", student_hidden.scalar_type(),
               teacher_shape, "student_hidden's shape but its last dimension");
  check_lm_head(op, teacher_hidden, teacher_weight, teacher_bias, kTeacher);
  TORCH_CHECK(teacher_weight.sym_size(0) == student_weight.sym_size(0), op, ": teacher_weight has ",
              teacher_weight.sym_size(0), " rows and student_weight ", student_weight.sym_size(0),
              "; expected one vocabulary for both");
  if (labels.defined()) {
    TORCH_CHECK(labels.scalar_type() == at::kLong || labels.scalar_type() == at::kInt, op, ": labels has dtype ",
                labels.scalar_type(), "; expected int64 (or int32) token ids");
    check_tensor(op, "labels", labels, student_hidden, "student_hidden", labels.scalar_type(),
                 student_hidden.sym_sizes().slice(0, student_hidden.dim() - 1), "student_hidden's shape without h");
  }
  TORCH_CHECK(settings.beta >= 0.0 && settings.beta <= 1.0, op, ": beta is ", settings.beta,
              "; expected a value in [0, 1] (0: forward KL, 1: reverse KL)");
  settings.student.check(op, "student_");
  settings.teacher.check(op, "teacher_");
}

// The problem flattened: both hiddens [T, h] contiguous, which tokens count, and the tile shape.
struct Tiles {
  at::Tensor student, teacher, counted;
  int64_t tokens, vocab, rows, cols;

  Tiles(const at::Tensor& student_hidden, const at::Tensor& teacher_hidden, const at::Tensor& weight,
        const at::Tensor& labels, int64_t ignore_index)
      : student(token_rows(student_hidden)), teacher(token_rows(teacher_hidden)) {
    tokens = student.size(0);
    vocab = weight.size(0);
    const auto tile = linear_cross_entropy_tile_kernel(tokens, vocab, student.scalar_type());
    rows = tile[0];
    cols = tile[1];
    counted = labels.defined() ? labels.reshape({-1}).ne(ignore_index)
                               : at::ones({tokens}, student.options().dtype(at::kBool));
  }
};

// One model's online log-sum-exp over the vocabulary, folded tile by tile per token: max M, S = sum exp(z - M),
// and where asked the exp-weighted sum of a term (z's own z - M for the entropy, or the gap to the other model).
struct RunningSoftmax {
  at::Tensor max, sum_exp, shifted_sum, gap_sum;

  // The tile's scores z [rows, cols]; gap [rows, cols] or undefined. A row whose every z so far is -inf (a bias
  // masking the vocabulary) keeps M = -inf and S = 0.
  void fold(const at::Tensor& z, const at::Tensor& gap, const at::Tensor& zero) {
    const at::Tensor new_max = at::maximum(max, std::get<0>(z.max(1)));
    const at::Tensor reference = at::where(new_max.eq(-kInf), zero, new_max);
    const at::Tensor rescale = at::exp(max - reference);
    const at::Tensor shifted = z - reference.unsqueeze(1);
    const at::Tensor e = at::exp(shifted);
    const at::Tensor live = e.gt(0);
    if (shifted_sum.defined()) {
      // Q relative to the new max: exp(M - M') (Q + S (M - M')); nothing where S is still 0.
      const at::Tensor carried = at::where(sum_exp.gt(0), rescale * (shifted_sum + sum_exp * (max - reference)), zero);
      shifted_sum.copy_(carried + at::where(live, e * shifted, zero).sum(1));
    }
    if (gap.defined()) {
      gap_sum.copy_(gap_sum * rescale + at::where(live, e * gap, zero).sum(1));
    }
    sum_exp.copy_(sum_exp * rescale + e.sum(1));
    max.copy_(new_max);
  }
  at::Tensor lse() const { return max + at::log(sum_exp); }
};

// log m for the JSD's mixture m = (1 - beta) p_s + beta p_t.
at::Tensor log_mixture(const at::Tensor& log_ps, const at::Tensor& log_pt, double beta) {
  return at::logaddexp(log_ps + std::log1p(-beta), log_pt + std::log(beta));
}

// x where y > 0, else 0: p log(p / q) is 0 where p is (a masked logit's log p is -inf).
at::Tensor where_positive(const at::Tensor& y, const at::Tensor& x, const at::Tensor& zero) {
  return at::where(y.gt(0), x, zero);
}

// The tokens of hidden [..., h], h possibly 0.
c10::SymInt token_count(const at::Tensor& hidden) {
  c10::SymInt tokens = 1;
  for (const c10::SymInt& size : hidden.sym_sizes().slice(0, hidden.dim() - 1)) {
    tokens *= size;
  }
  return tokens;
}

at::Tensor kept(const at::Tensor& x, const Tiles& t, const at::IntArrayRef shape) {
  return x.masked_fill(t.counted.logical_not(), 0).view(shape);
}

}  // namespace

TokenDivergenceForward token_divergence_forward_kernel(TORCH_OFFLOAD_TOKEN_DIVERGENCE_ARGS) {
  const char* op = "token_divergence";
  const Settings settings = Settings::of(beta, temperature, student_softcap, student_logit_scale, teacher_softcap,
                                         teacher_logit_scale, ignore_index);
  const at::Tensor sb = value_or_undefined(student_bias), tb = value_or_undefined(teacher_bias);
  const at::Tensor l = value_or_undefined(labels);
  check_arguments(op, student_hidden, student_weight, sb, teacher_hidden, teacher_weight, tb, l, settings);
  const Tiles t(student_hidden, teacher_hidden, student_weight, l, ignore_index);
  const auto acc = student_hidden.options().dtype(at::toOpMathType(student_hidden.scalar_type()));
  const Divergence divergence = settings.divergence();
  const auto zeros = [&] { return at::zeros({t.tokens}, acc); };
  const auto undefined_unless = [&](bool want) { return want ? zeros() : at::Tensor(); };
  RunningSoftmax s{at::full({t.tokens}, -kInf, acc), zeros(), zeros(),
                   undefined_unless(divergence == Divergence::kReverseKl)};
  RunningSoftmax u{at::full({t.tokens}, -kInf, acc), zeros(), at::Tensor(),
                   undefined_unless(divergence == Divergence::kForwardKl)};
  at::Tensor jsd = undefined_unless(divergence == Divergence::kJsd), kl_student = jsd.defined() ? zeros() : jsd;
  if (t.tokens > 0 && t.vocab > 0) {
    const at::Tensor student_buffer = at::empty({t.rows * t.cols}, acc),
                     teacher_buffer = at::empty_like(student_buffer);
    const at::Tensor zero = at::zeros({}, acc);
    for (int64_t start = 0; start < t.tokens; start += t.rows) {
      const int64_t rows = std::min(t.rows, t.tokens - start);
      const at::Tensor student_tile = t.student.narrow(0, start, rows), teacher_tile = t.teacher.narrow(0, start, rows);
      const auto part = [&](const RunningSoftmax& r) {
        const auto narrow = [&](const at::Tensor& x) { return x.defined() ? x.narrow(0, start, rows) : x; };
        return RunningSoftmax{narrow(r.max), narrow(r.sum_exp), narrow(r.shifted_sum), narrow(r.gap_sum)};
      };
      RunningSoftmax s_rows = part(s), u_rows = part(u);
      const auto scores = [&](int64_t col0, int64_t cols) {
        return std::pair{tile_scores(student_buffer, student_tile, student_weight, sb, col0, cols, settings.student),
                         tile_scores(teacher_buffer, teacher_tile, teacher_weight, tb, col0, cols, settings.teacher)};
      };
      for (int64_t col0 = 0; col0 < t.vocab; col0 += t.cols) {
        const int64_t cols = std::min(t.cols, t.vocab - col0);
        const auto [zs, zt] = scores(col0, cols);
        s_rows.fold(zs, divergence == Divergence::kReverseKl ? zs - zt : at::Tensor(), zero);
        u_rows.fold(zt, divergence == Divergence::kForwardKl ? zt - zs : at::Tensor(), zero);
      }
      if (divergence != Divergence::kJsd) {
        continue;
      }
      const at::Tensor lse_s = s_rows.lse().unsqueeze(1), lse_t = u_rows.lse().unsqueeze(1);
      for (int64_t col0 = 0; col0 < t.vocab; col0 += t.cols) {
        const int64_t cols = std::min(t.cols, t.vocab - col0);
        const auto [zs, zt] = scores(col0, cols);
        const at::Tensor log_ps = zs - lse_s, log_pt = zt - lse_t;
        const at::Tensor log_m = log_mixture(log_ps, log_pt, beta);
        const at::Tensor ps = at::exp(log_ps), pt = at::exp(log_pt);
        const at::Tensor kl_s = where_positive(ps, ps * (log_ps - log_m), zero);
        const at::Tensor kl_t = where_positive(pt, pt * (log_pt - log_m), zero);
        jsd.narrow(0, start, rows).add_((kl_t * beta + kl_s * (1.0 - beta)).sum(1));
        kl_student.narrow(0, start, rows).add_(kl_s.sum(1));
      }
    }
  }
  const at::Tensor lse_s = s.lse(), lse_t = u.lse();
  at::Tensor raw, aux;
  switch (divergence) {
    case Divergence::kForwardKl:
      raw = u.gap_sum / u.sum_exp - lse_t + lse_s;
      aux = raw;
      break;
    case Divergence::kReverseKl:
      raw = s.gap_sum / s.sum_exp - lse_s + lse_t;
      aux = raw;
      break;
    case Divergence::kJsd:
      raw = jsd;
      aux = kl_student;
      break;
  }
  const at::IntArrayRef shape = student_hidden.sizes().slice(0, student_hidden.dim() - 1);
  const at::Tensor entropy = at::log(s.sum_exp) - s.shifted_sum / s.sum_exp;
  return {kept(raw, t, shape), kept(entropy, t, shape), lse_s, lse_t, aux};
}

TokenDivergence token_divergence_kernel(TORCH_OFFLOAD_TOKEN_DIVERGENCE_ARGS) {
  auto [divergence, entropy, lse_s, lse_t, aux] = token_divergence_forward_kernel(
      student_hidden, student_weight, teacher_hidden, teacher_weight, student_bias, teacher_bias, labels, beta,
      temperature, student_softcap, student_logit_scale, teacher_softcap, teacher_logit_scale, ignore_index);
  return {divergence, entropy};
}

TokenDivergenceGradients token_divergence_backward_kernel(TORCH_OFFLOAD_TOKEN_DIVERGENCE_BACKWARD_ARGS) {
  const char* op = "token_divergence_backward";
  const Settings settings = Settings::of(beta, temperature, student_softcap, student_logit_scale, teacher_softcap,
                                         teacher_logit_scale, ignore_index);
  const at::Tensor sb = value_or_undefined(student_bias), tb = value_or_undefined(teacher_bias);
  const at::Tensor l = value_or_undefined(labels);
  check_arguments(op, student_hidden, student_weight, sb, teacher_hidden, teacher_weight, tb, l, settings);
  const auto dtype = student_hidden.scalar_type();
  const auto acc_type = at::toOpMathType(dtype);
  const auto acc = student_hidden.options().dtype(acc_type);
  const c10::SymInt tokens = token_count(student_hidden);
  for (const auto& [name, x] : {std::pair{"student_lse", student_lse}, {"teacher_lse", teacher_lse}, {"aux", aux}}) {
    check_tensor(op, name, x, student_hidden, "student_hidden", acc_type, {tokens}, "[tokens]");
  }
  check_tensor(op, "grad_divergence", grad_divergence, student_hidden, "student_hidden", grad_divergence.scalar_type(),
               student_hidden.sym_sizes().slice(0, student_hidden.dim() - 1), "student_hidden's shape without h");
  const Tiles t(student_hidden, teacher_hidden, student_weight, l, ignore_index);
  HeadGradients gradients(t.student, student_hidden.sizes(), student_weight, sb.defined(), output_mask, t.rows);

  if (t.tokens > 0 && t.vocab > 0 && gradients.any()) {
    const Divergence divergence = settings.divergence();
    // The ignored tokens' upstream gradients count as 0.
    const at::Tensor upstream = grad_divergence.reshape({-1}).to(acc_type).masked_fill(t.counted.logical_not(), 0);
    const at::Tensor student_buffer = at::empty({t.rows * t.cols}, acc),
                     teacher_buffer = at::empty_like(student_buffer);
    const at::Tensor zero = at::zeros({}, acc);
    for (int64_t start = 0; start < t.tokens; start += t.rows) {
      const int64_t rows = std::min(t.rows, t.tokens - start);
      const at::Tensor student_tile = t.student.narrow(0, start, rows), teacher_tile = t.teacher.narrow(0, start, rows);
      const auto column = [&](const at::Tensor& x) { return x.narrow(0, start, rows).unsqueeze(1); };
      const at::Tensor lse_s = column(student_lse), lse_t = column(teacher_lse), aux_rows = column(aux);
      const at::Tensor upstream_rows = column(upstream);
      gradients.begin_token_tile(start, rows);
      for (int64_t col0 = 0; col0 < t.vocab; col0 += t.cols) {
        const int64_t cols = std::min(t.cols, t.vocab - col0);
        const at::Tensor zs =
            tile_scores(student_buffer, student_tile, student_weight, sb, col0, cols, settings.student);
        const at::Tensor zt =
            tile_scores(teacher_buffer, teacher_tile, teacher_weight, tb, col0, cols, settings.teacher);
        const at::Tensor log_ps = zs - lse_s, log_pt = zt.sub_(lse_t);
        const at::Tensor ps = at::exp(log_ps);
        at::Tensor d_s;
        switch (divergence) {
          case Divergence::kForwardKl:
            d_s = ps - at::exp(log_pt);
            break;
          case Divergence::kReverseKl:
            d_s = where_positive(ps, ps * (log_ps - log_pt - aux_rows), zero);
            break;
          case Divergence::kJsd:
            d_s =
                where_positive(ps, ps * (log_ps - log_mixture(log_ps, log_pt, beta) - aux_rows), zero).mul_(1.0 - beta);
            break;
        }
        d_s.mul_(upstream_rows);
        settings.student.to_logits_gradient(d_s, zs);
        gradients.add(d_s, col0);
      }
      gradients.end_token_tile();
    }
  }
  return gradients.gradients();
}

// Meta: the same checks (on symbolic shapes), then results shaped like the real ones.
TokenDivergenceForward token_divergence_forward_meta(TORCH_OFFLOAD_TOKEN_DIVERGENCE_ARGS) {
  const Settings settings = Settings::of(beta, temperature, student_softcap, student_logit_scale, teacher_softcap,
                                         teacher_logit_scale, ignore_index);
  check_arguments("token_divergence", student_hidden, student_weight, value_or_undefined(student_bias), teacher_hidden,
                  teacher_weight, value_or_undefined(teacher_bias), value_or_undefined(labels), settings);
  const auto acc = student_hidden.options().dtype(at::toOpMathType(student_hidden.scalar_type()));
  const c10::SymIntArrayRef shape = student_hidden.sym_sizes().slice(0, student_hidden.dim() - 1);
  const c10::SymInt tokens = token_count(student_hidden);
  return {at::empty_symint(shape, acc), at::empty_symint(shape, acc), at::empty_symint({tokens}, acc),
          at::empty_symint({tokens}, acc), at::empty_symint({tokens}, acc)};
}

TokenDivergence token_divergence_meta(TORCH_OFFLOAD_TOKEN_DIVERGENCE_ARGS) {
  auto [divergence, entropy, lse_s, lse_t, aux] = token_divergence_forward_meta(
      student_hidden, student_weight, teacher_hidden, teacher_weight, student_bias, teacher_bias, labels, beta,
      temperature, student_softcap, student_logit_scale, teacher_softcap, teacher_logit_scale, ignore_index);
  return {divergence, entropy};
}

TokenDivergenceGradients token_divergence_backward_meta(TORCH_OFFLOAD_TOKEN_DIVERGENCE_BACKWARD_ARGS) {
  const Settings settings = Settings::of(beta, temperature, student_softcap, student_logit_scale, teacher_softcap,
                                         teacher_logit_scale, ignore_index);
  const at::Tensor sb = value_or_undefined(student_bias);
  check_arguments("token_divergence_backward", student_hidden, student_weight, sb, teacher_hidden, teacher_weight,
                  value_or_undefined(teacher_bias), value_or_undefined(labels), settings);
  (void)grad_divergence, (void)student_lse, (void)teacher_lse, (void)aux;
  const auto like = [](bool want, const at::Tensor& x) {
    return want && x.defined() ? at::empty_symint(x.sym_sizes(), x.options()) : at::Tensor();
  };
  return {like(output_mask[0], student_hidden), like(output_mask[1], student_weight), like(output_mask[2], sb)};
}

}  // namespace torch_offload
