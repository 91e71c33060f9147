// attention_block from C++ through the public header: values and gradients (autograd
// registered in C++) against the same attention written in plain ATen, gradients that
// are not needed, errors, and the GPU path where a GPU exists.
#include <gtest/gtest.h>

#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "expect_error.h"
#include "ops/attention_block/attention_block.h"
#include "torch_offload/torch_offload.h"

namespace {

// batch 2, 9 tokens, h 12, 4 query heads sharing 2 key/value heads of 4, with biases.
struct Attention {
  at::Tensor x, w_q, w_k, w_v, w_o, cos, sin, b_q, b_k, b_v, b_o;

  std::vector<at::Tensor> leaves() const { return {x, w_q, w_k, w_v, w_o, b_q, b_k, b_v, b_o}; }
};

Attention make_attention(at::Device device = at::kCPU) {
  at::manual_seed(0);
  const auto options = at::TensorOptions().dtype(at::kDouble);
  const auto grad = [&](const at::Tensor& t) { return t.to(device).requires_grad_(true); };
  Attention a;
  a.x = grad(at::randn({2, 9, 12}, options));
  a.w_q = grad(at::randn({16, 12}, options) / 3);
  a.w_k = grad(at::randn({8, 12}, options) / 3);
  a.w_v = grad(at::randn({8, 12}, options) / 3);
  a.w_o = grad(at::randn({12, 16}, options) / 4);
  a.b_q = grad(at::randn({16}, options));
  a.b_k = grad(at::randn({8}, options));
  a.b_v = grad(at::randn({8}, options));
  a.b_o = grad(at::randn({12}, options));
  const at::Tensor angles = at::randn({1, 9, 2}, options).repeat({1, 1, 2});
  a.cos = angles.cos().to(device);
  a.sin = angles.sin().to(device);
  return a;
}

at::Tensor fused(const Attention& a) {
  return torch_offload::attention_block(a.x, a.w_q, a.w_k, a.w_v, a.w_o, a.cos, a.sin, a.b_q, a.b_k, a.b_v, a.b_o);
}

at::Tensor rotate_half(const at::Tensor& t) {
  return at::cat({-t.narrow(-1, 2, 2), t.narrow(-1, 0, 2)}, -1);
}

// The same attention in plain ATen: every head at once, the mask and softmax written out.
// `blocked` [batch or 1, 9, 9] says which keys each query may not see (default: the future);
// q_norm, k_norm, when defined: q, k through an RMSNorm (eps 1e-6) before the rotary embedding, per head (weights
// [4], Qwen3's) or over each token's whole projection (wider weights, OLMo 2's).
at::Tensor reference(const Attention& a, at::Tensor blocked = {}, const at::Tensor& q_norm = {},
                     const at::Tensor& k_norm = {}) {
  const auto heads = [](const at::Tensor& rows) { return rows.view({2, 9, -1, 4}).transpose(1, 2); };
  const auto rope = [&](const at::Tensor& t) { return t * a.cos.unsqueeze(1) + rotate_half(t) * a.sin.unsqueeze(1); };
  const auto norm = [](const at::Tensor& rows, const at::Tensor& weight) {
    if (!weight.defined()) {
      return rows;
    }
    const at::Tensor t = rows.unflatten(-1, {-1, weight.size(0)});  // [.., heads, 4] or [.., 1, width]
    return (weight * t * at::rsqrt(t.square().mean(-1, true) + 1e-6)).flatten(-2);
  };
  const at::Tensor q = rope(heads(norm(at::linear(a.x, a.w_q, a.b_q), q_norm)));
  const at::Tensor k = rope(heads(norm(at::linear(a.x, a.w_k, a.b_k), k_norm))).repeat_interleave(2, 1);
  const at::Tensor v = heads(at::linear(a.x, a.w_v, a.b_v)).repeat_interleave(2, 1);
  if (!blocked.defined()) {
    blocked = at::ones({1, 9, 9}, at::TensorOptions().dtype(at::kBool).device(a.x.device())).triu(1);
  }
  const at::Tensor scores = at::matmul(q, k.transpose(-2, -1)).div(2.0).masked_fill(blocked.unsqueeze(1), -INFINITY);
  const at::Tensor out = at::matmul(at::softmax(scores, -1), v).transpose(1, 2).reshape({2, 9, 16});
  return at::linear(out, a.w_o, a.b_o);
}

void expect_close(const at::Tensor& got, const at::Tensor& want) {
  ASSERT_EQ(got.sizes(), want.sizes());
  EXPECT_TRUE(at::allclose(got, want, 1e-10, 1e-12)) << (got - want).abs().max().item<double>();
}

// out and want close, and their gradients with respect to leaves for one random upstream gradient.
void expect_values_and_gradients_close(const at::Tensor& out, const at::Tensor& want,
                                       const std::vector<at::Tensor>& leaves) {
  expect_close(out, want);
  const at::Tensor grad_out = at::randn_like(want);
  const auto got_grads = torch::autograd::grad({out}, leaves, {grad_out});
  const auto want_grads = torch::autograd::grad({want}, leaves, {grad_out});
  ASSERT_EQ(got_grads.size(), want_grads.size());
  for (size_t i = 0; i < got_grads.size(); ++i) {
    expect_close(got_grads[i], want_grads[i]);
  }
}

TEST(AttentionBlock, ValuesAndGradientsMatchAtenWithAutogradFromCpp) {
  const Attention a = make_attention();
  const at::Tensor out = fused(a);
  ASSERT_TRUE(out.requires_grad());
  expect_values_and_gradients_close(out, reference(a), a.leaves());
}

TEST(AttentionBlock, SegmentsMatchAtenWithTheirMaskWrittenOut) {
  const Attention a = make_attention();
  // Row 0: two packed documents; row 1: real tokens, then two of padding.
  const at::Tensor segment_ids = at::tensor({0, 0, 0, 0, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 4, 4}).view({2, 9});
  const at::Tensor out = torch_offload::attention_block(a.x, a.w_q, a.w_k, a.w_v, a.w_o, a.cos, a.sin, a.b_q, a.b_k,
                                                        a.b_v, a.b_o, std::nullopt, segment_ids);
  const at::Tensor same = segment_ids.unsqueeze(2).eq(segment_ids.unsqueeze(1));
  const at::Tensor want = reference(a, same.logical_not().logical_or(at::ones({9, 9}, at::kBool).triu(1)));
  expect_values_and_gradients_close(out, want, a.leaves());
}

TEST(AttentionBlock, AttendingOnceMatchesAtenWithAutogradFromCpp) {
  const Attention a = make_attention();
  const auto [attention, logsumexp] =
      torch_offload::attention_block_attend(a.x, a.w_q, a.w_k, a.w_v, a.cos, a.sin, a.b_q, a.b_k, a.b_v);
  EXPECT_FALSE(attention.requires_grad() || logsumexp.requires_grad());
  ASSERT_EQ(attention.sizes(), (std::vector<int64_t>{2, 9, 16}));
  ASSERT_EQ(logsumexp.sizes(), (std::vector<int64_t>{4, 2, 9}));
  const at::Tensor out = torch_offload::attention_block(a.x, a.w_q, a.w_k, a.w_v, a.w_o, a.cos, a.sin, a.b_q, a.b_k,
                                                        a.b_v, a.b_o, std::nullopt, std::nullopt, std::nullopt,
                                                        std::nullopt, std::nullopt, 1e-6, attention, logsumexp);
  expect_values_and_gradients_close(out, reference(a), a.leaves());
}

// q_norm [q_width] and k_norm [k_width] through the op and the reference, values and gradients.
void expect_norms_match_aten(int64_t q_width, int64_t k_width) {
  const Attention a = make_attention();
  const auto options = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor q_norm = (1 + at::randn({q_width}, options) / 2).requires_grad_(true);
  const at::Tensor k_norm = (1 + at::randn({k_width}, options) / 2).requires_grad_(true);
  const at::Tensor out =
      torch_offload::attention_block(a.x, a.w_q, a.w_k, a.w_v, a.w_o, a.cos, a.sin, a.b_q, a.b_k, a.b_v, a.b_o,
                                     std::nullopt, std::nullopt, std::nullopt, q_norm, k_norm);
  std::vector<at::Tensor> leaves = a.leaves();
  leaves.insert(leaves.end(), {q_norm, k_norm});
  expect_values_and_gradients_close(out, reference(a, {}, q_norm, k_norm), leaves);
}

TEST(AttentionBlock, PerHeadNormsMatchAtenWithTheirGradientsFromCpp) {
  expect_norms_match_aten(4, 4);
}

// OLMo 2's norms: over each token's whole q [16] and k [8] projection.
TEST(AttentionBlock, WholeRowNormsMatchAtenWithTheirGradientsFromCpp) {
  expect_norms_match_aten(16, 8);
}

TEST(AttentionBlock, GradientsNotAskedForAreUndefined) {
  const Attention a = make_attention();
  const auto [dx, dw_q, dw_k, dw_v, dw_o, db_q, db_k, db_v, db_o, dq_norm, dk_norm] =
      torch_offload::attention_block_backward(
          at::ones({2, 9, 12}, at::kDouble), a.x.detach(), a.w_q, a.w_k, a.w_v, a.w_o, a.cos, a.sin, a.b_q, a.b_k,
          a.b_v, a.b_o, std::nullopt, std::nullopt,
          {false, false, false, false, true, false, false, false, true, true, true});
  for (const at::Tensor& g : {dx, dw_q, dw_k, dw_v, db_q, db_k, db_v, dq_norm, dk_norm}) {
    EXPECT_FALSE(g.defined());
  }
  const auto want = torch::autograd::grad({reference(a).sum()}, {a.w_o, a.b_o});
  expect_close(dw_o, want[0]);
  expect_close(db_o, want[1]);
}

TEST(AttentionBlock, BadInputsRaiseErrorsNamingTheArgument) {
  const Attention a = make_attention();
  const at::Tensor x = a.x.detach();
  expect_error([&] { torch_offload::attention_block(x, a.w_q.narrow(0, 0, 12), a.w_k, a.w_v, a.w_o, a.cos, a.sin); },
               "attention_block: w_q has 3 heads and w_k 2; the query heads must be a multiple");
  expect_error([&] { torch_offload::attention_block(x, a.w_q, a.w_k, a.w_v, a.w_o, a.cos.narrow(1, 0, 8), a.sin); },
               "attention_block: cos has shape [1, 8, 4]; expected [1 or batch, tokens, head_dim]");
  expect_error([&] { torch_offload::attention_block(x, a.w_q, a.w_k, a.w_v.to(at::kFloat), a.w_o, a.cos, a.sin); },
               "attention_block: w_v has dtype Float; expected Double");
  expect_error([&] { torch_offload::attention_block(at::Tensor(), a.w_q, a.w_k, a.w_v, a.w_o, a.cos, a.sin); },
               "attention_block: x is an undefined tensor");
}

// segment_attention alone: q, k [2, 3, 9, 4], v [2, 3, 9, value_head_dim], against the scores and
// softmax written out with the segments' mask, values and gradients, from C++; with score mods,
// soft-capped scores (softcap > 0) and a sink per head (the sinks' gradient too).
void check_segment_attention(at::Device device, at::ScalarType dtype, double rtol, double atol, double softcap = 0,
                             bool with_sinks = false, int64_t value_head_dim = 4) {
  at::manual_seed(1);
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  std::vector<at::Tensor> qkv;
  for (int64_t head_dim : {int64_t{4}, int64_t{4}, value_head_dim}) {
    qkv.push_back(at::randn({2, 3, 9, head_dim}, options).requires_grad_(true));
  }
  // Row 0: two packed documents; row 1: real tokens, then two of padding (they see the real tokens).
  const at::Tensor segment_ids =
      at::tensor({0, 0, 0, 0, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, -1, -1}).view({2, 9}).to(device);
  const at::Tensor sinks = with_sinks ? at::randn({3}, options).requires_grad_(true) : at::Tensor();
  const at::Tensor out = torch_offload::segment_attention(qkv[0], qkv[1], qkv[2], segment_ids, 0.5,
                                                          softcap > 0 ? std::optional<double>(softcap) : std::nullopt,
                                                          with_sinks ? std::optional<at::Tensor>(sinks) : std::nullopt);
  const at::Tensor causal = at::ones({9, 9}, options.dtype(at::kBool)).tril();
  at::Tensor seen = segment_ids.unsqueeze(2).eq(segment_ids.unsqueeze(1)).logical_and(causal);
  seen.select(0, 1).narrow(0, 7, 2).fill_(false).narrow(1, 0, 7).fill_(true);
  at::Tensor scores = at::matmul(qkv[0], qkv[1].transpose(-2, -1)).mul(0.5);
  if (softcap > 0) {
    scores = at::tanh(scores / softcap) * softcap;
  }
  scores = scores.masked_fill(seen.logical_not().unsqueeze(1), -INFINITY);
  if (with_sinks) {
    scores = at::cat({scores, sinks.view({1, 3, 1, 1}).expand({2, 3, 9, 1})}, -1);
  }
  const at::Tensor want = at::matmul(at::softmax(scores, -1).narrow(-1, 0, 9), qkv[2]);
  EXPECT_TRUE(at::allclose(out, want, rtol, atol)) << (out - want).abs().max().item<double>();
  const at::Tensor grad_out = at::randn_like(want);
  if (with_sinks) {
    qkv.push_back(sinks);
  }
  const auto got_grads = torch::autograd::grad({out}, qkv, {grad_out});
  const auto want_grads = torch::autograd::grad({want}, qkv, {grad_out});
  for (size_t i = 0; i < got_grads.size(); ++i) {
    EXPECT_TRUE(at::allclose(got_grads[i], want_grads[i], rtol, atol)) << i;
  }
}

TEST(AttentionBlock, HeadGroupBudgetIs16MiBOnTheCpuAndUpTo256MiBOnAGpu) {
  constexpr int64_t MiB = int64_t{1} << 20;
  EXPECT_EQ(torch_offload::head_group_bytes(c10::DeviceType::CPU, 0), 16 * MiB);
  EXPECT_EQ(torch_offload::head_group_bytes(c10::DeviceType::CPU, 80 * 1024 * MiB), 16 * MiB);
  // An H100 or H200: Llama-8B's key/value heads (34 x 8192 tokens x 128 x 2 bytes each at 8K tokens in bf16) run 3 a
  // group.
  EXPECT_EQ(torch_offload::head_group_bytes(c10::DeviceType::CUDA, 80 * 1024 * MiB), 256 * MiB);
  EXPECT_EQ(torch_offload::head_group_bytes(c10::DeviceType::CUDA, 141 * 1024 * MiB) / (34 * 8192 * 128 * 2), 3);
  // A small GPU: 1/64 of its memory, never less than the CPU's budget.
  EXPECT_EQ(torch_offload::head_group_bytes(c10::DeviceType::CUDA, 8 * 1024 * MiB), 128 * MiB);
  EXPECT_EQ(torch_offload::head_group_bytes(c10::DeviceType::CUDA, 512 * MiB), 16 * MiB);
}

TEST(SegmentAttention, ValuesAndGradientsMatchAtenWithTheMaskWrittenOut) {
  check_segment_attention(at::kCPU, at::kDouble, 1e-10, 1e-12);
}

TEST(SegmentAttention, SoftcapAndSinksMatchAtenWithTheirGradients) {
  check_segment_attention(at::kCPU, at::kDouble, 1e-10, 1e-12, /*softcap=*/1.5, /*with_sinks=*/true);
}

// Multi-head latent attention's value heads differ from its query's: narrower and wider.
TEST(SegmentAttention, ValueHeadDimensionsOtherThanTheQuerysMatchAten) {
  check_segment_attention(at::kCPU, at::kDouble, 1e-10, 1e-12, 0, false, /*value_head_dim=*/3);
  check_segment_attention(at::kCPU, at::kDouble, 1e-10, 1e-12, /*softcap=*/1.5, /*with_sinks=*/true,
                          /*value_head_dim=*/7);
}

TEST(SegmentAttention, BadInputsRaiseErrorsNamingTheArgument) {
  const at::Tensor q = at::zeros({2, 3, 9, 4});
  expect_error([&] { torch_offload::segment_attention(q, q.narrow(1, 0, 2), q, at::zeros({2, 9}, at::kLong)); },
               "segment_attention: key has shape [2, 2, 9, 4]; expected query's [batch, heads, tokens, head_dim]");
  expect_error([&] { torch_offload::segment_attention(q, q, q, at::zeros({2, 8}, at::kLong)); },
               "segment_attention: segment_ids has shape [2, 8]; expected [batch, tokens] = [2, 9]");
  expect_error([&] { torch_offload::segment_attention(at::Tensor(), q, q, at::zeros({2, 9}, at::kLong)); },
               "segment_attention: query is an undefined tensor");
  expect_error([&] { torch_offload::segment_attention(q, q, q.narrow(2, 0, 8), at::zeros({2, 9}, at::kLong)); },
               "segment_attention: value has shape [2, 3, 8, 4]; expected query's [batch, heads, tokens] and a head "
               "dimension");
}

TEST(SegmentAttentionCuda, MatchesAtenWithGradientsInFloat32) {
  if (!at::hasCUDA()) {
    GTEST_SKIP() << "no CUDA device";
  }
  check_segment_attention(at::kCUDA, at::kFloat, 1e-4, 1e-5);
  check_segment_attention(at::kCUDA, at::kFloat, 1e-4, 1e-5, /*softcap=*/1.5, /*with_sinks=*/true);
  check_segment_attention(at::kCUDA, at::kFloat, 1e-4, 1e-5, 0, false, /*value_head_dim=*/8);
}

// GPU path: runs wherever a GPU is present; skipped (and reported as such) here.
TEST(AttentionBlockCuda, MatchesAtenWithGradientsInFloat32) {
  if (!at::hasCUDA()) {
    GTEST_SKIP() << "no CUDA device";
  }
  Attention a = make_attention(at::kCUDA);
  for (at::Tensor* t : {&a.x, &a.w_q, &a.w_k, &a.w_v, &a.w_o, &a.b_q, &a.b_k, &a.b_v, &a.b_o}) {
    *t = t->detach().to(at::kFloat).requires_grad_(true);
  }
  a.cos = a.cos.to(at::kFloat);
  a.sin = a.sin.to(at::kFloat);
  const at::Tensor out = fused(a);
  EXPECT_TRUE(out.is_cuda());
  const at::Tensor want = reference(a);
  EXPECT_TRUE(at::allclose(out, want, 1e-4, 1e-5));
  const auto got_grads = torch::autograd::grad({out.sum()}, a.leaves());
  const auto want_grads = torch::autograd::grad({want.sum()}, a.leaves());
  for (size_t i = 0; i < got_grads.size(); ++i) {
    EXPECT_TRUE(at::allclose(got_grads[i], want_grads[i], 1e-4, 1e-5)) << i;
  }
}

}  // namespace
