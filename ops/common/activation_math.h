#pragma once
// The elementwise arithmetic of tiled_mlp: the activation fused with the gate * up
// product, and its derivative. One copy serves the CUDA kernels (T = float or
// double) and the CPU kernels (T = float, double or at::vec::Vectorized of them,
// whose ActMath specialization lives with the CPU kernel), so the CPU tests check
// the GPU's formulas too. Reduced-precision inputs are computed in float.
#include <cmath>
#include <cstdint>
#include <type_traits>

#ifdef __CUDACC__
#define TORCH_OFFLOAD_HOST_DEVICE __host__ __device__
#else
#define TORCH_OFFLOAD_HOST_DEVICE
#endif

namespace torch_offload {

enum class Activation : int8_t { kSilu, kGelu, kGeluTanh, kRelu };

// The CPU kernels are compiled once per vector ISA (CPU_CAPABILITY): each build gets
// its own copy of the inline functions below, so that the linker cannot hand an
// AVX512-compiled one to the DEFAULT kernels.
#ifdef CPU_CAPABILITY
#define TORCH_OFFLOAD_MATH_NAMESPACE CPU_CAPABILITY
#else
#define TORCH_OFFLOAD_MATH_NAMESPACE generic
#endif
inline namespace TORCH_OFFLOAD_MATH_NAMESPACE {

// Elementary functions for one element type. relu keeps NaN (like torch.relu);
// step is relu's derivative, 1 where x > 0 and 0 elsewhere.
template <typename T>
struct ActMath;

template <>
struct ActMath<float> {
  TORCH_OFFLOAD_HOST_DEVICE static float exp(float x) { return ::expf(x); }
  TORCH_OFFLOAD_HOST_DEVICE static float tanh(float x) { return ::tanhf(x); }
  TORCH_OFFLOAD_HOST_DEVICE static float erf(float x) { return ::erff(x); }
  TORCH_OFFLOAD_HOST_DEVICE static float relu(float x) { return x <= 0.f ? 0.f : x; }
  TORCH_OFFLOAD_HOST_DEVICE static float step(float x) { return x > 0.f ? 1.f : 0.f; }
};

template <>
struct ActMath<double> {
  TORCH_OFFLOAD_HOST_DEVICE static double exp(double x) { return ::exp(x); }
  TORCH_OFFLOAD_HOST_DEVICE static double tanh(double x) { return ::tanh(x); }
  TORCH_OFFLOAD_HOST_DEVICE static double erf(double x) { return ::erf(x); }
  TORCH_OFFLOAD_HOST_DEVICE static double relu(double x) { return x <= 0.0 ? 0.0 : x; }
  TORCH_OFFLOAD_HOST_DEVICE static double step(double x) { return x > 0.0 ? 1.0 : 0.0; }
};

// act(x); with a grad pointer also act'(x) into *grad.
template <Activation kAct, typename T>
TORCH_OFFLOAD_HOST_DEVICE inline T activation(T x, T* grad = nullptr) {
  using M = ActMath<T>;
  const T one(1.0), half(0.5);
  if constexpr (kAct == Activation::kSilu) {
    const T sigmoid = one / (one + M::exp(-x));
    if (grad != nullptr) {
      *grad = sigmoid * (one + x * (one - sigmoid));
    }
    return x * sigmoid;
  } else if constexpr (kAct == Activation::kGelu) {
    // 0.5 x (1 + erf(x / sqrt 2))
    const T cdf = half * (one + M::erf(x * T(0.70710678118654752440)));
    if (grad != nullptr) {
      *grad = cdf + x * T(0.39894228040143267794) * M::exp(T(-0.5) * x * x);  // + x pdf(x)
    }
    return x * cdf;
  } else if constexpr (kAct == Activation::kGeluTanh) {
    // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
    const T k0(0.79788456080286535588), k1(0.044715);
    const T x2 = x * x;
    const T t = M::tanh(k0 * x * (one + k1 * x2));
    if (grad != nullptr) {
      *grad = half * (one + t) + half * x * (one - t * t) * k0 * (one + T(3.0) * k1 * x2);
    }
    return half * x * (one + t);
  } else {
    static_assert(kAct == Activation::kRelu, "unknown activation");
    if (grad != nullptr) {
      *grad = M::step(x);
    }
    return M::relu(x);
  }
}

// The hidden activation of one element: act(gate) * up, or act(gate) when the
// MLP has no up projection.
template <Activation kAct, bool kGated, typename T>
TORCH_OFFLOAD_HOST_DEVICE inline T mlp_hidden(T gate, T up) {
  if constexpr (kGated) {
    return activation<kAct>(gate) * up;
  } else {
    return activation<kAct>(gate);
  }
}

// Backward of mlp_hidden for one element, given d_hidden = dL/d(hidden): the
// gradients of gate and up, and the hidden value itself (the down projection's
// weight gradient needs it).
template <Activation kAct, bool kGated, typename T>
TORCH_OFFLOAD_HOST_DEVICE inline void mlp_hidden_backward(T gate, T up, T d_hidden, T* hidden, T* d_gate, T* d_up) {
  T act_grad(0.0);
  const T act = activation<kAct>(gate, &act_grad);
  if constexpr (kGated) {
    *hidden = act * up;
    *d_gate = d_hidden * up * act_grad;
    *d_up = d_hidden * act;
  } else {
    *hidden = act;
    *d_gate = d_hidden * act_grad;
  }
}

// One element in memory, computed in opmath_t (float for bf16/fp16): the CPU
// kernels' scalar loops and the CUDA kernels run these same lines.
// gate[i] <- mlp_hidden(gate[i], up[i]).
template <Activation kAct, bool kGated, typename opmath_t, typename scalar_t>
TORCH_OFFLOAD_HOST_DEVICE inline void hidden_forward_element(scalar_t* gate, const scalar_t* up, int64_t i) {
  const auto g = static_cast<opmath_t>(gate[i]);
  gate[i] = static_cast<scalar_t>(mlp_hidden<kAct, kGated>(g, kGated ? static_cast<opmath_t>(up[i]) : g));
}

// (gate[i], up[i], d_hidden[i]) <- (d_gate, d_up, hidden).
template <Activation kAct, bool kGated, typename opmath_t, typename scalar_t>
TORCH_OFFLOAD_HOST_DEVICE inline void hidden_backward_element(scalar_t* gate, scalar_t* up, scalar_t* d_hidden,
                                                              int64_t i) {
  const auto g = static_cast<opmath_t>(gate[i]);
  opmath_t hidden, d_gate, d_up;
  mlp_hidden_backward<kAct, kGated>(g, kGated ? static_cast<opmath_t>(up[i]) : g, static_cast<opmath_t>(d_hidden[i]),
                                    &hidden, &d_gate, &d_up);
  gate[i] = static_cast<scalar_t>(d_gate);
  d_hidden[i] = static_cast<scalar_t>(hidden);
  if constexpr (kGated) {
    up[i] = static_cast<scalar_t>(d_up);
  }
}

}  // namespace TORCH_OFFLOAD_MATH_NAMESPACE

// Calls f(std::integral_constant<Activation, a>{}) so kernels take the activation
// as a template argument: the per-element code has no switch.
template <typename F>
decltype(auto) dispatch_activation(Activation a, F&& f) {
  switch (a) {
    case Activation::kGelu:
      return f(std::integral_constant<Activation, Activation::kGelu>{});
    case Activation::kGeluTanh:
      return f(std::integral_constant<Activation, Activation::kGeluTanh>{});
    case Activation::kRelu:
      return f(std::integral_constant<Activation, Activation::kRelu>{});
    case Activation::kSilu:
      break;
  }
  return f(std::integral_constant<Activation, Activation::kSilu>{});
}

}  // namespace torch_offload
