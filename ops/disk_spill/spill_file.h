#pragma once
// One anonymous spill file in a directory: created with O_TMPFILE (or opened and
// unlinked at once), so it has no name and the kernel reclaims it on any exit,
// SIGKILL included. Space is handed out in extents; a freed extent's blocks go
// back to the file system at once (a hole is punched) and its range is reused.
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>

#include <sys/uio.h>

#include "ops/common/free_ranges.h"

namespace torch_offload {

// The name of a file system whose files live in RAM (statfs's f_type: tmpfs,
// ramfs, hugetlbfs), nullptr for any other.
const char* ram_filesystem_name(int64_t f_type);

class SpillFile {
 public:
  static constexpr size_t kBlock = 4096;  // O_DIRECT alignment of offsets, lengths and buffers

  // Throws (naming `directory`) if it is missing, not a writable directory, or
  // in RAM (tmpfs, ramfs: not disk) while allow_tmpfs is false.
  SpillFile(const std::string& directory, bool allow_tmpfs);
  ~SpillFile();
  SpillFile(const SpillFile&) = delete;
  SpillFile& operator=(const SpillFile&) = delete;

  // Throws unless allow_tmpfs or the directory is not in RAM: asked of every spill,
  // since one call allowing tmpfs does not allow it for the next.
  void check_allowed(bool allow_tmpfs) const;
  // Throws (naming it) if the directory is gone or no longer a directory: asked of
  // every spill too, so a removed directory is an error whether or not an earlier
  // spill's file is still open there.
  void check_directory() const;

  // A file offset for `bytes` (a multiple of kBlock), reusing freed space first.
  size_t allocate(size_t bytes);
  // Punches a hole over the range (its blocks go back to the file system), then
  // lets allocate() hand it out again.
  void release(size_t offset, size_t bytes);

  // Whole transfers: loop over short counts and EINTR. Return 0 or an errno;
  // a read that hits the end of the file reports EIO (short read). Both
  // gather / scatter over `parts` (consumed as they go), so payloads move in place.
  int write_all(iovec* parts, int count, size_t offset);
  int read_all(iovec* parts, int count, size_t offset);

  const std::string& directory() const { return directory_; }
  int fd() const { return fd_; }
  bool direct_io() const;
  size_t peak_bytes() const;
  // In a child after fork(): the descriptor is the parent's file, whose extents
  // the child must never touch. Closes it; the object stays unusable.
  void close_inherited();

 private:
  // O_DIRECT refused for this transfer (EINVAL): drop to buffered I/O for good.
  void fall_back_to_buffered();
  int transfer_all(bool write, iovec* parts, int count, size_t offset);

  const std::string directory_;
  int fd_ = -1;
  mutable std::mutex mutex_;
  FreeRanges free_;
  size_t end_ = 0;  // bytes handed out from the start of the file
  size_t peak_ = 0;
  bool direct_ = false;
  const char* ram_filesystem_ = nullptr;  // tmpfs, ramfs, ...: RAM, not disk
};

}  // namespace torch_offload
