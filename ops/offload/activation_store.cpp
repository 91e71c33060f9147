#include "ops/offload/activation_store.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <thread>
#include <unordered_map>
#include <utility>

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/hash.h>

#include "torch_offload/torch_offload.h"

namespace torch_offload {
namespace {

// A tensor of `dtype` over `storage` with this geometry, made directly rather
// than by at::empty + set_ (two dispatcher calls): it runs for every saved tensor.
at::Tensor tensor_over(const c10::Storage& storage, c10::ScalarType dtype, c10::IntArrayRef sizes,
                       c10::IntArrayRef strides, int64_t storage_offset) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::Storage(storage), c10::DispatchKeySet(c10::computeDispatchKey(dtype, at::kStrided, storage.device())),
      c10::scalarTypeToTypeMeta(dtype));
  impl->set_sizes_and_strides(sizes, strides, storage_offset);
  return at::Tensor(std::move(impl));
}

// VariableVersion does not expose its shared counter; it holds nothing but the
// pointer to it, so that pointer is the counter's identity.
const void* version_counter_identity(const c10::VariableVersion& version) {
  static_assert(sizeof(c10::VariableVersion) == sizeof(void*));
  const void* identity = nullptr;
  std::memcpy(&identity, &version, sizeof(identity));
  return identity;
}

bool is_parameter_like(const at::Tensor& t) {
  // Parameters are leaves that require grad; F.linear and friends may save a view.
  if (t.is_view()) {
    const at::TensorBase& base = t._base();
    return base.is_leaf() && base.requires_grad();
  }
  return t.is_leaf() && t.requires_grad();
}

// Whether bytes, sizes, strides, dtype and the conjugate/negative bits (which
// unpack sets again) rebuild t exactly: t carries no dispatch key beyond those
// of a plain dense tensor of its backend. Zero tensors, quantized, nested and
// sparse tensors, functorch wrappers and Python subclasses all carry one.
bool rebuilds_exactly(const at::Tensor& t) {
  const c10::DispatchKeySet keys = t.key_set();
  const c10::BackendComponent backend = keys.highestBackendKey();
  const c10::DispatchKeySet plain = c10::DispatchKeySet(c10::DispatchKey::Dense) | c10::DispatchKeySet(backend) |
                                    c10::getAutogradRelatedKeySetFromBackend(backend) |
                                    c10::getAutocastRelatedKeySetFromBackend(backend) |
                                    c10::DispatchKeySet({c10::DispatchKey::Conjugate, c10::DispatchKey::Negative});
  return t.layout() == at::kStrided && (keys | plain) == plain;
}

// Bytes [begin, end) of t's storage that t's elements span (strides are never negative).
std::pair<int64_t, int64_t> byte_span(const at::Tensor& t) {
  const int64_t itemsize = static_cast<int64_t>(t.element_size());
  const int64_t begin = t.storage_offset() * itemsize;
  if (t.numel() == 0) {
    return {begin, begin};
  }
  int64_t last = 0;
  for (int64_t dim = 0; dim < t.dim(); ++dim) {
    last += (t.size(dim) - 1) * t.stride(dim);
  }
  return {begin, begin + (last + 1) * itemsize};
}

// A view's bytes are packed alone when they are at most 1/kSpanFraction of its
// storage; otherwise the whole storage is, so that other views of it share it.
constexpr int64_t kSpanFraction = 4;

// A CPU storage whose stores take its bytes when it is freed: its memory's deleter is
// swapped for free_watched, which hands the memory to them, then lets it go.
struct DeathWatch {
  c10::DeleterFnPtr free;  // the allocator's own deleter
  const c10::StorageImpl* storage;
  size_t nbytes;
  std::vector<c10::weak_intrusive_ptr<ActivationStore>> stores;
};

struct DeathWatches {
  std::mutex mutex;  // taken after a store's, never before
  std::unordered_map<void*, DeathWatch> by_memory;
};

DeathWatches& death_watches() {
  static auto* watches = new DeathWatches();  // never destroyed: storages may be freed at exit
  return *watches;
}

// Writes out the memory that deleters handed to disk-tier stores. A deleter runs on any
// thread and must neither wait nor raise, so a thread of its own spills it, at once: left
// to the store's next pack, the memory freed after a step's last pack stayed in RAM
// through backward.
class FreedMemorySpiller {
 public:
  static FreedMemorySpiller& instance() {
    static auto* spiller = new FreedMemorySpiller();  // never destroyed, as its thread never ends
    return *spiller;
  }

  void request(c10::weak_intrusive_ptr<ActivationStore> store) noexcept {
    try {
      std::lock_guard<std::mutex> lock(mutex_);
      pending_.push_back(std::move(store));
    } catch (...) {  // out of memory: the store's next pack spills it
      return;
    }
    work_.notify_one();
  }

 private:
  FreedMemorySpiller() {
    std::thread([this] { run(); }).detach();
  }

  void run() {
    while (true) {
      std::vector<c10::weak_intrusive_ptr<ActivationStore>> stores;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        work_.wait(lock, [&] { return !pending_.empty(); });
        stores.swap(pending_);
      }
      for (const auto& weak : stores) {
        if (auto store = weak.lock()) {
          store->spill_freed();
        }
      }
    }
  }

  std::mutex mutex_;
  std::condition_variable work_;
  std::vector<c10::weak_intrusive_ptr<ActivationStore>> pending_;
};

void free_watched(void* memory) {
  DeathWatch watch;
  {
    DeathWatches& watches = death_watches();
    std::lock_guard<std::mutex> lock(watches.mutex);
    watch = std::move(watches.by_memory.extract(memory).mapped());
  }
  // Ours now: the allocator's deleter frees it once no entry keeps it.
  const c10::Storage freed(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), static_cast<int64_t>(watch.nbytes),
      c10::DataPtr(memory, memory, watch.free, c10::Device(c10::kCPU)), nullptr, /*resizable=*/false));
  for (const auto& weak : watch.stores) {
    if (auto store = weak.lock(); store && store->on_storage_freed(watch.storage, freed)) {
      FreedMemorySpiller::instance().request(weak);
    }
  }
}

// The memory of `storage` if the store learns when it is freed (from now, or already), else
// null: only plain memory of the CPU allocator, whose deleter is known and takes the data pointer.
const char* watch_death(c10::StorageImpl& storage, const c10::weak_intrusive_ptr<ActivationStore>& store) {
  c10::DataPtr& memory = storage._mutable_data_ptr_no_checks();
  DeathWatches& watches = death_watches();
  std::lock_guard<std::mutex> lock(watches.mutex);
  if (memory.get_deleter() == &free_watched) {
    auto& stores = watches.by_memory.at(memory.get()).stores;
    if (std::none_of(stores.begin(), stores.end(),
                     [&](const auto& s) { return s._unsafe_get_target() == store._unsafe_get_target(); })) {
      stores.push_back(store);
    }
    return static_cast<const char*>(memory.get());
  }
  const c10::Allocator* allocator = storage.allocator();
  const c10::DeleterFnPtr free = memory.get_deleter();
  if (storage.device_type() != c10::kCPU || memory.get() == nullptr || memory.get_context() != memory.get() ||
      allocator == nullptr || allocator != c10::GetCPUAllocator() || free == nullptr ||
      free != allocator->raw_deleter()) {
    return nullptr;
  }
  watches.by_memory.emplace(memory.get(), DeathWatch{free, &storage, storage.nbytes(), {store}});
  TORCH_INTERNAL_ASSERT(memory.compare_exchange_deleter(free, &free_watched));
  return static_cast<const char*>(memory.get());
}

// The store no longer needs to know: the storage gets its own deleter back once no store does.
void unwatch_death(c10::StorageImpl& storage, const ActivationStore* store) {
  c10::DataPtr& memory = storage._mutable_data_ptr_no_checks();
  DeathWatches& watches = death_watches();
  std::lock_guard<std::mutex> lock(watches.mutex);
  if (memory.get_deleter() != &free_watched) {
    return;
  }
  const auto found = watches.by_memory.find(memory.get());
  auto& stores = found->second.stores;
  std::erase_if(stores, [&](const auto& s) { return s._unsafe_get_target() == store; });
  if (stores.empty()) {
    TORCH_INTERNAL_ASSERT(memory.compare_exchange_deleter(&free_watched, found->second.free));
    watches.by_memory.erase(found);
  }
}

}  // namespace

size_t DedupKeyHash::operator()(const DedupKey& key) const noexcept {
  return c10::get_hash(key.storage, key.version_counter, key.version, key.begin, key.end);
}

ActivationEntry::ActivationEntry(c10::intrusive_ptr<ActivationStore> store, int64_t sequence, const DedupKey& key,
                                 const at::Tensor& source, at::Tensor packed, at::Tensor ticket, at::Tensor kept)
    : store_(std::move(store)),
      sequence_(sequence),
      key_(key),
      nbytes_(key.end - key.begin),
      device_(source.device()),
      source_(source.storage().getWeakStorageImpl()),
      version_counter_(source.unsafeGetTensorImpl()->version_counter()),
      packed_(std::move(packed)),
      ticket_(std::move(ticket)),
      kept_(std::move(kept)) {}

void ActivationEntry::release_resources() {
  store_->on_entry_released(*this);
  packed_.reset();
  ticket_.reset();  // frees its disk space
  kept_.reset();
  freed_bytes_.reset();
  prefetched_ = {};
  restored_ = {};
  store_.reset();
}

at::Tensor ActivationEntry::restore() {
  // Released after the lock: it may be the storage's last reference, whose deleter takes the lock.
  c10::intrusive_ptr<c10::StorageImpl> live;
  std::lock_guard<std::mutex> lock(store_->mutex_);
  if (!restored_.tensor.defined()) {
    live = source_.lock();
    restore_locked(live);
  }
  // Each hand-out, not only the first: the consumer may read it on another stream.
  return finish_unpack(restored_);
}

void ActivationEntry::restore_locked(const c10::intrusive_ptr<c10::StorageImpl>& live) {
  ActivationStore& store = *store_;
  if (live && !kept_.defined() && static_cast<int64_t>(live->nbytes()) >= key_.end) {
    // Something still holds the original storage (a tensor the caller keeps, an x.data
    // alias): eager's backward would read it, changes made through .data included (no
    // version counter sees those), so this does too, and reads nothing back. A prefetch
    // of the copy is given up.
    restored_ = {tensor_over(c10::Storage(live), at::kByte, {nbytes_}, {1}, key_.begin), nullptr};
    if (prefetched_.tensor.defined() || (disk_prefetched_ && ticket_.defined())) {
      store.prefetch_in_flight_bytes_ -= nbytes_;
    }
    prefetched_ = {};
    ticket_.reset();
    store.live_bytes_ += nbytes_;
  } else if (kept_.defined()) {
    restored_ = {kept_, nullptr};
  } else {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;  // no graph, no autograd node: plain copies
    if (watched_memory_ != nullptr) {
      // Freed, but its deleter has yet to hand the memory over: it waits for this lock in
      // another thread, or another storage (a lazy clone) shares the memory now. Nothing frees
      // the memory before that deleter had the lock, so it holds the bytes still.
      restored_ = {at::empty({nbytes_}, at::TensorOptions(at::kByte)), nullptr};
      std::memcpy(restored_.tensor.mutable_data_ptr(), watched_memory_ + key_.begin, nbytes_);
      watched_memory_ = nullptr;
    } else if (freed_bytes_.defined()) {
      // Freed after the last pack: its memory is still here, nothing to write or read.
      std::erase(store.freed_to_spill_, this);
      restored_ = {std::exchange(freed_bytes_, {}), nullptr};
    } else if (ticket_.defined()) {
      at::Tensor host = disk_restore(ticket_, {nbytes_}, at::kByte, at::kCPU);
      restored_ = device_.is_cpu() ? PendingUnpack{std::move(host), nullptr} : start_unpack(host, device_);
      ticket_.reset();
      if (disk_prefetched_) {
        store.prefetch_in_flight_bytes_ -= nbytes_;
        ++store.prefetch_hits_;
      }
    } else if (prefetched_.tensor.defined()) {
      restored_ = std::exchange(prefetched_, {});
      store.prefetch_in_flight_bytes_ -= nbytes_;
      ++store.prefetch_hits_;
    } else {
      restored_ = start_unpack(packed_, device_);
    }
    store.unpacked_bytes_ += nbytes_;
  }
  store.prefetch_before_locked(*this);
}

SavedActivation::SavedActivation(const at::Tensor& saved, c10::intrusive_ptr<ActivationEntry> entry)
    : entry_(std::move(entry)),
      as_is_(entry_ ? at::Tensor() : saved.detach()),  // detached: an output must not own itself
      version_counter_(saved.unsafeGetTensorImpl()->version_counter()),
      saved_version_(saved._version()),
      dtype_(saved.scalar_type()),
      is_conj_(saved.is_conj()),
      is_neg_(saved.is_neg()),
      // Only an offloaded tensor is rebuilt from these (a nested one has no sizes).
      sizes_(entry_ ? saved.sizes() : c10::IntArrayRef()),
      strides_(entry_ ? saved.strides() : c10::IntArrayRef()),
      byte_offset_(entry_ ? saved.storage_offset() * static_cast<int64_t>(saved.element_size()) - entry_->key_.begin
                          : 0) {}

at::Tensor SavedActivation::unpack() const {
  if (version_counter_.enabled()) {
    const uint32_t now = version_counter_.current_version();
    TORCH_CHECK(now == saved_version_,
                "one of the variables needed for gradient computation has been modified by an inplace "
                "operation: [",
                c10::toString(dtype_), " ", entry_ || as_is_.is_nested() ? c10::IntArrayRef(sizes_) : as_is_.sizes(),
                "] is at version ", now, "; expected version ", saved_version_,
                " instead (it was saved for backward, then changed in place)");
  }
  if (!entry_) {
    return as_is_;
  }
  const at::Tensor bytes = entry_->restore();
  // The same view of the same bytes: expanded, strided, conjugate and negative views come back exactly.
  const int64_t itemsize = static_cast<int64_t>(c10::elementSize(dtype_));
  at::Tensor out =
      tensor_over(bytes.storage(), dtype_, sizes_, strides_, (bytes.storage_offset() + byte_offset_) / itemsize);
  out.unsafeGetTensorImpl()->_set_conj(is_conj_);
  out.unsafeGetTensorImpl()->_set_neg(is_neg_);
  return out;
}

ActivationStore::ActivationStore(int64_t min_bytes, int64_t max_host_bytes, int64_t prefetch_bytes,
                                 bool prefetch_over_budget, bool offload_cpu_tensors, bool spill_to_disk,
                                 std::optional<std::string> spill_directory, bool allow_tmpfs)
    : min_bytes_(min_bytes),
      max_host_bytes_(max_host_bytes),
      prefetch_bytes_(prefetch_bytes),
      prefetch_over_budget_(prefetch_over_budget),
      offload_cpu_tensors_(offload_cpu_tensors),
      spill_to_disk_(spill_to_disk),
      spill_directory_(std::move(spill_directory)),
      allow_tmpfs_(allow_tmpfs) {
  TORCH_CHECK(min_bytes >= 0, "offload_activations: min_bytes must be >= 0, got ", min_bytes);
  TORCH_CHECK(prefetch_bytes >= 0, "offload_activations: prefetch_bytes must be >= 0, got ", prefetch_bytes);
  if (spill_to_disk_) {
    FreedMemorySpiller::instance();  // its thread starts here, not in a deleter, which must not raise
  }
}

bool ActivationStore::should_offload(const at::Tensor& t) const {
  if (!t.defined() || !t.has_storage() || !(t.is_cpu() || t.is_cuda()) || !rebuilds_exactly(t)) {
    return false;
  }
  if (t.is_cpu() && !offload_cpu_tensors_) {
    return false;
  }
  if (is_parameter_like(t) || t.numel() * static_cast<int64_t>(t.element_size()) < min_bytes_) {
    return false;
  }
  return skipped_storages_.count(t.storage().unsafeGetStorageImpl()) == 0;
}

c10::intrusive_ptr<SavedActivation> ActivationStore::pack(const at::Tensor& t) {
  c10::intrusive_ptr<ActivationEntry> entry;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++pack_calls_;
    spill_freed_locked();
    if (should_offload(t)) {
      entry = entry_for_locked(t);
    }
  }
  return c10::make_intrusive<SavedActivation>(t, std::move(entry));
}

c10::intrusive_ptr<ActivationEntry> ActivationStore::find_locked(const DedupKey& key) {
  const auto found = by_key_.find(key);
  if (found == by_key_.end()) {
    return {};
  }
  // Null when the entry's last reference just went (its release waits for this lock).
  auto entry = found->second.lock();
  if (entry) {
    ++dedup_hits_;
  }
  return entry;
}

c10::intrusive_ptr<ActivationEntry> ActivationStore::entry_for_locked(const at::Tensor& t) {
  const c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  const int64_t storage_nbytes = static_cast<int64_t>(storage->nbytes());
  const void* counter = version_counter_identity(t.unsafeGetTensorImpl()->version_counter());
  const uint32_t version = t._version();
  const DedupKey whole{storage, counter, version, 0, storage_nbytes};
  if (auto entry = find_locked(whole)) {
    return entry;
  }
  DedupKey key = whole;
  if (const auto [begin, end] = byte_span(t); (end - begin) * kSpanFraction <= storage_nbytes) {
    key = DedupKey{storage, counter, version, begin, end};
    if (auto entry = find_locked(key)) {
      return entry;
    }
  }
  const int64_t nbytes = key.end - key.begin;
  at::Tensor bytes = tensor_over(t.storage(), at::kByte, {nbytes}, {1}, key.begin);
  at::Tensor packed;
  at::Tensor ticket;
  at::Tensor kept;
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  refresh_changed_copies_locked(key, t);
  auto self = c10::intrusive_ptr<ActivationStore>::reclaim_copy(this);
  const bool to_host = max_host_bytes_ < 0 || host_bytes_ + nbytes <= max_host_bytes_;
  // The bytes of a watched storage are taken when it is freed, the last ones written:
  // until then, eager's backward would read any write, x.data's included.
  const char* watched = to_host || spill_to_disk_ ? watch_death(*t.storage().unsafeGetStorageImpl(),
                                                                c10::weak_intrusive_ptr<ActivationStore>(self))
                                                  : nullptr;
  if (to_host) {
    packed = watched != nullptr ? at::empty({nbytes}, at::TensorOptions(at::kByte))
                                : offload_pack(bytes, /*non_blocking=*/true);
    host_bytes_ += nbytes;
    packed_bytes_ += nbytes;
    peak_host_bytes_ = std::max(peak_host_bytes_, host_bytes_);
  } else if (spill_to_disk_) {
    if (watched == nullptr) {
      ticket = disk_spill(bytes, spill_directory_, allow_tmpfs_);
    }
    packed_bytes_ += nbytes;
    disk_bytes_ += nbytes;
  } else {
    kept = std::move(bytes);  // over the host budget: stays on its device, never an error
    kept_on_device_bytes_ += nbytes;
  }
  auto entry = c10::make_intrusive<ActivationEntry>(std::move(self), next_sequence_++, key, t, std::move(packed),
                                                    std::move(ticket), std::move(kept));
  entry->watched_memory_ = watched;
  // Replaces only the record of an entry already being released (find_locked
  // found it dead). Every live entry keeps its record: that weak reference is
  // what makes its last strong one call release_resources().
  by_key_.insert_or_assign(key, c10::weak_intrusive_ptr<ActivationEntry>(entry));
  by_storage_.emplace(storage, entry.get());
  entry->older_ = newest_;
  if (newest_ != nullptr) {
    newest_->newer_ = entry.get();
  }
  newest_ = entry.get();
  ++live_entries_;
  return entry;
}

void ActivationStore::refresh_changed_copies_locked(const DedupKey& key, const at::Tensor& source) {
  const auto [first, last] = by_storage_.equal_range(key.storage);
  for (auto it = first; it != last; ++it) {
    ActivationEntry& entry = *it->second;
    const DedupKey& old = entry.key_;
    const bool same_bytes = old.version_counter == key.version_counter && old.version == key.version;
    // A restored entry is read already (from this storage, when it was still held); a kept one is
    // the storage; a watched one takes the bytes when the storage is freed.
    if (same_bytes || old.end <= key.begin || key.end <= old.begin || entry.restored_.tensor.defined() ||
        entry.kept_.defined() || entry.watched_memory_ != nullptr ||
        static_cast<int64_t>(key.storage->nbytes()) < old.end) {
      continue;
    }
    const at::Tensor bytes = tensor_over(source.storage(), at::kByte, {entry.nbytes_}, {1}, old.begin);
    if (entry.prefetched_.tensor.defined() || (entry.disk_prefetched_ && entry.ticket_.defined())) {
      prefetch_in_flight_bytes_ -= entry.nbytes_;
    }
    entry.prefetched_ = {};
    entry.disk_prefetched_ = false;
    if (entry.packed_.defined()) {
      entry.packed_ = offload_pack(bytes, /*non_blocking=*/true);
    } else {
      entry.ticket_ = disk_spill(bytes, spill_directory_, allow_tmpfs_);  // the old ticket frees its space
    }
    refreshed_bytes_ += entry.nbytes_;
  }
}

void ActivationStore::prefetch_before_locked(ActivationEntry& restoring) {
  // Every live entry between the last scan's stop and its start was looked at:
  // go on from the stop when this restore lies in that stretch, else start below it.
  const int64_t sequence = restoring.sequence_;
  const bool resumes =
      sequence <= prefetch_from_ && (prefetch_next_ == nullptr || prefetch_next_->sequence_ < sequence);
  ActivationEntry* entry = resumes ? prefetch_next_ : restoring.older_;
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  // Entries whose last reference went but whose release waits for this lock are
  // still linked and intact: the release unlinks them first, then frees.
  for (; entry != nullptr && prefetch_in_flight_bytes_ < prefetch_bytes_; entry = entry->older_) {
    ++prefetch_scanned_;
    const bool on_host = entry->packed_.defined() && !entry->prefetched_.tensor.defined();
    const bool on_disk = entry->ticket_.defined() && !entry->disk_prefetched_;
    // An entry whose storage is still held elsewhere is restored from it (see restore()); a
    // watched one's bytes are not in place before the storage's deleter handed them over.
    if (entry->restored_.tensor.defined() || !(on_host || on_disk) || !entry->source_.expired() ||
        entry->watched_memory_ != nullptr) {
      continue;
    }
    // With prefetch_over_budget the next entry goes even when it alone is over the budget:
    // one in flight keeps backward from waiting, whatever the tensor sizes. Without, the
    // budget holds: where the compute is long next to a restore (a CPU at long context),
    // an entry restored on demand costs less time than its memory held ahead costs.
    const bool first_over_budget = prefetch_over_budget_ && prefetch_in_flight_bytes_ == 0;
    if (!first_over_budget && prefetch_in_flight_bytes_ + entry->nbytes_ > prefetch_bytes_) {
      break;
    }
    if (on_host) {
      entry->prefetched_ = start_unpack(entry->packed_, entry->device_);
    } else {
      disk_prefetch(entry->ticket_);  // the I/O threads read it while backward computes
      entry->disk_prefetched_ = true;
    }
    prefetch_in_flight_bytes_ += entry->nbytes_;
  }
  prefetch_from_ = sequence;
  prefetch_next_ = entry;
}

void ActivationStore::on_entry_released(ActivationEntry& entry) {
  c10::intrusive_ptr<c10::StorageImpl> watched;  // released after the lock, as in restore()
  std::lock_guard<std::mutex> lock(mutex_);
  if (entry.packed_.defined()) {
    host_bytes_ -= entry.nbytes_;
  }
  if (entry.prefetched_.tensor.defined() || (entry.disk_prefetched_ && entry.ticket_.defined())) {
    prefetch_in_flight_bytes_ -= entry.nbytes_;
  }
  std::erase(freed_to_spill_, &entry);
  const auto [first, last] = by_storage_.equal_range(entry.key_.storage);
  for (auto it = first; it != last; ++it) {
    if (it->second == &entry) {
      by_storage_.erase(it);
      break;
    }
  }
  // The last entry that watched a storage still alive gives it its own deleter back.
  const auto [others, others_end] = by_storage_.equal_range(entry.key_.storage);
  if (entry.watched_memory_ != nullptr &&
      std::none_of(others, others_end, [](const auto& other) { return other.second->watched_memory_ != nullptr; }) &&
      (watched = entry.source_.lock())) {
    unwatch_death(*watched, this);
  }
  // Erase only our own record: a newer entry may already own the key.
  if (auto found = by_key_.find(entry.key_); found != by_key_.end() && found->second._unsafe_get_target() == &entry) {
    by_key_.erase(found);
  }
  if (prefetch_next_ == &entry) {
    prefetch_next_ = entry.older_;
  }
  (entry.newer_ != nullptr ? entry.newer_->older_ : newest_) = entry.older_;
  if (entry.older_ != nullptr) {
    entry.older_->newer_ = entry.newer_;
  }
  entry.older_ = entry.newer_ = nullptr;
  --live_entries_;
}

bool ActivationStore::on_storage_freed(const c10::StorageImpl* storage, const c10::Storage& memory) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto [first, last] = by_storage_.equal_range(storage);
  for (auto it = first; it != last; ++it) {
    ActivationEntry& entry = *it->second;
    if (entry.watched_memory_ == nullptr) {
      continue;
    }
    entry.watched_memory_ = nullptr;
    if (entry.restored_.tensor.defined()) {
      continue;
    }
    if (entry.packed_.defined()) {
      std::memcpy(entry.packed_.mutable_data_ptr(), static_cast<const char*>(memory.data()) + entry.key_.begin,
                  entry.nbytes_);
    } else {
      entry.freed_bytes_ = tensor_over(memory, at::kByte, {entry.nbytes_}, {1}, entry.key_.begin);
      freed_to_spill_.push_back(&entry);
    }
  }
  return !freed_to_spill_.empty();
}

void ActivationStore::spill_freed() {
  std::lock_guard<std::mutex> lock(mutex_);
  try {
    spill_freed_locked();
  } catch (const std::exception&) {
    // Nobody to tell here: the memory stays in RAM, and the next pack spills it or raises.
  }
}

void ActivationStore::spill_freed_locked() {
  const at::AutoDispatchBelowADInplaceOrView below_autograd;
  while (!freed_to_spill_.empty()) {
    ActivationEntry& entry = *freed_to_spill_.back();
    entry.ticket_ = disk_spill(entry.freed_bytes_, spill_directory_, allow_tmpfs_);
    entry.freed_bytes_.reset();
    freed_to_spill_.pop_back();
  }
}

void ActivationStore::skip_storages_of(const std::vector<at::Tensor>& tensors) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.has_storage()) {
      skipped_storages_.insert(t.storage().unsafeGetStorageImpl());
      skipped_holders_.push_back(t);
    }
  }
}

void ActivationStore::clear_skipped_storages() {
  std::vector<at::Tensor> holders;  // let go of after the lock, as in restore()
  std::lock_guard<std::mutex> lock(mutex_);
  skipped_storages_.clear();
  holders.swap(skipped_holders_);
}

c10::Dict<std::string, int64_t> ActivationStore::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  c10::Dict<std::string, int64_t> out;
  out.insert("pack_calls", pack_calls_);
  out.insert("packed_bytes", packed_bytes_);
  out.insert("unpacked_bytes", unpacked_bytes_);
  out.insert("live_bytes", live_bytes_);
  out.insert("dedup_hits", dedup_hits_);
  out.insert("refreshed_bytes", refreshed_bytes_);
  out.insert("kept_on_device_bytes", kept_on_device_bytes_);
  out.insert("disk_bytes", disk_bytes_);
  out.insert("prefetch_hits", prefetch_hits_);
  out.insert("prefetch_scanned", prefetch_scanned_);
  out.insert("peak_host_bytes", peak_host_bytes_);
  out.insert("host_bytes", host_bytes_);
  out.insert("live_entries", live_entries_);
  return out;
}

}  // namespace torch_offload
