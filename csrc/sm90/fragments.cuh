// Pieces both M1c kernels use: the query rows staged in shared memory (QueryRows, stage_query_rows;
// the fp8 query's as f16), V^T fragments built from a K tile's fp8 bytes
// (v_token_words / v_token_pairs), and the cp.async tile gatherer (TileLoader, the token-major
// kernel's loads).
//
// Byte layouts:
//   reads   q [T*H, 576] bf16 (a row = 1152 bytes, 9 words a lane) or fp8 (576 bytes, 4.5 words a
//           lane) and q_scale [1] f32, kv [N, 576] fp8 rows, kv_indices
//   writes  Q in shared memory as f16: row r, permuted column k at q_smem[r * kQStride + k]
//           (kQStride = 584 halves, 1168 bytes), or with kCoreMatrix wgmma's no-swizzle K-major
//           core matrices (8 rows x 8 columns = 128 bytes; K-adjacent ones 128 bytes apart,
//           8-row groups kQCoreGroup = 4608 halves apart); row_fac [rows] f32 (an fp8 Q the same,
//           its bytes converted to f16)
//           K tiles: token row j at stage + j * kSmemRow (592 bytes), 576 bytes of the cache row
//           (zero-filled past the split or for an index outside the cache), 16 bytes of padding
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "copy.cuh"
#include "params.cuh"
#include "ptx.cuh"
#include "work_list.cuh"

namespace kimi_ops::sm90 {
namespace {

// Query rows r = first, first + kStep, ... (< kRows) of the CTA, one warp a row: bf16 -> f16 scaled
// by 2^k into [2^14, 2^15) (exact), columns permuted inside each 16-column chunk so that ldmatrix's
// A fragment pairs physical columns (4c, 4c+1) and (4c+2, 4c+3), the pairs the K fragment gets
// from one 32-bit word of fp8 bytes; row_fac[r] = qk_scale_log2 * 2^-k. Row r, permuted column k
// is q_smem[r * kQStride + k], or with kCoreMatrix wgmma's no-swizzle K-major layout: core
// matrices of 8 rows x 8 columns (128 bytes), K-adjacent ones 128 bytes apart (lbo), 8-row groups
// kQCoreGroup halves apart (sbo).
constexpr int kQCoreGroup = 8 * kRowBytes;  // f16 per 8-row group of the core-matrix layout

// The permuted column of physical column col (even) of a query row, and where the f16 pair of
// (row r, that column) goes in q_smem.
template <bool kCoreMatrix>
__device__ __forceinline__ int query_pair_at(int r, int col) {
  const int within = col % 16, c4 = within / 4;
  const int scol = col - within + ((within % 4) == 0 ? 2 * c4 : 8 + 2 * c4);
  return kCoreMatrix ? (r / 8) * kQCoreGroup + (scol / 8) * 64 + (r % 8) * 8 + scol % 8 : r * kQStride + scol;
}

// The query rows r = first, first + kStep, ... (< kRows) of a warp, in two steps so a kernel can
// put the loads where it likes: load() into registers, every row before any is converted (one
// memory round trip a warp), and stage(): the conversion above (kFp8: each e4m3 byte to f16, as
// stage_query_rows says), the stores to q_smem and row_fac.
template <int kRows, int kStep, bool kFp8, bool kCoreMatrix = false>
struct QueryRows {
  static_assert(kRows % kStep == 0, "the same number of rows a warp");
  static constexpr int kPerWarp = kRows / kStep;
  // query_pair_at(r, 2 (lane + 32 j)) = query_pair_at(r, 2 lane) + j kPairStride: 64 more columns
  // keep col % 16 (the permutation) and move 8 core matrices (512 halves) or 64 halves. One base
  // a row and constant offsets: ~5 IMAD a pair fewer; mla_decode 0.7-6% faster at 32-96
  // rows (token-major) on an H100 (docs/perf-history.md "Session 46")
  static constexpr int kPairStride = kCoreMatrix ? 512 : 64;
  uint32_t w[kPerWarp][9];  // row first + i kStep: the bf16 (fp8) pair at physical columns 2 (lane + 32 j)

  __device__ __forceinline__ void load(const SplitKVParams& p, int64_t flat0, int valid_rows, int first, int lane) {
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) {
      const int r = first + i * kStep;
      if constexpr (kFp8) {
        const uint8_t* row = reinterpret_cast<const uint8_t*>(p.q) + (flat0 + r) * kRowBytes;
        const uint16_t* src = reinterpret_cast<const uint16_t*>(row);
#pragma unroll
        for (int j = 0; j < 9; ++j) w[i][j] = r < valid_rows ? src[lane + 32 * j] : 0u;
      } else {
        const uint32_t* src = reinterpret_cast<const uint32_t*>(p.q + (flat0 + r) * kRowBytes);
#pragma unroll
        for (int j = 0; j < 9; ++j) w[i][j] = r < valid_rows ? src[lane + 32 * j] : 0u;
      }
    }
  }

  __device__ __forceinline__ void stage(const SplitKVParams& p, __half* q_smem, float* row_fac, int first, int lane) {
    if constexpr (kFp8) {
      const float fac = p.qk_scale_log2 * *p.q_scale;
#pragma unroll
      for (int i = 0; i < kPerWarp; ++i) {
        const int r = first + i * kStep;
        __half* const at = q_smem + query_pair_at<kCoreMatrix>(r, 2 * lane);
#pragma unroll
        for (int j = 0; j < 9; ++j)
          *reinterpret_cast<uint32_t*>(at + j * kPairStride) = e4m3x4_to_f16x4(w[i][j]).lo;
        if (lane == 0) row_fac[r] = fac;
      }
    } else {
#pragma unroll
      for (int i = 0; i < kPerWarp; ++i) {
        const int r = first + i * kStep;
        float2 v[9];
        float amax = 0.f;
#pragma unroll
        for (int j = 0; j < 9; ++j) {
          v[j] = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&w[i][j]));
          amax = fmaxf(amax, fmaxf(fabsf(v[j].x), fabsf(v[j].y)));
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
        // amax = m 2^e, m in [0.5, 1), e from the exponent bits (frexpf's and ldexpf's code was
        // 1-6% of a call, H100 2026-12-06; a subnormal amax reads e = -126, and its k clamps to
        // 100 as a smaller e's does); 2^k and 2^-k are normal floats: the products are ldexpf's
        const int e = static_cast<int>(__float_as_uint(amax) >> 23) - 126;
        const int k = amax > 0.f ? max(-100, min(100, kQExp + 1 - e)) : 0;
        const float up = __uint_as_float(static_cast<uint32_t>(127 + k) << 23);
        __half* const at = q_smem + query_pair_at<kCoreMatrix>(r, 2 * lane);
#pragma unroll
        for (int j = 0; j < 9; ++j)
          *reinterpret_cast<uint32_t*>(at + j * kPairStride) = pack_half2(v[j].x * up, v[j].y * up);
        if (lane == 0) row_fac[r] = p.qk_scale_log2 * __uint_as_float(static_cast<uint32_t>(127 - k) << 23);
      }
    }
  }
};

// Row by row (QueryRows of one row a warp, a memory round trip each), for splitkv_kernel, whose
// consumers start with few registers to spare (its 3-stage instance spills more with a warp's rows
// loaded at once, and the 16-row kernel measured no faster with them, H100 2026-12-06). kFp8: the
// fp8 query for the f16 MMAs (sm_90's mma.sync m16n8k32 e4m3 is emulated: ptxas turns it into f16
// HMMA plus conversions of both operands every tile), each e4m3 byte to f16 (exact, no scaling
// needed: |e4m3| <= 448, its smallest subnormal 2^-9) in the same permuted layout; row_fac[r] =
// qk_scale_log2 * q_scale (read on the device, so a graph replays a new scale).
template <int kRows, int kStep, bool kFp8, bool kCoreMatrix = false>
__device__ __forceinline__ void stage_query_rows(const SplitKVParams& p, __half* q_smem, float* row_fac,
                                                 int64_t flat0, int valid_rows, int first, int lane) {
  for (int r = first; r < kRows; r += kStep) {
    QueryRows<kStep, kStep, kFp8, kCoreMatrix> row;
    row.load(p, flat0, valid_rows, r, lane);
    row.stage(p, q_smem, row_fac, r, lane);
  }
}

// V^T fragments of four latents from the K tile's bytes, in two steps so the loads can go out a
// step ahead: v_token_words loads, from v + off = token 2c's byte of latent 4g (token rows kSmemRow
// apart), the 32-bit words of tokens 2c, 2c+1, 2c+8, 2c+9; v_token_pairs byte-permutes them (prmt)
// into (token, token+1) pairs and converts: t01[j] = f16x2 of latent 4g+j at tokens (2c, 2c+1),
// t89[j] the same at (2c+8, 2c+9). No second pass over the tile, no transpose in memory.
__device__ __forceinline__ void v_token_words(const uint8_t* v, int off, uint32_t (&x)[4]) {
  x[0] = lds32(v + off);                 // token 2c
  x[1] = lds32(v + kSmemRow + off);      // token 2c+1
  x[2] = lds32(v + 8 * kSmemRow + off);  // token 2c+8
  x[3] = lds32(v + 9 * kSmemRow + off);  // token 2c+9
}
__device__ __forceinline__ void v_token_pairs(const uint32_t (&x)[4], uint32_t (&t01)[4], uint32_t (&t89)[4]) {
  const uint32_t lo01 = prmt(x[0], x[1], 0x5140), hi01 = prmt(x[0], x[1], 0x7362);
  const uint32_t lo23 = prmt(x[2], x[3], 0x5140), hi23 = prmt(x[2], x[3], 0x7362);
  const F16x4 l01 = e4m3x4_to_f16x4(lo01), h01 = e4m3x4_to_f16x4(hi01);
  const F16x4 l23 = e4m3x4_to_f16x4(lo23), h23 = e4m3x4_to_f16x4(hi23);
  t01[0] = l01.lo, t01[1] = l01.hi, t01[2] = h01.lo, t01[3] = h01.hi;
  t89[0] = l23.lo, t89[1] = l23.hi, t89[2] = h23.lo, t89[3] = h23.hi;
}

// Gathers a split's 64-token tiles into a shared-memory ring with cp.async (16-byte chunks,
// zero-filled past the split's end or for an index outside the cache). Warp w gathers tokens
// [kLoadRows*w, kLoadRows*(w+1)) of a tile, 8 lanes a token row: in pass m lane l copies 16-byte
// chunks l % 8, + 8, ... of row 4m + l / 8, so each copy instruction takes whole 128-byte lines of
// 4 rows (measured: 2 lanes a row, 32 bytes of each of 16 rows an instruction, ran at 55% of this
// rate from HBM). Each lane fetches its rows' indices one tile ahead (their latency hides behind a
// tile of compute) and computes their addresses once a tile.
// kHalves: a tile gathered by halves of kTile / 2 tokens (load_first_half, load_piece_second_half):
// warp w's passes 0 .. kPasses/2 - 1 take its kLoadRows / 2 rows of the first half, the rest the
// same rows of the second.
template <int kWarps, int kTile = kTileN, bool kHalves = false>
struct TileLoader {
  static constexpr int kLoadRows = kTile / kWarps;
  static constexpr int kPasses = kLoadRows / 4;
  static constexpr int kHalfPasses = kPasses / 2;
  static constexpr int kChunks = kRowBytes / 16;
  static_assert(kLoadRows % 4 == 0, "a warp loads whole passes of 4 rows");
  static_assert(!kHalves || kPasses % 2 == 0, "a half is whole passes");
  const uint8_t* kv_lane;  // kv + the lane's 16-byte chunk within a row
  const int* idx_base;
  int64_t num_kv_rows;
  int lo, hi, load_row, load_chunk;
  int next_index[kPasses];  // pass m's row; from the tile's first copy on (resolve) < 0 if zero-filled

  __device__ __forceinline__ TileLoader(const SplitKVParams& p, const CtaWork& w, int warp, int lane)
      : idx_base(p.indices + w.start), num_kv_rows(p.num_kv_rows), lo(w.lo), hi(w.hi),
        load_row(warp * (kHalves ? kLoadRows / 2 : kLoadRows) + lane / 8), load_chunk(lane % 8) {
    // through a mov the compiler cannot see into, so kv_lane stays one register pair (it had split
    // it back into kv and the chunk offset and added kv at every copy)
    asm("mov.b64 %0, %1;" : "=l"(kv_lane) : "l"(p.kv + load_chunk * 16));
    fetch_indices(0);
  }
  // the tile row of pass m
  __device__ __forceinline__ int row(int m) const {
    return kHalves ? load_row + 4 * (m % kHalfPasses) + (m / kHalfPasses) * (kTile / 2) : load_row + 4 * m;
  }
  __device__ __forceinline__ void fetch_indices(int t) {
#pragma unroll
    for (int m = 0; m < kPasses; ++m) {
      const int j = lo + t * kTile + row(m);
      next_index[m] = j < hi ? idx_base[j] : -1;  // past the split (or its last tile): zero-filled
    }
  }
  // Tile t into `stage` (a [kTile][kSmemRow] byte ring slot), then tile t + 1's indices: at
  // once (load: row pass by row pass, each pass's copies back to back; chunk by chunk measured
  // slower for splitkv_kernel, docs/PERF.md session 10) or in kLoadPieces parts spread over the
  // caller's MMAs (load_piece: piece k issues copy k of every pass). kHalves: the same over one
  // half's passes, the first half at once (load_first_half: no index fetch) and the second in
  // pieces (load_piece_second_half). The index loads go out after the copies have consumed
  // next_index, so they land in its registers (fetched before the copies, ptxas moved each into
  // next_index right away: a wait for the load).
  __device__ __forceinline__ void load(int t, uint8_t* stage) {
    load_passes<0, kPasses>(stage);
    fetch_indices(t + 1);
  }
  __device__ __forceinline__ void load_piece(int t, int k, uint8_t* stage) { load_passes_piece<0, kPasses>(t, k, stage); }
  __device__ __forceinline__ void load_first_half(uint8_t* stage) {
    static_assert(kHalves, "a loader by halves");
    load_passes<0, kHalfPasses>(stage);
  }
  __device__ __forceinline__ void load_piece_second_half(int t, int k, uint8_t* stage) {
    static_assert(kHalves, "a loader by halves");
    load_passes_piece<kHalfPasses, kPasses>(t, k, stage);
  }
  // passes [M0, M1) of the tile whose indices next_index holds, pass by pass
  template <int M0, int M1>
  __device__ __forceinline__ void load_passes(uint8_t* stage) {
    resolve(M0, M1);
#pragma unroll
    for (int m = M0; m < M1; ++m)
#pragma unroll
      for (int k = 0; k < kLoadPieces; ++k) copy(m, k, stage);
  }
  // copy k of passes [M0, M1); after the last piece, tile t + 1's indices
  template <int M0, int M1>
  __device__ __forceinline__ void load_passes_piece(int t, int k, uint8_t* stage) {
    if (k == 0) resolve(M0, M1);
#pragma unroll
    for (int m = M0; m < M1; ++m) copy(m, k, stage);
    if (k == kLoadPieces - 1) fetch_indices(t + 1);
  }
  // An index outside the cache to -1, once a tile before its first copy, so that each copy is an
  // address and a sign test (with the bounds checked at every copy, ptxas recomputed them and the
  // address at each of the kLoadPieces pieces: ~30 instructions a piece, the token-major tile loop
  // 1429 -> 1252 SASS instructions at 48 rows without them)
  __device__ __forceinline__ void resolve(int first, int end) {
#pragma unroll
    for (int m = first; m < end; ++m)
      if (next_index[m] >= num_kv_rows) next_index[m] = -1;
  }
  // pass m's copy k: 16-byte chunk 8k + load_chunk of row(m) (zero-filled for idx < 0: the copy
  // reads nothing, its out-of-range address unused)
  __device__ __forceinline__ void copy(int m, int k, uint8_t* stage) const {
    const int idx = next_index[m];
    if (k < kChunks / 8 || load_chunk < kChunks % 8)
      cp_async_16_unless_negative(stage + row(m) * kSmemRow + load_chunk * 16 + k * 128,
                                  kv_lane + static_cast<int64_t>(idx) * kRowBytes + k * 128, idx);
  }
};

}  // namespace
}  // namespace kimi_ops::sm90
