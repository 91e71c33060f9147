// token_logprobs from C++ through the public header: log-probabilities, entropies and their gradients
// (autograd registered in C++) against plain ATen, the backward op alone, meta tensors, errors.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "expect_error.h"
#include "torch_offload/torch_offload.h"

namespace {

struct Head {
  at::Tensor hidden, weight, bias, ids;
};

// hidden [2, 9, 8], weight [V = 23, 8], bias [23], ids [2, 9].
Head make_head() {
  at::manual_seed(0);
  const auto options = at::TensorOptions().dtype(at::kDouble);
  Head m;
  m.hidden = at::randn({2, 9, 8}, options).requires_grad_(true);
  m.weight = (at::randn({23, 8}, options) / 2).requires_grad_(true);
  m.bias = at::randn({23}, options).requires_grad_(true);
  m.ids = at::randint(0, 23, {2, 9}, at::kLong);
  return m;
}

// Eager: the whole logits' log-softmax at the ids, and the entropy.
std::tuple<at::Tensor, at::Tensor> reference(const Head& m, double temperature) {
  const at::Tensor log_p = at::log_softmax(at::linear(m.hidden, m.weight, m.bias) / temperature, -1);
  return {log_p.gather(-1, m.ids.unsqueeze(-1)).squeeze(-1), -(log_p.exp() * log_p).sum(-1)};
}

void expect_close(const at::Tensor& got, const at::Tensor& want) {
  ASSERT_EQ(got.sizes(), want.sizes());
  EXPECT_TRUE(at::allclose(got, want, 1e-10, 1e-12)) << (got - want).abs().max().item<double>();
}

TEST(TokenLogprobs, OutputsAndGradientsMatchAtenWithAutogradFromCpp) {
  const Head m = make_head();
  const at::Tensor upstream_logprobs = at::randn({2, 9}, at::kDouble),
                   upstream_entropy = at::randn({2, 9}, at::kDouble);
  for (const double temperature : {1.0, 0.7}) {
    const auto [logprobs, entropy] =
        torch_offload::token_logprobs(m.hidden, m.weight, m.ids, m.bias, temperature, true);
    const auto [want_logprobs, want_entropy] = reference(m, temperature);
    expect_close(logprobs, want_logprobs);
    expect_close(entropy, want_entropy);
    const auto got_grads = torch::autograd::grad(
        {(logprobs * upstream_logprobs).sum() + (entropy * upstream_entropy).sum()}, {m.hidden, m.weight, m.bias});
    const auto want_grads =
        torch::autograd::grad({(want_logprobs * upstream_logprobs).sum() + (want_entropy * upstream_entropy).sum()},
                              {m.hidden, m.weight, m.bias});
    for (size_t i = 0; i < got_grads.size(); ++i) {
      expect_close(got_grads[i], want_grads[i]);
    }
  }
}

TEST(TokenLogprobs, SeveralIdsATokenMatchAtenFromOnePass) {
  // A teacher's K = 3 candidates a token: the log-probabilities [2, 9, 3] and the entropy [2, 9], with gradients.
  const Head m = make_head();
  const at::Tensor ids = at::randint(0, 23, {2, 9, 3}, at::kLong);
  const auto [logprobs, entropy] = torch_offload::token_logprobs(m.hidden, m.weight, ids, m.bias, 0.7, true);
  const at::Tensor log_p = at::log_softmax(at::linear(m.hidden, m.weight, m.bias) / 0.7, -1);
  const at::Tensor want_logprobs = log_p.gather(-1, ids), want_entropy = -(log_p.exp() * log_p).sum(-1);
  expect_close(logprobs, want_logprobs);
  expect_close(entropy, want_entropy);
  // Upstream gradients differing per token and per id: one sent to the wrong token or id would show.
  const at::Tensor upstream = at::randn({2, 9, 3}, at::kDouble), upstream_entropy = at::randn({2, 9}, at::kDouble);
  const auto got_grads = torch::autograd::grad({(logprobs * upstream).sum() + (entropy * upstream_entropy).sum()},
                                               {m.hidden, m.weight, m.bias});
  const auto want_grads = torch::autograd::grad(
      {(want_logprobs * upstream).sum() + (want_entropy * upstream_entropy).sum()}, {m.hidden, m.weight, m.bias});
  for (size_t i = 0; i < got_grads.size(); ++i) {
    expect_close(got_grads[i], want_grads[i]);
  }
}

TEST(TokenLogprobs, BackwardOpGivesOnlyTheGradientsAskedFor) {
  const Head m = make_head();
  const at::Tensor hidden = m.hidden.detach(), weight = m.weight.detach();
  const auto [logprobs, entropy, lse] =
      torch_offload::token_logprobs_forward(hidden, weight, m.ids, std::nullopt, 1.0, false);
  EXPECT_EQ(entropy.numel(), 0);
  const auto [grad_hidden, grad_weight, grad_bias] =
      torch_offload::token_logprobs_backward(at::ones({2, 9}, at::kDouble), std::nullopt, hidden, weight, m.ids,
                                             std::nullopt, lse, std::nullopt, 1.0, {false, true, true});
  EXPECT_FALSE(grad_hidden.defined());
  EXPECT_FALSE(grad_bias.defined());  // no bias
  // d sum(log p_t) / d W_j = sum over tokens of ([j = t] - p_j) x.
  const at::Tensor p = at::softmax(at::linear(hidden, weight), -1).view({-1, 23});
  const at::Tensor one_hot = at::one_hot(m.ids.view({-1}), 23).to(at::kDouble);
  expect_close(grad_weight, (one_hot - p).t().mm(hidden.view({-1, 8})));
}

TEST(TokenLogprobs, MetaTensorsGiveShapes) {
  const auto meta = at::TensorOptions().device(at::kMeta);
  const auto [logprobs, entropy] = torch_offload::token_logprobs(
      at::empty({3, 4, 8}, meta.dtype(at::kBFloat16)), at::empty({30, 8}, meta.dtype(at::kBFloat16)),
      at::empty({3, 4}, meta.dtype(at::kLong)), std::nullopt, 1.0, true);
  EXPECT_EQ(logprobs.sizes(), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(entropy.scalar_type(), at::kFloat);
}

TEST(TokenLogprobs, BadArgumentsAreNamed) {
  const Head m = make_head();
  expect_error([&] { torch_offload::token_logprobs(m.hidden, m.weight, m.ids + 23); },
               "; expected token ids in [0, 23)");
  expect_error([&] { torch_offload::token_logprobs(m.hidden, m.weight, m.ids, std::nullopt, -1.0); },
               "token_logprobs: temperature is -1; expected a finite value > 0");
  expect_error([&] { torch_offload::token_logprobs(at::Tensor(), m.weight, m.ids); },
               "token_logprobs: hidden is an undefined tensor");
}

}  // namespace
