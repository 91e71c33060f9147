// token_divergence from C++ through the public header: the generalized JSD and its gradients (autograd registered
// in C++) against plain ATen on the whole logits, meta tensors, errors.
#include <cmath>

#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "expect_error.h"
#include "torch_offload/torch_offload.h"

namespace {

struct Heads {
  at::Tensor student_hidden, student_weight, teacher_hidden, teacher_weight;
};

// Student [2, 5, 8] and teacher [2, 5, 12] hidden states, one vocabulary of 17.
Heads make_heads() {
  at::manual_seed(0);
  const auto options = at::TensorOptions().dtype(at::kDouble);
  return {at::randn({2, 5, 8}, options).requires_grad_(true), (at::randn({17, 8}, options) / 2).requires_grad_(true),
          at::randn({2, 5, 12}, options), at::randn({17, 12}, options) / 2};
}

// Eager: beta KL(p_t || m) + (1 - beta) KL(p_s || m), the two KLs at beta 0 and 1.
at::Tensor reference(const Heads& m, double beta) {
  const at::Tensor ls = at::log_softmax(at::linear(m.student_hidden, m.student_weight), -1);
  const at::Tensor lt = at::log_softmax(at::linear(m.teacher_hidden, m.teacher_weight), -1);
  if (beta == 0.0) {
    return (lt.exp() * (lt - ls)).sum(-1);
  }
  if (beta == 1.0) {
    return (ls.exp() * (ls - lt)).sum(-1);
  }
  const at::Tensor lm = at::logaddexp(ls + std::log1p(-beta), lt + std::log(beta));
  return beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1);
}

TEST(TokenDivergence, DivergenceAndGradientsMatchAtenWithAutogradFromCpp) {
  const Heads m = make_heads();
  const at::Tensor upstream = at::randn({2, 5}, at::kDouble);
  for (const double beta : {0.0, 0.5, 1.0}) {
    const auto [divergence, entropy] =
        torch_offload::token_divergence(m.student_hidden, m.student_weight, m.teacher_hidden, m.teacher_weight,
                                        std::nullopt, std::nullopt, std::nullopt, beta);
    const at::Tensor want = reference(m, beta);
    EXPECT_TRUE(at::allclose(divergence, want, 1e-10, 1e-12)) << beta;
    EXPECT_FALSE(entropy.requires_grad());
    const auto got = torch::autograd::grad({(divergence * upstream).sum()}, {m.student_hidden, m.student_weight});
    const auto expected = torch::autograd::grad({(want * upstream).sum()}, {m.student_hidden, m.student_weight});
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(at::allclose(got[i], expected[i], 1e-9, 1e-11)) << beta << " " << i;
    }
  }
}

TEST(TokenDivergence, MetaTensorsGetTheOutputShapes) {
  const auto meta = at::TensorOptions().device(at::kMeta).dtype(at::kBFloat16);
  const auto [divergence, entropy] = torch_offload::token_divergence(
      at::empty({3, 4, 8}, meta), at::empty({50, 8}, meta), at::empty({3, 4, 6}, meta), at::empty({50, 6}, meta));
  EXPECT_EQ(divergence.sizes(), at::IntArrayRef({3, 4}));
  EXPECT_EQ(entropy.scalar_type(), at::kFloat);
  EXPECT_TRUE(divergence.is_meta());
}

TEST(TokenDivergence, ErrorsNameTheArgument) {
  const Heads m = make_heads();
  expect_error(
      [&] {
        torch_offload::token_divergence(m.student_hidden, m.student_weight, m.teacher_hidden,
                                        m.teacher_weight.narrow(0, 0, 16));
      },
      "token_divergence: teacher_weight has 16 rows and student_weight 17; expected one vocabulary for both");
  expect_error(
      [&] {
        torch_offload::token_divergence(m.student_hidden, m.student_weight, m.teacher_hidden, m.teacher_weight,
                                        std::nullopt, std::nullopt, std::nullopt, -0.5);
      },
      "token_divergence: beta is -0.5; expected a value in [0, 1]");
}

}  // namespace
