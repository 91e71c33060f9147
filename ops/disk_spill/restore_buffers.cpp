#include "ops/disk_spill/restore_buffers.h"

#include <algorithm>
#include <cstdlib>
#include <new>

#include <sys/mman.h>

#include "ops/common/free_ranges.h"
#include "ops/disk_spill/spill_file.h"

namespace torch_offload {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;

// What take() and recycle() count a buffer for `bytes` of data as: whole blocks, at least one.
size_t block_bytes(size_t bytes) {
  return round_up(std::max<size_t>(bytes, 1), SpillFile::kBlock);
}

// A buffer counted as `counted` bytes: one block more, for data that start inside the first.
size_t allocated_bytes(size_t counted) {
  return counted + SpillFile::kBlock;
}

void* allocate(size_t bytes) {
  // Huge pages take one fault per 2 MiB instead of 512 (c10's CPU allocator
  // does the same under THP_MEM_ALLOC_ENABLE); below two of them, not worth it.
  const size_t alignment = bytes >= 2 * kHugePage ? kHugePage : SpillFile::kBlock;
  void* memory = nullptr;
  if (::posix_memalign(&memory, alignment, bytes) != 0) {
    return nullptr;
  }
  if (alignment == kHugePage) {
    ::madvise(memory, bytes, MADV_HUGEPAGE);  // a hint: failure is harmless
  }
  return memory;
}

// A kept buffer's pages are lazily freed: a CPU write takes them back for good (the page tables mark them
// dirty), but a device's write through O_DIRECT does not on every kernel (before the 2024 fix "block: Remove
// special-casing of compound pages", huge pages read into were never marked dirty), and reclaim would then
// drop a restored tensor's data. So one CPU write per page, before any read lands there.
void redirty(void* buffer, size_t bytes) {
  auto* page = static_cast<volatile char*>(buffer);
  for (size_t offset = 0; offset < bytes; offset += SpillFile::kBlock) {
    page[offset] = 0;
  }
}

}  // namespace

void* RestoreBuffers::take(size_t bytes) {
  bytes = block_bytes(bytes);
  void* kept = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto newest = std::find_if(kept_.rbegin(), kept_.rend(), [&](const Kept& k) { return k.bytes == bytes; });
    if (newest != kept_.rend()) {
      kept = newest->buffer;
      kept_.erase(std::next(newest).base());
      kept_bytes_ -= bytes;
      ++hits_;
    }
  }
  if (kept == nullptr) {
    return allocate(allocated_bytes(bytes));
  }
  redirty(kept, allocated_bytes(bytes));
  return kept;
}

void RestoreBuffers::recycle(void* buffer, size_t bytes) {
  bytes = block_bytes(bytes);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (bytes > capacity_) {
      std::free(buffer);
      return;
    }
  }
  // Before it is kept, where another restore may take it: the kernel may take the pages back from here on
  // (they read as zeros then) until take() writes to each. A hint: where the kernel refuses, the buffer
  // stays as it was.
  ::madvise(buffer, allocated_bytes(bytes), MADV_FREE);
  std::lock_guard<std::mutex> lock(mutex_);
  if (bytes > capacity_) {  // set_capacity() ran meanwhile
    std::free(buffer);
    return;
  }
  free_until_locked(capacity_ - bytes);
  try {
    kept_.push_back(Kept{bytes, buffer});
  } catch (const std::bad_alloc&) {  // called from tensor deleters, which must not throw
    std::free(buffer);
    return;
  }
  kept_bytes_ += bytes;
}

void RestoreBuffers::set_capacity(size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  capacity_ = bytes;
  free_until_locked(0);
}

void RestoreBuffers::clear() {
  std::lock_guard<std::mutex> lock(mutex_);
  free_until_locked(0);
}

void RestoreBuffers::free_until_locked(size_t limit) {
  size_t dropped = 0;
  while (dropped < kept_.size() && kept_bytes_ > limit) {
    kept_bytes_ -= kept_[dropped].bytes;
    std::free(kept_[dropped].buffer);
    ++dropped;
  }
  kept_.erase(kept_.begin(), kept_.begin() + static_cast<std::ptrdiff_t>(dropped));
}

int64_t RestoreBuffers::hits() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return hits_;
}

size_t RestoreBuffers::kept_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return kept_bytes_;
}

}  // namespace torch_offload
