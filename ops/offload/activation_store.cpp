#include "ops/offload/activation_store.h"

#include <algorithm>

#include <ATen/ops/empty.h>
#include <c10/core/GradMode.h>

#include "torch_offload/torch_offload.h"

namespace torch_offload {
namespace {

// A flat uint8 tensor over all of t's storage: the bytes every view of it shares.
at::Tensor storage_bytes(const at::Tensor& t) {
  return at::empty({0}, t.options().dtype(at::kByte)).set_(t.storage());
}

bool is_parameter_like(const at::Tensor& t) {
  // Parameters are leaves that require grad; F.linear and friends may save a view.
  if (t.is_view()) {
    const at::TensorBase& base = t._base();
    return base.is_leaf() && base.requires_grad();
  }
  return t.is_leaf() && t.requires_grad();
}

}  // namespace

ActivationEntry::ActivationEntry(c10::intrusive_ptr<ActivationStore> store, int64_t sequence,
                                 std::pair<const c10::StorageImpl*, int64_t> dedup_key, const at::Tensor& source,
                                 at::Tensor packed, at::Tensor ticket, at::Tensor kept)
    : store_(std::move(store)),
      sequence_(sequence),
      dedup_key_(dedup_key),
      nbytes_(static_cast<int64_t>(source.storage().nbytes())),
      device_(source.device()),
      source_(source.storage().getWeakStorageImpl()),
      packed_(std::move(packed)),
      ticket_(std::move(ticket)),
      kept_(std::move(kept)) {}

void ActivationEntry::release_resources() {
  store_->on_entry_released(*this);
  packed_.reset();
  ticket_.reset();  // frees its disk space
  kept_.reset();
  prefetched_.reset();
  restored_.reset();
  store_.reset();
}

at::Tensor ActivationEntry::restore() {
  std::vector<c10::intrusive_ptr<ActivationEntry>> holders;  // released after the lock
  std::lock_guard<std::mutex> lock(store_->mutex_);
  if (restored_.defined()) {
    return restored_;
  }
  if (kept_.defined()) {
    restored_ = kept_;
  } else if (ticket_.defined()) {
    const c10::NoGradGuard no_grad;
    restored_ = disk_restore(ticket_, {nbytes_}, at::kByte, device_);
    ticket_.reset();
    if (disk_prefetched_) {
      store_->prefetch_in_flight_bytes_ -= nbytes_;
      ++store_->prefetch_hits_;
    }
    store_->unpacked_bytes_ += nbytes_;
  } else {
    if (prefetched_.defined()) {
      restored_ = std::move(prefetched_);
      prefetched_.reset();
      store_->prefetch_in_flight_bytes_ -= nbytes_;
      ++store_->prefetch_hits_;
    } else {
      const c10::NoGradGuard no_grad;
      restored_ = offload_unpack(packed_, device_);
    }
    store_->unpacked_bytes_ += nbytes_;
  }
  store_->prefetch_before_locked(sequence_, holders);
  return restored_;
}

SavedActivation::SavedActivation(const at::Tensor& saved, c10::intrusive_ptr<ActivationEntry> entry)
    : entry_(std::move(entry)),
      as_is_(entry_ ? at::Tensor() : saved.detach()),  // detached: an output must not own itself
      version_counter_(saved.unsafeGetTensorImpl()->version_counter()),
      saved_version_(saved._version()),
      dtype_(saved.scalar_type()),
      sizes_(saved.sizes().vec()),
      strides_(saved.strides().vec()),
      storage_offset_(saved.storage_offset()) {}

at::Tensor SavedActivation::unpack() const {
  if (version_counter_.enabled()) {
    const uint32_t now = version_counter_.current_version();
    TORCH_CHECK(now == saved_version_,
                "one of the variables needed for gradient computation has been modified by an inplace "
                "operation: [",
                c10::toString(dtype_), " ", c10::IntArrayRef(sizes_), "] is at version ", now, "; expected version ",
                saved_version_, " instead (it was saved for backward, then changed in place)");
  }
  if (!entry_) {
    return as_is_;
  }
  const at::Tensor bytes = entry_->restore();
  // The same view of the same bytes: expanded and strided tensors come back exactly.
  return at::empty({0}, bytes.options().dtype(dtype_)).set_(bytes.storage(), storage_offset_, sizes_, strides_);
}

ActivationStore::ActivationStore(int64_t min_bytes, int64_t max_host_bytes, int64_t prefetch_bytes,
                                 bool offload_cpu_tensors, bool spill_to_disk,
                                 std::optional<std::string> spill_directory, bool allow_tmpfs)
    : min_bytes_(min_bytes),
      max_host_bytes_(max_host_bytes),
      prefetch_bytes_(prefetch_bytes),
      offload_cpu_tensors_(offload_cpu_tensors),
      spill_to_disk_(spill_to_disk),
      spill_directory_(std::move(spill_directory)),
      allow_tmpfs_(allow_tmpfs) {
  TORCH_CHECK(min_bytes >= 0, "offload_activations: min_bytes must be >= 0, got ", min_bytes);
  TORCH_CHECK(prefetch_bytes >= 0, "offload_activations: prefetch_bytes must be >= 0, got ", prefetch_bytes);
}

bool ActivationStore::should_offload(const at::Tensor& t) const {
  if (!t.defined() || !t.has_storage() || !(t.is_cpu() || t.is_cuda())) {
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
  std::vector<c10::intrusive_ptr<ActivationEntry>> holders;  // released after the lock
  c10::intrusive_ptr<ActivationEntry> entry;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (should_offload(t)) {
      entry = entry_for_locked(t, holders);
    }
  }
  return c10::make_intrusive<SavedActivation>(t, std::move(entry));
}

c10::intrusive_ptr<ActivationEntry> ActivationStore::entry_for_locked(
    const at::Tensor& t, std::vector<c10::intrusive_ptr<ActivationEntry>>& holders) {
  const DedupKey key{t.storage().unsafeGetStorageImpl(), t._version()};
  if (auto found = by_storage_.find(key); found != by_storage_.end()) {
    // An entry whose source storage died may share the address of a new one.
    if (auto entry = found->second.lock()) {
      holders.push_back(entry);
      if (!entry->source_.expired()) {
        ++dedup_hits_;
        return entry;
      }
    }
  }
  const int64_t nbytes = static_cast<int64_t>(t.storage().nbytes());
  at::Tensor bytes = storage_bytes(t);
  at::Tensor packed;
  at::Tensor ticket;
  at::Tensor kept;
  const c10::NoGradGuard no_grad;
  if (max_host_bytes_ < 0 || host_bytes_ + nbytes <= max_host_bytes_) {
    packed = offload_pack(bytes, /*non_blocking=*/true);
    host_bytes_ += nbytes;
    packed_bytes_ += nbytes;
    peak_host_bytes_ = std::max(peak_host_bytes_, host_bytes_);
  } else if (spill_to_disk_) {
    ticket = disk_spill(bytes, spill_directory_, allow_tmpfs_);
    packed_bytes_ += nbytes;
    disk_bytes_ += nbytes;
  } else {
    kept = std::move(bytes);  // over the host budget: stays on its device, never an error
    kept_on_device_bytes_ += nbytes;
  }
  auto entry = c10::make_intrusive<ActivationEntry>(c10::intrusive_ptr<ActivationStore>::reclaim_copy(this),
                                                    next_sequence_++, key, t, std::move(packed), std::move(ticket),
                                                    std::move(kept));
  by_storage_.insert_or_assign(key, c10::weak_intrusive_ptr<ActivationEntry>(entry));
  by_sequence_.emplace(entry->sequence_, c10::weak_intrusive_ptr<ActivationEntry>(entry));
  return entry;
}

void ActivationStore::prefetch_before_locked(int64_t sequence,
                                             std::vector<c10::intrusive_ptr<ActivationEntry>>& holders) {
  const c10::NoGradGuard no_grad;
  auto it = by_sequence_.lower_bound(sequence);
  while (it != by_sequence_.begin() && prefetch_in_flight_bytes_ < prefetch_bytes_) {
    --it;
    auto entry = it->second.lock();
    if (!entry) {
      continue;  // released: its release_resources() is waiting for this lock
    }
    holders.push_back(entry);
    const bool on_host = entry->packed_.defined() && !entry->prefetched_.defined();
    const bool on_disk = entry->ticket_.defined() && !entry->disk_prefetched_;
    if (entry->restored_.defined() || !(on_host || on_disk)) {
      continue;
    }
    if (prefetch_in_flight_bytes_ + entry->nbytes_ > prefetch_bytes_) {
      break;
    }
    if (on_host) {
      entry->prefetched_ = offload_unpack(entry->packed_, entry->device_);
    } else {
      disk_prefetch(entry->ticket_);  // the I/O threads read it while backward computes
      entry->disk_prefetched_ = true;
    }
    prefetch_in_flight_bytes_ += entry->nbytes_;
  }
}

void ActivationStore::on_entry_released(const ActivationEntry& entry) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (entry.packed_.defined()) {
    host_bytes_ -= entry.nbytes_;
  }
  if (entry.prefetched_.defined() || (entry.disk_prefetched_ && entry.ticket_.defined())) {
    prefetch_in_flight_bytes_ -= entry.nbytes_;
  }
  // Erase only our own records: a newer entry may already own the dedup key.
  if (auto found = by_storage_.find(entry.dedup_key_);
      found != by_storage_.end() && found->second._unsafe_get_target() == &entry) {
    by_storage_.erase(found);
  }
  by_sequence_.erase(entry.sequence_);
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
  std::lock_guard<std::mutex> lock(mutex_);
  skipped_storages_.clear();
  skipped_holders_.clear();
}

c10::Dict<std::string, int64_t> ActivationStore::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  c10::Dict<std::string, int64_t> out;
  out.insert("packed_bytes", packed_bytes_);
  out.insert("unpacked_bytes", unpacked_bytes_);
  out.insert("dedup_hits", dedup_hits_);
  out.insert("kept_on_device_bytes", kept_on_device_bytes_);
  out.insert("disk_bytes", disk_bytes_);
  out.insert("prefetch_hits", prefetch_hits_);
  out.insert("peak_host_bytes", peak_host_bytes_);
  out.insert("host_bytes", host_bytes_);
  out.insert("live_entries", static_cast<int64_t>(by_sequence_.size()));
  return out;
}

}  // namespace torch_offload
