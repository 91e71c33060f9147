#pragma once
// Free byte ranges of one address space (a pinned memory chunk, a spill file):
// first-fit allocation, neighbours coalesced on release.
#include <cstddef>
#include <map>
#include <optional>

namespace torch_offload {

class FreeRanges {
 public:
  // Gives back [offset, offset + bytes), merging it with free neighbours.
  void add(size_t offset, size_t bytes);
  // The offset of the first free range of at least `bytes`, now taken.
  std::optional<size_t> take(size_t bytes);
  // True when [offset, offset + bytes) is one free range.
  bool is_one_range(size_t offset, size_t bytes) const;
  void clear() { ranges_.clear(); }

 private:
  std::map<size_t, size_t> ranges_;  // offset -> length
};

inline size_t round_up(size_t bytes, size_t to) {
  return (bytes + to - 1) / to * to;
}

}  // namespace torch_offload
