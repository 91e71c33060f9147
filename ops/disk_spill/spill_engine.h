#pragma once
// The process's disk tier: tickets for tensors written asynchronously, in
// checksummed extents, to anonymous spill files by a pool of I/O threads.
//
// A ticket's write starts at spill() and runs on the workers; restore() (or
// wait_written()) is where a write error surfaces, as a RuntimeError, and the
// process stays usable. Workers block on condition variables; nothing polls.
//
// fork(): the child's threads are gone and its files are the parent's, so the
// child gets a fresh engine (new nonce, files and threads, the same settings);
// the parent's tickets are foreign to it, like any other process's.
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "ops/disk_spill/restore_buffers.h"
#include "ops/disk_spill/spill_file.h"

namespace torch_offload {

struct SpillConfig {
  int64_t num_threads = 4;
  int64_t extent_bytes = int64_t{32} << 20;  // payload of one extent (one header each)
  bool checksums = true;
  int64_t max_in_flight_bytes = int64_t{512} << 20;  // spill() waits beyond this
  // Freed restore buffers kept, lazily freed, for reuse; off by default: kept buffers count in the
  // resident set until the kernel takes them, and a training step's peak held up to two.
  int64_t restore_cache_bytes = 0;
};

struct SpillStats {
  int64_t bytes_written = 0;
  int64_t bytes_read = 0;
  int64_t extents_live = 0;
  int64_t peak_file_bytes = 0;
  int64_t write_ns = 0;  // summed over workers, in pwrite
  int64_t read_ns = 0;   // summed over workers, in pread
  int64_t tickets_live = 0;
  int64_t restore_cache_hits = 0;        // restores that reused a freed buffer
  int64_t restore_cache_kept_bytes = 0;  // freed restore buffers kept now
  int64_t heap_trims = 0;                // times a worker gave the heaps' free pages back
};

class SpillEngine {
 public:
  static SpillEngine& instance();

  // The spill file of `directory`: opened on first use (errors name the
  // directory), closed once no ticket uses it.
  std::shared_ptr<SpillFile> file_for(const std::string& directory, bool allow_tmpfs);
  // Starts writing `source` (contiguous, on the CPU) and returns the ticket id.
  // `source_ready`, if set, is called by a worker before it reads the source
  // (a device-to-host copy may still be filling it). `bounce_source`: the
  // source's memory may refuse O_DIRECT (CUDA pinned memory), copy it first.
  int64_t spill(const at::Tensor& source, std::shared_ptr<SpillFile> file, std::function<void()> source_ready,
                bool bounce_source = false);
  // Blocks until the ticket's write finished; raises its error.
  void wait_written(int64_t ticket);
  // Starts reading the ticket back (after its write) into a host buffer that
  // restore() will hand out.
  void prefetch(int64_t ticket);
  // The tensor back, on the CPU. A ticket is restored once; sizes and dtype must match.
  at::Tensor restore(int64_t ticket, at::IntArrayRef sizes, c10::ScalarType dtype);
  // The tensor back, on the CPU, the ticket kept: read again as often as asked (a prefetch serves the next read),
  // until restored or freed; sizes and dtype must match.
  at::Tensor read(int64_t ticket, at::IntArrayRef sizes, c10::ScalarType dtype);
  // The ticket tensor is gone: its extents are freed once no I/O uses them.
  // A ticket of another engine (the parent's, after fork) is ignored.
  void release(int64_t ticket, uint64_t nonce);

  // Waits for the I/O in flight (freed extents given back included) to finish first.
  void configure(const SpillConfig& config);
  SpillStats stats() const;
  // [fd, file offset of the first extent, offset of its payload within it]: for tests that corrupt data.
  std::vector<int64_t> location(int64_t ticket) const;
  uint64_t nonce() const { return nonce_; }

 private:
  struct Ticket;
  struct Job {
    std::shared_ptr<Ticket> ticket;
    size_t index;
    bool write;
  };

  // A freed ticket's extents, given back to their file by an I/O thread: the
  // hole punched over each takes milliseconds per 64 MiB (tens with online
  // discard), which the thread that freed the ticket must not wait for.
  struct FreedExtents {
    std::shared_ptr<SpillFile> file;                // closed by the thread that drops the last reference
    std::vector<std::pair<size_t, size_t>> ranges;  // offset, bytes
  };

  explicit SpillEngine(const SpillConfig& config);
  static void restart_in_child();
  void start_workers_locked();
  void stop_workers(std::unique_lock<std::mutex>& lock);
  void worker_loop(char* staging);
  // Returns an error message, empty on success.
  std::string run_job(const Job& job, char* staging, std::unique_ptr<char, decltype(&std::free)>& bounce);
  void finish_job(const Job& job, const std::string& error);
  void start_reads_locked(const std::shared_ptr<Ticket>& ticket);
  // Counts bytes that went through the tier; every kTrimEveryBytes, asks a worker to trim the heap.
  void count_for_trim_locked(int64_t bytes);
  void free_extents_locked(Ticket& ticket);
  std::shared_ptr<Ticket> find_locked(int64_t ticket, const char* op) const;
  // The ticket `op` reads, checked against sizes and dtype, once its reads have landed (started here if none are).
  std::shared_ptr<Ticket> read_locked(std::unique_lock<std::mutex>& lock, int64_t ticket, at::IntArrayRef sizes,
                                      c10::ScalarType dtype, const char* op);

  const uint64_t nonce_;  // per process: extents written by anyone else never verify
  SpillConfig config_;
  mutable std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<Job> queue_;
  std::deque<FreedExtents> frees_;  // taken before the jobs: space back first
  // Bytes written or restored since the heap was last trimmed, whether a worker should trim it (trim_heap()), and
  // whether one is.
  int64_t bytes_since_trim_ = 0;
  bool trim_requested_ = false;
  bool trimming_ = false;
  std::vector<std::thread> workers_;
  bool stopping_ = false;
  int64_t in_flight_bytes_ = 0;
  int64_t jobs_in_flight_ = 0;
  int64_t next_ticket_ = 1;
  std::map<int64_t, std::shared_ptr<Ticket>> tickets_;
  std::map<std::string, std::weak_ptr<SpillFile>> files_;  // tickets own them
  SpillStats stats_;
  RestoreBuffers restore_buffers_;  // its own lock: tensors die anywhere, under mutex_ too
};

}  // namespace torch_offload
