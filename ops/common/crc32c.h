#pragma once
// CRC-32C (Castagnoli), the checksum of spill extents. Uses the SSE4.2 crc32
// instruction when the CPU has it, a table otherwise; both give the same value.
#include <cstddef>
#include <cstdint>

namespace torch_offload {

uint32_t crc32c(const void* data, size_t bytes, uint32_t crc = 0);

namespace detail {
// The table version, always; tests compare it with the hardware one.
uint32_t crc32c_portable(const void* data, size_t bytes, uint32_t crc = 0);
}  // namespace detail

}  // namespace torch_offload
