#pragma once
// at::vec building blocks of the fused CPU kernels, which are compiled once per
// CPU_CAPABILITY (see CMakeLists.txt): activation_math.h's elementary functions on
// whole vectors, and loads/stores of a step of elements as opmath vectors.
#include <type_traits>

#include <ATen/OpMathType.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "ops/common/activation_math.h"

namespace torch_offload {

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

}  // namespace CPU_CAPABILITY
}  // namespace torch_offload
