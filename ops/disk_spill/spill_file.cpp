#include "ops/disk_spill/spill_file.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include <fcntl.h>
#include <linux/falloc.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <c10/util/Exception.h>

namespace torch_offload {
namespace {

int open_anonymous(const std::string& directory, int flags) {
#ifdef O_TMPFILE
  const int anonymous = ::open(directory.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC | flags, 0600);
  if (anonymous >= 0 || (errno != EOPNOTSUPP && errno != EISDIR && errno != ENOENT)) {
    return anonymous;
  }
#endif
  // No O_TMPFILE here: a named file, unlinked before anything is written to it.
  std::string path = directory + "/torch_offload_spill." + std::string(6, 'X');  // mkostemp fills in the Xs
  const int fd = ::mkostemp(path.data(), O_CLOEXEC | flags);
  if (fd >= 0) {
    ::unlink(path.c_str());
  }
  return fd;
}

}  // namespace

const char* ram_filesystem_name(int64_t f_type) {
  switch (f_type) {
    case TMPFS_MAGIC:
      return "tmpfs";
    case RAMFS_MAGIC:
      return "ramfs";
    case HUGETLBFS_MAGIC:
      return "hugetlbfs";
    default:
      return nullptr;
  }
}

SpillFile::SpillFile(const std::string& directory, bool allow_tmpfs) : directory_(directory) {
  check_directory();
  TORCH_CHECK(::access(directory.c_str(), W_OK | X_OK) == 0, "disk_spill: directory '", directory,
              "' is not writable: ", std::strerror(errno));
  struct statfs fs{};
  TORCH_CHECK(::statfs(directory.c_str(), &fs) == 0, "disk_spill: directory '", directory,
              "' cannot be inspected: ", std::strerror(errno));
  ram_filesystem_ = ram_filesystem_name(static_cast<int64_t>(fs.f_type));
  check_allowed(allow_tmpfs);
  fd_ = open_anonymous(directory, O_DIRECT);
  direct_ = fd_ >= 0;
  if (fd_ < 0 && errno == EINVAL) {  // the file system refuses O_DIRECT
    fd_ = open_anonymous(directory, 0);
  }
  TORCH_CHECK(fd_ >= 0, "disk_spill: cannot create a spill file in directory '", directory,
              "': ", std::strerror(errno));
}

SpillFile::~SpillFile() {
  ::close(fd_);
}

void SpillFile::check_directory() const {
  struct stat info{};
  TORCH_CHECK(::stat(directory_.c_str(), &info) == 0, "disk_spill: directory '", directory_,
              "' cannot be used: ", std::strerror(errno));
  TORCH_CHECK(S_ISDIR(info.st_mode), "disk_spill: directory '", directory_, "' is not a directory");
}

void SpillFile::check_allowed(bool allow_tmpfs) const {
  TORCH_CHECK(allow_tmpfs || ram_filesystem_ == nullptr, "disk_spill: directory '", directory_, "' is on ",
              ram_filesystem_,
              ", which is RAM, not disk; choose a directory on a disk "
              "(TORCH_OFFLOAD_SPILL_DIR), or pass allow_tmpfs=True");
}

size_t SpillFile::allocate(size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (const auto offset = free_.take(bytes)) {
    return *offset;
  }
  const size_t offset = end_;
  end_ += bytes;
  peak_ = std::max(peak_, end_);
  return offset;
}

void SpillFile::release(size_t offset, size_t bytes) {
  // Before the range is free: once allocate() may hand it out, a hole could
  // punch through new data. File systems without holes (ramfs) keep the blocks
  // until the file is closed.
  ::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset), static_cast<off_t>(bytes));
  std::lock_guard<std::mutex> lock(mutex_);
  free_.add(offset, bytes);
}

bool SpillFile::direct_io() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return direct_;
}

size_t SpillFile::peak_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_;
}

void SpillFile::close_inherited() {
  ::close(fd_);
  fd_ = -1;
}

void SpillFile::fall_back_to_buffered() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (direct_) {
    const int flags = ::fcntl(fd_, F_GETFL);
    if (flags >= 0 && ::fcntl(fd_, F_SETFL, flags & ~O_DIRECT) == 0) {
      direct_ = false;
    }
  }
}

int SpillFile::transfer_all(bool write, iovec* parts, int count, size_t offset) {
  while (count > 0) {
    const auto at = static_cast<off_t>(offset);
    const ssize_t n = write ? ::pwritev(fd_, parts, count, at) : ::preadv(fd_, parts, count, at);
    if (n < 0) {
      if (errno == EINTR) {
        continue;
      }
      if (errno == EINVAL && direct_io()) {
        fall_back_to_buffered();
        continue;
      }
      return errno;
    }
    if (n == 0) {
      return EIO;  // a read past the end of the file (short extent), or a write that made no progress
    }
    offset += static_cast<size_t>(n);
    for (size_t left = static_cast<size_t>(n); left > 0;) {  // skip what was transferred
      const size_t used = std::min(left, parts->iov_len);
      parts->iov_base = static_cast<char*>(parts->iov_base) + used;
      parts->iov_len -= used;
      left -= used;
      if (parts->iov_len == 0) {
        ++parts;
        --count;
      }
    }
  }
  return 0;
}

int SpillFile::write_all(iovec* parts, int count, size_t offset) {
  return transfer_all(/*write=*/true, parts, count, offset);
}

int SpillFile::read_all(iovec* parts, int count, size_t offset) {
  return transfer_all(/*write=*/false, parts, count, offset);
}

}  // namespace torch_offload
