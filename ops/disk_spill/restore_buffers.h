#pragma once
// Host memory that restored tensors are read into, recycled.
//
// A restore fills a large buffer that is usually fresh memory: the kernel must
// fault in and zero every page before the read can land there, which costs as
// much CPU as the read itself; in a VM, memory freed for a few seconds goes back
// to the hypervisor, and faulting it in again runs slower than a disk reads
// (0.7 GB/s on this project's machines). Backward restores the same sizes layer
// after layer, and frees each soon after, so freed buffers can be kept, up to a
// byte capacity, for the next restore of the same size, in this backward or the
// next. Kept buffers are lazily freed (MADV_FREE): the kernel takes their pages
// first when memory runs short, so they never hold memory anything else needs;
// until then a restore writes into pages that are already there (take() writes
// one byte per page first, which makes them the process's again). They count in
// the resident set meanwhile, so the engine's capacity is 0 by default
// (restore_cache_bytes): recycle() then frees at once.
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

namespace torch_offload {

class RestoreBuffers {
 public:
  // Block-aligned memory for `bytes` of data that start anywhere in its first
  // block (O_DIRECT reads land in it in place): a recycled buffer for the same
  // size if one is kept, else a new one (backed by transparent huge pages where
  // the kernel allows). nullptr if out of memory.
  void* take(size_t bytes);
  // `buffer` (from take(bytes)) is free: keep it, lazily freed, if `bytes` fits
  // the capacity, dropping the least recently kept ones, else free it. Any thread
  // may call it.
  void recycle(void* buffer, size_t bytes);
  void set_capacity(size_t bytes);  // capacity in data bytes; also frees what is kept
  void clear();
  // Held across fork(), so that the child finds the buffers at rest and can clear them.
  void lock() { mutex_.lock(); }
  void unlock() { mutex_.unlock(); }

  int64_t hits() const;
  size_t kept_bytes() const;

 private:
  void free_until_locked(size_t limit);

  mutable std::mutex mutex_;
  struct Kept {
    size_t bytes;  // as counted: data bytes rounded up to blocks
    void* buffer;
  };
  std::vector<Kept> kept_;  // oldest first
  size_t kept_bytes_ = 0;
  size_t capacity_ = 0;
  int64_t hits_ = 0;
};

}  // namespace torch_offload
