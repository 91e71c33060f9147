// tiled_mlp from C++ through the public header: values and gradients (autograd
// registered in C++) against plain ATen, gradients that are not needed, errors.
#include <gtest/gtest.h>

#include <string>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "expect_error.h"
#include "torch_offload/torch_offload.h"

namespace {

struct Mlp {
  at::Tensor x, w_gate, w_up, w_down, b_gate, b_up, b_down;
};

Mlp make_mlp(bool gated, bool bias, int64_t h = 8, int64_t intermediate = 20) {
  at::manual_seed(0);
  const auto options = at::TensorOptions().dtype(at::kDouble);
  Mlp m;
  m.x = at::randn({3, 7, h}, options).requires_grad_(true);
  m.w_gate = (at::randn({intermediate, h}, options) / 3).requires_grad_(true);
  m.w_down = (at::randn({h, intermediate}, options) / 4).requires_grad_(true);
  if (gated) {
    m.w_up = (at::randn({intermediate, h}, options) / 3).requires_grad_(true);
  }
  if (bias) {
    m.b_gate = at::randn({intermediate}, options).requires_grad_(true);
    m.b_down = at::randn({h}, options).requires_grad_(true);
    if (gated) {
      m.b_up = at::randn({intermediate}, options).requires_grad_(true);
    }
  }
  return m;
}

std::optional<at::Tensor> opt(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

at::Tensor tiled(const Mlp& m, const std::string& activation, int64_t num_shards) {
  return torch_offload::tiled_mlp(m.x, m.w_gate, opt(m.w_up), m.w_down, opt(m.b_gate), opt(m.b_up), opt(m.b_down),
                                  activation, num_shards);
}

// The untiled MLP in plain ATen.
at::Tensor reference(const Mlp& m, const std::string& activation) {
  at::Tensor hidden = at::linear(m.x, m.w_gate, opt(m.b_gate));
  hidden = activation == "silu" ? at::silu(hidden) : at::gelu(hidden, activation == "gelu_tanh" ? "tanh" : "none");
  if (m.w_up.defined()) {
    hidden = hidden * at::linear(m.x, m.w_up, opt(m.b_up));
  }
  return at::linear(hidden, m.w_down, opt(m.b_down));
}

std::vector<at::Tensor> leaves(const Mlp& m) {
  std::vector<at::Tensor> out;
  for (const at::Tensor& t : {m.x, m.w_gate, m.w_up, m.w_down, m.b_gate, m.b_up, m.b_down}) {
    if (t.defined() && t.requires_grad()) {
      out.push_back(t);
    }
  }
  return out;
}

void expect_close(const at::Tensor& got, const at::Tensor& want) {
  ASSERT_EQ(got.sizes(), want.sizes());
  EXPECT_TRUE(at::allclose(got, want, 1e-10, 1e-12)) << (got - want).abs().max().item<double>();
}

struct Case {
  bool gated, bias;
  const char* activation;
};

class TiledMlpAgainstAten : public ::testing::TestWithParam<Case> {};

TEST_P(TiledMlpAgainstAten, ValuesAndGradientsMatchWithAutogradFromCpp) {
  const Case c = GetParam();
  const Mlp m = make_mlp(c.gated, c.bias);
  const at::Tensor out = tiled(m, c.activation, 4);
  const at::Tensor want = reference(m, c.activation);
  ASSERT_TRUE(out.requires_grad());
  expect_close(out, want);
  const at::Tensor grad_out = at::randn_like(want);
  const auto got_grads = torch::autograd::grad({out}, leaves(m), {grad_out});
  const auto want_grads = torch::autograd::grad({want}, leaves(m), {grad_out});
  ASSERT_EQ(got_grads.size(), want_grads.size());
  for (size_t i = 0; i < got_grads.size(); ++i) {
    expect_close(got_grads[i], want_grads[i]);
  }
}

INSTANTIATE_TEST_SUITE_P(Mlps, TiledMlpAgainstAten,
                         ::testing::Values(Case{true, true, "silu"}, Case{true, false, "gelu"},
                                           Case{false, true, "gelu_tanh"}, Case{false, false, "silu"}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return std::string(info.param.gated ? "gated_" : "plain_") +
                                  (info.param.bias ? "bias_" : "nobias_") + info.param.activation;
                         });

TEST(TiledMlp, FrozenWeightsGetNoGradientAndXGetsTheRightOne) {
  Mlp m = make_mlp(true, true);
  for (at::Tensor* w : {&m.w_gate, &m.w_up, &m.w_down, &m.b_gate, &m.b_up, &m.b_down}) {
    *w = w->detach();
  }
  const at::Tensor out = tiled(m, "silu", 3);
  const auto grads = torch::autograd::grad({out.sum()}, {m.x});
  expect_close(grads[0], torch::autograd::grad({reference(m, "silu").sum()}, {m.x})[0]);

  // The backward op itself returns undefined tensors where the mask says no.
  const auto [dx, dw_gate, dw_up, dw_down, db_gate, db_up, db_down] =
      torch_offload::tiled_mlp_backward(at::ones_like(out), m.x.detach(), m.w_gate, m.w_up, m.w_down, m.b_gate, m.b_up,
                                        m.b_down, "silu", 3, {true, false, false, false, false, false, false});
  EXPECT_TRUE(dx.defined());
  for (const at::Tensor& g : {dw_gate, dw_up, dw_down, db_gate, db_up, db_down}) {
    EXPECT_FALSE(g.defined());
  }
}

TEST(TiledMlp, MetaTensorsGiveShapes) {
  const auto meta = at::TensorOptions().device(at::kMeta).dtype(at::kBFloat16);
  const at::Tensor out = torch_offload::tiled_mlp(at::empty({2, 9, 8}, meta), at::empty({20, 8}, meta), std::nullopt,
                                                  at::empty({8, 20}, meta));
  EXPECT_TRUE(out.is_meta());
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 9, 8}));
  EXPECT_EQ(out.scalar_type(), at::kBFloat16);
}

TEST(TiledMlp, BadInputsRaiseErrorsNamingTheArgument) {
  const Mlp m = make_mlp(true, true);
  const at::Tensor x = m.x.detach();
  expect_error([&] { torch_offload::tiled_mlp(x, at::zeros({20, 7}, at::kDouble), m.w_up, m.w_down); },
               "tiled_mlp: w_gate has shape [20, 7]; expected [I, h] = [20, 8]");
  expect_error([&] { torch_offload::tiled_mlp(x, m.w_gate, m.w_up, at::zeros({8, 19}, at::kDouble)); },
               "tiled_mlp: w_down has shape [8, 19]; expected [h, I] = [8, 20]");
  expect_error([&] { torch_offload::tiled_mlp(x, m.w_gate, m.w_up.detach().to(at::kFloat), m.w_down); },
               "tiled_mlp: w_up has dtype Float but x has Double");
  expect_error(
      [&] {
        torch_offload::tiled_mlp(x, m.w_gate, m.w_up, m.w_down, std::nullopt, std::nullopt,
                                 at::zeros({7}, at::kDouble));
      },
      "tiled_mlp: b_down has shape [7]; expected [h] = [8]");
  expect_error(
      [&] {
        torch_offload::tiled_mlp(x, m.w_gate, m.w_up, m.w_down, std::nullopt, std::nullopt, std::nullopt, "tanh");
      },
      "tiled_mlp: activation is 'tanh'; expected one of silu, gelu, gelu_tanh, relu");
  expect_error([&] { torch_offload::tiled_mlp(at::Tensor(), m.w_gate, m.w_up, m.w_down); },
               "tiled_mlp: x is an undefined tensor");
  // Tensors that are not dense reach keys of their own (ops/common/op_rules.h).
  expect_error([&] { torch_offload::tiled_mlp(x, m.w_gate, m.w_up.detach().to_sparse(), m.w_down); },
               "tiled_mlp: w_up is a sparse COO tensor; expected a dense (strided) tensor");
}

TEST(RmsNormTiledMlp, IsRmsNormThenTiledMlpWithGradientsFromCpp) {
  const Mlp m = make_mlp(true, true);
  const at::Tensor weight = (1 + at::randn({8}, at::kDouble) / 2).requires_grad_(true);
  const at::Tensor fused = torch_offload::rms_norm_tiled_mlp(m.x, weight, 1e-5, m.w_gate, m.w_up, m.w_down, m.b_gate,
                                                             m.b_up, m.b_down, "silu", 3);
  const at::Tensor separate = torch_offload::tiled_mlp(torch_offload::rms_norm(m.x, weight, 1e-5), m.w_gate, m.w_up,
                                                       m.w_down, m.b_gate, m.b_up, m.b_down, "silu", 3);
  EXPECT_TRUE(at::equal(fused, separate));
  const auto got = torch::autograd::grad({fused.sum()}, {m.x, weight, m.w_gate});
  const auto want = torch::autograd::grad({separate.sum()}, {m.x, weight, m.w_gate});
  for (size_t i = 0; i < got.size(); ++i) {
    expect_close(got[i], want[i]);
  }
  expect_error(
      [&] {
        torch_offload::rms_norm_tiled_mlp(m.x.detach(), at::ones({7}, at::kDouble), 1e-5, m.w_gate, m.w_up, m.w_down);
      },
      "rms_norm_tiled_mlp: norm_weight has shape [7]; expected [h], x's last dimension = [8]");
  expect_error([&] { torch_offload::rms_norm_tiled_mlp(m.x.detach(), at::Tensor(), 1e-5, m.w_gate, m.w_up, m.w_down); },
               "rms_norm_tiled_mlp: norm_weight is an undefined tensor");
}

// GPU path: runs wherever a GPU is present; skipped (and reported as such) here.
TEST(TiledMlpCuda, MatchesTheCpuOpWithGradients) {
  if (!at::hasCUDA()) {
    GTEST_SKIP() << "no CUDA device";
  }
  const Mlp cpu = make_mlp(true, true);
  Mlp gpu;
  for (auto [from, to] : {std::pair{&cpu.x, &gpu.x},
                          {&cpu.w_gate, &gpu.w_gate},
                          {&cpu.w_up, &gpu.w_up},
                          {&cpu.w_down, &gpu.w_down},
                          {&cpu.b_gate, &gpu.b_gate},
                          {&cpu.b_up, &gpu.b_up},
                          {&cpu.b_down, &gpu.b_down}}) {
    *to = from->detach().to(at::kCUDA).requires_grad_(true);
  }
  const at::Tensor out = tiled(gpu, "gelu", 3);
  EXPECT_TRUE(out.is_cuda());
  expect_close(out.cpu(), tiled(cpu, "gelu", 3));
  const auto gpu_grads = torch::autograd::grad({out.sum()}, leaves(gpu));
  const auto cpu_grads = torch::autograd::grad({tiled(cpu, "gelu", 3).sum()}, leaves(cpu));
  for (size_t i = 0; i < gpu_grads.size(); ++i) {
    expect_close(gpu_grads[i].cpu(), cpu_grads[i]);
  }
}

}  // namespace
