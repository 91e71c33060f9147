// Fused elementwise CPU kernels of tiled_mlp: one pass over a shard's buffers in
// each direction, vectorized with at::vec and split across threads. Compiled once
// per CPU_CAPABILITY (see CMakeLists.txt); the arithmetic is activation_math.h's.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include "ops/common/activation_math.h"
#include "ops/common/cpu_vec.h"
#include "ops/tiled_mlp/tiled_mlp_cpu_kernel.h"

namespace torch_offload {

namespace CPU_CAPABILITY {
namespace {

constexpr int64_t kGrainSize = 32768;  // elements per thread task, as in ATen's elementwise loops

// gate <- mlp_hidden(gate, up) over n elements.
template <Activation kAct, bool kGated, typename scalar_t>
void forward_loop(scalar_t* gate, const scalar_t* up, int64_t n) {
  using L = Lanes<scalar_t>;
  using opmath_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, n, kGrainSize, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + kStep<scalar_t> <= end; i += kStep<scalar_t>) {
      typename L::Vec g[L::kVecs], u[L::kVecs];
      L::load(gate + i, g);
      if constexpr (kGated) {
        L::load(up + i, u);
      }
      for (int k = 0; k < L::kVecs; ++k) {
        g[k] = mlp_hidden<kAct, kGated>(g[k], kGated ? u[k] : g[k]);
      }
      L::store(gate + i, g);
    }
    for (; i < end; ++i) {
      hidden_forward_element<kAct, kGated, opmath_t>(gate, up, i);
    }
  });
}

// (gate, up, d_hidden) <- (d_gate, d_up, hidden) over n elements.
template <Activation kAct, bool kGated, typename scalar_t>
void backward_loop(scalar_t* gate, scalar_t* up, scalar_t* d_hidden, int64_t n) {
  using L = Lanes<scalar_t>;
  using opmath_t = at::opmath_type<scalar_t>;
  at::parallel_for(0, n, kGrainSize, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + kStep<scalar_t> <= end; i += kStep<scalar_t>) {
      typename L::Vec g[L::kVecs], u[L::kVecs], dh[L::kVecs];
      L::load(gate + i, g);
      L::load(d_hidden + i, dh);
      if constexpr (kGated) {
        L::load(up + i, u);
      }
      for (int k = 0; k < L::kVecs; ++k) {
        // Written over the inputs: each output depends on its own element only.
        mlp_hidden_backward<kAct, kGated>(g[k], kGated ? u[k] : g[k], dh[k], &dh[k], &g[k], &u[k]);
      }
      L::store(gate + i, g);
      L::store(d_hidden + i, dh);
      if constexpr (kGated) {
        L::store(up + i, u);
      }
    }
    for (; i < end; ++i) {
      hidden_backward_element<kAct, kGated, opmath_t>(gate, up, d_hidden, i);
    }
  });
}

void hidden_forward(Activation act, const at::Tensor& gate, const at::Tensor& up) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "tiled_mlp_cpu", [&] {
    dispatch_activation(act, [&](auto kind) {
      if (up.defined()) {
        forward_loop<decltype(kind)::value, true>(gate.data_ptr<scalar_t>(), up.const_data_ptr<scalar_t>(),
                                                  gate.numel());
      } else {
        forward_loop<decltype(kind)::value, false, scalar_t>(gate.data_ptr<scalar_t>(), nullptr, gate.numel());
      }
    });
  });
}

void hidden_backward(Activation act, const at::Tensor& gate, const at::Tensor& up, const at::Tensor& d_hidden) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate.scalar_type(), "tiled_mlp_backward_cpu", [&] {
    dispatch_activation(act, [&](auto kind) {
      if (up.defined()) {
        backward_loop<decltype(kind)::value, true>(gate.data_ptr<scalar_t>(), up.data_ptr<scalar_t>(),
                                                   d_hidden.data_ptr<scalar_t>(), gate.numel());
      } else {
        backward_loop<decltype(kind)::value, false, scalar_t>(gate.data_ptr<scalar_t>(), nullptr,
                                                              d_hidden.data_ptr<scalar_t>(), gate.numel());
      }
    });
  });
}

}  // namespace

const HiddenKernels hidden_kernels_cpu{&hidden_forward, &hidden_backward};

}  // namespace CPU_CAPABILITY
}  // namespace torch_offload
