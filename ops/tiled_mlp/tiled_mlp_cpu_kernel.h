#pragma once
// The fused elementwise CPU kernels of tiled_mlp, compiled once per x86 vector
// capability (CMakeLists.txt builds DEFAULT, AVX2 and AVX512, each in its own
// namespace, as ATen builds its kernels) and picked at run time.
#include "ops/tiled_mlp/tiled_mlp.h"

namespace torch_offload {

// Built on every machine: DEFAULT; on x86-64 also AVX2 and AVX512.
namespace DEFAULT {
extern const HiddenKernels hidden_kernels_cpu;
}
namespace AVX2 {
extern const HiddenKernels hidden_kernels_cpu;
}
namespace AVX512 {
extern const HiddenKernels hidden_kernels_cpu;
}

// The kernels for the widest vector instructions ATen uses on this machine
// (ATEN_CPU_CAPABILITY=default or avx2 lowers it, as for ATen's own kernels).
const HiddenKernels& cpu_hidden_kernels();

}  // namespace torch_offload
