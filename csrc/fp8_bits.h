// fp8 e4m3fn -> f16 with integer operations only (no conversion instruction), for kernels whose
// conversion pipe is the bottleneck. Host and device code: the host build is what
// tests/test_fp8_bits.py checks against torch over every byte pair.
//
// An e4m3fn byte is s eeee mmm with value 2^(e-7) (1 + m/8), or 2^-6 (m/8) when e = 0. Its seven
// magnitude bits placed at f16 bits 13..7 read as f16 exponent e (bias 15) and the top three
// mantissa bits: 2^(e-15) (1 + m/8), or 2^-14 (m/8) for e = 0 -- exactly 2^-8 times the e4m3
// value, subnormals included. So the f16 bits of 2^-8 x the byte are (mag << 7) | (s << 15).
// The two NaN bytes (0x7F, 0xFF) come out as +-1.875 (i.e. +-480 before the 2^-8), not NaN.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define KIMI_OPS_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KIMI_OPS_HOST_DEVICE inline
#endif

namespace kimi_ops {

// PTX prmt.b32 in its default mode: result byte i is byte (nibble_i & 7) of {y, x} (x = bytes
// 0..3), or, when nibble_i & 8, that byte's sign bit replicated over all eight bits.
KIMI_OPS_HOST_DEVICE uint32_t prmt(uint32_t x, uint32_t y, uint32_t selector) {
#ifdef __CUDA_ARCH__
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(x), "r"(y), "r"(selector));
  return d;
#else
  const uint64_t bytes = (static_cast<uint64_t>(y) << 32) | x;
  uint32_t d = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t nibble = (selector >> (4 * i)) & 0xFu;
    uint32_t b = static_cast<uint32_t>(bytes >> (8 * (nibble & 7u))) & 0xFFu;
    if (nibble & 8u) b = (b & 0x80u) ? 0xFFu : 0u;
    d |= b << (8 * i);
  }
  return d;
#endif
}

// f16x2 holding 2^-8 x two e4m3 bytes of {y, x}. `selector` (a prmt selector) must put the low
// half's byte at byte 0 with its sign replicated into byte 1, and the high half's byte at byte 2
// with its sign in byte 3: e.g. 0x9180 for bytes 0, 1 of x; 0xC480 for byte 0 of x and of y.
// After << 7 each half holds sign (bit 15), the byte's own sign bit (14, masked off) and the
// magnitude (13..7); the sign bytes' other bits land in the other half's masked bits 16..22.
KIMI_OPS_HOST_DEVICE uint32_t e4m3x2_to_f16x2_scaled(uint32_t x, uint32_t y, uint32_t selector) {
  return (prmt(x, y, selector) << 7) & 0xBF80BF80u;
}

// selectors: bytes (0, 1) and (2, 3) of one word; byte j (0..3) of two words (x low, y high)
constexpr uint32_t kSelBytes01 = 0x9180u, kSelBytes23 = 0xB3A2u;
KIMI_OPS_HOST_DEVICE constexpr uint32_t sel_byte_of_each(int j) { return 0xC480u + 0x1111u * j; }
constexpr float kIntConvertScale = 256.0f;  // undoes the 2^-8

}  // namespace kimi_ops
