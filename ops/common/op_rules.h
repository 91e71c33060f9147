#pragma once
// What every op of offload:: registers beside its schema and kernels, from its own folder (the
// <folder>_registration.cpp files); python_tests/test_op_registration.py fails where an op misses one.
// - Layouts: sparse, nested, mkldnn and quantized tensors dispatch to keys of their own, where no op has a
//   kernel (each computes on dense, strided memory). Kernels there turn the dispatcher's "could not run ...
//   with arguments from the 'SparseCPU' backend" (or a nested tensor's internal error inside autograd) into
//   an error naming the op and the argument.
// - Autocast: each op says what it does under torch.autocast: casts its inputs in a kernel of its own
//   (BelowAutocast below), runs in its inputs' dtypes, or runs with autocast off.
#include <cstdint>
#include <initializer_list>
#include <source_location>
#include <vector>

#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace torch_offload {

enum class UnderAutocast {
  // The op's folder registers kernels of its own at AutocastCPU and AutocastCUDA.
  kOwnKernel,
  // Autocast passes the op by: it runs in its inputs' dtypes (it moves or stores them, or, as rms_norm,
  // is no matrix product to cast).
  kInputDtypes,
  // Runs in its inputs' dtypes with autocast off inside too: the backward ops, whose forward chose the
  // dtypes. Gradients asked for inside an autocast region (`loss.backward()` under `with
  // torch.autocast(...)`) would otherwise recast the formulas' own operations: CUDA's autocast sums in
  // float32 and CPU's multiplies matrices in bf16, and attention_block's backward then met mixed dtypes.
  kOff,
};

// Registers the layout rule and the autocast rule for `ops` (names in offload::, each taking a tensor) while
// it lives: one static object per rule in an op's folder.
class SharedOpRules {
 public:
  SharedOpRules(std::initializer_list<const char*> ops, UnderAutocast autocast,
                std::source_location where = std::source_location::current());

 private:
  std::vector<torch::Library> libraries_;
};

// In an op's own autocast kernel: autocast off for the op's work, and a cast of floating tensors to autocast's
// dtype (the weights through autocast's cast cache), as the layers the op stands for would run:
//   const BelowAutocast<kDevice> cast;
//   return op(cast(x), cast(weight), ...);
template <c10::DeviceType kDevice>
class BelowAutocast {
 public:
  BelowAutocast()
      : no_autocast_(at::autocast::get_autocast_dispatch_key_from_device_type(kDevice)),
        dtype_(at::autocast::get_autocast_dtype(kDevice)) {}
  template <typename T>
  auto operator()(const T& t) const {
    return at::autocast::cached_cast(dtype_, t, kDevice);
  }

 private:
  c10::impl::ExcludeDispatchKeyGuard no_autocast_;
  at::ScalarType dtype_;
};

}  // namespace torch_offload
