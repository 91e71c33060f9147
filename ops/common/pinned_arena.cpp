#include "ops/common/pinned_arena.h"

#include <algorithm>
#include <cstdlib>

#include <c10/util/Exception.h>

#include "ops/common/checks.h"

#ifdef TORCH_OFFLOAD_WITH_CUDA
#include <cuda_runtime_api.h>
#endif

namespace torch_offload {
namespace {

bool all_done(const std::vector<std::shared_ptr<Fence>>& fences) {
  return std::all_of(fences.begin(), fences.end(), [](const auto& f) { return f->done(); });
}

}  // namespace

PinnedArena::PinnedArena(HostMemory memory, size_t chunk_bytes, size_t budget_bytes)
    : memory_(memory), chunk_bytes_(round_up(chunk_bytes, kAlignment)), budget_bytes_(budget_bytes) {}

PinnedArena::~PinnedArena() {
  for (auto& chunk : chunks_) {
    if (chunk.base != nullptr) {
      memory_.free(chunk.base);
    }
  }
}

const PinnedArena::Slice* PinnedArena::find_slice_locked(const void* ptr) const {
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  auto it = slices_.upper_bound(address);
  if (it == slices_.begin()) {
    return nullptr;
  }
  --it;
  const Slice& slice = it->second;
  return address < it->first + slice.bytes ? &slice : nullptr;
}

void PinnedArena::reclaim_locked() {
  for (auto it = slices_.begin(); it != slices_.end();) {
    Slice& slice = it->second;
    if (slice.released && all_done(slice.fences)) {
      chunks_[slice.chunk].free.add(slice.offset, slice.bytes);
      in_use_bytes_ -= slice.bytes;
      it = slices_.erase(it);
    } else {
      ++it;
    }
  }
}

void* PinnedArena::carve_locked(size_t bytes) {
  for (size_t index = 0; index < chunks_.size(); ++index) {
    Chunk& chunk = chunks_[index];
    if (const auto offset = chunk.free.take(bytes)) {
      char* start = chunk.base + *offset;
      slices_.emplace(reinterpret_cast<uintptr_t>(start), Slice{index, *offset, bytes, false, {}});
      in_use_bytes_ += bytes;
      ++slice_allocations_;
      return start;
    }
  }
  return nullptr;
}

void PinnedArena::free_idle_chunks_locked(size_t keep_reserved_at_most) {
  for (auto& chunk : chunks_) {
    if (reserved_bytes_ <= keep_reserved_at_most) {
      return;
    }
    if (chunk.base != nullptr && chunk.free.is_one_range(0, chunk.bytes)) {
      memory_.free(chunk.base);
      reserved_bytes_ -= chunk.bytes;
      chunk.base = nullptr;
      chunk.free.clear();
    }
  }
}

void* PinnedArena::allocate(size_t bytes) {
  TORCH_CHECK(bytes > 0, "PinnedArena::allocate: bytes must be positive");
  bytes = round_up(bytes, kAlignment);
  std::lock_guard<std::mutex> lock(mutex_);
  reclaim_locked();
  if (void* ptr = carve_locked(bytes)) {
    return ptr;
  }
  // Grow by a whole chunk when the budget allows, else by exactly what is asked,
  // after giving back idle chunks that are too small to serve this request.
  if (reserved_bytes_ + bytes > budget_bytes_) {
    free_idle_chunks_locked(budget_bytes_ > bytes ? budget_bytes_ - bytes : 0);
  }
  if (reserved_bytes_ + bytes > budget_bytes_) {
    return nullptr;
  }
  const size_t grow = std::min(std::max(bytes, chunk_bytes_), budget_bytes_ - reserved_bytes_);
  void* base = memory_.allocate(grow);
  if (base == nullptr) {
    return nullptr;
  }
  ++chunk_allocations_;
  reserved_bytes_ += grow;
  Chunk chunk{static_cast<char*>(base), grow, {}};
  chunk.free.add(0, grow);
  auto reuse = std::find_if(chunks_.begin(), chunks_.end(), [](const Chunk& c) { return c.base == nullptr; });
  if (reuse != chunks_.end()) {
    *reuse = std::move(chunk);
  } else {
    chunks_.push_back(std::move(chunk));
  }
  return carve_locked(bytes);
}

void PinnedArena::release(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = slices_.find(reinterpret_cast<uintptr_t>(ptr));
  TORCH_CHECK(it != slices_.end() && !it->second.released,
              "PinnedArena::release: pointer is not a live slice of this arena");
  it->second.released = true;
  reclaim_locked();
}

bool PinnedArena::add_fence(const void* ptr, std::shared_ptr<Fence> fence) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto* slice = const_cast<Slice*>(find_slice_locked(ptr));
  if (slice == nullptr) {
    return false;
  }
  auto& fences = slice->fences;
  fences.erase(std::remove_if(fences.begin(), fences.end(), [](const auto& f) { return f->done(); }), fences.end());
  fences.push_back(std::move(fence));
  return true;
}

std::vector<std::shared_ptr<Fence>> PinnedArena::pending_fences(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::shared_ptr<Fence>> pending;
  if (const Slice* slice = find_slice_locked(ptr)) {
    for (const auto& fence : slice->fences) {
      if (!fence->done()) {
        pending.push_back(fence);
      }
    }
  }
  return pending;
}

void PinnedArena::set_budget(size_t budget_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  budget_bytes_ = budget_bytes;
  reclaim_locked();
  free_idle_chunks_locked(budget_bytes_);
}

ArenaStats PinnedArena::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return ArenaStats{static_cast<int64_t>(budget_bytes_), static_cast<int64_t>(reserved_bytes_),
                    static_cast<int64_t>(in_use_bytes_), chunk_allocations_, slice_allocations_};
}

namespace {

#ifdef TORCH_OFFLOAD_WITH_CUDA
void* pinned_allocate(size_t bytes) {
  void* ptr = nullptr;
  if (cudaHostAlloc(&ptr, bytes, cudaHostAllocDefault) != cudaSuccess) {
    (void)cudaGetLastError();  // so the failure is not reported by an unrelated later call
    return nullptr;
  }
  return ptr;
}
void pinned_free(void* ptr) {
  cudaFreeHost(ptr);
}
#else
void* pinned_allocate(size_t bytes) {
  return std::malloc(bytes);
}
void pinned_free(void* ptr) {
  std::free(ptr);
}
#endif

constexpr size_t kDefaultChunkBytes = size_t{64} << 20;

}  // namespace

PinnedArena& host_arena() {
  // Never destroyed: freeing pinned memory during static destruction races the
  // CUDA runtime's own teardown. The OS reclaims it at exit.
  static auto* arena = new PinnedArena(HostMemory{pinned_allocate, pinned_free}, kDefaultChunkBytes,
                                       static_cast<size_t>(physical_host_bytes() / 4));
  return *arena;
}

void set_pinned_budget_kernel(int64_t budget_bytes) {
  TORCH_CHECK(budget_bytes >= 0, "set_pinned_budget: budget_bytes must be >= 0, got ", budget_bytes);
  const int64_t physical = physical_host_bytes();
  TORCH_CHECK(budget_bytes <= physical, "set_pinned_budget: budget_bytes ", budget_bytes,
              " exceeds this host's physical memory (", physical, " bytes)");
  host_arena().set_budget(static_cast<size_t>(budget_bytes));
}

std::vector<int64_t> pinned_arena_stats_kernel() {
  const ArenaStats s = host_arena().stats();
  return {s.budget_bytes, s.reserved_bytes, s.in_use_bytes, s.chunk_allocations, s.slice_allocations};
}

}  // namespace torch_offload
