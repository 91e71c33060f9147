// CUDA side of linear_cross_entropy: the fused per-tile kernels (the arithmetic is
// cross_entropy_math.h's, shared with the CPU) and the entry points that run the
// device-generic tiling loop with them. GEMMs go through ATen.
#include "ops/linear_cross_entropy/linear_cross_entropy.h"

#include <limits>

#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "ops/common/cross_entropy_math.h"

namespace torch_offload {
namespace {

constexpr int kThreads = 256;  // one block per row of the tile in forward
constexpr int64_t kMaxBlocks = 65535;

// The block-wide reduction of v by op (max or sum), returned to every thread.
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op) {
  __shared__ T partial[kThreads / 32];
  for (int offset = 16; offset > 0; offset /= 2) {
    v = op(v, __shfl_down_sync(0xffffffffu, v, offset));
  }
  const int lane = threadIdx.x % 32;
  const int warp = threadIdx.x / 32;
  if (lane == 0) {
    partial[warp] = v;
  }
  __syncthreads();
  if (warp == 0) {
    v = partial[0];
    for (int i = 1; i < kThreads / 32; ++i) {
      v = op(v, partial[i]);
    }
    if (lane == 0) {
      partial[0] = v;
    }
  }
  __syncthreads();
  v = partial[0];
  __syncthreads();  // partial is reused by the next reduction
  return v;
}

struct MaxOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a < b || b != b ? b : a;  // NaN wins
  }
};
struct SumOp {
  template <typename T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};

// Block r folds row r of the tile into the running log-sum-exp (see CrossEntropyTileKernels).
template <bool kSoftcap, typename scalar_t, typename acc_t>
__global__ void forward_tile_kernel(scalar_t* logits, int64_t cols, const int64_t* target, int64_t col0, acc_t* max,
                                    acc_t* sum_exp, acc_t* target_z, acc_t* sum_z, acc_t softcap) {
  const int64_t r = blockIdx.x;
  scalar_t* row = logits + r * cols;
  acc_t row_max = -std::numeric_limits<acc_t>::infinity();
  acc_t row_sum_z = 0;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
    const acc_t z = capped_logit<kSoftcap>(static_cast<acc_t>(row[j]), softcap);
    if constexpr (kSoftcap) {
      row[j] = static_cast<scalar_t>(z);
    }
    row_max = MaxOp()(row_max, z);
    row_sum_z += z;
  }
  row_max = block_reduce(row_max, MaxOp());
  row_sum_z = block_reduce(row_sum_z, SumOp());
  acc_t row_sum_exp = 0;
  for (int64_t j = threadIdx.x; j < cols; j += kThreads) {
    row_sum_exp += ActMath<acc_t>::exp(static_cast<acc_t>(row[j]) - row_max);
  }
  row_sum_exp = block_reduce(row_sum_exp, SumOp());
  if (threadIdx.x == 0) {
    lse_combine(&max[r], &sum_exp[r], row_max, row_sum_exp);
    sum_z[r] += row_sum_z;
    const int64_t column = target[r] - col0;
    if (column >= 0 && column < cols) {
      target_z[r] = static_cast<acc_t>(row[column]);
    }
  }
}

// logits <- d loss / d logits, element by element; with gradient filtering (counts
// not null), *counts <- 1 where an entry is not negligible.
template <bool kSoftcap, typename scalar_t, typename acc_t>
__global__ void backward_tile_kernel(scalar_t* logits, int64_t rows, int64_t cols, const int64_t* target, int64_t col0,
                                     const acc_t* lse, const acc_t* grad_scale, acc_t softcap, acc_t eps, acc_t uniform,
                                     acc_t z_loss, acc_t filter_eps, int* counts) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{blockDim.x} * gridDim.x) {
    const int64_t r = i / cols;
    const acc_t g = grad_scale[r];
    const acc_t prob_scale = g * (acc_t(1) + acc_t(2) * z_loss * lse[r]);
    const bool is_target = target[r] - col0 == i - r * cols;
    const acc_t subtract = g * uniform + (is_target ? g * (acc_t(1) - eps) : acc_t(0));
    const acc_t d = logit_gradient<kSoftcap>(static_cast<acc_t>(logits[i]), lse[r], prob_scale, subtract, softcap);
    logits[i] = static_cast<scalar_t>(d);
    if (counts != nullptr && !gradient_is_negligible(d < acc_t(0) ? -d : d, g, filter_eps)) {
      *counts = 1;
    }
  }
}

void forward_tile_cuda(const CrossEntropyOptions& options, const at::Tensor& logits, const at::Tensor& target,
                       int64_t col0, const at::Tensor& max, const at::Tensor& sum_exp, const at::Tensor& target_z,
                       const at::Tensor& sum_z) {
  const int64_t rows = logits.size(0);
  if (rows == 0) {
    return;
  }
  const auto stream = c10::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "linear_cross_entropy_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const auto launch = [&](auto softcap_flag) {
      forward_tile_kernel<decltype(softcap_flag)::value><<<rows, kThreads, 0, stream>>>(
          logits.data_ptr<scalar_t>(), logits.size(1), target.const_data_ptr<int64_t>(), col0, max.data_ptr<acc_t>(),
          sum_exp.data_ptr<acc_t>(), target_z.data_ptr<acc_t>(), sum_z.data_ptr<acc_t>(),
          static_cast<acc_t>(options.softcap));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    };
    if (options.softcap > 0) {
      launch(std::true_type{});
    } else {
      launch(std::false_type{});
    }
  });
}

bool backward_tile_cuda(const CrossEntropyOptions& options, const at::Tensor& logits, const at::Tensor& target,
                        int64_t col0, const at::Tensor& lse, const at::Tensor& grad_scale) {
  const int64_t n = logits.numel();
  if (n == 0) {
    return options.filter_eps <= 0;
  }
  // Filtering reads the flag back: one device synchronization per tile.
  const at::Tensor counts = options.filter_eps > 0 ? at::zeros({1}, logits.options().dtype(at::kInt)) : at::Tensor();
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int blocks = static_cast<int>(std::min<int64_t>(kMaxBlocks, (n + kThreads - 1) / kThreads));
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, logits.scalar_type(), "linear_cross_entropy_backward_cuda", [&] {
        using acc_t = at::opmath_type<scalar_t>;
        const auto launch = [&](auto softcap_flag) {
          backward_tile_kernel<decltype(softcap_flag)::value><<<blocks, kThreads, 0, stream>>>(
              logits.data_ptr<scalar_t>(), logits.size(0), logits.size(1), target.const_data_ptr<int64_t>(), col0,
              lse.const_data_ptr<acc_t>(), grad_scale.const_data_ptr<acc_t>(), static_cast<acc_t>(options.softcap),
              static_cast<acc_t>(options.label_smoothing),
              static_cast<acc_t>(options.label_smoothing / static_cast<double>(options.vocab)),
              static_cast<acc_t>(options.z_loss), static_cast<acc_t>(options.filter_eps),
              counts.defined() ? counts.data_ptr<int>() : nullptr);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        };
        if (options.softcap > 0) {
          launch(std::true_type{});
        } else {
          launch(std::false_type{});
        }
      });
  return !counts.defined() || counts.item<int>() != 0;
}

const CrossEntropyTileKernels kCudaKernels{&forward_tile_cuda, &backward_tile_cuda};

}  // namespace

at::Tensor linear_cross_entropy_cuda(TORCH_OFFLOAD_LCE_ARGS, double filter_eps,
                                     std::optional<bool> gradients_in_forward) {
  check_filter_eps("linear_cross_entropy", filter_eps, label_smoothing);
  gradients_in_forward_by_default("linear_cross_entropy", hidden, softcap, reduction, filter_eps, gradients_in_forward);
  const c10::cuda::CUDAGuard device_guard(hidden.device());
  return std::get<0>(linear_cross_entropy_forward_impl(kCudaKernels, hidden, weight, bias, target, ignore_index,
                                                       label_smoothing, softcap, z_loss, reduction, tile_tokens,
                                                       tile_vocab, /*statistics=*/false));
}

LinearCrossEntropyForward linear_cross_entropy_forward_cuda(TORCH_OFFLOAD_LCE_ARGS, bool statistics) {
  const c10::cuda::CUDAGuard device_guard(hidden.device());
  return linear_cross_entropy_forward_impl(kCudaKernels, hidden, weight, bias, target, ignore_index, label_smoothing,
                                           softcap, z_loss, reduction, tile_tokens, tile_vocab, statistics);
}

LinearCrossEntropyWithGradients linear_cross_entropy_with_gradients_cuda(TORCH_OFFLOAD_LCE_WITH_GRADIENTS_ARGS) {
  const c10::cuda::CUDAGuard device_guard(hidden.device());
  return linear_cross_entropy_with_gradients_impl(kCudaKernels, hidden, weight, bias, target, ignore_index,
                                                  label_smoothing, softcap, z_loss, reduction, tile_tokens, output_mask,
                                                  statistics);
}

LinearCrossEntropyGradients linear_cross_entropy_backward_cuda(TORCH_OFFLOAD_LCE_BACKWARD_ARGS) {
  const c10::cuda::CUDAGuard device_guard(hidden.device());
  return linear_cross_entropy_backward_impl(kCudaKernels, grad_loss, hidden, weight, bias, target, lse, ignore_index,
                                            label_smoothing, softcap, z_loss, reduction, tile_tokens, tile_vocab,
                                            output_mask, filter_eps);
}

}  // namespace torch_offload
