#pragma once
// How an LM head's logits become the scores its softmax takes, s = cap(logit_scale * logits) / temperature
// (cap(z) = softcap tanh(z / softcap) where softcap > 0, else z), computed tile by tile in place: shared by the ops
// that walk the head in tiles of tokens x vocabulary (token_logprobs, token_divergence).
#include <cmath>
#include <cstdint>
#include <limits>

#include <ATen/core/Tensor.h>
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

}  // namespace torch_offload
