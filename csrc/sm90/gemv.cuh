// Small-M projections of the decode layer: y [M, N] = x [M, K] @ W^T for M <= 32 tokens, W a bf16
// weight or an fp8 e4m3 weight with 128 x 128-style block scales (gemv_kernel). At such M the step
// is a stream of the weight's bytes; the kernel's job is to keep enough of them in flight.
//
// Byte layouts:
//   reads   x [M, K] bf16 (rows x_stride elements apart, 16-byte aligned); W [N, K] row-major,
//           contiguous: bf16 (2K bytes a row) or fp8 e4m3fn (K bytes a row, real W = fp8 x
//           scale[n / block_n][k / kFp8BlockK]); scale [ceil(N / block_n), ceil(K / 128)] f32,
//           rows scale_stride apart
//   writes  y [M, N] bf16, contiguous; every element of the M rows
//   shared  red [WARPS][16][8 kNT] f32: each warp's partial sums of the CTA's 16 x 8 kNT outputs
//
// gemv_kernel: one CTA of WARPS warps per 16 weight rows (the MMA's M; tokens are its N = 8, kNT
// such MMAs on the same W fragments for up to 8 kNT tokens, the tokens past M read as zeros). The
// warps split K into whole k-blocks (kFp8BlockK = 128 fp8
// columns, or kBf16BlockK = 256 bf16 columns, each a 512-byte run of a row) and each streams its
// share with 16-byte loads (W's bypass L1), kUnroll k-blocks a step; their partials meet in shared
// memory. mma.sync m16n8k16 bf16 with f32 accumulation; the K order inside a 32- (bf16) or 64-
// (fp8) column chunk is permuted the same way in A and B, so lane (g, c) feeds the MMA straight
// from its loads of W rows g, g + 8 and x row g at columns [k0 + 8c, +8) (bf16) or [k0 + 16c, +16)
// (fp8): step s takes the lane's register pairs 2s and 2s + 1 as its columns (2c, 2c+1) and
// (2c+8, 2c+9). fp8 bytes become bf16 exactly, as value * 2^-120 (integer ops, no conversion
// instruction), x is multiplied by 2^60 (exact for |x| < 2^67; at 4 token tiles W instead, the same
// products with half the multiplies), and a k-block's sum by its scale * 2^60 in f32 (DeepSeek-V3's
// promotion), so each MMA chain is one k-block long.
// PDL (a launch with programmatic stream serialization, the op's constant_w): each warp's first
// weight loads go out before griddepcontrol.wait, so W streams while the previous kernel on the
// stream finishes; x (that kernel's output, perhaps) is read after it. Without the attribute the
// wait returns at once.
//
// kNorm (the decode layer's q_b, fused with its RMSNorm: _norm_q_b_sm90): y = rstd(x) * ((x * norm_w)
// @ W^T), rstd(x) = rsqrt(mean(x^2) + eps) over x's K columns; the product takes x * norm_w
// rounded to bf16 (as the unfused step takes the normed x rounded to bf16) and each output's f32
// sum is multiplied by its token's rstd before the one rounding. Each lane adds up the squares of
// the x it loads; the sums meet in shared memory beside the partial products. norm_w [K] bf16 is
// copied into dynamic shared memory (cp.async, before the PDL wait: a model's constant), each warp
// the columns of its own k-blocks, which are whole and at least one a warp (the host checks
// k-blocks >= WARPS), so a warp's __syncwarp orders them. The CTAs after the product's
// (blockIdx.x >= main_ctas) take one token each: pre_norm.cuh's kv norm, cache row and gate.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "pre_norm.cuh"
#include "ptx.cuh"

namespace kimi_ops::sm90 {
namespace {

constexpr int kGemvRows = 16;     // weight rows (outputs) a CTA
constexpr int kGemvMaxM = 8;      // tokens an MMA tile (N = 8); a launch takes kNT of them
constexpr int kFp8BlockK = 128;   // fp8: the scale's k-block (the kernel's only one)
constexpr int kBf16BlockK = 256;  // bf16: columns a warp takes at a time (512 bytes a row)
constexpr int kNormWarps = 4;     // kNorm: the warps of a CTA (the fused q_b's K is a q_lora rank)
constexpr int kNormMaxK = 8192;   // kNorm: norm_w's shared memory, 2 K bytes, within the 48 KB
constexpr int kNormMaxM = 16;     // kNorm: tokens (one or two token tiles; at four, 32 tokens of fp8
                                  // weights, the layer measured 1.8% slower fused than as two ops)

struct GemvParams {
  const __nv_bfloat16* x;  // [M, K]
  int64_t x_stride;        // elements between x rows
  const void* w;           // [N, K] bf16 or fp8 e4m3fn, contiguous
  const float* scale;      // fp8: [ceil(N / block_n), ceil(K / 128)]; bf16: nullptr
  int64_t scale_stride;    // elements between scale rows
  __nv_bfloat16* y;        // [M, N], contiguous
  int M, N, K, block_n;
  // kNorm only
  const __nv_bfloat16* norm_w;  // [K] bf16, 16-byte aligned
  float eps;
  int main_ctas;                // ceil(N / 16): the product's CTAs; one a token after them
  NormSideParams side;
};

// 16 bytes at p where `pred`, else zeros; no branch, so the loads of a step stay together in flight.
// kStream: W's bytes, read once (no L1 allocation); else x's, shared by every CTA through L2.
template <bool kStream>
__device__ __forceinline__ uint4 ld16_or_zero(const void* p, bool pred) {
  uint4 v;
  if constexpr (kStream)
    asm("{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n"
        " mov.b32 %3, 0;\n @q ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "r"(static_cast<int>(pred)));
  else
    asm("{\n .reg .pred q;\n setp.ne.b32 q, %5, 0;\n mov.b32 %0, 0;\n mov.b32 %1, 0;\n mov.b32 %2, 0;\n"
        " mov.b32 %3, 0;\n @q ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n}\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "r"(static_cast<int>(pred)));
  return v;
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 16 e4m3 bytes -> 8 bf16x2 words (word i = bytes 2i, 2i + 1) of value * 2^-120, exact, on the
// integer pipe (3 instructions a word; cvt to f16 and on to bf16 took 4, two on the conversion
// pipe): prmt puts each byte under its sign-replicated copy, the shift moves its 7 bits of
// exponent and mantissa under bf16's (bias 127 - 7 = 120 off), the mask keeps them and one sign
// bit. e4m3's subnormals become bf16 subnormals (the MMA keeps them: tests/test_gemv.py); e4m3fn's
// NaN (0x7f / 0xff) becomes a finite 480 * 2^-120.
__device__ __forceinline__ void e4m3x16_to_bf16_pow2(const uint4& v, uint32_t (&out)[8]) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    out[2 * i] = (prmt(words[i], 0u, 0x9180u) << 4) & 0x87F087F0u;      // bytes 0, 1
    out[2 * i + 1] = (prmt(words[i], 0u, 0xB3A2u) << 4) & 0x87F087F0u;  // bytes 2, 3
  }
}
// kNorm: a word of two x values times norm_w's two, rounded to bf16 (the product of two bf16 is
// exact in f32, so one rounding), and their squares added to sumsq.
__device__ __forceinline__ uint32_t norm_times_x(uint32_t x2, uint32_t w2, float& sumsq) {
  const __nv_bfloat162 x = *reinterpret_cast<const __nv_bfloat162*>(&x2);
  const float2 xf = __bfloat1622float2(x);
  sumsq = fmaf(xf.x, xf.x, fmaf(xf.y, xf.y, sumsq));
  const __nv_bfloat162 y = __hmul2(x, *reinterpret_cast<const __nv_bfloat162*>(&w2));
  return *reinterpret_cast<const uint32_t*>(&y);
}

constexpr float kXUp = 0x1p60f;  // fp8: x * 2^60 in bf16 (exact), so W * 2^-120 times it stays an
                                 // f32 normal down to |w x| = 2^-66; k-block sums * scale * 2^60

// a word of two bf16 times 2^60, exactly (a bf16 subnormal becomes a normal; no rounding): where a
// W fragment meets several token tiles, W * 2^-60 times x gives the products of W * 2^-120 times
// x * 2^60 with fewer multiplies (one a W word instead of one an x word a tile)
__device__ __forceinline__ uint32_t bf16x2_up(uint32_t v) {
  const __nv_bfloat162 u = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&v), __floats2bfloat162_rn(kXUp, kXUp));
  return *reinterpret_cast<const uint32_t*>(&u);
}

// kNT: 8-token MMA tiles (1: M <= 8; 2: M <= 16; 4: M <= 32; each lane loads x rows g + 8t). With
// an fp8 W up to kNT 2 the summation order of a token's outputs does not depend on kNT or kUnroll
// (k-blocks in order, one MMA chain pair a k-block): a launch of 16 rows gives the bits of two
// launches of 8. kNT 4 runs one MMA chain a tile (two took 128 registers and spilled), and a bf16
// W's k-block is 256 / kNT columns (x's registers stay those of kNT 1): other orders, same bound.
// kNorm: two CTAs a SM (q_b's 144 + T on 132 SMs) leave 255 registers (at 128 the fp8 form spilled)
template <int WARPS, bool kFp8, int kUnroll, int kNT = 1, bool kNorm = false>
__global__ void __launch_bounds__(WARPS * 32, kNorm ? 2 : 16 / WARPS) gemv_kernel(const GemvParams p) {
  static_assert(kNT == 1 || kNT == 2 || kNT == 4, "8, 16 or 32 tokens");
  __shared__ float red[WARPS][kGemvRows][kGemvMaxM * kNT];
  __shared__ float red_ss[kNorm ? WARPS : 1][kGemvMaxM * kNT];  // kNorm: each warp's sums of x^2 a token
  extern __shared__ __align__(16) __nv_bfloat16 norm_w_smem[];  // kNorm: norm_w [K]
  if constexpr (kNorm) {
    if (static_cast<int>(blockIdx.x) >= p.main_ctas) {
      norm_side_cta<WARPS * 32>(p.side, blockIdx.x - p.main_ctas, p.eps, &red[0][0][0]);
      return;
    }
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;
  const int n0 = blockIdx.x * kGemvRows;
  const bool row_lo_ok = n0 + g < p.N, row_hi_ok = n0 + g + 8 < p.N;

  constexpr int kBlockK = kFp8 ? kFp8BlockK : kBf16BlockK / kNT;  // bf16: x's registers stay those of kNT 1
  constexpr int kBytesPerCol = kFp8 ? 1 : 2;
  constexpr int kChunkK = kFp8 ? 64 : 32;  // columns of one 16-byte load by each of a row's 4 lanes
  constexpr int kChunks = kBlockK / kChunkK;
  const int k_blocks = (p.K + kBlockK - 1) / kBlockK;
  const int per_warp = (k_blocks + WARPS - 1) / WARPS;
  // kNorm: every warp at least one k-block (k_blocks >= WARPS), its columns' norm_w its own to copy
  const int kb0 = kNorm ? warp * k_blocks / WARPS : warp * per_warp;
  const int kb1 = kNorm ? (warp + 1) * k_blocks / WARPS : min(kb0 + per_warp, k_blocks);
  if constexpr (kNorm) {
    const int c0 = kb0 * kBlockK, c1 = min(kb1 * kBlockK, p.K);  // K % 8 == 0: whole 16-byte chunks
    for (int col = c0 + 8 * lane; col < c1; col += 8 * 32) cp_async_16(norm_w_smem + col, p.norm_w + col, 16);
    cp_async_commit();
  }

  const uint8_t* w_lo = static_cast<const uint8_t*>(p.w) + static_cast<int64_t>(n0 + g) * p.K * kBytesPerCol;
  const uint8_t* w_hi = w_lo + static_cast<int64_t>(8) * p.K * kBytesPerCol;
  const __nv_bfloat16* x_row = p.x + static_cast<int64_t>(g) * p.x_stride;  // token g + 8t: + 8t rows
  const float* scale_row = kFp8 ? p.scale + static_cast<int64_t>(n0 / p.block_n) * p.scale_stride : nullptr;

  float acc[kNT][4] = {};
  float sumsq[kNT] = {};  // kNorm: the squares of the x this lane loads, token g + 8t
  // steps of kUnroll k-blocks up to kb1 (the last one shorter); odd warps take the short one first,
  // so that half the warps convert and multiply while the other half's loads are in flight
  const int short_step = (kb1 - kb0) % kUnroll;
  int lim = min(kb1, kb0 + ((warp & 1) && short_step ? short_step : kUnroll));  // this step's end
  for (int kb = kb0; kb < kb1; kb = lim, lim = min(kb1, kb + kUnroll)) {
    // all of the step's loads first (kUnroll k-blocks: 16 bytes of W a load, 12 loads a lane in
    // flight for fp8's three k-blocks, 16 for bf16's one), then its MMAs; a row past N loads zeros
    constexpr int kLoads = kUnroll * kChunks;
    uint4 a_lo[kLoads], a_hi[kLoads], xv[kLoads][kNT][kFp8 ? 2 : 1];
    auto lane_k = [&](int i, bool& in_k) {  // the lane's first column of load i; whether it is in K
      const int blk = kb + i / kChunks;
      const int k = blk * kBlockK + (i % kChunks) * kChunkK + c * (kChunkK / 4);
      in_k = blk < lim && k < p.K;  // (K % kChunkK == 0: a chunk is wholly in or out)
      return k;
    };
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      bool in_k;
      const int k = lane_k(i, in_k);
      a_lo[i] = ld16_or_zero<true>(w_lo + static_cast<int64_t>(k) * kBytesPerCol, row_lo_ok && in_k);
      a_hi[i] = ld16_or_zero<true>(w_hi + static_cast<int64_t>(k) * kBytesPerCol, row_hi_ok && in_k);
    }
    // PDL: the first step's weight loads are in flight while the previous kernel finishes
    if (kb == kb0) wait_prior_grid();
#pragma unroll
    for (int i = 0; i < kLoads; ++i) {
      bool in_k;
      const int k = lane_k(i, in_k);
#pragma unroll
      for (int t = 0; t < kNT; ++t)
#pragma unroll
        for (int j = 0; j < (kFp8 ? 2 : 1); ++j)
          xv[i][t][j] = ld16_or_zero<false>(x_row + static_cast<int64_t>(8 * t) * p.x_stride + k + 8 * j,
                                            g + 8 * t < p.M && in_k);
    }
    if constexpr (kNorm) {
      if (kb == kb0) {  // this warp's norm_w columns are in shared memory
        cp_async_wait<0>();
        __syncwarp();
      }
    }
    float sc[kUnroll];  // each k-block's scale
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) sc[u] = kFp8 && kb + u < lim ? scale_row[kb + u] * kXUp : 1.f;
    __syncwarp();  // orders the loads before the MMAs: ptxas otherwise sinks each load to its MMA
                   // (~3 of a lane's loads in flight instead of all; .nc loads move past it too)
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (kb + u >= lim) break;
      // two MMA chains a token tile (k-steps alternate between them); one at kNT 4 (registers)
      constexpr int kChains = kNT == 4 ? 1 : 2;
      float part[kNT][kChains][4] = {};
#pragma unroll
      for (int ch = 0; ch < kChunks; ++ch) {
        const int i = u * kChunks + ch;
        if constexpr (kFp8) {
          uint32_t lo[8], hi[8];
          e4m3x16_to_bf16_pow2(a_lo[i], lo);
          e4m3x16_to_bf16_pow2(a_hi[i], hi);
          constexpr bool kUpW = kNT == 4 && !kNorm;  // 2^60 on W's 16 words, not on the tiles' 32 x words
          if constexpr (kUpW) {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              lo[j] = bf16x2_up(lo[j]);
              hi[j] = bf16x2_up(hi[j]);
            }
            __syncwarp();  // keeps ptxas from interleaving them with the MMAs (that spilled 4 bytes)
          }
          uint4 nw[2];  // kNorm: norm_w at the lane's 16 columns
          if constexpr (kNorm) {
            bool in_k;
            const int k = lane_k(i, in_k);
            nw[0] = in_k ? *reinterpret_cast<const uint4*>(norm_w_smem + k) : uint4{};
            nw[1] = in_k ? *reinterpret_cast<const uint4*>(norm_w_smem + k + 8) : uint4{};
          }
#pragma unroll
          for (int t = 0; t < kNT; ++t) {
            uint32_t xb[8];
            uint32_t xr[8] = {xv[i][t][0].x, xv[i][t][0].y, xv[i][t][0].z, xv[i][t][0].w,
                              xv[i][t][1].x, xv[i][t][1].y, xv[i][t][1].z, xv[i][t][1].w};
            if constexpr (kNorm) {
              const uint32_t nr[8] = {nw[0].x, nw[0].y, nw[0].z, nw[0].w, nw[1].x, nw[1].y, nw[1].z, nw[1].w};
#pragma unroll
              for (int j = 0; j < 8; ++j) xr[j] = norm_times_x(xr[j], nr[j], sumsq[t]);
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) xb[j] = kUpW ? xr[j] : bf16x2_up(xr[j]);
#pragma unroll
            for (int s = 0; s < 4; ++s)
              mma_bf16(part[t][s % kChains], lo[2 * s], hi[2 * s], lo[2 * s + 1], hi[2 * s + 1], xb[2 * s], xb[2 * s + 1]);
          }
        } else {
          uint4 nw{};  // kNorm: norm_w at the lane's 8 columns
          if constexpr (kNorm) {
            bool in_k;
            const int k = lane_k(i, in_k);
            if (in_k) nw = *reinterpret_cast<const uint4*>(norm_w_smem + k);
          }
#pragma unroll
          for (int t = 0; t < kNT; ++t) {
            uint4 x = xv[i][t][0];
            if constexpr (kNorm) {
              x.x = norm_times_x(x.x, nw.x, sumsq[t]);
              x.y = norm_times_x(x.y, nw.y, sumsq[t]);
              x.z = norm_times_x(x.z, nw.z, sumsq[t]);
              x.w = norm_times_x(x.w, nw.w, sumsq[t]);
            }
            mma_bf16(part[t][0], a_lo[i].x, a_hi[i].x, a_lo[i].y, a_hi[i].y, x.x, x.y);
            mma_bf16(part[t][kChains - 1], a_lo[i].z, a_hi[i].z, a_lo[i].w, a_hi[i].w, x.z, x.w);
          }
        }
      }
#pragma unroll
      for (int t = 0; t < kNT; ++t)
#pragma unroll
        for (int r = 0; r < 4; ++r)
          acc[t][r] = fmaf(kChains == 2 ? part[t][0][r] + part[t][kChains - 1][r] : part[t][0][r], sc[u], acc[t][r]);
    }
  }
  wait_prior_grid();  // (a warp with no k-block: nothing of this grid writes before the previous grid is done)
  allow_next_grid();
  // acc[t]: (row g, token 8t + 2c), (g, 8t + 2c + 1), (g + 8, 8t + 2c), (g + 8, 8t + 2c + 1)
#pragma unroll
  for (int t = 0; t < kNT; ++t) {
    red[warp][g][8 * t + 2 * c] = acc[t][0];
    red[warp][g][8 * t + 2 * c + 1] = acc[t][1];
    red[warp][g + 8][8 * t + 2 * c] = acc[t][2];
    red[warp][g + 8][8 * t + 2 * c + 1] = acc[t][3];
  }
  if constexpr (kNorm) {
#pragma unroll
    for (int t = 0; t < kNT; ++t) {  // a token's squares over the 4 lanes of its row, then the warps
      float ss = sumsq[t];
      ss += __shfl_xor_sync(0xffffffffu, ss, 1);
      ss += __shfl_xor_sync(0xffffffffu, ss, 2);
      if (c == 0) red_ss[warp][8 * t + g] = ss;
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < kGemvRows * kGemvMaxM * kNT; idx += WARPS * 32) {
    const int tok = idx / kGemvRows, r = idx % kGemvRows;
    if (tok < p.M && n0 + r < p.N) {
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) sum += red[w][r][tok];
      if constexpr (kNorm) {
        float ss = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) ss += red_ss[w][tok];
        sum *= rsqrtf(ss / p.K + p.eps);
      }
      p.y[static_cast<int64_t>(tok) * p.N + n0 + r] = __float2bfloat16_rn(sum);
    }
  }
}

}  // namespace
}  // namespace kimi_ops::sm90
