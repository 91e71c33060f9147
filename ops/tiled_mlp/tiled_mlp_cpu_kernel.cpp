// Fused elementwise CPU kernels of tiled_mlp: one pass over a shard's buffers in
// each direction, vectorized with at::vec and split across threads. Compiled once
// per CPU_CAPABILITY (see CMakeLists.txt); the arithmetic is activation_math.h's.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "ops/common/activation_math.h"
#include "ops/tiled_mlp/tiled_mlp_cpu_kernel.h"

namespace torch_offload {

// activation_math.h's functions on whole vectors.
template <typename S>
struct ActMath<at::vec::Vectorized<S>> {
  using V = at::vec::Vectorized<S>;
  static V exp(const V& x) { return x.exp(); }
  static V tanh(const V& x) { return x.tanh(); }
  static V erf(const V& x) { return x.erf(); }
  static V relu(const V& x) { return V::blendv(x, V(S(0)), x <= V(S(0))); }  // NaN stays NaN
  static V step(const V& x) { return x.gt(V(S(0))); }
};

namespace CPU_CAPABILITY {
namespace {

// A step of the loops: Vectorized<scalar_t>::size() elements, as opmath vectors
// (one for float and double; two float vectors for bf16 and fp16).
template <typename scalar_t, typename = void>
struct Lanes {
  using Vec = at::vec::Vectorized<scalar_t>;
  static constexpr int kVecs = 1;
  static void load(const scalar_t* p, Vec* v) { v[0] = Vec::loadu(p); }
  static void store(scalar_t* p, const Vec* v) { v[0].store(p); }
};

template <typename scalar_t>
struct Lanes<scalar_t, std::enable_if_t<c10::is_reduced_floating_point_v<scalar_t>>> {
  using Vec = at::vec::Vectorized<float>;
  static constexpr int kVecs = 2;
  static void load(const scalar_t* p, Vec* v) { at::vec::load_to_float(p, v[0], v[1]); }
  static void store(scalar_t* p, const Vec* v) { at::vec::convert_from_float<scalar_t>(v[0], v[1]).store(p); }
};

template <typename scalar_t>
constexpr int64_t kStep = at::vec::Vectorized<scalar_t>::size();

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
