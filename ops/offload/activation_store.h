#pragma once
// The state behind torch_offload.offload_activations(): which saved activations
// move to the host (or to disk), their copies (deduplicated by storage), the
// budget, the backward prefetch queue and the statistics. Python's saved-tensor hooks only
// call pack() and unpack(); everything that must be fast happens here.
//
// The unit of offload is a storage: every saved tensor that views the same
// storage (same version) shares one Entry, and is rebuilt on unpack as the same
// view (sizes, strides, offset) of the restored bytes.
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/core/Dict.h>
#include <torch/custom_class.h>

namespace torch_offload {

class ActivationStore;

// One offloaded (or budget-kept) storage. Held by the hook's saved object, so it
// dies, and frees its host bytes, when autograd frees the graph.
class ActivationEntry : public torch::CustomClassHolder {
 public:
  // Exactly one of packed (host), ticket (disk) and kept (device) is defined.
  ActivationEntry(c10::intrusive_ptr<ActivationStore> store, int64_t sequence,
                  std::pair<const c10::StorageImpl*, int64_t> dedup_key, const at::Tensor& source, at::Tensor packed,
                  at::Tensor ticket, at::Tensor kept);
  // Runs when the last strong reference goes (the store's weak ones keep the
  // object itself alive a little longer): frees the bytes, updates the store.
  void release_resources() override;

  // Bytes of the whole storage, as a flat uint8 tensor on the original device.
  at::Tensor restore();

 private:
  friend class ActivationStore;
  c10::intrusive_ptr<ActivationStore> store_;
  const int64_t sequence_;  // pack order
  const std::pair<const c10::StorageImpl*, int64_t> dedup_key_;
  const int64_t nbytes_;
  const c10::Device device_;
  const c10::weak_intrusive_ptr<c10::StorageImpl> source_;  // for dedup: alive means same storage
  at::Tensor packed_;     // host bytes when offloaded
  at::Tensor ticket_;     // disk_spill ticket when spilled
  at::Tensor kept_;       // device bytes when no tier took it
  at::Tensor prefetched_;  // restored ahead of need during backward (host tier)
  bool disk_prefetched_ = false;  // disk_prefetch issued (disk tier)
  at::Tensor restored_;   // restored bytes, shared by every view of this storage
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
  const std::vector<int64_t> sizes_;
  const std::vector<int64_t> strides_;
  const int64_t storage_offset_;
};

class ActivationStore : public torch::CustomClassHolder {
 public:
  // max_host_bytes < 0: no host budget. Past the budget a tensor goes to disk
  // when spill_to_disk (in spill_directory, none: disk_spill's default), else
  // stays on its device.
  ActivationStore(int64_t min_bytes, int64_t max_host_bytes, int64_t prefetch_bytes, bool offload_cpu_tensors,
                  bool spill_to_disk, std::optional<std::string> spill_directory, bool allow_tmpfs);

  // t saved: offloaded (through an entry shared by every tensor of its storage),
  // or as it is when it is a parameter or a view of one, a skipped storage,
  // smaller than min_bytes, or on the CPU without offload_cpu_tensors.
  c10::intrusive_ptr<SavedActivation> pack(const at::Tensor& t);
  // Storages of these tensors (a module's parameters and buffers) are never offloaded.
  void skip_storages_of(const std::vector<at::Tensor>& tensors);
  void clear_skipped_storages();
  c10::Dict<std::string, int64_t> stats() const;

 private:
  friend class ActivationEntry;
  using DedupKey = std::pair<const c10::StorageImpl*, int64_t>;  // storage, version

  bool should_offload(const at::Tensor& t) const;
  c10::intrusive_ptr<ActivationEntry> entry_for_locked(const at::Tensor& t,
                                                       std::vector<c10::intrusive_ptr<ActivationEntry>>& holders);
  // Called by an entry on its first restore: restores the entries packed just
  // before it (needed next by backward), up to prefetch_bytes_ in flight. The
  // entries it touched go to `holders`, to be released after the lock.
  void prefetch_before_locked(int64_t sequence, std::vector<c10::intrusive_ptr<ActivationEntry>>& holders);
  void on_entry_released(const ActivationEntry& entry);

  const int64_t min_bytes_;
  const int64_t max_host_bytes_;
  const int64_t prefetch_bytes_;
  const bool offload_cpu_tensors_;
  const bool spill_to_disk_;
  const std::optional<std::string> spill_directory_;
  const bool allow_tmpfs_;

  mutable std::mutex mutex_;
  int64_t next_sequence_ = 0;
  std::map<DedupKey, c10::weak_intrusive_ptr<ActivationEntry>> by_storage_;
  std::map<int64_t, c10::weak_intrusive_ptr<ActivationEntry>> by_sequence_;
  std::unordered_set<const c10::StorageImpl*> skipped_storages_;
  std::vector<at::Tensor> skipped_holders_;  // keep the skipped storages (and so their addresses) alive

  int64_t host_bytes_ = 0;
  int64_t prefetch_in_flight_bytes_ = 0;
  int64_t packed_bytes_ = 0;
  int64_t unpacked_bytes_ = 0;
  int64_t dedup_hits_ = 0;
  int64_t kept_on_device_bytes_ = 0;
  int64_t disk_bytes_ = 0;
  int64_t prefetch_hits_ = 0;
  int64_t peak_host_bytes_ = 0;
};

}  // namespace torch_offload
