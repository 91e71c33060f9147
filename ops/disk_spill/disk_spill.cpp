#include "ops/disk_spill/disk_spill.h"

#include <cstdlib>
#include <filesystem>
#include <string>

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include "ops/common/checks.h"
#include "ops/disk_spill/spill_engine.h"
#include "torch_offload/torch_offload.h"

#ifdef TORCH_OFFLOAD_WITH_CUDA
#include "ops/offload/offload.h"
#endif

namespace torch_offload {
namespace {

std::string spill_directory(std::optional<c10::string_view> directory) {
  if (directory.has_value()) {
    return std::string(*directory);
  }
  if (const char* from_env = std::getenv("TORCH_OFFLOAD_SPILL_DIR"); from_env != nullptr && *from_env != '\0') {
    return from_env;
  }
  return std::filesystem::temp_directory_path().string();
}

// The ticket tensor owns the ticket: when it is freed, so is the disk space.
at::Tensor make_ticket(int64_t id) {
  auto* data = new int64_t[2]{id, static_cast<int64_t>(SpillEngine::instance().nonce())};
  return at::from_blob(
      data, {2},
      [](void* ptr) {
        auto* fields = static_cast<int64_t*>(ptr);
        SpillEngine::instance().release(fields[0], static_cast<uint64_t>(fields[1]));
        delete[] fields;
      },
      at::TensorOptions().dtype(at::kLong));
}

int64_t ticket_id(const at::Tensor& ticket, const char* op) {
  check_defined(ticket, op, "ticket");
  TORCH_CHECK(ticket.device().is_cpu() && ticket.scalar_type() == at::kLong && ticket.numel() == 2, op,
              ": ticket must be the CPU int64 tensor of 2 elements that disk_spill returned, got ",
              ticket.scalar_type(), " ", ticket.sizes(), " on ", ticket.device());
  const at::Tensor fields = ticket.contiguous();
  const int64_t* data = fields.const_data_ptr<int64_t>();
  TORCH_CHECK(static_cast<uint64_t>(data[1]) == SpillEngine::instance().nonce(), op,
              ": ticket was not made by disk_spill in this process");
  return data[0];
}

// A tensor over t's memory that only the engine holds (t itself where it is not a plain strided one). The I/O
// threads let go of a source once it is written: letting go of the last C++ reference to a tensor Python has seen
// takes the GIL (c10's decref_pyobject), so an I/O thread would wait for the training loop's Python, and at
// interpreter exit that wait ends the thread inside a noexcept destructor: std::terminate.
at::Tensor engine_own(const at::Tensor& t) {
  if (t.layout() != at::kStrided || t.is_quantized() || !t.has_storage()) {
    return t;
  }
  at::Tensor own = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set(), t.dtype());
  own.unsafeGetTensorImpl()->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return own;
}

// host: engine_own's (it outlives this call in the ticket until written).
at::Tensor spill_host_tensor(const at::Tensor& host, std::optional<c10::string_view> directory, bool allow_tmpfs,
                             std::function<void()> source_ready, bool bounce_source) {
  auto file = SpillEngine::instance().file_for(spill_directory(directory), allow_tmpfs);
  return make_ticket(SpillEngine::instance().spill(host, std::move(file), std::move(source_ready), bounce_source));
}

#ifdef TORCH_OFFLOAD_WITH_CUDA
// CUDA pinned memory (offload_pack's results, pin_memory()): O_DIRECT may refuse it, so the
// worker copies it to its own buffer first, and only once a non-blocking offload_pack's
// device-to-host copy into it has landed.
at::Tensor spill_pinned_tensor(const at::Tensor& host, std::optional<c10::string_view> directory, bool allow_tmpfs) {
  const at::Tensor own = engine_own(host);
  return spill_host_tensor(
      own, directory, allow_tmpfs, [own] { wait_for_pending_pack(own); },
      /*bounce_source=*/true);
}
#endif

}  // namespace

at::Tensor disk_spill_cpu(const at::Tensor& src, std::optional<c10::string_view> directory, bool allow_tmpfs) {
  check_defined(src, "disk_spill", "src");
#ifdef TORCH_OFFLOAD_WITH_CUDA
  if (is_pinned_host_memory(src)) {
    if (!src.is_contiguous()) {
      wait_for_pending_pack(src);  // the host reads it now, to make it contiguous
    }
    return spill_pinned_tensor(src.contiguous(), directory, allow_tmpfs);
  }
#endif
  // Written asynchronously from src's own memory (no copy when contiguous):
  // do not change src in place before disk_wait (the checksum, taken first,
  // would then fail on restore).
  return spill_host_tensor(engine_own(src.contiguous()), directory, allow_tmpfs, nullptr, /*bounce_source=*/false);
}

at::Tensor disk_spill_meta(const at::Tensor& src, std::optional<c10::string_view> /*directory*/, bool /*allow_tmpfs*/) {
  return at::empty({2}, src.options().dtype(at::kLong));
}

#ifdef TORCH_OFFLOAD_WITH_CUDA
at::Tensor disk_spill_cuda(const at::Tensor& src, std::optional<c10::string_view> directory, bool allow_tmpfs) {
  check_defined(src, "disk_spill", "src");
  return spill_pinned_tensor(offload_pack(src, /*non_blocking=*/true), directory, allow_tmpfs);
}
#endif

at::Tensor disk_restore_cpu(const at::Tensor& ticket, c10::SymIntArrayRef size, c10::ScalarType dtype,
                            c10::Device device) {
  const int64_t id = ticket_id(ticket, "disk_restore");
  check_device_available(device, "disk_restore", "device");
  // Restoring consumes the ticket: a meta tensor would keep none of its data.
  TORCH_CHECK(!device.is_meta(),
              "disk_restore: device is meta, which would drop the ticket's data; "
              "expected a cpu or cuda device");
  at::Tensor host = SpillEngine::instance().restore(id, C10_AS_INTARRAYREF_SLOW(size), dtype);
  return device.is_cpu() ? host : offload_unpack(host, device);
}

at::Tensor disk_read_cpu(const at::Tensor& ticket, c10::SymIntArrayRef size, c10::ScalarType dtype,
                         c10::Device device) {
  const int64_t id = ticket_id(ticket, "disk_read");
  check_device_available(device, "disk_read", "device");
  at::Tensor host = SpillEngine::instance().read(id, C10_AS_INTARRAYREF_SLOW(size), dtype);
  return device.is_cpu() ? host : offload_unpack(host, device);
}

at::Tensor disk_restore_meta(const at::Tensor& ticket, c10::SymIntArrayRef size, c10::ScalarType dtype,
                             c10::Device /*device*/) {
  return at::empty_symint(size, ticket.options().dtype(dtype));
}

void disk_prefetch_cpu(const at::Tensor& ticket) {
  SpillEngine::instance().prefetch(ticket_id(ticket, "disk_prefetch"));
}

void disk_wait_cpu(const at::Tensor& ticket) {
  SpillEngine::instance().wait_written(ticket_id(ticket, "disk_wait"));
}

void disk_prefetch_meta(const at::Tensor& /*ticket*/) {}

void disk_wait_meta(const at::Tensor& /*ticket*/) {}

std::vector<int64_t> disk_ticket_location_cpu(const at::Tensor& ticket) {
  return SpillEngine::instance().location(ticket_id(ticket, "_disk_ticket_location"));
}

void disk_spill_configure_kernel(int64_t num_threads, int64_t extent_bytes, bool checksums, int64_t max_in_flight_bytes,
                                 int64_t restore_cache_bytes) {
  SpillEngine::instance().configure(
      SpillConfig{num_threads, extent_bytes, checksums, max_in_flight_bytes, restore_cache_bytes});
}

std::vector<int64_t> disk_spill_stats_kernel() {
  const SpillStats s = SpillEngine::instance().stats();
  return {s.bytes_written, s.bytes_read,   s.extents_live,       s.peak_file_bytes,          s.write_ns,
          s.read_ns,       s.tickets_live, s.restore_cache_hits, s.restore_cache_kept_bytes, s.heap_trims};
}

}  // namespace torch_offload
