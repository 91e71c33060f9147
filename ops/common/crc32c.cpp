#include "ops/common/crc32c.h"

#include <array>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <nmmintrin.h>
#endif

namespace torch_offload {
namespace {

constexpr uint32_t kPolynomial = 0x82F63B78;  // reflected Castagnoli

std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) {
      c = (c & 1) ? (c >> 1) ^ kPolynomial : c >> 1;
    }
    table[i] = c;
  }
  return table;
}

uint32_t crc32c_table(const uint8_t* p, size_t bytes, uint32_t crc) {
  static const std::array<uint32_t, 256> table = make_table();
  for (size_t i = 0; i < bytes; ++i) {
    crc = table[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  }
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(const uint8_t* p, size_t bytes, uint32_t crc) {
  uint64_t c = crc;
  for (; bytes >= 8; bytes -= 8, p += 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; bytes > 0; --bytes, ++p) {
    c32 = _mm_crc32_u8(c32, *p);
  }
  return c32;
}

bool cpu_has_sse42() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  return __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & bit_SSE4_2);
}
#endif

}  // namespace

uint32_t crc32c(const void* data, size_t bytes, uint32_t crc) {
  const auto* p = static_cast<const uint8_t*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  static const bool hardware = cpu_has_sse42();
  crc = hardware ? crc32c_sse42(p, bytes, crc) : crc32c_table(p, bytes, crc);
#else
  crc = crc32c_table(p, bytes, crc);
#endif
  return ~crc;
}

namespace detail {
uint32_t crc32c_portable(const void* data, size_t bytes, uint32_t crc) {
  return ~crc32c_table(static_cast<const uint8_t*>(data), bytes, ~crc);
}
}  // namespace detail

}  // namespace torch_offload
