// The ops that read a value on the host refuse by name while their device's stream captures a
// CUDA graph. The CUDA build asks CUDA; here a stand-in query says the CPU is capturing, so the
// refusal logic runs without a GPU (python_tests/test_token_logprobs_cuda.py asks a real capture).
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include "expect_error.h"
#include "ops/common/checks.h"
#include "torch_offload/torch_offload.h"

namespace {

// The stand-in query for the scope of a test; the one it replaced after.
class CpuCaptures {
 public:
  CpuCaptures() : replaced_(torch_offload::set_stream_capture_query([](c10::Device d) { return d.is_cpu(); })) {}
  ~CpuCaptures() { torch_offload::set_stream_capture_query(replaced_); }
  CpuCaptures(const CpuCaptures&) = delete;
  CpuCaptures& operator=(const CpuCaptures&) = delete;

 private:
  torch_offload::StreamCaptureQuery replaced_;
};

TEST(Capture, OpsReadingValuesOnTheHostRefuseByName) {
  const at::Tensor hidden = at::randn({2, 5, 8}), weight = at::randn({11, 8});
  const at::Tensor ids = at::randint(0, 11, {2, 5}, at::kLong);
  {
    const CpuCaptures capturing;
    const std::string refused = ": cannot run while a CUDA graph is being captured on cpu";
    expect_error([&] { torch_offload::token_logprobs(hidden, weight, ids); },
                 "token_logprobs" + refused +
                     " (torch.cuda.graph, torch.compile's mode='reduce-overhead'): it reads "
                     "the ids on the host to check their values; call token_logprobs outside the captured region");
    expect_error([&] { torch_offload::linear_cross_entropy(hidden, weight, std::nullopt, ids); },
                 "linear_cross_entropy" + refused);
    expect_error([&] { torch_offload::assert_all_kernel(ids, ids.ge(0), "ids must be >= 0"); },
                 "_assert_all" + refused);
  }
  // Not capturing: each runs.
  EXPECT_EQ(std::get<0>(torch_offload::token_logprobs(hidden, weight, ids)).sizes(), ids.sizes());
  EXPECT_TRUE(torch_offload::linear_cross_entropy(hidden, weight, std::nullopt, ids).isfinite().item<bool>());
  EXPECT_TRUE(at::equal(torch_offload::assert_all_kernel(ids, ids.ge(0), "ids must be >= 0"), ids));
}

}  // namespace
