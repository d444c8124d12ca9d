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
// memory. Reads only after the previous grid is done (PDL).
template <int kThreads>
__device__ void norm_side_cta(const NormSideParams& s, int t, float eps, float* red) {
  static_assert(kThreads % 32 == 0 && kThreads <= kNormLatent / 2, "a thread takes whole bf16 pairs of kv_c");
  constexpr int kPairs = kNormLatent / 2 / kThreads;
  wait_prior_grid();
  allow_next_grid();
  const int tid = threadIdx.x;
  const int64_t slot = s.slot64 ? static_cast<const int64_t*>(s.slot)[t] : static_cast<const int*>(s.slot)[t];
  if (slot >= 0 && slot < s.cache_rows) {  // uniform across the CTA
    const __nv_bfloat162* kv = reinterpret_cast<const __nv_bfloat162*>(s.kv_c + t * s.kv_c_stride);
    float2 x[kPairs];
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      x[i] = __bfloat1622float2(kv[tid + i * kThreads]);
      ss = fmaf(x[i].x, x[i].x, fmaf(x[i].y, x[i].y, ss));
    }
#pragma unroll
    for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (tid % 32 == 0) red[tid / 32] = ss;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) total += red[w];
    const float r = rsqrtf(total / kNormLatent + eps);
    uint8_t* row = s.cache + slot * (kNormLatent + kNormRope);
    const __nv_bfloat162* w2 = reinterpret_cast<const __nv_bfloat162*>(s.kv_norm_w);
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      const int pair = tid + i * kThreads;
      const float2 w = __bfloat1622float2(w2[pair]);
      // the normed kv_c as the unfused step stores it: rounded to bf16 first
      const float a = __bfloat162float(__float2bfloat16_rn(x[i].x * r * w.x));
      const float b = __bfloat162float(__float2bfloat16_rn(x[i].y * r * w.y));
      reinterpret_cast<uint16_t*>(row)[pair] = e4m3x2_of(a, b, s.kv_scale);
    }
    if (tid < kNormRope / 2) {
      const float2 pe = __bfloat1622float2(reinterpret_cast<const __nv_bfloat162*>(s.k_pe + t * s.k_pe_stride)[tid]);
      reinterpret_cast<uint16_t*>(row + kNormLatent)[tid] = e4m3x2_of(pe.x, pe.y, s.kv_scale);
    }
  }
  if (s.g != nullptr) {
    const __nv_bfloat16* g = s.g + t * s.g_stride;
    for (int c = tid; c < s.G; c += kThreads) {
      const float v = __bfloat162float(g[c]);
      s.gate[static_cast<int64_t>(t) * s.G + c] = __float2bfloat16_rn(1.f / (1.f + expf(-v)));
    }
  }
}

}  // namespace
}  // namespace kimi_ops::sm90
