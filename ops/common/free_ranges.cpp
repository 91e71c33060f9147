#include "ops/common/free_ranges.h"

#include <iterator>

namespace torch_offload {

void FreeRanges::add(size_t offset, size_t bytes) {
  auto next = ranges_.lower_bound(offset);
  if (next != ranges_.end() && offset + bytes == next->first) {
    bytes += next->second;
    next = ranges_.erase(next);
  }
  if (next != ranges_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      prev->second += bytes;
      return;
    }
  }
  ranges_.emplace(offset, bytes);
}

std::optional<size_t> FreeRanges::take(size_t bytes) {
  for (auto it = ranges_.begin(); it != ranges_.end(); ++it) {
    if (it->second < bytes) {
      continue;
    }
    const size_t offset = it->first;
    const size_t rest = it->second - bytes;
    ranges_.erase(it);
    if (rest > 0) {
      ranges_.emplace(offset + bytes, rest);
    }
    return offset;
  }
  return std::nullopt;
}

bool FreeRanges::is_one_range(size_t offset, size_t bytes) const {
  auto it = ranges_.find(offset);
  return it != ranges_.end() && it->second == bytes;
}

}  // namespace torch_offload
