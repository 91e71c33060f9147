#include "ops/common/op_rules.h"

#include <iterator>
#include <string>

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>

namespace torch_offload {
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

void without_autocast(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  op.callBoxed(stack);
}

constexpr c10::DispatchKey kNonDenseKeys[] = {
    c10::DispatchKey::SparseCPU,
    c10::DispatchKey::SparseCUDA,
    c10::DispatchKey::SparseCsrCPU,
    c10::DispatchKey::SparseCsrCUDA,
    c10::DispatchKey::NestedTensorCPU,
    c10::DispatchKey::NestedTensorCUDA,
    c10::DispatchKey::AutogradNestedTensor,
    c10::DispatchKey::MkldnnCPU,
    c10::DispatchKey::QuantizedCPU,
    c10::DispatchKey::QuantizedCUDA,
};

}  // namespace

SharedOpRules::SharedOpRules(std::initializer_list<const char*> ops, UnderAutocast autocast,
                             std::source_location where) {
  libraries_.reserve(std::size(kNonDenseKeys) + 2);
  const auto library_at = [&](c10::DispatchKey key) -> torch::Library& {
    return libraries_.emplace_back(torch::Library::IMPL, "offload", key, where.file_name(), where.line());
  };
  for (const c10::DispatchKey key : kNonDenseKeys) {
    torch::Library& library = library_at(key);
    for (const char* op : ops) {
      library.impl(op, torch::CppFunction::makeFromBoxedFunction<&reject_non_dense>());
    }
  }
  if (autocast == UnderAutocast::kOwnKernel) {
    return;
  }
  for (const c10::DispatchKey key : {c10::DispatchKey::AutocastCPU, c10::DispatchKey::AutocastCUDA}) {
    torch::Library& library = library_at(key);
    for (const char* op : ops) {
      library.impl(op, autocast == UnderAutocast::kOff ? torch::CppFunction::makeFromBoxedFunction<&without_autocast>()
                                                       : torch::CppFunction::makeFallthrough());
    }
  }
}

}  // namespace torch_offload
