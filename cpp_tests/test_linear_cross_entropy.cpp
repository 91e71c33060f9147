// linear_cross_entropy from C++ through the public header: loss and gradients
// (autograd registered in C++) against plain ATen, a frozen head, meta tensors, errors.
#include <gtest/gtest.h>

#include <string>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "expect_error.h"
#include "torch_offload/torch_offload.h"

namespace {

struct Head {
  at::Tensor hidden, weight, bias, target;
};

// hidden [2, 9, 8], weight [V = 23, 8], bias [23], target [2, 9] with ignored tokens.
Head make_head() {
  at::manual_seed(0);
  const auto options = at::TensorOptions().dtype(at::kDouble);
  Head m;
  m.hidden = at::randn({2, 9, 8}, options).requires_grad_(true);
  m.weight = (at::randn({23, 8}, options) / 2).requires_grad_(true);
  m.bias = at::randn({23}, options).requires_grad_(true);
  m.target = at::randint(0, 23, {2, 9}, at::kLong);
  m.target.view({-1}).slice(0, 0, 18, 4).fill_(-100);
  return m;
}

// Eager: softcap, label smoothing and z-loss written in plain ATen, reduction mean.
at::Tensor reference(const Head& m, double label_smoothing, double softcap, double z_loss) {
  at::Tensor logits = at::linear(m.hidden, m.weight, m.bias).view({-1, 23});
  if (softcap > 0) {
    logits = softcap * at::tanh(logits / softcap);
  }
  const at::Tensor target = m.target.view({-1});
  const at::Tensor valid = target.ne(-100);
  at::Tensor loss = at::cross_entropy_loss(logits, target, {}, at::Reduction::None, -100, label_smoothing);
  loss = at::where(valid, loss + z_loss * logits.logsumexp({-1}).square(), at::zeros({}, logits.options()));
  return loss.sum() / valid.sum();
}

void expect_close(const at::Tensor& got, const at::Tensor& want) {
  ASSERT_EQ(got.sizes(), want.sizes());
  EXPECT_TRUE(at::allclose(got, want, 1e-10, 1e-12)) << (got - want).abs().max().item<double>();
}

TEST(LinearCrossEntropy, LossAndGradientsMatchAtenWithAutogradFromCpp) {
  const Head m = make_head();
  for (const auto& [smoothing, softcap, z_loss] : {std::tuple{0.0, 0.0, 0.0}, std::tuple{0.2, 3.0, 1e-2}}) {
    const at::Tensor loss = torch_offload::linear_cross_entropy(m.hidden, m.weight, m.bias, m.target, -100, smoothing,
                                                                softcap, z_loss, "mean", 4, 5);
    const at::Tensor want = reference(m, smoothing, softcap, z_loss);
    ASSERT_TRUE(loss.requires_grad());
    expect_close(loss, want);
    const auto got_grads = torch::autograd::grad({loss}, {m.hidden, m.weight, m.bias});
    const auto want_grads = torch::autograd::grad({want}, {m.hidden, m.weight, m.bias});
    for (size_t i = 0; i < got_grads.size(); ++i) {
      expect_close(got_grads[i], want_grads[i]);
    }
  }
}

TEST(LinearCrossEntropy, BothPathsOfTheGradientsMatchAtenFromCpp) {
  const Head m = make_head();
  const at::Tensor want = reference(m, 0.1, 0.0, 1e-2);
  const auto unit_grads = torch::autograd::grad({want}, {m.hidden, m.weight, m.bias});
  for (const bool in_forward : {true, false}) {
    const at::Tensor loss = torch_offload::linear_cross_entropy(m.hidden, m.weight, m.bias, m.target, -100, 0.1, 0.0,
                                                                1e-2, "mean", 4, 5, 0.0, in_forward);
    expect_close(loss, want);
    const auto got_grads = torch::autograd::grad({loss * 3}, {m.hidden, m.weight, m.bias});
    for (size_t i = 0; i < got_grads.size(); ++i) {
      expect_close(got_grads[i], unit_grads[i] * 3);
    }
  }
  // The op itself: the loss and its gradients for a unit grad_loss, those asked for.
  const auto [loss, grad_hidden, grad_weight, grad_bias, statistics] =
      torch_offload::linear_cross_entropy_with_gradients(m.hidden.detach(), m.weight.detach(), m.bias.detach(),
                                                         m.target, -100, 0.1, 0.0, 1e-2, "mean", 4,
                                                         {false, true, true});
  expect_close(loss, want);
  EXPECT_FALSE(grad_hidden.defined());
  expect_close(grad_weight, unit_grads[1]);
  expect_close(grad_bias, unit_grads[2]);
  EXPECT_EQ(statistics.numel(), 0);  // not asked for
  expect_error(
      [&] {
        torch_offload::linear_cross_entropy(m.hidden, m.weight, m.bias, m.target, -100, 0.0, 0.0, 0.0, "none", 0, 0,
                                            0.0, true);
      },
      "gradients_in_forward is True with reduction \"none\"");
}

TEST(LinearCrossEntropy, StatisticsFromTheSamePassMatchAten) {
  const Head m = make_head();
  const double softcap = 3.0, z_loss = 1e-2;
  const auto [loss, z_loss_term, accuracy, entropy] = torch_offload::linear_cross_entropy_with_statistics(
      m.hidden, m.weight, m.bias, m.target, -100, 0.0, softcap, z_loss, "mean", 4, 5);
  expect_close(loss, reference(m, 0.0, softcap, z_loss));
  EXPECT_FALSE(entropy.requires_grad());
  const at::Tensor logits = softcap * at::tanh(at::linear(m.hidden, m.weight, m.bias).view({-1, 23}) / softcap);
  const at::Tensor valid = m.target.view({-1}).ne(-100);
  const at::Tensor count = valid.sum();
  const auto mean = [&](const at::Tensor& per_token) {
    return at::where(valid, per_token, at::zeros({}, per_token.options())).sum() / count;
  };
  const at::Tensor log_p = logits.log_softmax(-1);
  expect_close(entropy, mean(-(log_p.exp() * log_p).sum(-1)).detach());
  expect_close(z_loss_term, mean(z_loss * logits.logsumexp({-1}).square()).detach());
  const at::Tensor top1 = logits.argmax(-1).eq(m.target.view({-1}).clamp_min(0)).to(at::kDouble);
  expect_close(accuracy, mean(top1));
}

TEST(LinearCrossEntropy, FrozenHeadGetsNoGradientAndTheBackwardOpSkipsIt) {
  Head m = make_head();
  m.weight = m.weight.detach();
  m.bias = m.bias.detach();
  const at::Tensor loss = torch_offload::linear_cross_entropy(m.hidden, m.weight, m.bias, m.target);
  expect_close(torch::autograd::grad({loss}, {m.hidden})[0],
               torch::autograd::grad({reference(m, 0.0, 0.0, 0.0)}, {m.hidden})[0]);

  const auto [loss2, lse, statistics] = torch_offload::linear_cross_entropy_forward(
      m.hidden.detach(), m.weight, m.bias, m.target, -100, 0.0, 0.0, 0.0, "sum", 0, 0);
  EXPECT_EQ(lse.sizes(), (std::vector<int64_t>{18}));
  EXPECT_EQ(statistics.numel(), 0);
  const auto [d_hidden, d_weight, d_bias] = torch_offload::linear_cross_entropy_backward(
      at::ones({}, at::kDouble), m.hidden.detach(), m.weight, m.bias, m.target, lse, -100, 0.0, 0.0, 0.0, "sum", 0, 0,
      {true, false, false});
  EXPECT_TRUE(d_hidden.defined());
  EXPECT_FALSE(d_weight.defined());
  EXPECT_FALSE(d_bias.defined());
}

TEST(LinearCrossEntropy, GradientFilteringSkipsTheImprobableVocabularyTiles) {
  Head m = make_head();
  m.bias = m.bias.detach().index_fill(0, at::arange(12, 23), -60.0).requires_grad_(true);
  m.target = at::where(m.target.ge(0), m.target.remainder(12), m.target);
  const auto grads = [&](double filter_eps) {
    const at::Tensor loss = torch_offload::linear_cross_entropy(m.hidden, m.weight, m.bias, m.target, -100, 0.0, 0.0,
                                                                0.0, "mean", 4, 6, filter_eps,
                                                                /*gradients_in_forward=*/false);
    return torch::autograd::grad({loss}, {m.hidden, m.weight, m.bias});
  };
  const auto filtered = grads(1e-20);
  const auto unfiltered = grads(0.0);
  // Columns 12..22 (two of the four vocabulary tiles) have softmax < 1e-20: skipped, so exactly zero.
  EXPECT_TRUE(filtered[1].slice(0, 12).eq(0).all().item<bool>());
  EXPECT_TRUE(unfiltered[1].slice(0, 12).ne(0).all().item<bool>());
  EXPECT_TRUE(at::equal(filtered[1].slice(0, 0, 12), unfiltered[1].slice(0, 0, 12)));
  for (size_t i = 0; i < filtered.size(); ++i) {
    expect_close(filtered[i], unfiltered[i]);
  }
  expect_error(
      [&] {
        torch_offload::linear_cross_entropy(m.hidden, m.weight, m.bias, m.target, -100, 0.1, 0.0, 0.0, "mean", 0, 0,
                                            1e-20);
      },
      "linear_cross_entropy: filter_eps is 1e-20 with label_smoothing 0.1");
}

TEST(LinearCrossEntropy, MetaTensorsGiveShapes) {
  const auto meta = at::TensorOptions().device(at::kMeta).dtype(at::kBFloat16);
  const at::Tensor loss =
      torch_offload::linear_cross_entropy(at::empty({2, 9, 8}, meta), at::empty({23, 8}, meta), std::nullopt,
                                          at::empty({2, 9}, meta.dtype(at::kLong)), -100, 0.0, 0.0, 0.0, "none");
  EXPECT_TRUE(loss.is_meta());
  EXPECT_EQ(loss.sizes(), (std::vector<int64_t>{2, 9}));
  EXPECT_EQ(loss.scalar_type(), at::kFloat);
}

TEST(LinearCrossEntropy, AutomaticTileIsThePublishedOne) {
  EXPECT_EQ(torch_offload::linear_cross_entropy_tile(16384, 32000, at::kFloat), (std::vector<int64_t>{1024, 2000}));
}

TEST(LinearCrossEntropy, BadInputsRaiseErrorsNamingTheArgument) {
  const Head m = make_head();
  const at::Tensor hidden = m.hidden.detach();
  const at::Tensor bad_target = m.target.clone();
  bad_target.view({-1})[1] = 23;
  expect_error([&] { torch_offload::linear_cross_entropy(hidden, m.weight, std::nullopt, bad_target); },
               "linear_cross_entropy: target holds 23 at (flattened) index 1; expected class indices in [0, 23)");
  expect_error(
      [&] { torch_offload::linear_cross_entropy(hidden, at::zeros({23, 7}, at::kDouble), std::nullopt, m.target); },
      "linear_cross_entropy: weight has shape [23, 7]; expected [V, h] = [23, 8]");
  expect_error([&] { torch_offload::linear_cross_entropy(hidden, m.weight, std::nullopt, m.target.to(at::kFloat)); },
               "linear_cross_entropy: target has dtype Float; expected int64");
  expect_error(
      [&] {
        torch_offload::linear_cross_entropy(hidden, m.weight, std::nullopt, m.target, -100, 0.0, 0.0, 0.0, "max");
      },
      "linear_cross_entropy: reduction is 'max'; expected one of mean, sum, none");
  expect_error([&] { torch_offload::linear_cross_entropy(at::Tensor(), m.weight, std::nullopt, m.target); },
               "linear_cross_entropy: hidden is an undefined tensor");
}

TEST(LinearCrossEntropyCuda, MatchesTheCpuOpWithGradients) {
  if (!at::hasCUDA()) {
    GTEST_SKIP() << "no CUDA device";
  }
  const Head cpu = make_head();
  Head gpu;
  for (auto [from, to] : {std::pair{&cpu.hidden, &gpu.hidden}, {&cpu.weight, &gpu.weight}, {&cpu.bias, &gpu.bias}}) {
    *to = from->detach().to(at::kCUDA).requires_grad_(true);
  }
  gpu.target = cpu.target.to(at::kCUDA);
  const auto run = [](const Head& m) {
    return torch_offload::linear_cross_entropy(m.hidden, m.weight, m.bias, m.target, -100, 0.1, 2.0, 1e-3, "mean", 4,
                                               5);
  };
  const at::Tensor gpu_loss = run(gpu);
  const at::Tensor cpu_loss = run(cpu);
  expect_close(gpu_loss.cpu(), cpu_loss);
  const auto gpu_grads = torch::autograd::grad({gpu_loss}, {gpu.hidden, gpu.weight, gpu.bias});
  const auto cpu_grads = torch::autograd::grad({cpu_loss}, {cpu.hidden, cpu.weight, cpu.bias});
  for (size_t i = 0; i < gpu_grads.size(); ++i) {
    expect_close(gpu_grads[i].cpu(), cpu_grads[i]);
  }
}

}  // namespace
