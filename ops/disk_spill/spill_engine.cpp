#include "ops/disk_spill/spill_engine.h"

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <system_error>
#include <utility>

#include <pthread.h>
#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include "ops/common/crc32c.h"

namespace torch_offload {
namespace {

constexpr uint64_t kMagic = 0x314C505346464F54;  // "TOFFSPL1"
constexpr uint32_t kHasChecksum = 1;

// The first block of every extent; ExtentLayout says where the payload follows.
struct ExtentHeader {
  uint64_t magic;
  uint64_t nonce;   // the writing process
  uint64_t ticket;  // a reused extent still holding an older ticket is stale
  uint64_t index;
  uint64_t payload_bytes;
  uint32_t flags;
  uint32_t payload_crc;
  uint32_t header_crc;  // over everything above
};

uint32_t header_checksum(const ExtentHeader& header) {
  return crc32c(&header, offsetof(ExtentHeader, header_crc));
}

// An exception caught on an I/O thread, as restore() will raise it: without c10's backtrace.
std::string message_of(const std::exception& e) {
  const auto* error = dynamic_cast<const c10::Error*>(&e);
  return error != nullptr ? error->what_without_backtrace() : e.what();
}

// An extent on disk: the header block, then the payload, contiguous, split by
// memory alignment so that its bulk moves straight between the tensor and the
// disk with O_DIRECT, no copy: the `head` bytes before the tensor's first block
// boundary fill the end of a block of their own, then `middle` whole blocks,
// then `tail` bytes at the start of a last block. Head and tail go through
// per-worker staging blocks.
struct ExtentLayout {
  size_t payload, head, middle, tail;

  size_t span() const { return SpillFile::kBlock * (1 + (head > 0) + (tail > 0)) + middle; }
  size_t payload_at() const {  // the payload's first byte, from the extent's start
    return SpillFile::kBlock + (head > 0 ? SpillFile::kBlock - head : 0);
  }
};

// CUDA's pinned host memory may refuse O_DIRECT (EFAULT: the kernel cannot pin
// the pages of a driver mapping), so a pinned source's bulk, parts[bulk], goes
// to disk through a pageable bounce buffer, kBounceBytes at a time.
constexpr size_t kBounceBytes = size_t{4} << 20;

int write_through_bounce(SpillFile& file, const iovec* parts, int count, int bulk, size_t offset, char* bounce) {
  for (int i = 0; i < count; ++i) {
    if (i != bulk) {
      iovec part = parts[i];
      if (const int err = file.write_all(&part, 1, offset)) {
        return err;
      }
      offset += parts[i].iov_len;
      continue;
    }
    const char* from = static_cast<const char*>(parts[i].iov_base);
    for (size_t done = 0; done < parts[i].iov_len; done += kBounceBytes) {
      const size_t piece = std::min(kBounceBytes, parts[i].iov_len - done);
      std::memcpy(bounce, from + done, piece);
      iovec part{bounce, piece};
      if (const int err = file.write_all(&part, 1, offset)) {
        return err;
      }
      offset += piece;
    }
  }
  return 0;
}

int64_t elapsed_ns(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - since).count();
}

// glibc keeps freed blocks of up to 32 MiB in the heap: after the first big block is freed it serves blocks up to
// that size from the heap instead of mmap (its dynamic mmap threshold), and frees them into holes that later
// allocations of other sizes rarely fill. The tier frees such blocks all the time (each written tensor, each restored
// one once backward is done with it) and the holes stayed resident: one step of the demo's Llama at 8K tokens grew
// the resident set by 1.4 GiB against 0.4 with the heap trimmed. So every kTrimEveryBytes written or restored, an
// idle worker gives the heaps' free pages back (malloc_trim): the training thread's allocations wait only while it
// releases their arena's pages, and the process's malloc settings stay as the user left them.
constexpr int64_t kTrimEveryBytes = int64_t{64} << 20;

#if defined(__GLIBC__)
constexpr bool kCanTrimHeap = true;
void trim_heap() {
  ::malloc_trim(0);
}
#else
constexpr bool kCanTrimHeap = false;
void trim_heap() {}
#endif

// The engine of this process: replaced in a child after fork().
std::atomic<SpillEngine*> current_engine{nullptr};

}  // namespace

struct SpillEngine::Ticket {
  int64_t id;
  std::shared_ptr<SpillFile> file;
  int64_t nbytes;
  size_t extent_bytes;
  size_t memory_offset;         // of the source's data within a block; the restore buffer's data gets the same
  std::vector<size_t> offsets;  // file offset of each extent
  c10::ScalarType dtype;
  std::vector<int64_t> sizes;
  bool checksums;
  bool bounce_source;  // O_DIRECT may not read the source's memory (pinned by CUDA)

  at::Tensor source;  // kept alive until written
  std::function<void()> source_ready;
  at::Tensor destination;  // filled by reads
  int64_t writes_pending = 0;
  int64_t reads_pending = 0;
  bool reading = false;
  bool prefetch_requested = false;
  bool restored = false;
  bool released = false;
  std::string error;

  ExtentLayout layout(size_t index) const {
    const size_t payload = std::min(extent_bytes, static_cast<size_t>(nbytes) - index * extent_bytes);
    // Extents start extent_bytes apart, a multiple of kBlock: all share memory_offset.
    const size_t head = std::min(payload, (SpillFile::kBlock - memory_offset) % SpillFile::kBlock);
    const size_t middle = (payload - head) / SpillFile::kBlock * SpillFile::kBlock;
    return ExtentLayout{payload, head, middle, payload - head - middle};
  }
};

SpillEngine& SpillEngine::instance() {
  // Never destroyed: ticket tensors may be freed during interpreter teardown.
  static const bool created = [] {
    current_engine.store(new SpillEngine(SpillConfig{}));
    // The locks are held across fork() so that the child finds the engine at rest.
    const auto lock = [] {
      SpillEngine& engine = *current_engine.load();
      engine.mutex_.lock();
      engine.restore_buffers_.lock();
    };
    const auto unlock = [] {
      SpillEngine& engine = *current_engine.load();
      engine.restore_buffers_.unlock();
      engine.mutex_.unlock();
    };
    TORCH_CHECK(::pthread_atfork(lock, unlock, &SpillEngine::restart_in_child) == 0,
                "disk_spill: cannot register the fork handlers");
    return true;
  }();
  (void)created;
  return *current_engine.load();
}

// In the child, the only thread there. The parent's engine is left behind as it
// is (its workers are gone, its tickets belong to the parent): only its files are
// closed and its kept restore buffers freed, so the child holds neither.
void SpillEngine::restart_in_child() {
  SpillEngine& parent = *current_engine.load();
  for (const auto& [directory, weak_file] : parent.files_) {
    if (const auto file = weak_file.lock()) {
      file->close_inherited();
    }
  }
  const SpillConfig config = parent.config_;
  parent.restore_buffers_.unlock();
  parent.restore_buffers_.clear();
  parent.mutex_.unlock();
  current_engine.store(new SpillEngine(config));
}

SpillEngine::SpillEngine(const SpillConfig& config)
    : nonce_(std::random_device{}() * uint64_t{0x9E3779B97F4A7C15} ^ ::getpid()), config_(config) {
  restore_buffers_.set_capacity(static_cast<size_t>(config_.restore_cache_bytes));
}

std::shared_ptr<SpillFile> SpillEngine::file_for(const std::string& directory, bool allow_tmpfs) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::erase_if(files_, [](const auto& entry) { return entry.second.expired(); });
  if (auto file = files_[directory].lock()) {
    file->check_directory();
    file->check_allowed(allow_tmpfs);
    return file;
  }
  try {
    auto file = std::make_shared<SpillFile>(directory, allow_tmpfs);
    files_[directory] = file;
    return file;
  } catch (...) {
    files_.erase(directory);
    throw;
  }
}

void SpillEngine::start_workers_locked() {
  if (!workers_.empty()) {
    return;
  }
  // O_DIRECT needs aligned buffers: a header, a head and a tail block per worker.
  const size_t staging_bytes = 3 * SpillFile::kBlock;
  stopping_ = false;
  for (int64_t i = 0; i < config_.num_threads; ++i) {
    std::shared_ptr<char> staging(static_cast<char*>(std::aligned_alloc(SpillFile::kBlock, staging_bytes)), &std::free);
    TORCH_CHECK(staging, "disk_spill: cannot allocate a ", staging_bytes, "-byte staging buffer");
    try {
      workers_.emplace_back([this, staging] { worker_loop(staging.get()); });
    } catch (const std::system_error& error) {  // e.g. the process may start no more threads
      TORCH_CHECK(false, "disk_spill: cannot start an I/O thread (", error.what(), "); ", workers_.size(), " of ",
                  config_.num_threads, " are running");
    }
  }
}

void SpillEngine::stop_workers(std::unique_lock<std::mutex>& lock) {
  stopping_ = true;
  work_cv_.notify_all();
  std::vector<std::thread> workers = std::move(workers_);
  workers_.clear();
  lock.unlock();
  for (auto& worker : workers) {
    worker.join();
  }
  lock.lock();
}

void SpillEngine::configure(const SpillConfig& config) {
  TORCH_CHECK(config.num_threads >= 1 && config.num_threads <= 64,
              "disk_spill_configure: num_threads must be in [1, 64], got ", config.num_threads);
  TORCH_CHECK(config.extent_bytes >= static_cast<int64_t>(SpillFile::kBlock) &&
                  config.extent_bytes % SpillFile::kBlock == 0 && config.extent_bytes <= (int64_t{1} << 30),
              "disk_spill_configure: extent_bytes must be a multiple of ", SpillFile::kBlock,
              " between 4 KiB and 1 GiB, got ", config.extent_bytes);
  TORCH_CHECK(config.max_in_flight_bytes > 0, "disk_spill_configure: max_in_flight_bytes must be > 0, got ",
              config.max_in_flight_bytes);
  TORCH_CHECK(config.restore_cache_bytes >= 0, "disk_spill_configure: restore_cache_bytes must be >= 0, got ",
              config.restore_cache_bytes);
  std::unique_lock<std::mutex> lock(mutex_);
  // Jobs already queued (of freed tickets too) finish first, with their tickets' own settings.
  done_cv_.wait(lock, [&] { return jobs_in_flight_ == 0; });
  stop_workers(lock);
  config_ = config;
  restore_buffers_.set_capacity(static_cast<size_t>(config.restore_cache_bytes));
  if (!tickets_.empty()) {
    start_workers_locked();  // they give back the extents of the tickets still live once freed
  }
}

int64_t SpillEngine::spill(const at::Tensor& source, std::shared_ptr<SpillFile> file,
                           std::function<void()> source_ready, bool bounce_source) {
  auto ticket = std::make_shared<Ticket>();
  ticket->file = std::move(file);
  ticket->nbytes = static_cast<int64_t>(source.numel()) * source.element_size();
  ticket->dtype = source.scalar_type();
  ticket->sizes = source.sizes().vec();
  ticket->memory_offset = reinterpret_cast<uintptr_t>(source.const_data_ptr()) % SpillFile::kBlock;
  ticket->source = source;
  ticket->source_ready = std::move(source_ready);
  ticket->bounce_source = bounce_source;

  std::unique_lock<std::mutex> lock(mutex_);
  ticket->extent_bytes = static_cast<size_t>(config_.extent_bytes);
  ticket->checksums = config_.checksums;
  // Backpressure: bound the host memory held by writes not yet done.
  done_cv_.wait(
      lock, [&] { return in_flight_bytes_ == 0 || in_flight_bytes_ + ticket->nbytes <= config_.max_in_flight_bytes; });
  const size_t extents = (static_cast<size_t>(ticket->nbytes) + ticket->extent_bytes - 1) / ticket->extent_bytes;
  if (extents > 0) {
    start_workers_locked();  // before the ticket exists: if no thread starts, nothing is left registered
  }
  ticket->id = next_ticket_++;
  for (size_t index = 0; index < extents; ++index) {
    ticket->offsets.push_back(ticket->file->allocate(ticket->layout(index).span()));
  }
  stats_.peak_file_bytes = std::max(stats_.peak_file_bytes, static_cast<int64_t>(ticket->file->peak_bytes()));
  stats_.extents_live += static_cast<int64_t>(extents);
  stats_.tickets_live += 1;
  tickets_.emplace(ticket->id, ticket);
  if (extents == 0) {
    ticket->source.reset();
    return ticket->id;
  }
  ticket->writes_pending = static_cast<int64_t>(extents);
  in_flight_bytes_ += ticket->nbytes;
  for (size_t index = 0; index < extents; ++index) {
    queue_.push_back(Job{ticket, index, true});
    ++jobs_in_flight_;
  }
  work_cv_.notify_all();
  return ticket->id;
}

std::shared_ptr<SpillEngine::Ticket> SpillEngine::find_locked(int64_t id, const char* op) const {
  auto it = tickets_.find(id);
  TORCH_CHECK(it != tickets_.end() && !it->second->released, op, ": ticket ", id,
              " is unknown or was released (its ticket tensor was freed)");
  return it->second;
}

void SpillEngine::wait_written(int64_t id) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto ticket = find_locked(id, "disk_wait");
  done_cv_.wait(lock, [&] { return ticket->writes_pending == 0; });
  TORCH_CHECK(ticket->error.empty(), ticket->error);
}

void SpillEngine::start_reads_locked(const std::shared_ptr<Ticket>& ticket) {
  // The data starts at the source's offset within a block, so that the bulk of
  // every extent is read in place (ExtentLayout); buffers for one tensor size
  // hold it at any such offset, so they are interchangeable.
  const size_t offset = ticket->memory_offset;
  const size_t bytes = static_cast<size_t>(ticket->nbytes);
  char* memory = static_cast<char*>(restore_buffers_.take(bytes));
  TORCH_CHECK(memory != nullptr, "disk_restore: cannot allocate ", ticket->nbytes, " bytes for ticket ", ticket->id);
  ticket->reading = true;
  // Engines are never destroyed, so the buffer can come back whenever the tensor
  // dies: to the engine of the process it dies in (a child's after fork()).
  try {
    ticket->destination = at::from_blob(
        memory + offset, ticket->sizes,
        [offset, bytes](void* data) { instance().restore_buffers_.recycle(static_cast<char*>(data) - offset, bytes); },
        at::TensorOptions().dtype(ticket->dtype));
  } catch (...) {
    restore_buffers_.recycle(memory, bytes);
    throw;
  }
  ticket->reads_pending = static_cast<int64_t>(ticket->offsets.size());
  for (size_t index = 0; index < ticket->offsets.size(); ++index) {
    queue_.push_back(Job{ticket, index, false});
    ++jobs_in_flight_;
  }
  start_workers_locked();
  work_cv_.notify_all();
}

void SpillEngine::prefetch(int64_t id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto ticket = find_locked(id, "disk_prefetch");
  if (ticket->restored || ticket->reading || ticket->prefetch_requested) {
    return;
  }
  ticket->prefetch_requested = true;
  if (ticket->writes_pending == 0 && ticket->error.empty()) {
    start_reads_locked(ticket);
  }  // else the last write starts the reads
}

at::Tensor SpillEngine::restore(int64_t id, at::IntArrayRef sizes, c10::ScalarType dtype) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto ticket = read_locked(lock, id, sizes, dtype, "disk_restore");
  ticket->restored = true;
  free_extents_locked(*ticket);
  count_for_trim_locked(ticket->nbytes);
  TORCH_CHECK(ticket->error.empty(), ticket->error);
  return std::move(ticket->destination);
}

at::Tensor SpillEngine::read(int64_t id, at::IntArrayRef sizes, c10::ScalarType dtype) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto ticket = read_locked(lock, id, sizes, dtype, "disk_read");
  count_for_trim_locked(ticket->nbytes);
  TORCH_CHECK(ticket->error.empty(), ticket->error);
  // The extents stay: the next read (or a prefetch) starts reads into a buffer of its own.
  ticket->reading = false;
  ticket->prefetch_requested = false;
  return std::move(ticket->destination);
}

std::shared_ptr<SpillEngine::Ticket> SpillEngine::read_locked(std::unique_lock<std::mutex>& lock, int64_t id,
                                                              at::IntArrayRef sizes, c10::ScalarType dtype,
                                                              const char* op) {
  auto ticket = find_locked(id, op);
  TORCH_CHECK(!ticket->restored, op, ": ticket ", id, " was already restored; a ticket is restored once");
  TORCH_CHECK(dtype == ticket->dtype, op, ": dtype is ", dtype, " but ticket ", id, " holds ", ticket->dtype);
  TORCH_CHECK(sizes == at::IntArrayRef(ticket->sizes), op, ": size is ", sizes, " but ticket ", id,
              " holds a tensor of size ", at::IntArrayRef(ticket->sizes));
  done_cv_.wait(lock, [&] { return ticket->writes_pending == 0; });
  if (ticket->error.empty() && !ticket->reading) {
    start_reads_locked(ticket);
  }
  done_cv_.wait(lock, [&] { return ticket->reads_pending == 0; });
  return ticket;
}

void SpillEngine::release(int64_t id, uint64_t nonce) {
  if (nonce != nonce_) {
    return;
  }
  std::shared_ptr<Ticket> released;  // destroyed after unlocking, with whatever it still holds
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = tickets_.find(id);
  if (it == tickets_.end()) {
    return;
  }
  released = it->second;
  Ticket& ticket = *released;
  ticket.released = true;
  // Buffers stay with the Ticket, which jobs in flight still hold: they go with the last one.
  if (ticket.writes_pending == 0 && ticket.reads_pending == 0) {
    free_extents_locked(ticket);
  }  // else the last job frees them
  tickets_.erase(it);
  stats_.tickets_live -= 1;
}

void SpillEngine::free_extents_locked(Ticket& ticket) {
  // The ticket needs its file no more: the file closes with the last ticket that does.
  FreedExtents freed{std::move(ticket.file), {}};
  for (size_t index = 0; index < ticket.offsets.size(); ++index) {
    freed.ranges.emplace_back(ticket.offsets[index], ticket.layout(index).span());
  }
  stats_.extents_live -= static_cast<int64_t>(ticket.offsets.size());
  ticket.offsets.clear();
  if (freed.ranges.empty()) {
    return;  // a ticket of 0 bytes: the file has nothing of it
  }
  // The workers run: they wrote these extents, and configure() restarts them while tickets live.
  frees_.push_back(std::move(freed));
  ++jobs_in_flight_;
  work_cv_.notify_one();
}

void SpillEngine::count_for_trim_locked(int64_t bytes) {
  if (!kCanTrimHeap) {
    return;
  }
  bytes_since_trim_ += bytes;
  if (bytes_since_trim_ >= kTrimEveryBytes && !workers_.empty()) {
    bytes_since_trim_ = 0;
    trim_requested_ = true;
    work_cv_.notify_one();
  }
}

void SpillEngine::worker_loop(char* staging) {
  std::unique_ptr<char, decltype(&std::free)> bounce(nullptr, &std::free);  // made on first need
  while (true) {
    Job job;
    FreedExtents freed;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      // A trim waits for the queued work (restores wait on it) and for a trim in progress (it would only contend).
      const auto trim_due = [&] { return trim_requested_ && !trimming_; };
      work_cv_.wait(lock, [&] { return stopping_ || trim_due() || !queue_.empty() || !frees_.empty(); });
      if (!frees_.empty()) {
        freed = std::move(frees_.front());
        frees_.pop_front();
      } else if (!queue_.empty()) {
        job = std::move(queue_.front());
        queue_.pop_front();
      } else if (trim_due()) {
        trim_requested_ = false;
        trimming_ = true;
        stats_.heap_trims += 1;
        lock.unlock();
        trim_heap();
        lock.lock();
        trimming_ = false;
        if (trim_requested_) {
          work_cv_.notify_one();
        }
        continue;
      } else {
        return;  // stopping
      }
    }
    if (freed.file) {
      for (const auto& [offset, bytes] : freed.ranges) {
        freed.file->release(offset, bytes);
      }
      freed.file.reset();  // closes the file if no ticket uses it any more
      std::lock_guard<std::mutex> lock(mutex_);
      --jobs_in_flight_;
      done_cv_.notify_all();
      continue;
    }
    std::string error;
    try {
      error = run_job(job, staging, bounce);
    } catch (const std::exception& e) {  // e.g. a failed device-to-host copy
      error = message_of(e);
    }
    finish_job(job, error);
  }
}

std::string SpillEngine::run_job(const Job& job, char* staging, std::unique_ptr<char, decltype(&std::free)>& bounce) {
  const Ticket& ticket = *job.ticket;
  const ExtentLayout extent = ticket.layout(job.index);
  const size_t file_offset = ticket.offsets[job.index];
  auto* header = reinterpret_cast<ExtentHeader*>(staging);
  char* head_block = staging + SpillFile::kBlock;
  char* tail_block = staging + 2 * SpillFile::kBlock;
  const auto describe = [&](const char* what, int err) {
    return std::string("disk_spill: ") + what + " extent " + std::to_string(job.index) + " of ticket " +
           std::to_string(ticket.id) + " in '" + ticket.file->directory() + "' failed: " + std::strerror(err);
  };
  // The extent's memory: the source's for a write, the restore buffer's for a read.
  char* memory = static_cast<char*>(job.write ? const_cast<void*>(ticket.source.const_data_ptr())
                                              : ticket.destination.mutable_data_ptr()) +
                 job.index * ticket.extent_bytes;
  iovec parts[4];
  int count = 0;
  int bulk = -1;  // the part that moves in place
  parts[count++] = iovec{staging, SpillFile::kBlock};
  if (extent.head > 0) {
    parts[count++] = iovec{head_block, SpillFile::kBlock};
  }
  if (extent.middle > 0) {
    bulk = count;
    parts[count++] = iovec{memory + extent.head, extent.middle};
  }
  if (extent.tail > 0) {
    parts[count++] = iovec{tail_block, SpillFile::kBlock};
  }
  char* head_bytes = head_block + SpillFile::kBlock - extent.head;
  char* tail_bytes = memory + extent.head + extent.middle;

  if (job.write) {
    if (ticket.source_ready) {
      ticket.source_ready();
    }
    // Padding is zeroed: nothing of earlier extents goes to disk again.
    std::memset(staging, 0, 3 * SpillFile::kBlock);
    std::memcpy(head_bytes, memory, extent.head);
    std::memcpy(tail_block, tail_bytes, extent.tail);
    *header = ExtentHeader{kMagic,
                           nonce_,
                           static_cast<uint64_t>(ticket.id),
                           job.index,
                           extent.payload,
                           ticket.checksums ? kHasChecksum : 0,
                           ticket.checksums ? crc32c(memory, extent.payload) : 0,
                           0};
    header->header_crc = header_checksum(*header);
    const bool bounced = ticket.bounce_source && bulk >= 0;
    if (bounced && !bounce) {
      bounce.reset(static_cast<char*>(std::aligned_alloc(SpillFile::kBlock, kBounceBytes)));
      if (!bounce) {
        return describe("writing", ENOMEM);
      }
    }
    const auto start = std::chrono::steady_clock::now();
    const int err = bounced ? write_through_bounce(*ticket.file, parts, count, bulk, file_offset, bounce.get())
                            : ticket.file->write_all(parts, count, file_offset);
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.write_ns += elapsed_ns(start);
    if (err != 0) {
      return describe("writing", err);
    }
    stats_.bytes_written += static_cast<int64_t>(extent.payload);
    return {};
  }
  const auto start = std::chrono::steady_clock::now();
  const int err = ticket.file->read_all(parts, count, file_offset);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stats_.read_ns += elapsed_ns(start);
  }
  if (err != 0) {
    return describe("reading", err);
  }
  const std::string where = "disk_restore: extent " + std::to_string(job.index) + " of ticket " +
                            std::to_string(ticket.id) + " in '" + ticket.file->directory() + "' ";
  if (header->magic != kMagic || header->header_crc != header_checksum(*header) || header->nonce != nonce_) {
    return where + "has no valid header: the file was damaged or overwritten";
  }
  if (header->ticket != static_cast<uint64_t>(ticket.id) || header->index != job.index ||
      header->payload_bytes != extent.payload) {
    return where + "holds other data (ticket " + std::to_string(header->ticket) + ", extent " +
           std::to_string(header->index) + ", " + std::to_string(header->payload_bytes) + " bytes): stale or short";
  }
  std::memcpy(memory, head_bytes, extent.head);
  std::memcpy(tail_bytes, tail_block, extent.tail);
  if ((header->flags & kHasChecksum) != 0) {
    const uint32_t crc = crc32c(memory, extent.payload);
    if (crc != header->payload_crc) {
      return where + "failed its checksum (stored " + std::to_string(header->payload_crc) + ", computed " +
             std::to_string(crc) +
             "): the data on disk is corrupted, or the tensor's memory changed while it was written "
             "(a write through .data after disk_spill)";
    }
  }
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.bytes_read += static_cast<int64_t>(extent.payload);
  return {};
}

void SpillEngine::finish_job(const Job& job, const std::string& error) {
  // Let go of the written source after unlocking: its deleter may come back to
  // the engine (a spilled ticket tensor releases its own ticket).
  at::Tensor written_source;
  std::function<void()> written_source_ready;
  std::lock_guard<std::mutex> lock(mutex_);
  Ticket& ticket = *job.ticket;
  --jobs_in_flight_;
  if (!error.empty() && ticket.error.empty()) {
    ticket.error = error;
  }
  if (job.write) {
    if (--ticket.writes_pending == 0) {
      written_source = std::move(ticket.source);
      written_source_ready = std::exchange(ticket.source_ready, nullptr);
      in_flight_bytes_ -= ticket.nbytes;
      count_for_trim_locked(ticket.nbytes);
      if (ticket.prefetch_requested && ticket.error.empty() && !ticket.released) {
        try {
          start_reads_locked(job.ticket);
        } catch (const std::exception&) {
          // No memory for the restore buffer yet: not the write's fault, so not
          // the ticket's error. restore() tries again and raises if it must.
          ticket.prefetch_requested = false;
        }
      }
    }
  } else {
    --ticket.reads_pending;
  }
  if (ticket.released && ticket.writes_pending == 0 && ticket.reads_pending == 0 && !ticket.offsets.empty()) {
    free_extents_locked(ticket);
  }
  done_cv_.notify_all();
}

SpillStats SpillEngine::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  SpillStats out = stats_;
  out.restore_cache_hits = restore_buffers_.hits();
  out.restore_cache_kept_bytes = static_cast<int64_t>(restore_buffers_.kept_bytes());
  return out;
}

std::vector<int64_t> SpillEngine::location(int64_t id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto ticket = find_locked(id, "disk_spill location");
  TORCH_CHECK(!ticket->offsets.empty(), "disk_spill location: ticket ", id, " has no extents");
  return {ticket->file->fd(), static_cast<int64_t>(ticket->offsets[0]),
          static_cast<int64_t>(ticket->layout(0).payload_at())};
}

}  // namespace torch_offload
