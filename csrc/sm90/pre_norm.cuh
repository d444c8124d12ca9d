// The decode layer's pre step beside q_b: the work of kimi_ops/kernels/pre_norm.py that is not the
// q RMSNorm, done by CTAs of q_b's own launch (gemv_kernel<..., kNorm = true>, gemv.cuh: the CTAs
// after the product's take one token each), so the step has no kernel between qkv_a and q_b:
//   - kv_c[t]'s RMSNorm (float32 x * rsqrt(mean(x^2) + eps) * weight, rounded to bf16) and k_pe[t]
//     written as cache row slot[t]: fp8 e4m3fn(x / kv_scale), the division correctly rounded, round
//     to nearest even, saturated to +-448, NaN -> 0x7f | sign (mla_cache_write's bytes); a slot
//     outside [0, cache_rows) writes nothing;
//   - gate[t] = bf16(sigmoid(g[t])) when g is given.
//
// Byte layouts:
//   reads   kv_c [T, 512], k_pe [T, 64], g [T, G] bf16, rows *_stride elements apart, unit stride
//           along a row, 4-byte aligned; kv_norm_w [512] bf16; slot [T] int32 or int64
//   writes  cache [cache_rows, 576] fp8 e4m3fn, row = [kv_c 512 | k_pe 64]; gate [T, G] bf16, contiguous
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "ptx.cuh"

namespace kimi_ops::sm90 {
namespace {

constexpr int kNormLatent = 512;  // kv_c's columns (KV_LORA_RANK)
constexpr int kNormRope = 64;     // k_pe's (ROPE_DIM)

struct NormSideParams {
  const __nv_bfloat16* kv_c;
  int64_t kv_c_stride;
  const __nv_bfloat16* k_pe;
  int64_t k_pe_stride;
  const __nv_bfloat16* kv_norm_w;  // [512]
  const void* slot;                // [T] int32 or int64 (slot64)
  bool slot64;
  uint8_t* cache;                  // [cache_rows, 576] e4m3fn bytes
  int64_t cache_rows;
  float kv_scale;
  const __nv_bfloat16* g;          // [T, G] or nullptr
  int64_t g_stride;
  int G;
  __nv_bfloat16* gate;             // [T, G]
};

// fp8 e4m3fn of x / kv_scale, two values a 16-bit word (lo = a).
__device__ __forceinline__ uint16_t e4m3x2_of(float a, float b, float kv_scale) {
  const float qa = __fdiv_rn(a, kv_scale), qb = __fdiv_rn(b, kv_scale);
  uint16_t lo = __nv_cvt_float_to_fp8(qa, __NV_SATFINITE, __NV_E4M3);
  uint16_t hi = __nv_cvt_float_to_fp8(qb, __NV_SATFINITE, __NV_E4M3);
  if (qa != qa) lo = 0x7f | (signbit(qa) ? 0x80 : 0);
  if (qb != qb) hi = 0x7f | (signbit(qb) ? 0x80 : 0);
  return static_cast<uint16_t>(lo | (hi << 8));
}

// Token t's cache row and gate (one CTA of kThreads threads); red: kThreads / 32 floats of shared
// memory. The norm weight is loaded before the PDL wait (a model's constant), everything else after
// it, every load of the CTA's first round issued together (slot, kv_c, k_pe, kGateLoads of g a
// thread) so that the chain is one memory round trip, not one a load.
constexpr int kGateLoads = 16;  // g's values a thread loads at once (Kimi-K3 TP8: 1536 over 128 threads)

template <int kThreads>
__device__ void norm_side_cta(const NormSideParams& s, int t, float eps, float* red) {
  static_assert(kThreads % 32 == 0 && kThreads <= kNormLatent / 2, "a thread takes whole bf16 pairs of kv_c");
  constexpr int kPairs = kNormLatent / 2 / kThreads;
  const int tid = threadIdx.x;
  const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(s.kv_norm_w);
  float2 w[kPairs];
#pragma unroll
  for (int i = 0; i < kPairs; ++i) w[i] = __bfloat1622float2(w2[tid + i * kThreads]);
  wait_prior_grid();
  allow_next_grid();
  const int64_t slot = s.slot64 ? static_cast<const int64_t*>(s.slot)[t] : static_cast<const int*>(s.slot)[t];
  const __nv_bfloat162* kv = reinterpret_cast<const __nv_bfloat162*>(s.kv_c + t * s.kv_c_stride);
  float2 x[kPairs];
#pragma unroll
  for (int i = 0; i < kPairs; ++i) x[i] = __bfloat1622float2(kv[tid + i * kThreads]);
  const float2 pe = tid < kNormRope / 2
                        ? __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(s.k_pe + t * s.k_pe_stride)[tid])
                        : float2{};
  // the gate: rounds of kGateLoads values a thread, all loads of a round before its stores
  const __nv_bfloat16* g = s.g + t * s.g_stride;
  __nv_bfloat16* gate = s.gate + static_cast<int64_t>(t) * s.G;
  for (int base = 0; s.g != nullptr && base < s.G; base += kGateLoads * kThreads) {
    float v[kGateLoads];
#pragma unroll
    for (int j = 0; j < kGateLoads; ++j) {
      const int col = base + j * kThreads + tid;
      v[j] = col < s.G ? __bfloat162float(g[col]) : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kGateLoads; ++j) {
      const int col = base + j * kThreads + tid;
      if (col < s.G) gate[col] = __float2bfloat16_rn(1.f / (1.f + expf(-v[j])));
    }
  }
  if (slot < 0 || slot >= s.cache_rows) return;  // uniform across the CTA
  float ss = 0.f;
#pragma unroll
  for (int i = 0; i < kPairs; ++i) ss = fmaf(x[i].x, x[i].x, fmaf(x[i].y, x[i].y, ss));
#pragma unroll
  for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (tid % 32 == 0) red[tid / 32] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kThreads / 32; ++i) total += red[i];
  const float r = rsqrtf(total / kNormLatent + eps);
  uint8_t* row = s.cache + slot * (kNormLatent + kNormRope);
#pragma unroll
  for (int i = 0; i < kPairs; ++i) {
    // the normed kv_c as the unfused step stores it: rounded to bf16 first
    const float a = __bfloat162float(__float2bfloat16_rn(x[i].x * r * w[i].x));
    const float b = __bfloat162float(__float2bfloat16_rn(x[i].y * r * w[i].y));
    reinterpret_cast<uint16_t*>(row)[tid + i * kThreads] = e4m3x2_of(a, b, s.kv_scale);
  }
  if (tid < kNormRope / 2) reinterpret_cast<uint16_t*>(row + kNormLatent)[tid] = e4m3x2_of(pe.x, pe.y, s.kv_scale);
}

}  // namespace
}  // namespace kimi_ops::sm90
