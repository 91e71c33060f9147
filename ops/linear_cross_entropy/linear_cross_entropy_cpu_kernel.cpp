// Fused per-tile CPU kernels of linear_cross_entropy: rows of a logits tile split
// across threads, each row vectorized with at::vec. Compiled once per
// CPU_CAPABILITY (see CMakeLists.txt); the arithmetic is cross_entropy_math.h's.
#include <atomic>
#include <cmath>
#include <limits>
#include <type_traits>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include "ops/common/cpu_vec.h"
#include "ops/common/cross_entropy_math.h"
#include "ops/linear_cross_entropy/linear_cross_entropy.h"

namespace torch_offload {
namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kGrainSize = 32768;  // elements per thread task, as in ATen's elementwise loops

int64_t row_grain(int64_t cols) {
  return std::max<int64_t>(1, kGrainSize / std::max<int64_t>(1, cols));
}

template <typename T>
T max_of(T a, T b) {
  return a < b || b != b ? b : a;  // NaN wins, as at::vec::maximum
}

// One row of the forward: z over the row (stored over the logits with a softcap),
// its maximum, sum of exp(z - max) and sum of z.
template <bool kSoftcap, typename scalar_t>
void forward_row(scalar_t* row, int64_t cols, at::opmath_type<scalar_t> softcap, bool want_sum_z,
                 at::opmath_type<scalar_t>* row_max, at::opmath_type<scalar_t>* row_sum_exp,
                 at::opmath_type<scalar_t>* row_sum_z) {
  using L = Lanes<scalar_t>;
  using Vec = typename L::Vec;
  using opmath_t = at::opmath_type<scalar_t>;
  constexpr int64_t kStep = CPU_CAPABILITY::kStep<scalar_t>;
  const int64_t vec_end = cols - cols % kStep;
  Vec vmax(-std::numeric_limits<opmath_t>::infinity()), vsum_z(0);
  for (int64_t j = 0; j < vec_end; j += kStep) {
    Vec z[L::kVecs];
    L::load(row + j, z);
    for (int k = 0; k < L::kVecs; ++k) {
      z[k] = capped_logit<kSoftcap>(z[k], Vec(softcap));
      vmax = at::vec::maximum(vmax, z[k]);
      if (want_sum_z) {
        vsum_z += z[k];
      }
    }
    if constexpr (kSoftcap) {
      L::store(row + j, z);
    }
  }
  opmath_t max = at::vec::vec_reduce_all<opmath_t>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, vmax);
  opmath_t sum_z = want_sum_z ? at::vec::vec_reduce_all<opmath_t>([](Vec a, Vec b) { return a + b; }, vsum_z) : 0;
  for (int64_t j = vec_end; j < cols; ++j) {
    const opmath_t z = capped_logit<kSoftcap>(static_cast<opmath_t>(row[j]), softcap);
    row[j] = static_cast<scalar_t>(z);
    max = max_of(max, z);
    sum_z += z;
  }
  // The stored z (rounded to scalar_t) from here on, as the target pick reads it.
  Vec vsum_exp(0);
  const Vec vmax_all(max);
  for (int64_t j = 0; j < vec_end; j += kStep) {
    Vec z[L::kVecs];
    L::load(row + j, z);
    for (int k = 0; k < L::kVecs; ++k) {
      vsum_exp += (z[k] - vmax_all).exp();
    }
  }
  opmath_t sum_exp = at::vec::vec_reduce_all<opmath_t>([](Vec a, Vec b) { return a + b; }, vsum_exp);
  for (int64_t j = vec_end; j < cols; ++j) {
    sum_exp += ActMath<opmath_t>::exp(static_cast<opmath_t>(row[j]) - max);
  }
  *row_max = max;
  *row_sum_exp = sum_exp;
  *row_sum_z = sum_z;
}

void forward_tile(const CrossEntropyOptions& options, const at::Tensor& logits, const at::Tensor& target, int64_t col0,
                  const at::Tensor& max, const at::Tensor& sum_exp, const at::Tensor& target_z,
                  const at::Tensor& sum_z) {
  const int64_t rows = logits.size(0);
  const int64_t cols = logits.size(1);
  const bool want_sum_z = options.label_smoothing > 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "linear_cross_entropy_cpu", [&] {
    using opmath_t = at::opmath_type<scalar_t>;
    scalar_t* data = logits.data_ptr<scalar_t>();
    const int64_t* targets = target.const_data_ptr<int64_t>();
    opmath_t* maxes = max.data_ptr<opmath_t>();
    opmath_t* sums = sum_exp.data_ptr<opmath_t>();
    opmath_t* target_zs = target_z.data_ptr<opmath_t>();
    opmath_t* sum_zs = sum_z.data_ptr<opmath_t>();
    const auto softcap = static_cast<opmath_t>(options.softcap);
    at::parallel_for(0, rows, row_grain(cols), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* row = data + r * cols;
        opmath_t tile_max, tile_sum_exp, tile_sum_z;
        if (options.softcap > 0) {
          forward_row<true>(row, cols, softcap, want_sum_z, &tile_max, &tile_sum_exp, &tile_sum_z);
        } else {
          forward_row<false>(row, cols, softcap, want_sum_z, &tile_max, &tile_sum_exp, &tile_sum_z);
        }
        lse_combine(&maxes[r], &sums[r], tile_max, tile_sum_exp);
        sum_zs[r] += tile_sum_z;
        const int64_t column = targets[r] - col0;
        if (column >= 0 && column < cols) {
          target_zs[r] = static_cast<opmath_t>(row[column]);
        }
      }
    });
  });
}

// One row of the backward, in place: logits <- the loss's gradient by them. Returns the
// largest magnitude written when kTrack (for gradient filtering), else 0.
template <bool kSoftcap, bool kTrack, typename scalar_t>
at::opmath_type<scalar_t> backward_row(scalar_t* row, int64_t cols, at::opmath_type<scalar_t> lse,
                                       at::opmath_type<scalar_t> prob_scale, at::opmath_type<scalar_t> subtract,
                                       at::opmath_type<scalar_t> softcap) {
  using L = Lanes<scalar_t>;
  using Vec = typename L::Vec;
  using opmath_t = at::opmath_type<scalar_t>;
  constexpr int64_t kStep = CPU_CAPABILITY::kStep<scalar_t>;
  const int64_t vec_end = cols - cols % kStep;
  const Vec vlse(lse), vscale(prob_scale), vsubtract(subtract), vsoftcap(softcap);
  Vec vmax_abs(0);
  for (int64_t j = 0; j < vec_end; j += kStep) {
    Vec v[L::kVecs];
    L::load(row + j, v);
    for (int k = 0; k < L::kVecs; ++k) {
      v[k] = logit_gradient<kSoftcap>(v[k], vlse, vscale, vsubtract, vsoftcap);
      if constexpr (kTrack) {
        vmax_abs = at::vec::maximum(vmax_abs, v[k].abs());
      }
    }
    L::store(row + j, v);
  }
  opmath_t max_abs = 0;
  if constexpr (kTrack) {
    max_abs = at::vec::vec_reduce_all<opmath_t>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, vmax_abs);
  }
  for (int64_t j = vec_end; j < cols; ++j) {
    const opmath_t d = logit_gradient<kSoftcap>(static_cast<opmath_t>(row[j]), lse, prob_scale, subtract, softcap);
    row[j] = static_cast<scalar_t>(d);
    if constexpr (kTrack) {
      max_abs = max_of(max_abs, std::abs(d));
    }
  }
  return max_abs;
}

bool backward_tile(const CrossEntropyOptions& options, const at::Tensor& logits, const at::Tensor& target, int64_t col0,
                   const at::Tensor& lse, const at::Tensor& grad_scale) {
  const int64_t rows = logits.size(0);
  const int64_t cols = logits.size(1);
  const bool filter = options.filter_eps > 0;
  std::atomic<bool> counts{!filter};
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, logits.scalar_type(), "linear_cross_entropy_backward_cpu", [&] {
        using opmath_t = at::opmath_type<scalar_t>;
        scalar_t* data = logits.data_ptr<scalar_t>();
        const int64_t* targets = target.const_data_ptr<int64_t>();
        const opmath_t* lses = lse.const_data_ptr<opmath_t>();
        const opmath_t* scales = grad_scale.const_data_ptr<opmath_t>();
        const auto softcap = static_cast<opmath_t>(options.softcap);
        const auto eps = static_cast<opmath_t>(options.label_smoothing);
        const auto uniform = eps / static_cast<opmath_t>(options.vocab);
        const auto z_loss = static_cast<opmath_t>(options.z_loss);
        const auto filter_eps = static_cast<opmath_t>(options.filter_eps);
        const auto row_kernel = [&](auto softcap_flag, auto track_flag) {
          return &backward_row<decltype(softcap_flag)::value, decltype(track_flag)::value, scalar_t>;
        };
        const auto gradient_row = options.softcap > 0 ? (filter ? row_kernel(std::true_type{}, std::true_type{})
                                                                : row_kernel(std::true_type{}, std::false_type{}))
                                                      : (filter ? row_kernel(std::false_type{}, std::true_type{})
                                                                : row_kernel(std::false_type{}, std::false_type{}));
        at::parallel_for(0, rows, row_grain(cols), [&](int64_t begin, int64_t end) {
          bool rows_count = false;
          for (int64_t r = begin; r < end; ++r) {
            scalar_t* row = data + r * cols;
            const opmath_t g = scales[r];
            const opmath_t prob_scale = g * (opmath_t(1) + opmath_t(2) * z_loss * lses[r]);
            const int64_t column = targets[r] - col0;
            const bool has_target = column >= 0 && column < cols;
            const opmath_t target_logit = has_target ? static_cast<opmath_t>(row[column]) : opmath_t(0);
            opmath_t max_abs = gradient_row(row, cols, lses[r], prob_scale, g * uniform, softcap);
            if (has_target) {
              const opmath_t subtract = g * uniform + g * (opmath_t(1) - eps);
              const opmath_t d = options.softcap > 0
                                     ? logit_gradient<true>(target_logit, lses[r], prob_scale, subtract, softcap)
                                     : logit_gradient<false>(target_logit, lses[r], prob_scale, subtract, softcap);
              row[column] = static_cast<scalar_t>(d);
              max_abs = max_of(max_abs, std::abs(d));
            }
            rows_count = rows_count || (filter && !gradient_is_negligible(max_abs, g, filter_eps));
          }
          if (rows_count) {
            counts.store(true, std::memory_order_relaxed);
          }
        });
      });
  return counts.load();
}

}  // namespace

const CrossEntropyTileKernels cross_entropy_kernels_cpu{&forward_tile, &backward_tile};

}  // namespace CPU_CAPABILITY
}  // namespace torch_offload
