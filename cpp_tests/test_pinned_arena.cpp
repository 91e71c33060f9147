// The arena's bookkeeping, with plain host memory and hand-driven fences: what a
// GPU run relies on, checked without a GPU.
#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>

#include <c10/util/Exception.h>

#include "ops/common/pinned_arena.h"

namespace torch_offload {
namespace {

int g_live_chunks = 0;
void* counting_malloc(size_t bytes) {
  ++g_live_chunks;
  return std::malloc(bytes);
}
void counting_free(void* ptr) {
  --g_live_chunks;
  std::free(ptr);
}
const HostMemory kCountingMemory{counting_malloc, counting_free};

struct ManualFence final : Fence {
  bool finished = false;
  bool done() const override { return finished; }
  void wait() const override {}
};

constexpr size_t kChunk = 4096;

TEST(PinnedArena, SlicesAreExactSizeAndShareOneChunk) {
  PinnedArena arena(kCountingMemory, kChunk, 1 << 20);
  char* a = static_cast<char*>(arena.allocate(100));
  char* b = static_cast<char*>(arena.allocate(300));
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b - a, 256);  // 100 rounded to the alignment, not to a power of two
  const ArenaStats stats = arena.stats();
  EXPECT_EQ(stats.chunk_allocations, 1);
  EXPECT_EQ(stats.reserved_bytes, static_cast<int64_t>(kChunk));
  EXPECT_EQ(stats.in_use_bytes, 256 + 512);
}

TEST(PinnedArena, ReleasedSliceIsReusedWithoutNewAllocation) {
  PinnedArena arena(kCountingMemory, kChunk, 1 << 20);
  void* first = arena.allocate(1000);
  arena.release(first);
  EXPECT_EQ(arena.stats().in_use_bytes, 0);
  void* second = arena.allocate(1000);
  EXPECT_EQ(second, first);
  EXPECT_EQ(arena.stats().chunk_allocations, 1);
}

TEST(PinnedArena, SliceWithPendingFenceIsNotReused) {
  PinnedArena arena(kCountingMemory, kChunk, 1 << 20);
  void* slice = arena.allocate(kChunk);
  auto fence = std::make_shared<ManualFence>();
  ASSERT_TRUE(arena.add_fence(slice, fence));
  EXPECT_EQ(arena.pending_fences(static_cast<char*>(slice) + 10).size(), 1u);  // inner pointers too
  arena.release(slice);
  void* while_copying = arena.allocate(kChunk);
  EXPECT_NE(while_copying, slice);  // the copy may still be reading it
  EXPECT_EQ(arena.stats().chunk_allocations, 2);
  fence->finished = true;
  EXPECT_TRUE(arena.pending_fences(slice).empty());
  EXPECT_EQ(arena.allocate(kChunk), slice);
}

TEST(PinnedArena, FreedNeighboursCoalesce) {
  PinnedArena arena(kCountingMemory, kChunk, kChunk);
  void* a = arena.allocate(1024);
  void* b = arena.allocate(1024);
  void* c = arena.allocate(2048);
  arena.release(b);
  arena.release(a);
  arena.release(c);
  void* whole = arena.allocate(kChunk);  // needs all three back as one range
  EXPECT_EQ(whole, a);
  EXPECT_EQ(arena.stats().chunk_allocations, 1);
}

TEST(PinnedArena, BudgetIsNeverExceeded) {
  PinnedArena arena(kCountingMemory, kChunk, 3 * kChunk / 2);
  void* a = arena.allocate(kChunk);
  ASSERT_NE(a, nullptr);
  void* b = arena.allocate(kChunk / 2);  // grows by exactly what is left
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(arena.allocate(256), nullptr);
  EXPECT_LE(arena.stats().reserved_bytes, static_cast<int64_t>(3 * kChunk / 2));
  arena.release(b);
  EXPECT_EQ(arena.allocate(256), b);
}

TEST(PinnedArena, LowerBudgetFreesIdleChunks) {
  const int before = g_live_chunks;
  {
    PinnedArena arena(kCountingMemory, kChunk, 1 << 20);
    arena.release(arena.allocate(kChunk));
    void* kept = arena.allocate(2 * kChunk);
    EXPECT_EQ(g_live_chunks, before + 2);
    arena.set_budget(0);
    EXPECT_EQ(g_live_chunks, before + 1);  // the idle chunk went, the used one stays
    EXPECT_EQ(arena.allocate(256), nullptr);
    arena.release(kept);
  }
  EXPECT_EQ(g_live_chunks, before);  // the destructor frees the rest
}

TEST(PinnedArena, RejectsForeignPointers) {
  PinnedArena arena(kCountingMemory, kChunk, 1 << 20);
  int local = 0;
  EXPECT_FALSE(arena.add_fence(&local, std::make_shared<ManualFence>()));
  EXPECT_TRUE(arena.pending_fences(&local).empty());
  EXPECT_THROW(arena.release(&local), c10::Error);
}

}  // namespace
}  // namespace torch_offload
