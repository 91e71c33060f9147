// rms_norm from C++ through the public header: output and gradients (autograd registered in C++) against
// plain ATen, the backward op alone, meta tensors, errors.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "expect_error.h"
#include "torch_offload/torch_offload.h"

namespace {

at::Tensor reference(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return weight * (x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps));
}

void expect_close(const at::Tensor& got, const at::Tensor& want) {
  ASSERT_EQ(got.sizes(), want.sizes());
  EXPECT_TRUE(at::allclose(got, want, 1e-12, 1e-12)) << (got - want).abs().max().item<double>();
}

TEST(RmsNorm, OutputAndGradientsMatchAtenWithAutogradFromCpp) {
  at::manual_seed(0);
  const at::Tensor x = at::randn({2, 9, 8}, at::kDouble).requires_grad_(true);
  const at::Tensor weight = at::randn({8}, at::kDouble).requires_grad_(true);
  const at::Tensor upstream = at::randn({2, 9, 8}, at::kDouble);
  const at::Tensor got = torch_offload::rms_norm(x, weight, 1e-5), want = reference(x, weight, 1e-5);
  expect_close(got, want);
  const auto got_grads = torch::autograd::grad({(got * upstream).sum()}, {x, weight});
  const auto want_grads = torch::autograd::grad({(want * upstream).sum()}, {x, weight});
  for (size_t i = 0; i < got_grads.size(); ++i) {
    expect_close(got_grads[i], want_grads[i]);
  }
}

TEST(RmsNorm, BackwardOpGivesOnlyTheGradientsAskedFor) {
  at::manual_seed(0);
  const at::Tensor x = at::randn({5, 8}, at::kDouble), weight = at::randn({8}, at::kDouble);
  const auto [grad_x, grad_weight] =
      torch_offload::rms_norm_backward(at::ones({5, 8}, at::kDouble), x, weight, 1e-6, {false, true});
  EXPECT_FALSE(grad_x.defined());
  // d sum(y) / d weight = the normalized rows' sum.
  expect_close(grad_weight, (x * at::rsqrt(x.pow(2).mean(-1, true) + 1e-6)).sum(0));
}

TEST(RmsNorm, MetaTensorsGiveShapes) {
  const auto meta = at::TensorOptions().device(at::kMeta).dtype(at::kBFloat16);
  const at::Tensor out = torch_offload::rms_norm(at::empty({3, 4, 8}, meta), at::empty({8}, meta));
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{3, 4, 8}));
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
}

TEST(RmsNorm, BadArgumentsAreNamed) {
  const at::Tensor x = at::randn({3, 8});
  expect_error([&] { torch_offload::rms_norm(x, at::randn({7})); },
               "rms_norm: weight has shape [7]; expected [h], x's last dimension = [8]");
  expect_error([&] { torch_offload::rms_norm(x, at::randn({8}), -1.0); },
               "rms_norm: eps is -1; expected a finite value >= 0");
  expect_error([&] { torch_offload::rms_norm(at::Tensor(), at::randn({8})); }, "rms_norm: x is an undefined tensor");
}

}  // namespace
