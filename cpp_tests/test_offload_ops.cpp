// offload_pack / offload_unpack from C++, with no Python in the process: through
// the public header and through the raw dispatcher handle.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/autograd.h>

#include "torch_offload/torch_offload.h"

namespace {

using torch_offload::offload_pack;
using torch_offload::offload_unpack;

const c10::Device kCpu(c10::kCPU);

at::Tensor sample(at::ScalarType dtype, at::IntArrayRef sizes) {
  at::Tensor values = at::arange(c10::multiply_integers(sizes), at::kDouble).reshape(sizes);
  if (dtype == at::kBool) {
    return values.remainder(3).eq(0);
  }
  return (values * 0.5 - 3).to(dtype);
}

void expect_same(const at::Tensor& got, const at::Tensor& want) {
  EXPECT_EQ(got.scalar_type(), want.scalar_type());
  EXPECT_EQ(got.sizes(), want.sizes());
  EXPECT_TRUE(at::equal(got, want));
}

class DtypeRoundTrip : public ::testing::TestWithParam<at::ScalarType> {};

TEST_P(DtypeRoundTrip, PackAndUnpackKeepValuesShapeAndDtype) {
  const at::Tensor src = sample(GetParam(), {3, 5});
  const at::Tensor packed = offload_pack(src);
  EXPECT_TRUE(packed.device().is_cpu());
  EXPECT_TRUE(packed.is_contiguous());
  EXPECT_NE(packed.data_ptr(), src.data_ptr());  // a new tensor, not an alias
  expect_same(packed, src);
  const at::Tensor back = offload_unpack(packed, kCpu);
  EXPECT_NE(back.data_ptr(), packed.data_ptr());
  expect_same(back, src);
}

INSTANTIATE_TEST_SUITE_P(AllDtypes, DtypeRoundTrip,
                         ::testing::Values(at::kFloat, at::kDouble, at::kBFloat16, at::kHalf, at::kLong, at::kBool));

TEST(OffloadOps, NonContiguousAndExpandedInputsComeBackContiguous) {
  const at::Tensor base = sample(at::kFloat, {4, 6});
  const at::Tensor transposed = base.t();
  const at::Tensor strided = base.slice(1, 0, 6, 2);
  const at::Tensor expanded = sample(at::kFloat, {1, 6}).expand({5, 6});
  ASSERT_EQ(expanded.stride(0), 0);
  for (const at::Tensor& src : {transposed, strided, expanded}) {
    const at::Tensor packed = offload_pack(src);
    EXPECT_TRUE(packed.is_contiguous());
    expect_same(packed, src);
    const at::Tensor back = offload_unpack(src, kCpu);  // unpack takes any layout too
    EXPECT_TRUE(back.is_contiguous());
    expect_same(back, src);
  }
}

TEST(OffloadOps, ZeroSizeAndZeroDim) {
  const at::Tensor empty = at::empty({0, 7}, at::kFloat);
  expect_same(offload_unpack(offload_pack(empty), kCpu), empty);
  const at::Tensor scalar = at::scalar_tensor(2.5, at::kDouble);
  const at::Tensor back = offload_unpack(offload_pack(scalar), kCpu);
  EXPECT_EQ(back.dim(), 0);
  expect_same(back, scalar);
}

TEST(OffloadOps, RawDispatcherCallMatchesHeader) {
  const auto handle = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("offload::offload_pack", "")
                          .typed<at::Tensor(const at::Tensor&, bool)>();
  const at::Tensor src = sample(at::kFloat, {2, 3});
  expect_same(handle.call(src, false), offload_pack(src));
}

TEST(OffloadOps, GradientsFlowThroughBothOps) {
  const at::Tensor x = sample(at::kDouble, {3, 4}).requires_grad_(true);
  const at::Tensor weight = sample(at::kDouble, {3, 4}).add(1);
  const at::Tensor y = offload_unpack(offload_pack(x * 2), kCpu);
  ASSERT_TRUE(y.requires_grad());
  const at::Tensor loss = (y * weight).sum();
  const auto grads = torch::autograd::grad({loss}, {x});
  expect_same(grads[0], weight * 2);
}

TEST(OffloadOps, MetaTensorsStayMeta) {
  const at::Tensor src = at::empty({2, 8}, at::TensorOptions().device(at::kMeta).dtype(at::kHalf));
  const at::Tensor packed = offload_pack(src);
  EXPECT_TRUE(packed.is_meta());
  EXPECT_EQ(packed.sizes(), src.sizes());
  EXPECT_EQ(packed.scalar_type(), at::kHalf);
}

TEST(OffloadOps, BadInputsRaiseNamedErrors) {
  EXPECT_THROW(
      {
        try {
          offload_pack(at::Tensor());
        } catch (const c10::Error& e) {
          EXPECT_NE(std::string(e.what()).find("src is an undefined tensor"), std::string::npos);
          throw;
        }
      },
      c10::Error);
  EXPECT_THROW(offload_unpack(at::Tensor(), kCpu), c10::Error);
  if (!at::hasCUDA()) {
    try {
      offload_unpack(at::ones({2}), c10::Device(c10::kCUDA, 0));
      ADD_FAILURE() << "unpack to a missing CUDA device did not throw";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("no CUDA device is available"), std::string::npos) << e.what();
    }
  }
  try {
    torch_offload::set_pinned_budget(-1);
    ADD_FAILURE() << "a negative budget did not throw";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("budget_bytes must be >= 0"), std::string::npos) << e.what();
  }
  EXPECT_THROW(torch_offload::set_pinned_budget(int64_t{1} << 62), c10::Error);
}

TEST(OffloadOps, BudgetIsStoredAndReported) {
  const auto before = torch_offload::pinned_arena_stats();
  torch_offload::set_pinned_budget(int64_t{1} << 20);
  EXPECT_EQ(torch_offload::pinned_arena_stats()[0], int64_t{1} << 20);
  torch_offload::set_pinned_budget(before[0]);
}

// GPU path: runs wherever a GPU is present; skipped (and reported as such) here.
TEST(OffloadOpsCuda, RoundTripAndGradientOnGpu) {
  if (!at::hasCUDA()) {
    GTEST_SKIP() << "no CUDA device";
  }
  const c10::Device gpu(c10::kCUDA, 0);
  const at::Tensor src = sample(at::kFloat, {64, 33}).to(gpu).requires_grad_(true);
  const at::Tensor packed = offload_pack(src, /*non_blocking=*/true);
  EXPECT_TRUE(packed.device().is_cpu());
  const at::Tensor back = offload_unpack(packed, gpu);
  EXPECT_TRUE(back.is_cuda());
  expect_same(back.detach(), src.detach());
  const auto grads = torch::autograd::grad({(back * 3).sum()}, {src});
  EXPECT_TRUE(grads[0].is_cuda());
  expect_same(grads[0], at::full_like(src, 3).detach());
}

}  // namespace
