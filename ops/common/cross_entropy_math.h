#pragma once
// The elementwise arithmetic of linear_cross_entropy, shared by the CPU loops (T =
// float, double or at::vec::Vectorized of them) and the CUDA kernels (T = float or
// double), so the CPU tests check the GPU's formulas too.
//
// With z = softcap * tanh(logit / softcap) (z = logit without a softcap), a
// token's loss is lse - (1 - eps) z_target - eps / V sum_j z_j + z_loss lse^2,
// lse = log sum_j exp(z_j), eps the label smoothing; its derivative by logit_j is
//   g ((1 + 2 z_loss lse) exp(z_j - lse) - eps / V - (1 - eps) [j = target]) dz_j/dlogit_j
// with g the token's weight in the reduction (grad_out / tokens for "mean").
#include <cmath>

#include "ops/common/activation_math.h"

namespace torch_offload {
inline namespace TORCH_OFFLOAD_MATH_NAMESPACE {

// z of a logit: softcap * tanh(logit / softcap), or the logit itself.
template <bool kSoftcap, typename T>
TORCH_OFFLOAD_HOST_DEVICE inline T capped_logit(T logit, T softcap) {
  if constexpr (kSoftcap) {
    return softcap * ActMath<T>::tanh(logit / softcap);
  } else {
    return logit;
  }
}

// The loss's derivative by one logit. prob_scale = g (1 + 2 z_loss lse); subtract =
// g eps / V, plus g (1 - eps) at the target.
template <bool kSoftcap, typename T>
TORCH_OFFLOAD_HOST_DEVICE inline T logit_gradient(T logit, T lse, T prob_scale, T subtract, T softcap) {
  const T z = capped_logit<kSoftcap>(logit, softcap);
  const T d_z = prob_scale * ActMath<T>::exp(z - lse) - subtract;
  if constexpr (kSoftcap) {
    const T ratio = z / softcap;
    return d_z * (T(1.0) - ratio * ratio);  // d tanh(u) = 1 - tanh(u)^2
  } else {
    return d_z;
  }
}

// Gradient filtering (as Cut Cross-Entropy's): a row's gradient entries are negligible
// when the largest magnitude among them is at most filter_eps times the row's weight |g|
// in the reduction (for plain cross-entropy away from the target: every softmax
// probability at most filter_eps). A NaN is never negligible.
template <typename T>
TORCH_OFFLOAD_HOST_DEVICE inline bool gradient_is_negligible(T max_abs_gradient, T g, T filter_eps) {
  return max_abs_gradient <= filter_eps * (g < T(0) ? -g : g);
}

// Folds one tile's maximum and sum of exp(z - tile_max) into a row's running
// (max, sum of exp(z - max)): the online log-sum-exp. A tile whose every z is -inf (a
// vocabulary block masked by a -inf bias) adds nothing; its sum, exp(-inf - -inf), is NaN.
template <typename T>
TORCH_OFFLOAD_HOST_DEVICE inline void lse_combine(T* max, T* sum_exp, T tile_max, T tile_sum_exp) {
  if (tile_max == -T(INFINITY)) {
    return;
  }
  if (tile_max > *max) {
    *sum_exp = *sum_exp * ActMath<T>::exp(*max - tile_max) + tile_sum_exp;
    *max = tile_max;
  } else {
    *sum_exp += tile_sum_exp * ActMath<T>::exp(tile_max - *max);
  }
}

}  // namespace TORCH_OFFLOAD_MATH_NAMESPACE
}  // namespace torch_offload
