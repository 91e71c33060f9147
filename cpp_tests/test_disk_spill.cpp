// The disk tier's building blocks and the ops from C++.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>

#include <fcntl.h>
#include <linux/falloc.h>
#include <linux/magic.h>
#include <sys/stat.h>

#include <ATen/ATen.h>

#include "ops/common/crc32c.h"
#include "ops/common/free_ranges.h"
#include "ops/disk_spill/restore_buffers.h"
#include "ops/disk_spill/spill_engine.h"
#include "ops/disk_spill/spill_file.h"
#include "torch_offload/torch_offload.h"

namespace torch_offload {
namespace {

TEST(Crc32c, KnownValueAndBothImplementationsAgree) {
  const char* check = "123456789";
  EXPECT_EQ(crc32c(check, 9), 0xE3069283u);  // the standard CRC-32C check value
  std::string data(100003, '\0');
  std::mt19937 random(7);
  for (char& c : data) {
    c = static_cast<char>(random());
  }
  for (size_t length : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{4097}, data.size()}) {
    EXPECT_EQ(crc32c(data.data(), length), detail::crc32c_portable(data.data(), length)) << length;
  }
  // Chained calls equal one call over the whole buffer.
  EXPECT_EQ(crc32c(data.data() + 1000, data.size() - 1000, crc32c(data.data(), 1000)),
            crc32c(data.data(), data.size()));
  const uint32_t before = crc32c(data.data(), data.size());
  data[5000] ^= 1;
  EXPECT_NE(crc32c(data.data(), data.size()), before);  // one flipped bit is caught
}

TEST(FreeRanges, FirstFitSplitsAndCoalesces) {
  FreeRanges ranges;
  ranges.add(0, 100);
  EXPECT_EQ(ranges.take(30), std::optional<size_t>(0));
  EXPECT_EQ(ranges.take(30), std::optional<size_t>(30));
  EXPECT_EQ(ranges.take(50), std::nullopt);  // 40 left
  ranges.add(0, 30);
  ranges.add(30, 30);  // merges with [0,30) and with [60,100)
  EXPECT_TRUE(ranges.is_one_range(0, 100));
}

TEST(RestoreBuffers, ReusesTheSameSizeWithinCapacityOldestDroppedFirst) {
  RestoreBuffers buffers;
  buffers.set_capacity(2 * 8192);
  void* a = buffers.take(8000);  // rounded up to two blocks
  void* b = buffers.take(8192);
  void* c = buffers.take(100);
  ASSERT_TRUE(a && b && c);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 4096, 0u);
  buffers.recycle(a, 8000);
  buffers.recycle(b, 8192);
  EXPECT_EQ(buffers.kept_bytes(), 2 * 8192u);
  buffers.recycle(c, 100);  // no room: a, the oldest, is freed
  EXPECT_EQ(buffers.kept_bytes(), 8192 + 4096u);
  EXPECT_EQ(buffers.take(8192), b);  // same size: reused
  EXPECT_EQ(buffers.hits(), 1);
  void* fresh = buffers.take(8192);  // none kept of that size any more
  EXPECT_EQ(buffers.hits(), 1);
  EXPECT_EQ(buffers.take(4096), c);
  EXPECT_EQ(buffers.hits(), 2);
  EXPECT_EQ(buffers.kept_bytes(), 0u);
  buffers.recycle(fresh, 8192);
  buffers.recycle(b, 8192);
  buffers.recycle(c, 4096);
  buffers.clear();
  EXPECT_EQ(buffers.kept_bytes(), 0u);
}

// LazyFree of /proc/self/smaps_rollup, in kB: pages given back to the kernel with MADV_FREE and not yet taken.
int64_t lazy_free_kb() {
  std::ifstream rollup("/proc/self/smaps_rollup");
  std::string line;
  while (std::getline(rollup, line)) {
    if (line.rfind("LazyFree:", 0) == 0) {
      return std::stoll(line.substr(9));
    }
  }
  return -1;
}

TEST(RestoreBuffers, KeptBuffersAreLazilyFreedAndStillServeTheirSize) {
  const size_t bytes = size_t{8} << 20;
  RestoreBuffers buffers;
  buffers.set_capacity(bytes);  // a buffer for exactly the capacity's data is kept
  auto* buffer = static_cast<char*>(buffers.take(bytes));
  ASSERT_NE(buffer, nullptr);
  std::memset(buffer, 1, bytes + 4096);  // resident, the offset block too
  const int64_t before = lazy_free_kb();
  ASSERT_GE(before, 0) << "no LazyFree in /proc/self/smaps_rollup (Linux 4.14+)";
  buffers.recycle(buffer, bytes);
  // Small pages are counted in batches of up to 31 per CPU: allow that much short of the whole buffer.
  const int64_t slack_kb = 31 * 4;
  EXPECT_GE(lazy_free_kb() - before, static_cast<int64_t>(bytes / 1024) - slack_kb);
  EXPECT_EQ(buffers.kept_bytes(), bytes);
  EXPECT_EQ(buffers.take(bytes), buffer);  // still served, and already the process's again: take() wrote to it
  EXPECT_EQ(buffers.hits(), 1);
  EXPECT_LT(lazy_free_kb() - before, slack_kb);
  buffers.recycle(buffer, bytes);
  buffers.clear();
  EXPECT_EQ(buffers.kept_bytes(), 0u);
}

TEST(RestoreBuffers, ZeroCapacityKeepsNothingAndLargeBuffersAreHugePageAligned) {
  RestoreBuffers buffers;
  void* large = buffers.take(size_t{6} << 20);
  ASSERT_NE(large, nullptr);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(large) % (size_t{2} << 20), 0u);
  buffers.recycle(large, size_t{6} << 20);  // capacity 0: freed
  EXPECT_EQ(buffers.kept_bytes(), 0u);
  void* again = buffers.take(size_t{6} << 20);
  EXPECT_EQ(buffers.hits(), 0);
  std::free(again);
}

TEST(SpillFile, RamFileSystemsAreKnownByTheirMagicNumber) {
  EXPECT_STREQ(ram_filesystem_name(TMPFS_MAGIC), "tmpfs");
  EXPECT_STREQ(ram_filesystem_name(RAMFS_MAGIC), "ramfs");
  EXPECT_STREQ(ram_filesystem_name(HUGETLBFS_MAGIC), "hugetlbfs");
  EXPECT_EQ(ram_filesystem_name(EXT4_SUPER_MAGIC), nullptr);
  EXPECT_EQ(ram_filesystem_name(XFS_SUPER_MAGIC), nullptr);
}

TEST(SpillFile, ReleasedRangesGiveTheirBlocksBack) {
  SpillFile file(std::filesystem::temp_directory_path().string(), false);
  const auto allocated = [&] {
    struct stat info{};
    EXPECT_EQ(::fstat(file.fd(), &info), 0);
    return static_cast<size_t>(info.st_blocks) * 512;
  };
  if (::fallocate(file.fd(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, SpillFile::kBlock) != 0) {
    GTEST_SKIP() << "the temp directory's file system cannot punch holes";
  }
  constexpr size_t kBytes = size_t{1} << 20;
  std::unique_ptr<char, decltype(&std::free)> data(static_cast<char*>(std::aligned_alloc(SpillFile::kBlock, kBytes)),
                                                   &std::free);
  std::memset(data.get(), 7, kBytes);
  const size_t first = file.allocate(kBytes);
  const size_t second = file.allocate(kBytes);
  for (const size_t offset : {first, second}) {
    iovec part{data.get(), kBytes};
    ASSERT_EQ(file.write_all(&part, 1, offset), 0);
  }
  EXPECT_GE(allocated(), 2 * kBytes);
  file.release(first, kBytes);
  EXPECT_LT(allocated(), 2 * kBytes);
  file.release(second, kBytes);
  EXPECT_EQ(allocated(), 0u);
  EXPECT_EQ(file.allocate(2 * kBytes), first);  // and the ranges are handed out again
}

// CUDA spills bounce their pinned source through a pageable buffer, 4 MiB at a
// time; the bytes on disk are the same as a direct write's.
TEST(SpillEngine, BouncedSourceRoundTripsAtAnyOffset) {
  SpillEngine& engine = SpillEngine::instance();
  engine.configure(SpillConfig{2, int64_t{16} << 20, true, int64_t{512} << 20, 0});
  const auto file = engine.file_for(std::filesystem::temp_directory_path().string(), false);
  const at::Tensor buffer = at::randint(0, 256, {(int64_t{40} << 20) + 8192}, at::kByte);
  for (const int64_t start : {int64_t{0}, int64_t{100}}) {
    const at::Tensor source = buffer.slice(0, start, start + (int64_t{37} << 20) + 5);
    for (const bool bounce : {true, false}) {
      const int64_t id = engine.spill(source, file, nullptr, bounce);
      const at::Tensor back = engine.restore(id, source.sizes(), source.scalar_type());
      EXPECT_TRUE(at::equal(back, source)) << "start " << start << " bounce " << bounce;
      engine.release(id, engine.nonce());
    }
  }
  engine.configure(SpillConfig{});
}

TEST(DiskSpillOps, RoundTripFromCpp) {
  const std::string directory = std::filesystem::temp_directory_path().string();
  const at::Tensor src = at::randn({33, 17}, at::kDouble).t();
  const at::Tensor ticket = disk_spill(src, directory);
  EXPECT_EQ(ticket.numel(), 2);
  disk_prefetch(ticket);
  const at::Tensor back = disk_restore(ticket, src.sizes(), src.scalar_type(), c10::Device(c10::kCPU));
  EXPECT_TRUE(at::equal(back, src));
  EXPECT_THROW(disk_restore(ticket, src.sizes(), src.scalar_type(), c10::Device(c10::kCPU)), c10::Error);
}

TEST(DiskSpillOps, MissingDirectoryIsRefused) {
  const at::Tensor src = at::ones({8});
  try {
    disk_spill(src, std::string("/nonexistent/torch_offload"));
    ADD_FAILURE() << "a missing directory was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot be used"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace torch_offload
