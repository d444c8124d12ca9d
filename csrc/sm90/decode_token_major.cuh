// M1c, token-major: splitkv_tm_kernel, 24, 32, 48 or 64 query rows a CTA of two warpgroups, wgmma
// with the tokens as M (S^T = K Q^T, O^T = V^T P^T; an fp8 query is staged as f16, exact, and
// takes the same MMAs), and its per-tile pieces.
//
// Tried and removed: S^T for the fp8 query as wgmma m64nNk32 e4m3 (A = K's fp8 bytes straight
// from ldmatrix, no conversion; B = the fp8 Q in core matrices), behind KIMI_OPS_SM90_FP8_WGMMA=1.
// Measured on the H200 (2026-12-03): rel L2 of o <= 2.8e-3 but |dlse| 1.1-1.7e-2 against float64
// over the CTA heights, outside the fp8-query contract (4e-3: the e4m3 wgmma accumulates with
// reduced precision), for at most 10% speed over the f16 staging (issue-27 grid: H12 B32 8k q2
// 75.1 -> 67.9 us, q4 82.5 -> 80.5, q8 136.5 -> 130.9, H96 B64 4k 135.7 -> 132.3), at a longer
// device build (59 s -> 76 s measured with the fp8 query's kernels; the opt-in's own instances: 4,
// this kernel's, one a CTA shape). The code (tm_scores_fp8, stage_query_rows_fp8, the e4m3
// WgmmaRS, the KIMI_OPS_SM90_FP8_WGMMA switch, its test) is at commit fbde174. Again with f32
// promotion every 2 k-chunks (branch s46/fp8-promote, H100 2026-12-06): within 4e-3 at the test
// grid's scales but |dlse| 3.4-3.8e-2 for a 40x larger query (the e4m3 MMA's loss grows with the
// scores), and -3.8% to +1.9% in time.
//
// Byte layouts:
//   reads   q [T*H, 576] bf16 (or fp8 with q_scale [1] f32: kFp8Q); kv [N, 576] fp8 rows
//           (cp.async, 16-byte chunks: TileLoader; or one cp.async.bulk a row: BulkTileLoader,
//           kLoad); kv_indptr / kv_indices int32; seq_lens [R] int32
//   writes  o [valid_rows, 512] bf16 (16-byte stores) and lse [valid_rows] f32 (natural log) at
//           the CTA's rows of o_part / lse_part or o_final / lse_final (work_list.cuh)
//   shared  TokenMajorSmem<NT, STAGES, TILE>: kv[STAGES][TILE * 592] fp8 tiles, q [N * 576] f16
//           (core-matrix layout, fragments.cuh; an fp8 query the same, its bytes converted), p
//           [N * TILE] f16 (core matrices of 8 tokens x 8 rows, tm_store_p), red [TILE / 16][N] f32,
//           row_scale [N] f32, row_fac [N] f32, row_max [N] f32, row_lim [N] int32, full [STAGES]
//           mbarriers (bulk loads); the epilogue stages O [N][kOStride = 520] bf16 in the K ring
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "copy.cuh"
#include "fragments.cuh"
#include "params.cuh"
#include "ptx.cuh"
#include "work_list.cuh"

namespace kimi_ops::sm90 {
namespace {

// ---- M1c, token-major: 24, 32, 48 or 64 query rows a CTA ---------------------------------------
//
// splitkv_tm_kernel: one CTA of two warpgroups (8 warps) per (group of N = 8*NT query rows, split
// or work item), streaming TILE-token tiles (128 for N = 24, 32, 48; 64 for N = 64, whose Q leaves
// no room for two 128-token stages). N = 24 (NT = 3, odd) only with 128-token tiles: 64-token tiles
// split the rows over the warpgroups (NT / 2 n-tiles each), 128-token ones give each all NT. The
// MMAs are wgmma with tokens (and latents) as the 64 M rows and the query rows as N, S^T = K Q^T
// and O^T = V^T P^T. A is always in registers, converted from the tile's fp8 bytes exactly as
// splitkv_kernel builds its fragments; B is in shared memory in wgmma's no-swizzle layout (core
// matrices of 8 x 16 bytes: Q K-major, P MN-major; N / 8 of them along N, any N a multiple of 8).
// Per tile:
//   S^T = K Q^T     TILE 128: warpgroup h takes the tokens [64h, 64h+64) of all N rows, its warp w
//                   the tokens [16w, 16w+16) (M), so each K byte is converted once a CTA;
//                   TILE 64: warpgroup h takes the rows [N/2 h, N/2 (h+1)) of all 64 tokens, warp
//                   w the tokens [16(w%4), +16). A = K (ldmatrix of the fp8 bytes, cvt to f16, with
//                   Q's columns permuted as in stage_query_rows), B = Q (QueryRows, kCoreMatrix),
//                   36 wgmma m64 k16 a warpgroup (n = N, or N/2 at TILE 64); the next tile's copies
//                   are issued between them (TileLoader::load_piece; kCpAsyncHalves: its second
//                   half only, load_piece_second_half)
//   softmax         lazy (kMaxSlack): the tile's row maxima through smem (TILE / 16 token warps)
//                   only when the vote says some row's max rose by more than 2^8, each such row's O
//                   rescale (alpha) to smem; P (f16) to smem, MN-major for B (tm_store_p)
//   O^T += V^T P^T  warp w owns latents [64w, 64w+64) of all N rows: A = V^T (v_token_pairs, as
//                   in tile_pv), B = P, TILE / 4 wgmma m64 nN k16 a warpgroup; kCpAsyncHalves:
//                   once every warp has read the first 64 tokens (a barrier), the tile after
//                   next's first half goes into them (TileLoader::load_first_half)
// O^T's M row g (g + 8) of warp w's m-tile 2s + f is latent 64w + 32s + 4g + 2f (+ 1).

template <int NT, int STAGES, int TILE>
struct TokenMajorSmem {
  static constexpr int kRows = 8 * NT;
  uint8_t kv[STAGES][TILE * kSmemRow];
  __half q[kRows * kRowBytes];  // Q [row][576 permuted columns], core-matrix layout
  __half p[kRows * TILE];       // P, core matrices of 8 tokens x 8 rows (tm_store_p)
  float red[TILE / 16][kRows];  // per token warp: the tile's row maxima; at the end the row sums
  float row_scale[kRows];       // the tile's O rescale per row; at the end kv_scale / l
  float row_fac[kRows];
  float row_max[kRows];   // each row's running max (log2 units), kept by tm_raise_running_max
  int row_lim[kRows];     // the tokens each row sees in the split (CtaWork::row_limit)
  uint64_t full[STAGES];  // bulk loads: the stage's copied rows landed
};

// How a token-major CTA gathers its tiles.
enum class TmLoad {
  kCpAsync,        // every thread copies 16-byte chunks (TileLoader), on cp.async groups
  kBulk,           // one cp.async.bulk of 576 bytes a token row onto the stage's `full` mbarrier
  kCpAsyncHalves,  // as kCpAsync, a 128-token tile by halves (TileLoader<..., kHalves>; 2 stages)
};

// The bulk loads of a token-major CTA: one token row of each tile a lane of the issuing warps (the
// first TILE / 64 warps of each warpgroup), its index fetched a tile ahead. A row past the split is
// zeroed by its lane's stores, not copied (a split's last tile may be half past it: copying a zero
// row from one global address made every CTA read the same L2 lines at once, 25% slower at H12 q2
// B8 8k); an index outside the cache copies g_zero_row.
template <int TILE>
struct BulkTileLoader {
  static constexpr int kWarpsPerWg = TILE / 64;
  const uint8_t* kv;
  const int* idx_base;
  int64_t num_kv_rows;
  int lo, hi, row, next_index;
  bool issuer;

  __device__ __forceinline__ BulkTileLoader(const SplitKVParams& p, const CtaWork& w, int warp, int lane)
      : kv(p.kv), idx_base(p.indices + w.start), num_kv_rows(p.num_kv_rows), lo(w.lo), hi(w.hi) {
    issuer = warp % 4 < kWarpsPerWg;
    row = ((warp / 4) * kWarpsPerWg + warp % 4) * 32 + lane;
    next_index = issuer ? fetch(0) : -1;
  }
  __device__ __forceinline__ int fetch(int t) const {
    const int j = lo + t * TILE + row;
    return j < hi ? idx_base[j] : -1;
  }
  // Tile t into `stage`, completing on `full` (thread 0 posts the tile's copied bytes). The zeroed
  // rows are the caller's to order before their readers (the CTA barrier after `full`'s wait).
  __device__ __forceinline__ void issue(int t, uint8_t* stage, uint64_t* full, bool leader) {
    if (!issuer) return;
    const int first = lo + t * TILE;
    if (leader) mbar_arrive_expect_tx(full, min(hi - first, TILE) * kRowBytes);
    uint8_t* dst = stage + row * kSmemRow;
    if (first + row < hi) {
      const bool ok = next_index >= 0 && next_index < num_kv_rows;
      bulk_copy_g2s(dst, ok ? kv + static_cast<int64_t>(next_index) * kRowBytes : g_zero_row, kRowBytes, full);
      next_index = fetch(t + 1);
    } else {
#pragma unroll
      for (int i = 0; i < kRowBytes / 16; ++i) reinterpret_cast<uint4*>(dst)[i] = make_uint4(0, 0, 0, 0);
      fence_proxy_async_smem();  // before a later bulk copy into the row
    }
  }
};

constexpr int kTmWarps = 8;
// bulk loads: the load_piece that issues the next tile, at QK's k-chunk 2 (0 and 3 measured within
// 1%, H100 2026-12-06)
constexpr int kBulkPiece = 1;
constexpr int kOStride = kLatent + 8;  // bf16 per row of the token-major epilogue's O staging

// S^T over the warpgroup's 64 tokens (the warp's 16: k_lane) and HT n-tiles of query rows (q_desc):
// s[j] holds (token g / g + 8 of the warp, row 8j + 2c + {0, 1}). Each k-chunk's fp8 bytes are
// loaded two chunks ahead (ldmatrix latency off the MMA chain); two chunks' four MMAs are a commit
// group, and waiting for all but the newest group frees the older groups' A registers.
// load_piece(k), k < kLoadPieces, at the start of every other chunk: the next tile's copies
// (TileLoader::load_piece) spread over the MMAs rather than one burst before them.
// before_first_mma(): waits for the previous tile's PV tail (tm_pv), which writes no register or
// smem this reads, so it ran beside the first chunk's loads and conversions. S is first written by
// a wgmma with scale-d 0 (zeroing it before the loop made ptxas serialize the wgmmas, C7515).
template <int HT, class LoadPiece, class BeforeFirstMma>
__device__ __forceinline__ void tm_scores(float (&s)[HT][4], const uint8_t* k_lane, uint64_t q_desc,
                                          LoadPiece&& load_piece, BeforeFirstMma&& before_first_mma) {
  constexpr int kChunks = kRowBytes / 32;
  constexpr int kDist = 2, kBufs = kDist + 1;
  uint32_t kw[kBufs][4];  // (tokens 0-7, bytes 0-15), (8-15, 0-15), (0-7, 16-31), (8-15, 16-31) of a chunk
#pragma unroll
  for (int i = 0; i < kDist; ++i) ldmatrix_x4(kw[i], k_lane + i * 32);
#pragma unroll
  for (int kc = 0; kc < kChunks; ++kc) {
    if (kc % 2 == 0 && kc / 2 < kLoadPieces) load_piece(kc / 2);
    if (kc + kDist < kChunks) ldmatrix_x4(kw[(kc + kDist) % kBufs], k_lane + (kc + kDist) * 32);
    const uint32_t(&w)[4] = kw[kc % kBufs];
    const F16x4 k0 = e4m3x4_to_f16x4(w[0]), k1 = e4m3x4_to_f16x4(w[1]);
    const F16x4 k2 = e4m3x4_to_f16x4(w[2]), k3 = e4m3x4_to_f16x4(w[3]);
    const uint32_t a0[4] = {k0.lo, k1.lo, k0.hi, k1.hi};  // k-step 2kc: Q columns 32kc..32kc+15
    const uint32_t a1[4] = {k2.lo, k3.lo, k2.hi, k3.hi};  // k-step 2kc + 1
    if (kc == 0) before_first_mma();
    wgmma_fence();  // A written: explicit (a fence ptxas inserts itself can serialize the wgmmas)
    WgmmaF16RS<8 * HT>::run(s, a0, q_desc + (kc * 512 >> 4), kc > 0);
    WgmmaF16RS<8 * HT>::run(s, a1, q_desc + ((kc * 512 + 256) >> 4));
    if (kc % 2 == 1 || kc + 1 == kChunks) {
      wgmma_commit();
      wgmma_wait<1>();
    }
  }
  wgmma_wait<0>();
  fence_operands(s);
}

// P (f16) of the thread's S^T elements into P (B of O^T += V^T P^T, K = tokens, N = rows) in
// MN-major core matrices of 8 tokens x 8 rows (rows contiguous: a thread's two rows are one 32-bit
// store): 8-row groups 16 TILE bytes apart, 8-token core matrices 128 bytes apart.
template <int HT, int TILE>
__device__ __forceinline__ void tm_store_p(__half* p_smem, const float (&s)[HT][4], int row0, int tok0, int g, int c) {
#pragma unroll
  for (int j = 0; j < HT; ++j)
#pragma unroll
    for (int e = 0; e < 4; e += 2) {
      const int r = row0 + 8 * j + 2 * c, tok = tok0 + g + 8 * (e >> 1);
      *reinterpret_cast<uint32_t*>(&p_smem[(r / 8) * (8 * TILE) + (tok / 8) * 64 + (tok % 8) * 8 + r % 8]) =
          pack_half2(s[j][e], s[j][e + 1]);
    }
}

// Scale and mask the thread's S^T elements (token tok_base + g + 8 (e / 2) against each row's
// limit; no compares when `whole`: every row sees the whole tile); tile_max: the thread's max of
// each row over its two tokens (reduced over the warp on the slow path only: tm_raise_running_max).
// True when one of them exceeds the row's running max by more than kMaxSlack: the CTA's vote is
// the same as over the reduced maxima.
template <int HT>
__device__ __forceinline__ bool tm_mask_and_max(float (&s)[HT][4], float (&tile_max)[HT][2],
                                                const float (&row_fac)[HT][2], const int (&lim)[HT][2],
                                                const float (&m_run)[HT][2], int tok_base, int g, bool whole) {
#pragma unroll
  for (int j = 0; j < HT; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[j][e] *= row_fac[j][e & 1];
  if (!whole)
#pragma unroll
    for (int j = 0; j < HT; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (tok_base + g + 8 * (e >> 1) >= lim[j][e & 1]) s[j][e] = -INFINITY;
  bool raise = false;
#pragma unroll
  for (int j = 0; j < HT; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tile_max[j][h] = fmaxf(s[j][h], s[j][h + 2]);
      raise |= tile_max[j][h] > m_run[j][h] + kMaxSlack;
    }
  return raise;
}

// The slow path of lazy rescaling (every thread of the CTA): the thread's row maxima
// (tm_mask_and_max) reduced over the warp's lanes of each row, the kTokWarps token warps' maxima
// through red[tq * rows + row] (rows row0 + 8j + 2c + h); then one thread a row (tid < rows)
// raises the row's running max row_max[row] to them and writes the O / l rescale factor to
// row_scale[row]; every thread takes both for its rows (m_run, l_run). The same numbers as each
// thread reducing its own rows over the token warps, in less code: 2 loads a row, not kTokWarps.
template <int HT, int kTokWarps>
__device__ __forceinline__ void tm_raise_running_max(float (&m_run)[HT][2], float (&l_run)[HT][2],
                                                     float (&tile_max)[HT][2], float* red, float* row_max,
                                                     float* row_scale, int rows, int row0, int tq,
                                                     int g, int c, int tid) {
#pragma unroll
  for (int j = 0; j < HT; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int o = 4; o < 32; o <<= 1)
        tile_max[j][h] = fmaxf(tile_max[j][h], __shfl_xor_sync(0xffffffffu, tile_max[j][h], o));
  if (g == 0)
#pragma unroll
    for (int j = 0; j < HT; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) red[tq * rows + row0 + 8 * j + 2 * c + h] = tile_max[j][h];
  __syncthreads();
  if (tid < rows) {
    const float m_old = row_max[tid];
    float mx = m_old;
#pragma unroll
    for (int w = 0; w < kTokWarps; ++w) mx = fmaxf(mx, red[w * rows + tid]);
    row_scale[tid] = fast_exp2(m_old - (mx == -INFINITY ? 0.f : mx));
    row_max[tid] = mx;
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < HT; ++j) {
    const int r = row0 + 8 * j + 2 * c;
    const float2 mx = *reinterpret_cast<const float2*>(&row_max[r]);
    const float2 alpha = *reinterpret_cast<const float2*>(&row_scale[r]);
    m_run[j][0] = mx.x;
    m_run[j][1] = mx.y;
    l_run[j][0] *= alpha.x;
    l_run[j][1] *= alpha.y;
  }
}

// S^T becomes P = 2^(s - m_run), added to l.
template <int HT>
__device__ __forceinline__ void tm_exp(float (&s)[HT][4], const float (&m_run)[HT][2], float (&l_run)[HT][2]) {
#pragma unroll
  for (int j = 0; j < HT; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float m_safe = m_run[j][h] == -INFINITY ? 0.f : m_run[j][h];
      s[j][h] = fast_exp2(s[j][h] - m_safe);
      s[j][h + 2] = fast_exp2(s[j][h + 2] - m_safe);
      l_run[j][h] += s[j][h] + s[j][h + 2];
    }
}

// O^T = alpha O^T + V^T P^T over the tile's TILE tokens, the warp's 64 latents and all NT n-tiles
// of rows (alpha: row_scale, applied when `rescale`; P: p_desc). The first tile's wgmmas write O
// with scale-d 0 (O is not zeroed before the loop: as in tm_scores). The last k-step's wgmma group
// (the PV tail) is left in flight: its A fragments are kept in `tail` until the caller waits for
// it (tm_scores' before_first_mma, or after the loop); it reads P, which the next tile rewrites
// only after every warp has passed that wait and a barrier. after_first_half(): once the warp has
// read the tile's first TILE / 2 tokens (the halves loader refills them from there).
template <int NT, int TILE, class AfterFirstHalf>
__device__ __forceinline__ void tm_pv(float (&acc)[4][NT][4], const uint8_t* tile, uint64_t p_desc,
                                      const float* row_scale, bool rescale, int warp, int g, int c,
                                      uint32_t (&tail)[2][2][4], bool first, AfterFirstHalf&& after_first_half) {
  // CTA-uniform: only a tile that raised some row's running max (tile 0's O is not written yet)
  if (rescale && !first) {
    float2 alpha[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) alpha[j] = *reinterpret_cast<const float2*>(&row_scale[8 * j + 2 * c]);
#pragma unroll
    for (int m = 0; m < 4; ++m)
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        acc[m][j][0] *= alpha[j].x;
        acc[m][j][1] *= alpha[j].y;
        acc[m][j][2] *= alpha[j].x;
        acc[m][j][3] *= alpha[j].y;
      }
  }
#pragma unroll
  for (int m = 0; m < 4; ++m) fence_operands(acc[m]);
  wgmma_fence();
  const uint8_t* v0 = tile + 2 * c * kSmemRow + warp * 64 + 4 * g;
  uint32_t x[2][2][4];  // the words of k-step kk's two latent groups, loaded a k-step ahead
#pragma unroll
  for (int sp = 0; sp < 2; ++sp) v_token_words(v0, sp * 32, x[0][sp]);
#pragma unroll
  for (int kk = 0; kk < TILE / 16; ++kk) {
    if (kk + 1 < TILE / 16)
#pragma unroll
      for (int sp = 0; sp < 2; ++sp) v_token_words(v0 + (kk + 1) * 16 * kSmemRow, sp * 32, x[(kk + 1) % 2][sp]);
#pragma unroll
    for (int sp = 0; sp < 2; ++sp) {
      uint32_t t01[4], t89[4];
      v_token_pairs(x[kk % 2][sp], t01, t89);
      const uint32_t a_even[4] = {t01[0], t01[1], t89[0], t89[1]};  // latents 4g, 4g+1 (rows g, g+8)
      const uint32_t a_odd[4] = {t01[2], t01[3], t89[2], t89[3]};   // latents 4g+2, 4g+3
      if (kk + 1 == TILE / 16)
#pragma unroll
        for (int i = 0; i < 4; ++i) tail[sp][0][i] = a_even[i], tail[sp][1][i] = a_odd[i];
      const int scale_d = kk > 0 || !first;
      wgmma_fence();
      WgmmaF16RS<8 * NT, 1>::run(acc[2 * sp], a_even, p_desc + (kk * 256 >> 4), scale_d);  // tokens 16kk..16kk+15
      WgmmaF16RS<8 * NT, 1>::run(acc[2 * sp + 1], a_odd, p_desc + (kk * 256 >> 4), scale_d);
    }
    wgmma_commit();
    if (kk == TILE / 32 - 1) after_first_half();
    wgmma_wait<1>();
  }
}

// kFp8Q: the fp8 query, staged as f16 (exact: QueryRows<..., kFp8 = true>); the rest is the same.
// kLoad: how the tiles are gathered (TmLoad).
template <int NT, int STAGES, int TILE, bool kFp8Q = false, TmLoad kLoad = TmLoad::kCpAsync>
__global__ void __launch_bounds__(32 * kTmWarps, 1) splitkv_tm_kernel(const SplitKVParams p) {
  static_assert(TILE == 64 || TILE == 128, "64- or 128-token tiles");
  // 64-token tiles: two warpgroups of NT / 2 n-tiles (32..64 rows); 128-token tiles: each
  // warpgroup all NT n-tiles, so also 24 rows (NT = 3)
  static_assert((NT % 2 == 0 && NT >= 4 && NT <= 8) || (NT == 3 && TILE == 128),
                "32, 48, 64 rows, or 24 rows on 128-token tiles");
  using Smem = TokenMajorSmem<NT, STAGES, TILE>;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<Smem*>(smem_raw);
  // kWide (128-token tiles): in S^T = K Q^T warpgroup h takes the tokens [64h, 64h+64) of all rows
  // (K converted once a CTA); else all 64 tokens of the rows [N/2 h, N/2 (h+1))
  constexpr bool kWide = TILE == 128;
  constexpr int kRows = Smem::kRows, kHT = kWide ? NT : NT / 2, kTokWarps = TILE / 16, kThreads = 32 * kTmWarps;
  // kHalves: the two-stage ring of 128-token tiles gathered by halves: tile t + 2's first 64 tokens
  // go into tile t's stage once PV has read them (mid-PV, a CTA barrier), its second half during
  // tile t + 1's QK; up to 1.5 tiles in flight, not 1
  constexpr bool kHalves = kLoad == TmLoad::kCpAsyncHalves, kCp = kLoad != TmLoad::kBulk;
  static_assert(!kHalves || (kWide && STAGES == 2), "halves of 128-token tiles, two stages");

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // the warp's 16 tokens of a tile; the first of the thread's S^T rows (shuffled: the compiler then
  // knows it is warp-uniform and keeps the wgmma descriptors built from it in uniform registers)
  const int tq = kWide ? warp : warp % 4;
  const int half_row0 = kWide ? 0 : __shfl_sync(0xffffffffu, warp / 4, 0) * (kRows / 2);
  const int g = lane / 4, c = lane % 4;
  const int rows_per_req = p.qlen * p.heads;
  const int row0 = blockIdx.x * kRows;
  if (!p.kv_before_wait) wait_prior_grid();
  const CtaWork work = cta_work(p, kRows);
  if (!work.exists) return;
  if (work.ntiles == 0) {
    wait_prior_grid();  // (again: a no-op where it came first) every write after it
    write_empty_split(p, work, tid, kThreads);
    return;
  }
  const int ntiles = (work.ntiles * kTileN + TILE - 1) / TILE;  // the last may be half empty
  // Q loaded and staged before the first tiles' copies where q may be read now (no kv_before_wait):
  // queued behind ~74 KB of copies a CTA, Q's loads landed ~1 us later (H100: the loads first,
  // 48-row calls 1-5% faster); the staging first too, 2-13% more at batch >= 8 and faster than
  // staging between the index fetch and the copies at every batch (H100, 2026-12-06)
  QueryRows<kRows, kTmWarps, kFp8Q, true> qrows;
  if (!p.kv_before_wait) {
    qrows.load(p, work.flat0, work.valid_rows, warp, lane);
    qrows.stage(p, sm.q, sm.row_fac, warp, lane);
  }

  std::conditional_t<kCp, TileLoader<kTmWarps, TILE, kHalves>, BulkTileLoader<TILE>> loader(
      p, work, warp, lane);
  // each row's token limit, one thread a row (every thread computing its own 2 kHT rows', two
  // integer divisions each, was 2-6% of a 32-64-row call, H100 2026-12-06)
  if (tid < kRows) {
    sm.row_lim[tid] = work.row_limit(p, row0 + tid);
    sm.row_max[tid] = -INFINITY;  // the running max the lazy rescaling's slow path keeps (log2 units)
  }
  if constexpr (kCp) {
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      if (s < ntiles) loader.load(s, sm.kv[s]);
      cp_async_commit();
    }
  } else {
    if (tid == 0) {
#pragma unroll
      for (int s = 0; s < STAGES; ++s) mbar_init(&sm.full[s], 1);
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s)
      if (s < ntiles) loader.issue(s, sm.kv[s], &sm.full[s], tid == 0);
  }
  wait_prior_grid();  // q, and every write; with kv_before_wait the first tiles' copies are on their way
  if (p.kv_before_wait) {
    qrows.load(p, work.flat0, work.valid_rows, warp, lane);
    qrows.stage(p, sm.q, sm.row_fac, warp, lane);
  }
  fence_proxy_async_smem();

  // the thread's S^T rows (CTA-relative): half_row0 + 8j + 2c + h
  float m_run[kHT][2], l_run[kHT][2];
#pragma unroll
  for (int j = 0; j < kHT; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m_run[j][h] = -INFINITY;
      l_run[j][h] = 0.f;
    }
  float acc[4][NT][4];              // first written by tile 0's PV (scale-d 0)
  uint32_t pv_tail[2][2][4] = {};  // A fragments of PV's last wgmma group, in flight into the next tile
  auto wait_pv_tail = [&] {
    wgmma_wait<0>();
    keep_alive(pv_tail);
#pragma unroll
    for (int m = 0; m < 4; ++m) fence_operands(acc[m]);
  };

  __syncthreads();  // Q, row_fac and row_lim in smem
  float row_fac[kHT][2];
  int lim[kHT][2];
#pragma unroll
  for (int j = 0; j < kHT; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      row_fac[j][h] = sm.row_fac[half_row0 + 8 * j + 2 * c + h];
      lim[j][h] = sm.row_lim[half_row0 + 8 * j + 2 * c + h];
    }
  // the fewest tokens any of the CTA's rows sees: its first row's (visible_tokens grows with the position)
  const int cta_lim = sm.row_lim[0];
  const int k_lane = (tq * 16 + (lane & 15)) * kSmemRow + (lane >> 4) * 16;
  const uint64_t q_desc = smem_desc(&sm.q[(half_row0 / 8) * kQCoreGroup], 128, kQCoreGroup * 2);
  const uint64_t p_desc = smem_desc(sm.p, 128, 16 * TILE);
  if constexpr (kHalves) {  // tile 1's first half (its indices had Q's staging to land)
    if (1 < ntiles) loader.load_first_half(sm.kv[1]);
    cp_async_commit();
  }

  for (int t = 0; t < ntiles; ++t) {
    if constexpr (kCp)
      cp_async_wait<kHalves ? 1 : STAGES - 2>();  // kHalves: all but tile t + 1's first half
    else
      mbar_wait(&sm.full[t % STAGES], (t / STAGES) & 1);
    // tile t landed (its zeroed rows too); every warp is done with tile t - 1 (its stage, P, row_scale)
    __syncthreads();
    const uint8_t* tile = sm.kv[t % STAGES];
    const int tok_base = work.lo + t * TILE + tq * 16;  // request-relative token of the warp's M row 0
    float s[kHT][4];
    const bool load_next = t + STAGES - 1 < ntiles;
    uint8_t* next_stage = sm.kv[(t + STAGES - 1) % STAGES];
    tm_scores<kHT>(
        s, tile + k_lane, q_desc,
        [&](int piece) {
          if constexpr (kHalves) {
            if (load_next) loader.load_piece_second_half(t + 1, piece, next_stage);
          } else if constexpr (kCp) {
            if (load_next) loader.load_piece(t + STAGES - 1, piece, next_stage);
          } else if (piece == kBulkPiece && load_next) {
            loader.issue(t + STAGES - 1, next_stage, &sm.full[(t + STAGES - 1) % STAGES], tid == 0);
          }
        },
        wait_pv_tail);
    if constexpr (kCp) cp_async_commit();
    float tile_max[kHT][2];
    const bool whole = work.lo + (t + 1) * TILE <= cta_lim;  // no token of the tile is masked
    const bool raise = tm_mask_and_max<kHT>(s, tile_max, row_fac, lim, m_run, tok_base, g, whole);
    const bool rescale = __syncthreads_or(raise);  // also: every warp is done with red, row_scale
    if (rescale)
      tm_raise_running_max<kHT, kTokWarps>(m_run, l_run, tile_max, sm.red[0], sm.row_max, sm.row_scale, kRows,
                                           half_row0, tq, g, c, tid);
    tm_exp<kHT>(s, m_run, l_run);
    tm_store_p<kHT, TILE>(sm.p, s, half_row0, tq * 16, g, c);
    fence_proxy_async_smem();
    __syncthreads();  // P and row_scale
    tm_pv<NT, TILE>(acc, tile, p_desc, sm.row_scale, rescale, warp, g, c, pv_tail, t == 0, [&] {
      if constexpr (kHalves) {
        __syncthreads();  // every warp has read the tile's first half
        if (t + 2 < ntiles) loader.load_first_half(sm.kv[t % STAGES]);
        cp_async_commit();
      }
    });
  }
  wait_pv_tail();
  if constexpr (kCp) cp_async_wait<0>();
  allow_next_grid();

  // --- epilogue: row sums over the lanes and the token warps; lse; O^T / l staged in smem as
  // O [row][kOStride] bf16, then 16-byte stores of the valid rows
#pragma unroll
  for (int j = 0; j < kHT; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int o = 4; o < 32; o <<= 1) l_run[j][h] += __shfl_xor_sync(0xffffffffu, l_run[j][h], o);
  __syncthreads();  // every warp is done with the tiles, red and row_scale
  if (g == 0) {
#pragma unroll
    for (int j = 0; j < kHT; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) sm.red[tq][half_row0 + 8 * j + 2 * c + h] = l_run[j][h];
  }
  __syncthreads();
  // one thread a row: short code (4 lanes of warp 0 taking 12 unrolled rows each cost 3-11% of a
  // 48-row call, H100 2026-12-06)
  if (tid < kRows) {
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < kTokWarps; ++w) l += sm.red[w][tid];
    sm.row_scale[tid] = l > 0.f ? p.kv_scale / l : 0.f;
    if (row0 + tid < rows_per_req) work.lse_out(p)[tid] = l > 0.f ? (sm.row_max[tid] + log2f(l)) * kLn2 : -INFINITY;
  }
  __syncthreads();
  __nv_bfloat16* o_stage = reinterpret_cast<__nv_bfloat16*>(sm.kv[0]);
  static_assert(kRows * kOStride * 2 <= STAGES * TILE * kSmemRow, "O staging must fit the K ring");
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const float inv0 = sm.row_scale[8 * j + 2 * c], inv1 = sm.row_scale[8 * j + 2 * c + 1];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int lat = warp * 64 + (m / 2) * 32 + 4 * g + 2 * (m % 2);
      __nv_bfloat16* dst = &o_stage[(8 * j + 2 * c) * kOStride + lat];
      *reinterpret_cast<__nv_bfloat162*>(dst) = __floats2bfloat162_rn(acc[m][j][0] * inv0, acc[m][j][2] * inv0);
      *reinterpret_cast<__nv_bfloat162*>(dst + kOStride) =
          __floats2bfloat162_rn(acc[m][j][1] * inv1, acc[m][j][3] * inv1);
    }
  }
  __syncthreads();
  uint4* o_out = reinterpret_cast<uint4*>(work.o_out(p));
  constexpr int kChunksPerRow = kLatent / 8;
  for (int i = tid; i < work.valid_rows * kChunksPerRow; i += kThreads)
    o_out[i] = *reinterpret_cast<const uint4*>(&o_stage[(i / kChunksPerRow) * kOStride + (i % kChunksPerRow) * 8]);
}

}  // namespace
}  // namespace kimi_ops::sm90
