#include <torch/library.h>

#include "ops/disk_spill/disk_spill.h"
#include "ops/offload/offload.h"

TORCH_LIBRARY_IMPL(offload, CUDA, m) {
  m.impl("offload_pack", &torch_offload::offload_pack_cuda);
  m.impl("offload_unpack", &torch_offload::offload_unpack_cuda);
  m.impl("disk_spill", &torch_offload::disk_spill_cuda);
}
