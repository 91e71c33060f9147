#include "ops/common/checks.h"

#include <ATen/Context.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/SymBool.h>
#include <c10/util/Exception.h>
#include <unistd.h>

namespace torch_offload {

void check_defined(const at::Tensor& t, const char* op, const char* arg) {
  TORCH_CHECK(t.defined(), op, ": ", arg, " is an undefined tensor; expected a defined tensor");
}

void check_tensor(const char* op, const char* arg, const at::Tensor& t, const at::Tensor& ref, const char* ref_name,
                  c10::ScalarType dtype, c10::SymIntArrayRef want, const char* what) {
  check_defined(t, op, arg);
  TORCH_CHECK(t.device() == ref.device(), op, ": ", arg, " is on ", t.device(), " but ", ref_name, " is on ",
              ref.device(), "; every tensor must be on ", ref_name, "'s device");
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", arg, " has dtype ", t.scalar_type(), "; expected ", dtype);
  TORCH_CHECK(t.dim() == static_cast<int64_t>(want.size()), op, ": ", arg, " has shape ", t.sym_sizes(), "; expected ",
              what, " = ", want);
  for (size_t i = 0; i < want.size(); ++i) {
    TORCH_SYM_CHECK(t.sym_size(static_cast<int64_t>(i)).sym_eq(want[i]), op, ": ", arg, " has shape ", t.sym_sizes(),
                    "; expected ", what, " = ", want);
  }
}

void check_device_available(c10::Device device, const char* op, const char* arg) {
  if (device.is_cpu() || device.is_meta()) {
    return;
  }
  if (device.is_cuda()) {
    const int64_t count = at::hasCUDA() ? at::getNumGPUs() : 0;
    TORCH_CHECK(count > 0, op, ": ", arg, " is ", device, " but no CUDA device is available in this process");
    TORCH_CHECK(!device.has_index() || device.index() < count, op, ": ", arg, " is ", device, " but only ", count,
                " CUDA device(s) exist");
    return;
  }
  TORCH_CHECK(false, op, ": ", arg, " is ", device, "; expected a cpu or cuda device");
}

namespace {
StreamCaptureQuery stream_capture_query = nullptr;
}  // namespace

StreamCaptureQuery set_stream_capture_query(StreamCaptureQuery query) {
  const StreamCaptureQuery replaced = stream_capture_query;
  stream_capture_query = query;
  return replaced;
}

void check_not_capturing(const char* op, c10::Device device, const char* why) {
  TORCH_CHECK(stream_capture_query == nullptr || !stream_capture_query(device), op,
              ": cannot run while a CUDA graph is being captured on ", device,
              " (torch.cuda.graph, torch.compile's mode='reduce-overhead'): ", why, "; call ", op,
              " outside the captured region");
}

at::Tensor assert_all_kernel(const at::Tensor& value, const at::Tensor& condition, c10::string_view message) {
  check_not_capturing("_assert_all", condition.device(), "it reads the condition on the host");
  TORCH_CHECK(condition.all().item<bool>(), message);
  return value.clone();
}

at::Tensor assert_all_meta(const at::Tensor& value, const at::Tensor& /*condition*/, c10::string_view /*message*/) {
  return at::empty_like(value);
}

int64_t physical_host_bytes() {
  return static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGESIZE);
}

}  // namespace torch_offload
