// Tensors that are not dense: sparse, nested, mkldnn and quantized ones dispatch to keys
// of their own, where none of our ops has a kernel (each computes on dense, strided
// memory). Registered here, one boxed kernel per op turns the dispatcher's "could not run
// ... with arguments from the 'SparseCPU' backend" (or a nested tensor's internal error
// inside autograd) into an error naming the op and the argument.
#include <string>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

namespace {

// What kind of tensor `t` is when it is not dense and strided; nullptr for a dense one.
const char* non_dense_kind(const at::Tensor& t) {
  if (t.is_nested()) {
    return "nested";
  }
  if (t.is_quantized()) {
    return "quantized";
  }
  switch (t.layout()) {
    case at::kStrided:
      return nullptr;
    case at::kSparse:
      return "sparse COO";
    case at::kSparseCsr:
    case at::kSparseCsc:
    case at::kSparseBsr:
    case at::kSparseBsc:
      return "sparse compressed";
    case at::kMkldnn:
      return "mkldnn";
    default:
      return "non-strided";
  }
}

void reject_non_dense(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const std::string name = schema.name().substr(schema.name().find("::") + 2);
  const auto& arguments = schema.arguments();
  const auto values = torch::jit::last(*stack, arguments.size());
  for (size_t i = 0; i < arguments.size(); ++i) {
    if (values[i].isTensor()) {
      const char* kind = non_dense_kind(values[i].toTensor());
      TORCH_CHECK(kind == nullptr, name, ": ", arguments[i].name(), " is a ", kind,
                  " tensor; expected a dense (strided) tensor");
    }
  }
  TORCH_CHECK(false, name, ": got a tensor that is not dense (strided); expected dense tensors");
}

constexpr const char* kOpsTakingTensors[] = {
    "offload_pack",
    "offload_unpack",
    "tiled_mlp",
    "tiled_mlp_backward",
    "rms_norm_tiled_mlp",
    "rms_norm_tiled_mlp_backward",
    "disk_spill",
    "disk_restore",
    "disk_read",
    "disk_prefetch",
    "disk_wait",
    "_disk_ticket_location",
    "linear_cross_entropy",
    "linear_cross_entropy_forward",
    "linear_cross_entropy_backward",
    "rms_norm",
    "rms_norm_backward",
    "token_logprobs",
    "token_logprobs_forward",
    "token_logprobs_backward",
    "token_logprob_summaries",
    "attention_block",
    "attention_block_backward",
    "segment_attention",
    "segment_attention_backward",
    "ulysses_attention",
    "_assert_all",
};

void reject_at_this_key(torch::Library& m) {
  for (const char* op : kOpsTakingTensors) {
    m.impl(op, torch::CppFunction::makeFromBoxedFunction<&reject_non_dense>());
  }
}

}  // namespace

// One line per dispatch key: they differ by the key only.
// clang-format off
TORCH_LIBRARY_IMPL(offload, SparseCPU, m) { reject_at_this_key(m); }
TORCH_LIBRARY_IMPL(offload, SparseCUDA, m) { reject_at_this_key(m); }
TORCH_LIBRARY_IMPL(offload, SparseCsrCPU, m) { reject_at_this_key(m); }
TORCH_LIBRARY_IMPL(offload, SparseCsrCUDA, m) { reject_at_this_key(m); }
TORCH_LIBRARY_IMPL(offload, NestedTensorCPU, m) { reject_at_this_key(m); }
TORCH_LIBRARY_IMPL(offload, NestedTensorCUDA, m) { reject_at_this_key(m); }
TORCH_LIBRARY_IMPL(offload, AutogradNestedTensor, m) { reject_at_this_key(m); }
TORCH_LIBRARY_IMPL(offload, MkldnnCPU, m) { reject_at_this_key(m); }
TORCH_LIBRARY_IMPL(offload, QuantizedCPU, m) { reject_at_this_key(m); }
TORCH_LIBRARY_IMPL(offload, QuantizedCUDA, m) { reject_at_this_key(m); }
// clang-format on
