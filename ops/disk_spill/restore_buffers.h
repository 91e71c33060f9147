#pragma once
// Host memory that restored tensors are read into, recycled.
//
// A restore fills a large buffer that is usually fresh memory: the kernel must
// fault in and zero every page before the read can land there, which costs as
// much CPU as the read itself (and far more in a VM whose freed memory goes
// back to the hypervisor). Backward restores the same sizes layer after layer,
// and frees each soon after, so freed buffers are kept, up to a byte capacity,
// for the next restore of the same size. spill() calls clear(): a new forward
// pass must not find idle restore buffers adding to its peak.
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

namespace torch_offload {

class RestoreBuffers {
 public:
  // Block-aligned memory of at least `bytes` (O_DIRECT reads land in it): a
  // recycled buffer of the same size if one is kept, else a new one (backed by
  // transparent huge pages where the kernel allows). nullptr if out of memory.
  void* take(size_t bytes);
  // `buffer` (from take(bytes)) is free: keep it if it fits the capacity,
  // dropping the least recently kept ones, else free it. Any thread may call it.
  void recycle(void* buffer, size_t bytes);
  void set_capacity(size_t bytes);  // also frees what is kept
  void clear();
  // Held across fork(), so that the child finds the buffers at rest and can clear them.
  void lock() {
    mutex_.lock();
  }
  void unlock() {
    mutex_.unlock();
  }

  int64_t hits() const;
  size_t kept_bytes() const;

 private:
  void free_until_locked(size_t limit);

  mutable std::mutex mutex_;
  std::vector<std::pair<size_t, void*>> kept_;  // oldest first
  size_t kept_bytes_ = 0;
  size_t capacity_ = 0;
  int64_t hits_ = 0;
};

}  // namespace torch_offload
