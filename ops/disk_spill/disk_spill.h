#pragma once
// disk_spill / disk_restore and their companions. A ticket is a CPU int64
// tensor [id, process nonce]; freeing the ticket tensor frees its disk space.
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/SymIntArrayRef.h>
#include <c10/util/string_view.h>

namespace torch_offload {

at::Tensor disk_spill_cpu(const at::Tensor& src, std::optional<c10::string_view> directory, bool allow_tmpfs);
at::Tensor disk_spill_meta(const at::Tensor& src, std::optional<c10::string_view> directory, bool allow_tmpfs);
#ifdef TORCH_OFFLOAD_WITH_CUDA
// Device-to-host through offload_pack (pinned, copy stream), then written by the workers.
at::Tensor disk_spill_cuda(const at::Tensor& src, std::optional<c10::string_view> directory, bool allow_tmpfs);
#endif

at::Tensor disk_restore_cpu(const at::Tensor& ticket, c10::SymIntArrayRef size, c10::ScalarType dtype,
                            c10::Device device);
at::Tensor disk_restore_meta(const at::Tensor& ticket, c10::SymIntArrayRef size, c10::ScalarType dtype,
                             c10::Device device);

// disk_restore's tensor, the ticket kept for another read.
at::Tensor disk_read_cpu(const at::Tensor& ticket, c10::SymIntArrayRef size, c10::ScalarType dtype, c10::Device device);

void disk_prefetch_cpu(const at::Tensor& ticket);
void disk_wait_cpu(const at::Tensor& ticket);
// A meta ticket has nothing to read or wait for.
void disk_prefetch_meta(const at::Tensor& ticket);
void disk_wait_meta(const at::Tensor& ticket);
std::vector<int64_t> disk_ticket_location_cpu(const at::Tensor& ticket);

void disk_spill_configure_kernel(int64_t num_threads, int64_t extent_bytes, bool checksums, int64_t max_in_flight_bytes,
                                 int64_t restore_cache_bytes);
// [bytes_written, bytes_read, extents_live, peak_file_bytes, write_ns, read_ns, tickets_live,
//  restore_cache_hits, restore_cache_kept_bytes, heap_trims]
std::vector<int64_t> disk_spill_stats_kernel();

}  // namespace torch_offload
