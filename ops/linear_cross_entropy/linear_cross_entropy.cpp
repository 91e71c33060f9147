// The tiling loops of linear_cross_entropy, the same on every device: GEMMs through
// ATen into one reused buffer ([tile_tokens, tile_vocab] for the recompute path, a
// whole-vocabulary slab for gradients in forward), the per-tile elementwise steps by
// the device's fused kernels, per-token bookkeeping by ATen on [tokens] vectors.
#include "ops/linear_cross_entropy/linear_cross_entropy.h"

#include <algorithm>
#include <limits>
#include <string>

#include <ATen/OpMathType.h>
#include <ATen/TensorOperators.h>
#include <ATen/Version.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/log.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/nonzero.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/sub.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <c10/core/SymBool.h>
#include <c10/util/Exception.h>

#include "ops/common/checks.h"
#include "ops/common/gemm.h"

namespace torch_offload {

// The automatic tile. Token tiles hold up to kMaxTileTokens tokens (the GEMMs'
// shared dimension for the weight gradient: fewer tokens re-read the weight and its
// gradient more often); vocabulary tiles then fill the logits buffer's byte budget,
// between kMinTileVocab and kMaxTileVocab columns, so no tile spans a large
// vocabulary. Both split their extent evenly. Depends only on the shapes and the
// dtype, so every rank with the same shapes agrees.
constexpr int64_t kTileBytes = int64_t{8} << 20;
constexpr int64_t kMaxTileTokens = 1024;
constexpr int64_t kMinTileVocab = 256;
constexpr int64_t kMaxTileVocab = 4096;
// The 3-GEMM path (linear_cross_entropy_with_gradients): each tile of tokens has its logits over the whole
// vocabulary in one reused slab (kSlabBytes or kMinSlabTokens rows), which forward turns into d loss / d logits on the
// spot; the gradients' GEMMs read it there, so backward needs no second logits GEMM. A slab has room for at
// least kMinSlabTokens rows (the budget grows with the vocabulary, never with the tokens): the weight gradient,
// [V, h], is read and written once per slab, and 128-row slabs at V = 128K took 1.15x CCE's time.
constexpr int64_t kSlabBytes = int64_t{64} << 20;
constexpr int64_t kMinSlabTokens = 512;
// Statistics (entropy, accuracy) read each tile's logits a second time through a scratch buffer of at most this
// many bytes (or one row of the tile, if larger), in blocks of whole rows.
constexpr int64_t kStatisticsScratchBytes = int64_t{8} << 20;

namespace {

// The part size when `extent` is split into equal parts of at most `most` (1 for no extent).
int64_t even_split(int64_t extent, int64_t most) {
  if (extent <= 0) {
    return 1;
  }
  const int64_t parts = (extent + most - 1) / most;
  return (extent + parts - 1) / parts;
}

}  // namespace

std::vector<int64_t> linear_cross_entropy_tile_kernel(int64_t tokens, int64_t vocab, c10::ScalarType dtype) {
  TORCH_CHECK(tokens >= 0 && vocab >= 0, "linear_cross_entropy_tile: tokens is ", tokens, " and vocab is ", vocab,
              "; expected sizes >= 0");
  const int64_t tile_tokens = even_split(tokens, kMaxTileTokens);
  const int64_t budget_vocab = std::clamp(kTileBytes / (tile_tokens * static_cast<int64_t>(c10::elementSize(dtype))),
                                          kMinTileVocab, kMaxTileVocab);
  return {tile_tokens, even_split(vocab, budget_vocab)};
}

void check_lm_head(const char* op, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                   const LmHeadNames& names) {
  check_defined(hidden, op, names.hidden);
  const auto dtype = hidden.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf, op, ": ",
              names.hidden, " has dtype ", dtype, "; expected float32, float64, bfloat16 or float16");
  TORCH_CHECK(hidden.dim() >= 1, op, ": ", names.hidden, " is a 0-d tensor; expected [..., h]");
  check_defined(weight, op, names.weight);
  TORCH_CHECK(weight.dim() == 2, op, ": ", names.weight, " has shape ", weight.sym_sizes(), "; expected [V, h]");
  const c10::SymInt vocab = weight.sym_size(0);
  check_tensor(op, names.weight, weight, hidden, names.hidden, dtype, {vocab, hidden.sym_size(-1)}, "[V, h]");
  if (bias.defined()) {
    check_tensor(op, names.bias, bias, hidden, names.hidden, dtype, {vocab}, "[V]");
  }
}

namespace {

enum class Reduction { kMean, kSum, kNone };

Reduction parse_reduction(std::string_view name, const char* op) {
  if (name == "mean") {
    return Reduction::kMean;
  }
  if (name == "sum") {
    return Reduction::kSum;
  }
  TORCH_CHECK(name == "none", op, ": reduction is '", name, "'; expected one of mean, sum, none");
  return Reduction::kNone;
}

// Every argument against hidden [..., h] and weight [V, h]; works on symbolic shapes.
Reduction check_arguments(const char* op, const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& bias,
                          const at::Tensor& target, double label_smoothing, double softcap, double z_loss,
                          std::string_view reduction) {
  const Reduction parsed = parse_reduction(reduction, op);
  check_lm_head(op, hidden, weight, bias);
  check_defined(target, op, "target");
  TORCH_CHECK(target.scalar_type() == at::kLong || target.scalar_type() == at::kInt, op, ": target has dtype ",
              target.scalar_type(), "; expected int64 (or int32) class indices");
  check_tensor(op, "target", target, hidden, "hidden", target.scalar_type(),
               hidden.sym_sizes().slice(0, hidden.dim() - 1), "hidden's shape without h");
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, op, ": label_smoothing is ", label_smoothing,
              "; expected a value in [0, 1]");
  TORCH_CHECK(softcap >= 0.0 && softcap < std::numeric_limits<double>::infinity(), op, ": softcap is ", softcap,
              "; expected a finite value >= 0 (0: no softcap)");
  TORCH_CHECK(z_loss >= 0.0 && z_loss < std::numeric_limits<double>::infinity(), op, ": z_loss is ", z_loss,
              "; expected a finite value >= 0");
  return parsed;
}

// A target outside [0, V) that is not ignore_index would index no logit: an error
// naming the value, before any work (on CUDA this waits for the check's result).
void check_target_values(const char* op, const at::Tensor& target, int64_t vocab, int64_t ignore_index) {
  check_not_capturing(op, target.device(), "it reads the target on the host to check its values");
  const at::Tensor bad = target.ne(ignore_index).logical_and(target.lt(0).logical_or(target.ge(vocab)));
  if (bad.any().item<bool>()) {
    const int64_t index = at::nonzero(bad)[0][0].item<int64_t>();
    TORCH_CHECK(false, op, ": target holds ", target[index].item<int64_t>(), " at (flattened) index ", index,
                "; expected class indices in [0, ", vocab, ") or ignore_index (", ignore_index, ")");
  }
}

// Tokens of a tile and vocabulary columns of a tile: explicit (> 0) or automatic.
std::pair<int64_t, int64_t> tile_shape(int64_t tokens, int64_t vocab, c10::ScalarType dtype,
                                       const c10::SymInt& tile_tokens, const c10::SymInt& tile_vocab) {
  const std::vector<int64_t> automatic = linear_cross_entropy_tile_kernel(tokens, vocab, dtype);
  const int64_t rows = tile_tokens.expect_int();
  const int64_t cols = tile_vocab.expect_int();
  return {rows > 0 ? std::min(rows, std::max<int64_t>(tokens, 1)) : automatic[0],
          cols > 0 ? std::min(cols, std::max<int64_t>(vocab, 1)) : automatic[1]};
}

// The flattened problem: hidden [T, h] contiguous, target [T] int64.
struct Flat {
  at::Tensor hidden, target;
  int64_t tokens, vocab;
};

Flat flatten(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& target) {
  Flat f;
  f.hidden = token_rows(hidden);
  f.target = target.reshape({-1}).to(at::kLong).contiguous();
  f.tokens = f.target.size(0);
  f.vocab = weight.size(0);
  return f;
}

// The dtype of the logits' tiles: float32 for bf16/fp16 inputs on every device, so that the GEMMs' products stay
// unrounded through bias, soft-cap and the loss (Cut Cross-Entropy's criterion; rounding each logit, and a capped
// one again, failed it). CUDA's GEMM writes them from bf16/fp16 operands in one call (linear_into_accumulator).
c10::ScalarType logits_dtype(const at::Tensor& hidden) {
  return at::toOpMathType(hidden.scalar_type());
}

// A [rows, cols] contiguous view at the start of the flat tile buffer.
at::Tensor tile_view(const at::Tensor& buffer, int64_t rows, int64_t cols) {
  return buffer.narrow(0, 0, rows * cols).view({rows, cols});
}

at::Tensor narrow_or_undefined(const at::Tensor& t, int64_t start, int64_t length) {
  return t.defined() ? t.narrow(0, start, length) : t;
}

// The 3-GEMM path's slab of logits over the whole vocabulary, in `slab_dtype`: at most kSlabBytes or
// kMinSlabTokens rows, whichever is more, its token rows split evenly; tile_tokens rows when fewer.
int64_t slab_tokens(int64_t tokens, int64_t vocab, c10::ScalarType slab_dtype, const c10::SymInt& tile_tokens) {
  const int64_t row_bytes = std::max<int64_t>(vocab, 1) * static_cast<int64_t>(c10::elementSize(slab_dtype));
  const int64_t budget_rows = even_split(tokens, std::max(kSlabBytes / row_bytes, kMinSlabTokens));
  const int64_t asked = tile_tokens.expect_int();
  return asked > 0 ? std::min(asked, budget_rows) : budget_rows;
}

// What linear_cross_entropy_with_gradients computes: a scalar loss, without softcap (the forward kernel
// leaves the capped logits in the slab, where the backward kernel expects raw ones).
void check_gradients_in_forward_apply(const char* op, Reduction parsed, double softcap) {
  TORCH_CHECK_VALUE(parsed != Reduction::kNone, op,
                    ": reduction is \"none\"; gradients computed in forward need a scalar loss (\"mean\" or \"sum\")");
  TORCH_CHECK_VALUE(softcap == 0.0, op, ": softcap is ", softcap,
                    "; gradients computed in forward need softcap 0 (the recompute path takes softcap)");
}

// Per token: the running max and sum of exp(z - max), z of the target, sum of z, folded tile by tile. With
// statistics, also the first moment of exp(z - max) about the running max (entropy = log S - moment / S), and the
// largest stored z over the whole row and over the columns before the target's (the target is top-1, as argmax
// picks it, where its z reaches the first and exceeds the second), taken from each tile's z, which the tile
// kernels leave in the buffer, before anything else overwrites them.
struct TokenSums {
  at::Tensor max, sum_exp, target_z, sum_z;
  at::Tensor moment, top, top_before_target, scratch;  // with statistics only; scratch: rows of a tile

  TokenSums(int64_t tokens, const at::TensorOptions& acc_options, bool statistics = false, int64_t tile_rows = 0,
            int64_t tile_cols = 0)
      : max(at::full({tokens}, -std::numeric_limits<double>::infinity(), acc_options)),
        sum_exp(at::zeros({tokens}, acc_options)),
        target_z(at::zeros({tokens}, acc_options)),
        sum_z(at::zeros({tokens}, acc_options)) {
    if (statistics) {
      moment = at::zeros({tokens}, acc_options);
      top = at::full({tokens}, -std::numeric_limits<double>::infinity(), acc_options);
      top_before_target = top.clone();
      const int64_t budget = kStatisticsScratchBytes /
                             static_cast<int64_t>(c10::elementSize(c10::typeMetaToScalarType(acc_options.dtype())));
      scratch = at::empty({std::max(tile_cols, std::min(tile_rows * tile_cols, budget))}, acc_options);
    }
  }
  // Folds a tile of the rows [start, start + logits.size(0)) and columns [col0, col0 + logits.size(1)).
  void fold(const CrossEntropyTileKernels& kernels, const CrossEntropyOptions& options, const at::Tensor& logits,
            const at::Tensor& target_tile, int64_t col0, int64_t start) const {
    const int64_t rows = logits.size(0);
    const at::Tensor max_rows = max.narrow(0, start, rows), sum_exp_rows = sum_exp.narrow(0, start, rows);
    const at::Tensor max_before = moment.defined() ? max_rows.clone() : at::Tensor();
    const at::Tensor sum_exp_before = moment.defined() ? sum_exp_rows.clone() : at::Tensor();
    kernels.forward(options, logits, target_tile, col0, max_rows, sum_exp_rows, target_z.narrow(0, start, rows),
                    sum_z.narrow(0, start, rows));
    if (moment.defined()) {
      fold_statistics(logits, target_tile, col0, start, max_before, sum_exp_before);
    }
  }
  at::Tensor lse() const { return max + at::log(sum_exp); }
  at::Tensor lse(int64_t start, int64_t rows) const {
    return max.narrow(0, start, rows) + at::log(sum_exp.narrow(0, start, rows));
  }
  // Per token, zero where ignored: the z-loss term z_loss * lse^2, whether the target is top-1 (1 or 0), and the
  // entropy of softmax(z). [3, tokens].
  at::Tensor statistics(const at::Tensor& lse, const at::Tensor& valid, double z_loss) const {
    const at::Tensor entropy = at::log(sum_exp) - moment / sum_exp;
    const at::Tensor is_top1 = target_z.ge(top).logical_and(target_z.gt(top_before_target)).to(lse.scalar_type());
    return at::where(valid, at::stack({z_loss * lse * lse, is_top1, entropy}), at::zeros({}, lse.options()));
  }

 private:
  void fold_statistics(const at::Tensor& z, const at::Tensor& target_tile, int64_t col0, int64_t start,
                       const at::Tensor& max_before, const at::Tensor& sum_exp_before) const {
    const int64_t rows = z.size(0), cols = z.size(1);
    const at::Tensor max_now = max.narrow(0, start, rows);
    at::Tensor moment_rows = moment.narrow(0, start, rows);
    // The earlier tiles' moment about the new max: e^(m0 - m) (moment + (m0 - m) S0); none before the first tile.
    const at::Tensor shift = max_before - max_now;
    moment_rows.copy_(at::where(sum_exp_before.gt(0), shift.exp() * (moment_rows + shift * sum_exp_before),
                                at::zeros({}, moment.options())));
    // This tile's sum of e^(z - m) (z - m), as xlogy(e, e): 0 where e underflows or z is -inf. A max still -inf
    // (every z so far -inf) is taken as the lowest finite value, so that those z give e = 0, not nan. In blocks
    // of rows that fit the scratch buffer.
    const double lowest = max_now.scalar_type() == at::kDouble ? std::numeric_limits<double>::lowest()
                                                               : std::numeric_limits<float>::lowest();
    const at::Tensor shifted_max = max_now.clamp_min(lowest).unsqueeze(1);
    const at::Tensor columns = at::arange(col0, col0 + cols, target_tile.options()).unsqueeze(0);
    at::Tensor before_rows = top_before_target.narrow(0, start, rows);
    const int64_t block = std::max<int64_t>(1, scratch.numel() / std::max<int64_t>(cols, 1));
    for (int64_t row = 0; row < rows; row += block) {
      const int64_t n = std::min(block, rows - row);
      const at::Tensor z_block = z.narrow(0, row, n);
      at::Tensor e = scratch.narrow(0, 0, n * cols).view({n, cols});
      at::sub_out(e, z_block, shifted_max.narrow(0, row, n));
      e.exp_().xlogy_(e);
      moment_rows.narrow(0, row, n).add_(e.sum(1));
      // z of the columns before the target's, -inf at and after it.
      e.copy_(z_block).masked_fill_(columns.ge(target_tile.narrow(0, row, n).unsqueeze(1)),
                                    -std::numeric_limits<double>::infinity());
      at::Tensor before_block = before_rows.narrow(0, row, n);
      before_block.copy_(at::maximum(before_block, e.amax(1)));
    }
    at::Tensor top_rows = top.narrow(0, start, rows);
    top_rows.copy_(at::maximum(top_rows, z.amax(1).to(top.scalar_type())));
  }
};

// The loss from the tokens' sums and log-sum-exp: 0 for ignored tokens, then reduced.
at::Tensor reduced_loss(const TokenSums& sums, const at::Tensor& lse, const at::Tensor& valid, Reduction parsed,
                        const CrossEntropyOptions& options, const at::Tensor& target) {
  at::Tensor per_token = lse - (1.0 - options.label_smoothing) * sums.target_z;
  if (options.label_smoothing > 0) {
    per_token -= (options.label_smoothing / static_cast<double>(options.vocab)) * sums.sum_z;
  }
  if (options.z_loss > 0) {
    per_token += options.z_loss * lse * lse;
  }
  per_token = at::where(valid, per_token, at::zeros({}, lse.options()));
  // The loss stays in the accumulation type: float32 for a bf16/fp16 head, as transformers'
  // loss (which upcasts the logits) and F.cross_entropy under autocast.
  switch (parsed) {
    case Reduction::kNone:
      return per_token.view(target.sizes());
    case Reduction::kSum:
      return per_token.sum();
    case Reduction::kMean:
      break;
  }
  // No counted token gives 0 / 0 = nan, as F.cross_entropy.
  return per_token.sum() / valid.sum();
}

}  // namespace

bool gradients_in_forward_by_default(const char* op, const at::Tensor& hidden, double softcap,
                                     std::string_view reduction, double filter_eps,
                                     std::optional<bool> gradients_in_forward) {
  const bool applies = reduction != "none" && filter_eps == 0.0 && softcap == 0.0;
  TORCH_CHECK_VALUE(!gradients_in_forward.value_or(false) || applies, op,
                    ": gradients_in_forward is True with reduction \"", reduction, "\", filter_eps ", filter_eps,
                    " and softcap ", softcap,
                    "; it needs a scalar loss (\"mean\" or \"sum\"), filter_eps 0 and softcap 0");
  const auto dtype = hidden.scalar_type();
  return applies && (dtype == at::kFloat || dtype == at::kDouble || (dtype == at::kBFloat16 && hidden.is_cuda()));
}

void check_filter_eps(const char* op, double filter_eps, double label_smoothing) {
  TORCH_CHECK(filter_eps >= 0.0 && filter_eps < std::numeric_limits<double>::infinity(), op, ": filter_eps is ",
              filter_eps, "; expected a finite value >= 0 (0: no gradient filtering)");
  TORCH_CHECK(filter_eps == 0.0 || label_smoothing == 0.0, op, ": filter_eps is ", filter_eps, " with label_smoothing ",
              label_smoothing,
              "; gradient filtering needs label_smoothing = 0 (smoothing's gradient reaches every logit)");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> reduce_cross_entropy_statistics(const at::Tensor& statistics,
                                                                               const at::Tensor& target,
                                                                               int64_t ignore_index,
                                                                               std::string_view reduction) {
  const Reduction parsed = parse_reduction(reduction, "linear_cross_entropy");
  const auto reduced = [&](int64_t row) {
    const at::Tensor per_token = statistics.select(0, row);
    switch (parsed) {
      case Reduction::kNone:  // a tensor of its own, not a view of the three's buffer
        return per_token.clone().view_symint(target.sym_sizes());
      case Reduction::kSum:
        return per_token.sum();
      case Reduction::kMean:
        break;
    }
    return per_token.sum() / target.ne(ignore_index).sum();  // nan without a counted token, as the loss
  };
  return {reduced(0), reduced(1), reduced(2)};
}

LinearCrossEntropyForward linear_cross_entropy_forward_impl(const CrossEntropyTileKernels& kernels,
                                                            const at::Tensor& hidden, const at::Tensor& weight,
                                                            const std::optional<at::Tensor>& bias_opt,
                                                            const at::Tensor& target, int64_t ignore_index,
                                                            double label_smoothing, double softcap, double z_loss,
                                                            std::string_view reduction, const c10::SymInt& tile_tokens,
                                                            const c10::SymInt& tile_vocab, bool statistics) {
  const char* op = "linear_cross_entropy";
  const at::Tensor bias = value_or_undefined(bias_opt);
  const Reduction parsed =
      check_arguments(op, hidden, weight, bias, target, label_smoothing, softcap, z_loss, reduction);
  const Flat f = flatten(hidden, weight, target);
  check_target_values(op, f.target, f.vocab, ignore_index);
  const auto dtype = hidden.scalar_type();
  const auto acc_options = hidden.options().dtype(at::toOpMathType(dtype));

  const auto [tile_rows, tile_cols] = tile_shape(f.tokens, f.vocab, dtype, tile_tokens, tile_vocab);
  TokenSums sums(f.tokens, acc_options, statistics, tile_rows, tile_cols);
  const CrossEntropyOptions options{softcap, label_smoothing, z_loss, f.vocab, /*filter_eps=*/0.0};
  if (f.tokens > 0 && f.vocab > 0) {
    const at::Tensor buffer = at::empty({tile_rows * tile_cols}, hidden.options().dtype(logits_dtype(hidden)));
    for (int64_t start = 0; start < f.tokens; start += tile_rows) {
      const int64_t rows = std::min(tile_rows, f.tokens - start);
      const at::Tensor hidden_tile = f.hidden.narrow(0, start, rows);
      const at::Tensor target_tile = f.target.narrow(0, start, rows);
      for (int64_t col0 = 0; col0 < f.vocab; col0 += tile_cols) {
        const int64_t cols = std::min(tile_cols, f.vocab - col0);
        const at::Tensor logits = tile_view(buffer, rows, cols);
        linear_into_accumulator(logits, hidden_tile, weight.narrow(0, col0, cols),
                                narrow_or_undefined(bias, col0, cols));
        sums.fold(kernels, options, logits, target_tile, col0, start);
      }
    }
  }
  const at::Tensor lse = sums.lse();
  const at::Tensor valid = f.target.ne(ignore_index);
  return {reduced_loss(sums, lse, valid, parsed, options, target), lse,
          statistics ? sums.statistics(lse, valid, z_loss) : at::empty({0}, acc_options)};
}

LinearCrossEntropyWithGradients linear_cross_entropy_with_gradients_impl(
    const CrossEntropyTileKernels& kernels, const at::Tensor& hidden, const at::Tensor& weight,
    const std::optional<at::Tensor>& bias_opt, const at::Tensor& target, int64_t ignore_index, double label_smoothing,
    double softcap, double z_loss, std::string_view reduction, const c10::SymInt& tile_tokens,
    std::array<bool, 3> output_mask, bool statistics) {
  const char* op = "linear_cross_entropy";  // the op users call, as linear_cross_entropy_forward's errors
  const at::Tensor bias = value_or_undefined(bias_opt);
  const Reduction parsed =
      check_arguments(op, hidden, weight, bias, target, label_smoothing, softcap, z_loss, reduction);
  check_gradients_in_forward_apply(op, parsed, softcap);
  const Flat f = flatten(hidden, weight, target);
  check_target_values(op, f.target, f.vocab, ignore_index);
  const auto dtype = hidden.scalar_type();
  const auto acc_type = at::toOpMathType(dtype);
  const auto acc_options = hidden.options().dtype(acc_type);
  const bool want_hidden = output_mask[0], want_weight = output_mask[1], want_bias = output_mask[2] && bias.defined();

  // Each token's weight in the reduction for a unit grad_loss: 1 ("sum") or 1 / count ("mean"), 0 if ignored.
  const at::Tensor valid = f.target.ne(ignore_index);
  at::Tensor unit = at::ones({}, acc_options);
  if (parsed == Reduction::kMean) {
    unit = unit / valid.sum();
  }
  const at::Tensor grad_scale = at::where(valid, unit, at::zeros({}, acc_options)).expand({f.tokens}).contiguous();
  const int64_t h = hidden.size(-1);
  const int64_t rows_per_slab = slab_tokens(f.tokens, f.vocab, logits_dtype(hidden), tile_tokens);
  // hidden's gradient in hidden's dtype: a slab's rows are final after their one GEMM over the whole vocabulary, so
  // they are rounded there, as they would be at the end, and the step keeps [tokens, h] in bf16/fp16, not float32.
  at::Tensor grad_hidden = want_hidden ? at::zeros({f.tokens, h}, hidden.options()) : at::Tensor();
  const at::Tensor grad_rows_accumulator =
      want_hidden && acc_type != dtype ? at::empty({rows_per_slab, h}, acc_options) : at::Tensor();
  at::Tensor grad_weight = want_weight ? at::zeros({f.vocab, h}, acc_options) : at::Tensor();
  at::Tensor grad_bias = want_bias ? at::zeros({f.vocab}, acc_options) : at::Tensor();

  TokenSums sums(f.tokens, acc_options, statistics, rows_per_slab, f.vocab);
  const CrossEntropyOptions options{softcap, label_smoothing, z_loss, f.vocab, /*filter_eps=*/0.0};
  if (f.tokens > 0 && f.vocab > 0) {
    // The slab is float32 for bf16/fp16; off CUDA the GEMM operands are converted to float32 (the weight once).
    const bool convert = acc_type != dtype && !hidden.is_cuda();
    const at::Tensor slab = at::empty({rows_per_slab * f.vocab}, hidden.options().dtype(logits_dtype(hidden)));
    const at::Tensor weight_operand = convert && want_hidden ? weight.to(acc_type) : weight;
    for (int64_t start = 0; start < f.tokens; start += rows_per_slab) {
      const int64_t rows = std::min(rows_per_slab, f.tokens - start);
      const at::Tensor hidden_tile = f.hidden.narrow(0, start, rows);
      const at::Tensor target_tile = f.target.narrow(0, start, rows);
      const at::Tensor logits = tile_view(slab, rows, f.vocab);
      linear_into_accumulator(logits, hidden_tile, weight, bias);
      sums.fold(kernels, options, logits, target_tile, /*col0=*/0, start);
      // The slab holds whole rows: their log-sum-exp is final, and the slab becomes d loss / d logits.
      const at::Tensor lse = sums.lse(start, rows);
      kernels.backward(options, logits, target_tile, /*col0=*/0, lse, grad_scale.narrow(0, start, rows));
      const at::Tensor d_logits = logits_gradient_operand(logits, dtype, convert);
      if (want_hidden) {
        const at::Tensor grad_rows = grad_hidden.narrow(0, start, rows);
        if (grad_rows_accumulator.defined()) {
          const at::Tensor accumulator = grad_rows_accumulator.narrow(0, 0, rows).zero_();
          accumulate_mm(accumulator, d_logits, weight_operand);
          grad_rows.copy_(accumulator);
        } else {
          accumulate_mm(grad_rows, d_logits, weight_operand);
        }
      }
      if (want_weight) {
        accumulate_mm(grad_weight, d_logits.t(), convert ? hidden_tile.to(acc_type) : hidden_tile);
      }
      if (want_bias) {
        grad_bias.add_(at::sum(logits, {0}, false, acc_type));
      }
    }
  }
  const at::Tensor lse = sums.lse();
  return {reduced_loss(sums, lse, valid, parsed, options, target),
          want_hidden ? grad_hidden.view(hidden.sizes()) : grad_hidden, grad_weight, grad_bias,
          statistics ? sums.statistics(lse, valid, z_loss) : at::empty({0}, acc_options)};
}

LinearCrossEntropyGradients linear_cross_entropy_backward_impl(
    const CrossEntropyTileKernels& kernels, const at::Tensor& grad_loss, const at::Tensor& hidden,
    const at::Tensor& weight, const std::optional<at::Tensor>& bias_opt, const at::Tensor& target,
    const at::Tensor& lse, int64_t ignore_index, double label_smoothing, double softcap, double z_loss,
    std::string_view reduction, const c10::SymInt& tile_tokens, const c10::SymInt& tile_vocab,
    std::array<bool, 3> output_mask, double filter_eps) {
  const char* op = "linear_cross_entropy_backward";
  const at::Tensor bias = value_or_undefined(bias_opt);
  const Reduction parsed =
      check_arguments(op, hidden, weight, bias, target, label_smoothing, softcap, z_loss, reduction);
  check_filter_eps(op, filter_eps, label_smoothing);
  const auto dtype = hidden.scalar_type();
  const auto acc_type = at::toOpMathType(dtype);
  check_tensor(op, "lse", lse, hidden, "hidden", acc_type, {target.sym_numel()}, "[tokens]");
  check_defined(grad_loss, op, "grad_loss");
  check_tensor(op, "grad_loss", grad_loss, hidden, "hidden", grad_loss.scalar_type(),
               parsed == Reduction::kNone ? target.sym_sizes() : c10::SymIntArrayRef{},
               parsed == Reduction::kNone ? "target's shape" : "a scalar");
  const Flat f = flatten(hidden, weight, target);
  check_target_values(op, f.target, f.vocab, ignore_index);
  const auto acc_options = hidden.options().dtype(acc_type);

  const bool want_hidden = output_mask[0];
  const bool want_weight = output_mask[1];
  const bool want_bias = output_mask[2] && bias.defined();

  // Each token's weight in the reduction; 0 for ignored tokens.
  const at::Tensor valid = f.target.ne(ignore_index);
  at::Tensor scale = parsed == Reduction::kNone ? grad_loss.reshape({-1}).to(acc_type) : grad_loss.to(acc_type);
  if (parsed == Reduction::kMean) {
    scale = scale / valid.sum();
  }
  const at::Tensor grad_scale = at::where(valid, scale, at::zeros({}, acc_options)).expand({f.tokens}).contiguous();

  const int64_t h = hidden.size(-1);
  at::Tensor grad_hidden = want_hidden ? at::zeros({f.tokens, h}, hidden.options()) : at::Tensor();
  at::Tensor grad_weight = want_weight ? at::zeros({f.vocab, h}, acc_options) : at::Tensor();
  at::Tensor grad_bias = want_bias ? at::zeros({f.vocab}, acc_options) : at::Tensor();

  if (f.tokens > 0 && f.vocab > 0 && (want_hidden || want_weight || want_bias)) {
    const CrossEntropyOptions options{softcap, label_smoothing, z_loss, f.vocab, filter_eps};
    const auto [tile_rows, tile_cols] = tile_shape(f.tokens, f.vocab, dtype, tile_tokens, tile_vocab);
    const at::Tensor buffer = at::empty({tile_rows * tile_cols}, hidden.options().dtype(logits_dtype(hidden)));
    // bf16/fp16 gradients add up over the tiles in float32 and are rounded once; the tiles are float32, and off
    // CUDA the GEMM operands are converted to float32 (hidden once per token tile).
    const bool reduced = acc_type != dtype;
    const bool convert = reduced && !hidden.is_cuda();
    const at::Tensor hidden_acc_buffer = want_hidden && reduced ? at::empty({tile_rows, h}, acc_options) : at::Tensor();
    for (int64_t start = 0; start < f.tokens; start += tile_rows) {
      const int64_t rows = std::min(tile_rows, f.tokens - start);
      const at::Tensor hidden_tile = f.hidden.narrow(0, start, rows);
      const at::Tensor hidden_operand = convert && want_weight ? hidden_tile.to(acc_type) : hidden_tile;
      const at::Tensor target_tile = f.target.narrow(0, start, rows);
      at::Tensor grad_hidden_tile;
      if (want_hidden) {
        grad_hidden_tile = reduced ? hidden_acc_buffer.narrow(0, 0, rows).zero_() : grad_hidden.narrow(0, start, rows);
      }
      for (int64_t col0 = 0; col0 < f.vocab; col0 += tile_cols) {
        const int64_t cols = std::min(tile_cols, f.vocab - col0);
        const at::Tensor weight_tile = weight.narrow(0, col0, cols);
        const at::Tensor logits = tile_view(buffer, rows, cols);
        linear_into_accumulator(logits, hidden_tile, weight_tile, narrow_or_undefined(bias, col0, cols));
        // logits now hold d loss / d logits; a tile that gradient filtering finds negligible adds nothing.
        if (!kernels.backward(options, logits, target_tile, col0, lse.narrow(0, start, rows),
                              grad_scale.narrow(0, start, rows))) {
          continue;
        }
        const at::Tensor d_logits = logits_gradient_operand(logits, dtype, convert);
        if (want_hidden) {
          accumulate_mm(grad_hidden_tile, d_logits, convert ? weight_tile.to(acc_type) : weight_tile);
        }
        if (want_weight) {
          accumulate_mm(grad_weight.narrow(0, col0, cols), d_logits.t(), hidden_operand);
        }
        if (want_bias) {
          grad_bias.narrow(0, col0, cols).add_(at::sum(logits, {0}, false, acc_type));
        }
      }
      if (want_hidden && reduced) {
        grad_hidden.narrow(0, start, rows).copy_(grad_hidden_tile);
      }
    }
  }

  const auto to_dtype = [&](const at::Tensor& t) { return t.defined() ? t.to(dtype) : t; };
  return {want_hidden ? grad_hidden.view(hidden.sizes()) : grad_hidden, to_dtype(grad_weight), to_dtype(grad_bias)};
}

const CrossEntropyTileKernels& cpu_cross_entropy_kernels() {
#ifdef TORCH_OFFLOAD_CPU_AVX_KERNELS
  static const CrossEntropyTileKernels& kernels = []() -> const CrossEntropyTileKernels& {
    const std::string capability = at::get_cpu_capability();
    if (capability == "AVX512") {
      return AVX512::cross_entropy_kernels_cpu;
    }
    if (capability == "AVX2") {
      return AVX2::cross_entropy_kernels_cpu;
    }
    return DEFAULT::cross_entropy_kernels_cpu;
  }();
  return kernels;
#else
  return DEFAULT::cross_entropy_kernels_cpu;
#endif
}

at::Tensor linear_cross_entropy_cpu(TORCH_OFFLOAD_LCE_ARGS, double filter_eps,
                                    std::optional<bool> gradients_in_forward) {
  // filter_eps and gradients_in_forward choose how gradients are computed (the autograd kernel's business),
  // checked alike when there are none.
  check_filter_eps("linear_cross_entropy", filter_eps, label_smoothing);
  gradients_in_forward_by_default("linear_cross_entropy", hidden, softcap, reduction, filter_eps, gradients_in_forward);
  return std::get<0>(linear_cross_entropy_forward_impl(cpu_cross_entropy_kernels(), hidden, weight, bias, target,
                                                       ignore_index, label_smoothing, softcap, z_loss, reduction,
                                                       tile_tokens, tile_vocab, /*statistics=*/false));
}

LinearCrossEntropyForward linear_cross_entropy_forward_cpu(TORCH_OFFLOAD_LCE_ARGS, bool statistics) {
  return linear_cross_entropy_forward_impl(cpu_cross_entropy_kernels(), hidden, weight, bias, target, ignore_index,
                                           label_smoothing, softcap, z_loss, reduction, tile_tokens, tile_vocab,
                                           statistics);
}

LinearCrossEntropyWithGradients linear_cross_entropy_with_gradients_cpu(TORCH_OFFLOAD_LCE_WITH_GRADIENTS_ARGS) {
  return linear_cross_entropy_with_gradients_impl(cpu_cross_entropy_kernels(), hidden, weight, bias, target,
                                                  ignore_index, label_smoothing, softcap, z_loss, reduction,
                                                  tile_tokens, output_mask, statistics);
}

LinearCrossEntropyGradients linear_cross_entropy_backward_cpu(TORCH_OFFLOAD_LCE_BACKWARD_ARGS) {
  return linear_cross_entropy_backward_impl(cpu_cross_entropy_kernels(), grad_loss, hidden, weight, bias, target, lse,
                                            ignore_index, label_smoothing, softcap, z_loss, reduction, tile_tokens,
                                            tile_vocab, output_mask, filter_eps);
}

// Meta: the same checks (on symbolic shapes), then results shaped like the real ones.
namespace {
at::Tensor statistics_meta(bool statistics, const at::Tensor& target, const at::TensorOptions& acc_options) {
  return statistics ? at::empty_symint({3, target.sym_numel()}, acc_options) : at::empty({0}, acc_options);
}
}  // namespace

LinearCrossEntropyForward linear_cross_entropy_forward_meta(TORCH_OFFLOAD_LCE_ARGS, bool statistics) {
  const Reduction parsed = check_arguments("linear_cross_entropy", hidden, weight, value_or_undefined(bias), target,
                                           label_smoothing, softcap, z_loss, reduction);
  (void)ignore_index, (void)tile_tokens, (void)tile_vocab;
  const auto acc_options = hidden.options().dtype(at::toOpMathType(hidden.scalar_type()));
  const at::Tensor loss =
      at::empty_symint(parsed == Reduction::kNone ? target.sym_sizes() : c10::SymIntArrayRef{}, acc_options);
  const at::Tensor lse = at::empty_symint({target.sym_numel()}, acc_options);
  return {loss, lse, statistics_meta(statistics, target, acc_options)};
}

at::Tensor linear_cross_entropy_meta(TORCH_OFFLOAD_LCE_ARGS, double filter_eps,
                                     std::optional<bool> gradients_in_forward) {
  check_filter_eps("linear_cross_entropy", filter_eps, label_smoothing);
  gradients_in_forward_by_default("linear_cross_entropy", hidden, softcap, reduction, filter_eps, gradients_in_forward);
  return std::get<0>(linear_cross_entropy_forward_meta(hidden, weight, bias, target, ignore_index, label_smoothing,
                                                       softcap, z_loss, reduction, tile_tokens, tile_vocab,
                                                       /*statistics=*/false));
}

LinearCrossEntropyWithGradients linear_cross_entropy_with_gradients_meta(TORCH_OFFLOAD_LCE_WITH_GRADIENTS_ARGS) {
  const char* op = "linear_cross_entropy";
  const at::Tensor b = value_or_undefined(bias);
  const Reduction parsed = check_arguments(op, hidden, weight, b, target, label_smoothing, softcap, z_loss, reduction);
  check_gradients_in_forward_apply(op, parsed, softcap);
  (void)ignore_index, (void)tile_tokens;
  const auto acc_options = hidden.options().dtype(at::toOpMathType(hidden.scalar_type()));
  const auto like = [&](bool want, const at::Tensor& t, const at::TensorOptions& options) {
    return want && t.defined() ? at::empty_symint(t.sym_sizes(), options) : at::Tensor();
  };
  return {at::empty({}, acc_options), like(output_mask[0], hidden, hidden.options()),
          like(output_mask[1], weight, acc_options), like(output_mask[2], b, acc_options),
          statistics_meta(statistics, target, acc_options)};
}

LinearCrossEntropyGradients linear_cross_entropy_backward_meta(TORCH_OFFLOAD_LCE_BACKWARD_ARGS) {
  const char* op = "linear_cross_entropy_backward";
  const at::Tensor b = value_or_undefined(bias);
  const Reduction parsed = check_arguments(op, hidden, weight, b, target, label_smoothing, softcap, z_loss, reduction);
  check_filter_eps(op, filter_eps, label_smoothing);
  (void)ignore_index, (void)tile_tokens, (void)tile_vocab;
  check_tensor(op, "lse", lse, hidden, "hidden", at::toOpMathType(hidden.scalar_type()), {target.sym_numel()},
               "[tokens]");
  check_defined(grad_loss, op, "grad_loss");
  check_tensor(op, "grad_loss", grad_loss, hidden, "hidden", grad_loss.scalar_type(),
               parsed == Reduction::kNone ? target.sym_sizes() : c10::SymIntArrayRef{},
               parsed == Reduction::kNone ? "target's shape" : "a scalar");
  const auto like = [](bool want, const at::Tensor& t) {
    return want && t.defined() ? at::empty_symint(t.sym_sizes(), t.options()) : at::Tensor();
  };
  return {like(output_mask[0], hidden), like(output_mask[1], weight), like(output_mask[2], b)};
}

}  // namespace torch_offload
