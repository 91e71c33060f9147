#pragma once
// How an LM head's logits become the scores its softmax takes, s = cap(logit_scale * logits) / temperature
// (cap(z) = softcap tanh(z / softcap) where softcap > 0, else z), computed tile by tile in place: shared by the ops
// that walk the head in tiles of tokens x vocabulary (token_logprobs, token_divergence).
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include "ops/common/gemm.h"

namespace torch_offload {

struct LogitScores {
  double temperature, softcap, logit_scale;

  // Errors name `op` and the argument, its name after `prefix` ("teacher_" names teacher_softcap).
  void check(const char* op, const char* prefix = "") const {
    constexpr double kInf = std::numeric_limits<double>::infinity();
    TORCH_CHECK(temperature > 0.0 && temperature < kInf, op, ": temperature is ", temperature,
                "; expected a finite value > 0");
    TORCH_CHECK(softcap >= 0.0 && softcap < kInf, op, ": ", prefix, "softcap is ", softcap,
                "; expected a finite value >= 0 (0: no softcap)");
    TORCH_CHECK(std::isfinite(logit_scale), op, ": ", prefix, "logit_scale is ", logit_scale,
                "; expected a finite value");
  }
  at::Tensor scores(at::Tensor logits) const {
    if (logit_scale != 1.0) {
      logits.mul_(logit_scale);
    }
    if (softcap > 0.0) {
      logits.div_(softcap).tanh_().mul_(softcap);
    }
    return logits.mul_(1.0 / temperature);
  }
  // d/ds into d/dlogits, in place, for the scores s of those logits (read only with a softcap).
  void to_logits_gradient(at::Tensor& d_s, const at::Tensor& s) const {
    d_s.mul_(logit_scale / temperature);
    if (softcap > 0.0) {
      const at::Tensor capped = s * (temperature / softcap);  // tanh(logit_scale * logit / softcap)
      d_s.mul_(capped.mul_(capped).neg_().add_(1.0));
    }
  }
};

inline at::Tensor narrow_or_undefined(const at::Tensor& t, int64_t start, int64_t length) {
  return t.defined() ? t.narrow(0, start, length) : t;
}

// The scores of hidden_tile's rows and the columns [col0, col0 + cols) of weight [V, h] (bias [V] or undefined),
// in the reused buffer of the accumulation type: bf16/fp16 products are not rounded to bf16/fp16 before the bias,
// scale, cap and temperature.
inline at::Tensor tile_scores(const at::Tensor& buffer, const at::Tensor& hidden_tile, const at::Tensor& weight,
                              const at::Tensor& bias, int64_t col0, int64_t cols, const LogitScores& scoring) {
  const at::Tensor logits = buffer.narrow(0, 0, hidden_tile.size(0) * cols).view({hidden_tile.size(0), cols});
  linear_into_accumulator(logits, hidden_tile, weight.narrow(0, col0, cols), narrow_or_undefined(bias, col0, cols));
  return scoring.scores(logits);
}

// The head's gradients (hidden's, the weight's, the bias's: those output_mask asks for) added up tile by tile from
// the gradient by each tile's logits. bf16/fp16 gradients add up in float32 and are rounded once; off CUDA the GEMM
// operands are float32 (CUDA multiplies the tile's gradient rounded to the input dtype, accumulating in float32).
// For each tile of tokens: begin_token_tile, add for each tile of the vocabulary, end_token_tile.
class HeadGradients {
 public:
  // hidden: the head's input as [tokens, h] rows; hidden_sizes: its shape as the op took it.
  HeadGradients(const at::Tensor& hidden, c10::IntArrayRef hidden_sizes, const at::Tensor& weight, bool has_bias,
                std::array<bool, 3> output_mask, int64_t tile_rows)
      : hidden_(hidden),
        weight_(weight),
        hidden_sizes_(hidden_sizes.vec()),
        dtype_(hidden.scalar_type()),
        acc_type_(at::toOpMathType(dtype_)),
        convert_(acc_type_ != dtype_ && !hidden.is_cuda()),
        want_hidden_(output_mask[0]),
        want_weight_(output_mask[1]),
        want_bias_(output_mask[2] && has_bias) {
    const auto acc = hidden.options().dtype(acc_type_);
    const int64_t h = hidden.size(1);
    if (want_hidden_) {
      grad_hidden_ = at::zeros({hidden.size(0), h}, hidden.options());
      tile_buffer_ = at::empty({tile_rows, h}, acc);
    }
    grad_weight_ = want_weight_ ? at::zeros({weight.size(0), h}, acc) : at::Tensor();
    grad_bias_ = want_bias_ ? at::zeros({weight.size(0)}, acc) : at::Tensor();
  }
  bool any() const { return want_hidden_ || want_weight_ || want_bias_; }
  void begin_token_tile(int64_t start, int64_t rows) {
    start_ = start;
    const at::Tensor hidden_tile = hidden_.narrow(0, start, rows);
    hidden_operand_ = convert_ && want_weight_ ? hidden_tile.to(acc_type_) : hidden_tile;
    grad_hidden_tile_ = want_hidden_ ? tile_buffer_.narrow(0, 0, rows).zero_() : at::Tensor();
  }
  // d_s: the gradient by the logits of the current tile of tokens and the vocabulary's columns [col0, col0 +
  // d_s.size(1)), in the accumulation type.
  void add(const at::Tensor& d_s, int64_t col0) {
    const int64_t cols = d_s.size(1);
    const at::Tensor d_logits = logits_gradient_operand(d_s, dtype_, convert_);
    const at::Tensor weight_tile = weight_.narrow(0, col0, cols);
    if (want_hidden_) {
      accumulate_mm(grad_hidden_tile_, d_logits, convert_ ? weight_tile.to(acc_type_) : weight_tile);
    }
    if (want_weight_) {
      accumulate_mm(grad_weight_.narrow(0, col0, cols), d_logits.t(), hidden_operand_);
    }
    if (want_bias_) {
      grad_bias_.narrow(0, col0, cols).add_(d_s.sum(0));
    }
  }
  void end_token_tile() {
    if (want_hidden_) {
      grad_hidden_.narrow(0, start_, grad_hidden_tile_.size(0)).copy_(grad_hidden_tile_);
    }
  }
  // (hidden's, the weight's, the bias's) in the input dtype; undefined where not asked for.
  std::tuple<at::Tensor, at::Tensor, at::Tensor> gradients() const {
    const auto to_dtype = [&](const at::Tensor& x) { return x.defined() ? x.to(dtype_) : x; };
    return {want_hidden_ ? grad_hidden_.view(hidden_sizes_) : grad_hidden_, to_dtype(grad_weight_),
            to_dtype(grad_bias_)};
  }

 private:
  at::Tensor hidden_, weight_;
  std::vector<int64_t> hidden_sizes_;
  c10::ScalarType dtype_, acc_type_;
  bool convert_, want_hidden_, want_weight_, want_bias_;
  at::Tensor grad_hidden_, grad_weight_, grad_bias_, tile_buffer_;
  int64_t start_ = 0;
  at::Tensor hidden_operand_, grad_hidden_tile_;
};

}  // namespace torch_offload
