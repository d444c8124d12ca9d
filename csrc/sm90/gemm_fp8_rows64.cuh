// fp8 block-scaled projections at 33-64 tokens: y [M, N] = x [M, K] @ dequant(W)^T for
// 33 <= M <= 64, W fp8 e4m3fn with 128-column k-blocks of scales (gemm_a16w8_block's contract),
// the numerics of gemv.cuh's fp8 path: W bytes become bf16 exactly as value * 2^-120, x times 2^60
// (exact; at MT 1 W times 2^60 instead: the same products with fewer multiplies), mma.sync
// m16n8k16 bf16 with f32 accumulation, each k-block's sum times its scale * 2^60 added in f32, one
// rounding to bf16.
//
// Byte layouts:
//   reads   x [M, K] bf16 (rows x_stride elements apart, 16-byte aligned), W [N, K] fp8 contiguous,
//           scale [ceil(N / block_n), ceil(K / 128)] f32 (rows scale_stride apart)
//   writes  y [M, N] bf16, contiguous; every element of the M rows
//   shared  STAGES stages of { W [kRows][128 B]: a k-block of the CTA's rows, each row's 16-byte
//           chunk j at position j ^ 4 (odd rows); x [64][256 B]: the k-block's 128 columns of every
//           token, chunk j at j ^ 1 (odd tokens) }: the swizzles make the lanes' 16-byte reads
//           below conflict-free. After the K loop the same memory holds the CTA's f32 sums
//           [64 tokens][kRows + 4], read by the cluster's CTAs through distributed shared memory.
//
// Work: a CTA takes kRows = 8 warps x 16 MT weight rows and a contiguous range of K's k-blocks
// (split K); the splits of one row range form a thread-block cluster (1, splits, 1) that adds its
// CTAs' sums in shared memory (each CTA a 1 / splits share of the tile's rows) and writes y: no
// f32 partials in global memory, no second kernel. The k-blocks stream through a cp.async ring of
// STAGES stages (W before the PDL wait, x after it). Each warp keeps its 16 MT rows x 8 kTiles
// tokens of f32 sums in registers: per 64-column chunk a lane reads its rows g, g + 8 at columns
// [16c, +16) (gemv.cuh's K permutation, the same in A and B) and, for each 8-token tile (kTiles of
// them, in pairs: 6 at M <= 48, 8 above; tokens past M read zeros), token 8t + g's same 16
// columns, so a W fragment feeds 4 kTiles MMAs a chunk and an x fragment MT of them.
//
// Measured (H100, docs/perf-history.md): Kimi-K3's fused qkv_a + gate at 33 / 48 / 64 rows 18.5 /
// 19.0 / 23.1 us (Triton's tl.dot GEMM 25.8 / 25.7 / 26.5), o_proj 11.5 / 11.8 / 13.3 (14.2 / 14.6 /
// 15.1), q_b 9.0 / 9.7 / 11.7 (8.2 / 8.6 / 8.8) (session 58, each thread's copy addresses computed
// once; session 57's build in the same call 18.9 / 19.7 / 24.1, 11.7 / 12.0 / 13.6, 9.2 / 10.0 /
// 12.0); at MT 2 (session 56) 20.0 / - / 22.8, 12.2 / - / 13.8, 9.8 / - / 11.3. On wgmma (W's
// fragments from registers, x from shared memory; perf-history.md "Session 58") it was 7-31% slower.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "copy.cuh"
#include "gemv.cuh"
#include "ptx.cuh"

namespace kimi_ops::sm90 {
namespace {

constexpr int kRows64Warps = 8;
constexpr int kRows64MaxM = 64;
constexpr int kRows64MaxSplits = 8;  // the portable cluster size

struct Rows64Params {
  const __nv_bfloat16* x;  // [M, K]
  int64_t x_stride;
  const uint8_t* w;        // [N, K] fp8 e4m3fn, contiguous
  const float* scale;      // [ceil(N / block_n), ceil(K / 128)]
  int64_t scale_stride;
  __nv_bfloat16* y;        // [M, N], contiguous
  int M, N, K, block_n;
  int k_blocks;            // ceil(K / 128)
  int splits;              // gridDim.y = the cluster's size
};

template <int MT>
struct Rows64Shape {
  static constexpr int kRows = 16 * MT * kRows64Warps;           // weight rows a CTA
  static constexpr int kWBytes = kRows * kFp8BlockK;             // a stage's W
  static constexpr int kXBytes = kRows64MaxM * kFp8BlockK * 2;   // a stage's x
  static constexpr int kStageBytes = kWBytes + kXBytes;
  static constexpr int kSumPitch = kRows + 4;                    // floats between tokens of the sums
  static constexpr int kSumBytes = kRows64MaxM * kSumPitch * 4;
  template <int STAGES>
  static constexpr size_t smem_bytes() {
    return STAGES * kStageBytes > kSumBytes ? STAGES * kStageBytes : kSumBytes;
  }
};

__device__ __forceinline__ uint4 lds128(const uint8_t* p) { return *reinterpret_cast<const uint4*>(p); }

// gemv.cuh's mma_bf16 without `volatile`: the compiler may interleave independent MMA chains
__device__ __forceinline__ void mma_bf16_free(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                              uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// MT: m-tiles of 16 weight rows a warp (1: 128 rows a CTA, two CTAs a SM; 2: 256 rows, one)
// kTiles: 8-token tiles computed (6: M <= 48, 8: M <= 64), a compile-time count so that the tile
// loop has no branch and the next pair's x reads can move above this pair's MMAs
template <int MT, int STAGES, int kTiles>
__global__ void __launch_bounds__(kRows64Warps * 32, MT == 1 ? 2 : 1) gemm_fp8_rows64_kernel(const Rows64Params p) {
  using S = Rows64Shape<MT>;
  constexpr int kThreads = kRows64Warps * 32;
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, c = lane % 4;
  const int n0 = blockIdx.x * S::kRows;
  const int split = blockIdx.y;
  const int kb0 = split * p.k_blocks / p.splits, n_kb = (split + 1) * p.k_blocks / p.splits - kb0;

  // a thread's copies: W rows wr0 + 32u, chunk wj; x tokens xr0 + 16u, chunk xj; per k-block only
  // the source's column moves (the swizzles depend on the row's parity, the same for every u)
  const int wr0 = threadIdx.x / 8, wj = threadIdx.x % 8, xr0 = threadIdx.x / 16, xj = threadIdx.x % 16;
  const uint8_t* w_src = p.w + static_cast<int64_t>(n0 + wr0) * p.K + 16 * wj;
  const __nv_bfloat16* x_src = p.x + static_cast<int64_t>(xr0) * p.x_stride + 8 * xj;
  const uint32_t w_dst = wr0 * kFp8BlockK + 16 * (wj ^ ((wr0 & 1) << 2));
  const uint32_t x_dst = xr0 * 2 * kFp8BlockK + 16 * (xj ^ (xr0 & 1));
  constexpr int kWCopies = S::kRows * 8 / kThreads, kXCopies = kTiles * 8 * 16 / kThreads;
  static_assert(kWCopies * kThreads == S::kRows * 8 && kXCopies * kThreads == kTiles * 8 * 16);
  auto load_w = [&](int stage, int kb) {
    uint8_t* dst = smem + stage * S::kStageBytes + w_dst;
    const bool k_ok = kb * kFp8BlockK + 16 * wj < p.K;  // K % 64 == 0: a chunk is wholly in or out
#pragma unroll
    for (int u = 0; u < kWCopies; ++u) {
      const bool ok = k_ok && n0 + wr0 + 32 * u < p.N;
      cp_async_16(dst + u * 32 * kFp8BlockK,
                  ok ? w_src + static_cast<int64_t>(32 * u) * p.K + kb * kFp8BlockK : p.w, ok ? 16 : 0);
    }
  };
  auto load_x = [&](int stage, int kb) {
    uint8_t* dst = smem + stage * S::kStageBytes + S::kWBytes + x_dst;
    const bool k_ok = kb * kFp8BlockK + 8 * xj < p.K;
#pragma unroll
    for (int u = 0; u < kXCopies; ++u) {
      const bool ok = k_ok && xr0 + 16 * u < p.M;
      cp_async_16(dst + u * 16 * 2 * kFp8BlockK,
                  ok ? x_src + static_cast<int64_t>(16 * u) * p.x_stride + kb * kFp8BlockK : p.x, ok ? 16 : 0);
    }
  };

  // prologue: the first STAGES - 1 k-blocks' W before the PDL wait, their x after it
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s)
    if (s < n_kb) load_w(s, kb0 + s);
  wait_prior_grid();
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < n_kb) load_x(s, kb0 + s);
    cp_async_commit();
  }

  const float* scale_rows[MT];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    const int row = min(n0 + 16 * (MT * warp + m), p.N - 1);
    scale_rows[m] = p.scale + static_cast<int64_t>(row / p.block_n) * p.scale_stride;
  }
  float acc[MT][kTiles][4] = {};
  // 2^60 on W (16 multiplies a 64-column chunk) instead of x (8 a token tile: 64 at 8 tiles); at MT
  // 2 the x form, which fits 255 registers at 8 tiles (W's spilled 24 bytes)
  constexpr bool kUpW = MT == 1;
  for (int it = 0; it < n_kb; ++it) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // stage it % STAGES landed for every thread; stage (it - 1) % STAGES is free
    if (it + STAGES - 1 < n_kb) {
      load_w((it + STAGES - 1) % STAGES, kb0 + it + STAGES - 1);
      load_x((it + STAGES - 1) % STAGES, kb0 + it + STAGES - 1);
    }
    cp_async_commit();
    float sc[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) sc[m] = scale_rows[m][kb0 + it] * kXUp;
    const uint8_t* ws = smem + (it % STAGES) * S::kStageBytes;
    const uint8_t* xs = ws + S::kWBytes;
    float part[MT][kTiles][4] = {};
#pragma unroll
    for (int kc = 0; kc < 2; ++kc) {  // the k-block's two 64-column chunks
      uint32_t lo[MT][8], hi[MT][8];
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        const int r = 16 * (MT * warp + m) + g;  // even g: r and r + 8 have g's parity
        const int pos = 16 * ((4 * kc + c) ^ ((r & 1) << 2));
        e4m3x16_to_bf16_pow2(lds128(ws + r * kFp8BlockK + pos), lo[m]);
        e4m3x16_to_bf16_pow2(lds128(ws + (r + 8) * kFp8BlockK + pos), hi[m]);
        if constexpr (kUpW) {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            lo[m][j] = bf16x2_up(lo[m][j]);
            hi[m][j] = bf16x2_up(hi[m][j]);
          }
        }
      }
      // token tiles in pairs (tiles past M read zeros), the MMAs of the
      // two tiles (and MT m-tiles) alternating, so that no MMA waits on the one just before it
#pragma unroll
      for (int t = 0; t < kTiles; t += 2) {
        uint32_t xb[2][8];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = 8 * (t + h) + g;
          const uint8_t* xrow = xs + r * 2 * kFp8BlockK;
          const uint4 x0 = lds128(xrow + 16 * ((8 * kc + 2 * c) ^ (r & 1)));
          const uint4 x1 = lds128(xrow + 16 * ((8 * kc + 2 * c + 1) ^ (r & 1)));
          const uint32_t xr[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
          for (int j = 0; j < 8; ++j) xb[h][j] = kUpW ? xr[j] : bf16x2_up(xr[j]);
        }
#pragma unroll
        for (int s = 0; s < 4; ++s)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int m = 0; m < MT; ++m)
              mma_bf16_free(part[m][t + h], lo[m][2 * s], hi[m][2 * s], lo[m][2 * s + 1], hi[m][2 * s + 1],
                            xb[h][2 * s], xb[h][2 * s + 1]);
      }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int t = 0; t < kTiles; ++t)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[m][t][r] = fmaf(part[m][t][r], sc[m], acc[m][t][r]);
  }
  cp_async_wait<0>();
  allow_next_grid();
  __syncthreads();  // every warp done with the ring: its memory becomes the sums

  // acc[m][t]: (row g, token 8t + 2c), (g, 8t + 2c + 1), (g + 8, 8t + 2c), (g + 8, 8t + 2c + 1)
  float* sums = reinterpret_cast<float*>(smem);  // [64 tokens][kSumPitch]
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    const int r = 16 * (MT * warp + m) + g;
#pragma unroll
    for (int t = 0; t < kTiles; ++t) {
      sums[(8 * t + 2 * c) * S::kSumPitch + r] = acc[m][t][0];
      sums[(8 * t + 2 * c + 1) * S::kSumPitch + r] = acc[m][t][1];
      sums[(8 * t + 2 * c) * S::kSumPitch + r + 8] = acc[m][t][2];
      sums[(8 * t + 2 * c + 1) * S::kSumPitch + r + 8] = acc[m][t][3];
    }
  }
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every CTA of the row range has its sums in shared memory
  // CTA `rank` of the cluster: the tile's 4-row groups [rank, rank + 1) * kRows / 4 / splits, each
  // thread a (token, group) at a time, its splits' float4s loaded together
  const int rank = static_cast<int>(cluster.block_rank());
  constexpr int kGroups = S::kRows / 4;
  const int q0 = rank * kGroups / p.splits, q1 = (rank + 1) * kGroups / p.splits, width = q1 - q0;
  for (int i = threadIdx.x; i < p.M * width; i += kThreads) {
    const int tok = i / width, r = 4 * (q0 + i % width);
    float4 part[kRows64MaxSplits];
#pragma unroll
    for (int q = 0; q < kRows64MaxSplits; ++q)
      if (q < p.splits)
        part[q] = *reinterpret_cast<const float4*>(cluster.map_shared_rank(sums, q) + tok * S::kSumPitch + r);
    float4 sum = part[0];
#pragma unroll
    for (int q = 1; q < kRows64MaxSplits; ++q)
      if (q < p.splits) {
        sum.x += part[q].x;
        sum.y += part[q].y;
        sum.z += part[q].z;
        sum.w += part[q].w;
      }
    __nv_bfloat16* out = p.y + static_cast<int64_t>(tok) * p.N + n0 + r;
    const float v[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (n0 + r + j < p.N) out[j] = __float2bfloat16_rn(v[j]);
  }
  cluster.sync();  // no CTA leaves while another still reads its shared memory
}

}  // namespace
}  // namespace kimi_ops::sm90
