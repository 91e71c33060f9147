#pragma once
// A reusable arena of pinned host memory with a byte budget.
//
// cudaHostAlloc costs milliseconds per call and PyTorch's caching host allocator
// rounds every request up to a power of two. The arena instead grows by large
// chunks (cudaHostAlloc once per chunk) and hands out exact-size slices from them.
// A slice given back is reused only after every copy that touches it finished:
// each copy attaches a Fence (an event on the copy stream) to its slice.
//
// The arena knows nothing about CUDA: host memory comes from a HostMemory pair of
// functions, so the bookkeeping is unit-tested on machines without a GPU.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "ops/common/free_ranges.h"

namespace torch_offload {

// A copy in flight that reads or writes a slice.
struct Fence {
  virtual ~Fence() = default;
  virtual bool done() const = 0;  // true once the copy has finished
  virtual void wait() const = 0;  // blocks the calling host thread until done()
};

struct HostMemory {
  void* (*allocate)(size_t bytes);  // returns nullptr on failure
  void (*free)(void* ptr);
};

struct ArenaStats {
  int64_t budget_bytes;       // most pinned bytes the arena may hold
  int64_t reserved_bytes;     // pinned bytes held now, in chunks
  int64_t in_use_bytes;       // bytes in slices not yet reusable
  int64_t chunk_allocations;  // HostMemory::allocate calls so far
  int64_t slice_allocations;  // slices handed out so far
};

class PinnedArena {
 public:
  static constexpr size_t kAlignment = 256;  // what cudaMemcpyAsync likes

  PinnedArena(HostMemory memory, size_t chunk_bytes, size_t budget_bytes);
  ~PinnedArena();
  PinnedArena(const PinnedArena&) = delete;
  PinnedArena& operator=(const PinnedArena&) = delete;

  // A slice of at least `bytes` (rounded up to kAlignment), or nullptr when the
  // budget leaves no room for it. `bytes` must be positive.
  void* allocate(size_t bytes);
  // Gives back the slice that starts at `ptr`; it becomes reusable once all its
  // fences are done.
  void release(void* ptr);
  // Attaches a fence to the slice holding `ptr`; false if `ptr` is not arena memory.
  bool add_fence(const void* ptr, std::shared_ptr<Fence> fence);
  // The unfinished fences of the slice holding `ptr` (none if not arena memory).
  std::vector<std::shared_ptr<Fence>> pending_fences(const void* ptr) const;

  // Takes effect for later growth; idle chunks above the new budget are freed.
  void set_budget(size_t budget_bytes);
  ArenaStats stats() const;

 private:
  struct Chunk {
    char* base;
    size_t bytes;
    FreeRanges free;
  };
  struct Slice {
    size_t chunk;
    size_t offset;
    size_t bytes;
    bool released = false;
    std::vector<std::shared_ptr<Fence>> fences;
  };

  const Slice* find_slice_locked(const void* ptr) const;
  void reclaim_locked();
  void* carve_locked(size_t bytes);
  void free_idle_chunks_locked(size_t keep_reserved_at_most);

  const HostMemory memory_;
  const size_t chunk_bytes_;
  size_t budget_bytes_;
  size_t reserved_bytes_ = 0;
  size_t in_use_bytes_ = 0;
  int64_t chunk_allocations_ = 0;
  int64_t slice_allocations_ = 0;
  std::vector<Chunk> chunks_;          // a freed chunk keeps its index with base == nullptr
  std::map<uintptr_t, Slice> slices_;  // by start address
  mutable std::mutex mutex_;
};

// The process-wide arena used by offload_pack on CUDA. Its memory is pinned
// (cudaHostAlloc) in a CUDA build and plain host memory otherwise.
PinnedArena& host_arena();

}  // namespace torch_offload

namespace torch_offload {

// Kernels of the ops offload::set_pinned_budget and offload::pinned_arena_stats.
void set_pinned_budget_kernel(int64_t budget_bytes);
// [budget, reserved, in_use, chunk_allocations, slice_allocations], as in ArenaStats.
std::vector<int64_t> pinned_arena_stats_kernel();

}  // namespace torch_offload
