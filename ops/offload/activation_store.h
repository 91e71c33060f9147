#pragma once
// The state behind torch_offload.offload_activations(): which saved activations
// move to the host (or to disk), their copies (deduplicated by storage), the
// budget, the backward prefetch queue and the statistics. Python's saved-tensor hooks only
// call pack() and unpack(); everything that must be fast happens here.
//
// The unit of offload is a byte range of a storage: the whole storage, or only
// the bytes a view spans when that is much smaller. Every saved tensor that lies
// in the same unchanged range (same storage, version counter and version) shares
// one Entry, and is rebuilt on unpack as the same view (sizes, strides, offset,
// conjugate and negative bits) of the restored bytes. Eager's backward reads the
// storage as it is last, writes through an alias no version counter sees (x.data)
// included: a CPU storage's bytes are therefore taken when it is freed (its deleter is
// watched), and a range of another storage packed again through another counter or
// version is copied again into the older entries it overlaps.
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/core/Dict.h>
#include <ATen/core/Tensor.h>
#include <c10/util/SmallVector.h>
#include <torch/custom_class.h>

#include "ops/offload/offload.h"

namespace torch_offload {

class ActivationStore;

// What makes two saved tensors' bytes interchangeable: the same bytes of the same
// storage, unchanged since the first was packed. Versions only say that for one
// version counter: an alias with its own counter (x.data) changes the storage
// without bumping ours, so the counter is part of the key.
struct DedupKey {
  const c10::StorageImpl* storage;
  const void* version_counter;
  uint32_t version;
  int64_t begin;  // bytes [begin, end) of the storage
  int64_t end;
  bool operator==(const DedupKey&) const = default;
};

struct DedupKeyHash {
  size_t operator()(const DedupKey& key) const noexcept;
};

// One offloaded (or budget-kept) byte range. Held by the saved objects of the
// tensors that use it, so it dies, and frees its host bytes, when autograd frees the graph.
class ActivationEntry : public torch::CustomClassHolder {
 public:
  // At most one of packed (host), ticket (disk) and kept (device) is defined: none only
  // for a watched storage bound for disk, which is spilled once it is freed.
  ActivationEntry(c10::intrusive_ptr<ActivationStore> store, int64_t sequence, const DedupKey& key,
                  const at::Tensor& source, at::Tensor packed, at::Tensor ticket, at::Tensor kept);
  // Runs when the last strong reference goes (the store's weak one keeps the
  // object itself alive a little longer): frees the bytes, updates the store.
  void release_resources() override;

  // The bytes of the range, as a flat uint8 tensor on the original device. Every call, the
  // first or not, makes the current stream wait for them and records it as their user.
  at::Tensor restore();

 private:
  friend class ActivationStore;
  friend class SavedActivation;
  // The first restore. live: the storage, when something still holds it.
  void restore_locked(const c10::intrusive_ptr<c10::StorageImpl>& live);

  c10::intrusive_ptr<ActivationStore> store_;
  const int64_t sequence_;  // pack order
  const DedupKey key_;
  const int64_t nbytes_;  // key_.end - key_.begin
  const c10::Device device_;
  // Weak and strong references that keep the storage's and the counter's
  // addresses in key_ from being reused while the entry lives.
  const c10::weak_intrusive_ptr<c10::StorageImpl> source_;
  const c10::VariableVersion version_counter_;
  at::Tensor packed_;  // host bytes when offloaded (of a watched storage: filled when it is freed)
  at::Tensor ticket_;  // disk_spill ticket when spilled
  at::Tensor kept_;    // device bytes when no tier took it
  // The memory of a watched storage (a CPU one), until its deleter tells the store that it
  // frees it: the bytes are taken then, the last ones written.
  const char* watched_memory_ = nullptr;
  at::Tensor freed_bytes_;  // a watched storage's freed memory, until it is spilled
  // Restored ahead of need during backward (host tier); the stream that restores the
  // entry waits for its copy then, not the stream that was current when it started.
  PendingUnpack prefetched_;
  bool disk_prefetched_ = false;  // disk_prefetch issued (disk tier)
  // Restored bytes, shared by every view of this range: every consumer's stream waits
  // for their copy when it is handed them, and is recorded as a user of their memory.
  PendingUnpack restored_;
  // Live entries in pack order (a list under the store's mutex): each pack,
  // release and prefetch step is O(1), however many entries there are.
  ActivationEntry* older_ = nullptr;
  ActivationEntry* newer_ = nullptr;
};

// What the pack hook returns for one saved tensor: its entry (or the tensor
// itself, when it is not offloaded) and what is needed to rebuild it and to
// check that nobody modified it in place since. Autograd does not check
// versions once saved-tensor hooks are in use, so this does.
class SavedActivation : public torch::CustomClassHolder {
 public:
  SavedActivation(const at::Tensor& saved, c10::intrusive_ptr<ActivationEntry> entry);
  // The saved tensor: the same view of the restored bytes, or the tensor itself.
  at::Tensor unpack() const;

 private:
  const c10::intrusive_ptr<ActivationEntry> entry_;  // null when saved as it is
  const at::Tensor as_is_;
  const c10::VariableVersion version_counter_;
  const uint32_t saved_version_;
  const c10::ScalarType dtype_;
  const bool is_conj_;
  const bool is_neg_;
  const c10::SmallVector<int64_t, 5> sizes_;
  const c10::SmallVector<int64_t, 5> strides_;
  const int64_t byte_offset_;  // of the first element, within the entry's range
};

class ActivationStore : public torch::CustomClassHolder {
 public:
  // max_host_bytes < 0: no host budget. Past the budget a tensor goes to disk
  // when spill_to_disk (in spill_directory, none: disk_spill's default), else
  // stays on its device. prefetch_over_budget: the next entry is restored ahead even when
  // it alone is over prefetch_bytes.
  ActivationStore(int64_t min_bytes, int64_t max_host_bytes, int64_t prefetch_bytes, bool prefetch_over_budget,
                  bool offload_cpu_tensors, bool spill_to_disk, std::optional<std::string> spill_directory,
                  bool allow_tmpfs);

  // t saved: offloaded (through an entry shared by every tensor in the same
  // range), or as it is when it is a parameter or a view of one, a skipped
  // storage, smaller than min_bytes, on the CPU without offload_cpu_tensors, or
  // anything its bytes, sizes and strides do not rebuild exactly (quantized,
  // nested, sparse, zero tensors, functorch or Python subclass wrappers).
  c10::intrusive_ptr<SavedActivation> pack(const at::Tensor& t);
  // Storages of these tensors (a module's parameters and buffers) are never offloaded.
  void skip_storages_of(const std::vector<at::Tensor>& tensors);
  void clear_skipped_storages();
  c10::Dict<std::string, int64_t> stats() const;
  // From the deleter of a watched storage: `memory` holds its bytes as they were last,
  // and is freed once no entry keeps it. True when some of it waits for spill_freed().
  bool on_storage_freed(const c10::StorageImpl* storage, const c10::Storage& memory);
  // Spills the freed memory handed over and not yet spilled (from a thread of its own).
  void spill_freed();

 private:
  friend class ActivationEntry;

  bool should_offload(const at::Tensor& t) const;
  c10::intrusive_ptr<ActivationEntry> entry_for_locked(const at::Tensor& t);
  // A live entry for exactly this key, or null.
  c10::intrusive_ptr<ActivationEntry> find_locked(const DedupKey& key);
  // Copies again, from the storage as it is now, every live entry of key's storage whose
  // bytes overlap key's but were packed through another version counter or version.
  void refresh_changed_copies_locked(const DedupKey& key, const at::Tensor& source);
  // Called by an entry on its first restore: restores the entries packed just
  // before it (needed next by backward), up to prefetch_bytes_ in flight (at least one with
  // prefetch_over_budget_). It
  // resumes where the previous scan stopped when backward goes on downwards, so
  // each entry is looked at about once per backward.
  void prefetch_before_locked(ActivationEntry& restoring);
  // Spills the freed memory handed over (by a deleter, which must neither raise nor wait,
  // so it only hands the memory over) and not yet spilled or restored.
  void spill_freed_locked();
  void on_entry_released(ActivationEntry& entry);

  const int64_t min_bytes_;
  const int64_t max_host_bytes_;
  const int64_t prefetch_bytes_;
  const bool prefetch_over_budget_;
  const bool offload_cpu_tensors_;
  const bool spill_to_disk_;
  const std::optional<std::string> spill_directory_;
  const bool allow_tmpfs_;

  mutable std::mutex mutex_;
  std::vector<ActivationEntry*> freed_to_spill_;
  int64_t next_sequence_ = 0;
  std::unordered_map<DedupKey, c10::weak_intrusive_ptr<ActivationEntry>, DedupKeyHash> by_key_;
  std::unordered_multimap<const c10::StorageImpl*, ActivationEntry*> by_storage_;  // the live entries
  ActivationEntry* newest_ = nullptr;                                              // the live entries' list
  int64_t live_entries_ = 0;
  // The last prefetch scan: the restore that started it, and the next (older)
  // entry it would have looked at (null: it reached the oldest).
  int64_t prefetch_from_ = -1;
  ActivationEntry* prefetch_next_ = nullptr;
  std::unordered_set<const c10::StorageImpl*> skipped_storages_;
  std::vector<at::Tensor> skipped_holders_;  // keep the skipped storages (and so their addresses) alive

  int64_t pack_calls_ = 0;
  int64_t host_bytes_ = 0;
  int64_t prefetch_in_flight_bytes_ = 0;
  int64_t packed_bytes_ = 0;
  int64_t unpacked_bytes_ = 0;
  int64_t live_bytes_ = 0;  // restored from the original storage, still held elsewhere
  int64_t dedup_hits_ = 0;
  int64_t refreshed_bytes_ = 0;
  int64_t kept_on_device_bytes_ = 0;
  int64_t disk_bytes_ = 0;
  int64_t prefetch_hits_ = 0;
  int64_t prefetch_scanned_ = 0;
  int64_t peak_host_bytes_ = 0;
};

}  // namespace torch_offload
