// M1c, 16 query rows a CTA: splitkv_kernel (4 compute warps sharing one 16-row m-tile, a
// producer warp, mma.sync m16n8k16 f16; an fp8 query is staged as f16, exact) and its per-tile
// pieces.
//
// Byte layouts:
//   reads   q [T*H, 576] bf16 (or fp8 with q_scale [1] f32: kFp8Q); kv [N, 576] fp8 rows (one
//           cp.async.bulk of 576 bytes a token row); kv_indptr / kv_indices int32; seq_lens [R] int32
//   writes  o [valid_rows, 512] bf16 (16-byte stores) and lse [valid_rows] f32 (natural log) at
//           the CTA's rows of o_part / lse_part ([S, T*H] or the work list's [W, qlen*H]) or of
//           o_final / lse_final (work_list.cuh: CtaWork::o_out, lse_out)
//   shared  SplitKVSmem<STAGES>: kv[STAGES][64 * 592] fp8 tiles, q [16 * 584] f16 (permuted
//           columns; an fp8 query the same, its bytes converted), p [16 * 72] f16
//           (P rows), red [4][16] f32, row_fac [16] f32, row_lim [16] int32, the full / empty_lo /
//           empty_hi mbarriers; the epilogue stages O [16][512] bf16 in kv[0]
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "copy.cuh"
#include "fragments.cuh"
#include "params.cuh"
#include "ptx.cuh"
#include "work_list.cuh"

namespace kimi_ops::sm90 {
namespace {

template <int STAGES>
struct SplitKVSmem {
  uint8_t kv[STAGES][kTileN * kSmemRow];
  __half q[16 * kQStride];
  __half p[16 * kPStride];
  float red[kWarpsPerM][16];
  float row_fac[16];
  int row_lim[16];            // the tokens each row sees in the split (CtaWork::row_limit)
  uint64_t full[STAGES];      // the stage's 64 rows landed (bulk copies)
  uint64_t empty_lo[STAGES];  // tokens 0-31 of the stage read by every compute thread
  uint64_t empty_hi[STAGES];  // tokens 32-63 read
};

// The thread's two query rows' online-softmax state, and O = 0.
__device__ __forceinline__ void init_row_state(float (&m_run)[2], float (&l_run)[2], float (&acc)[16][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    m_run[h] = -INFINITY;
    l_run[h] = 0.f;
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
}

// S = Q K^T over the warp's 16 tokens of a tile: s[nt] holds (row g / g+8, token nt*8 + 2c + {0,1}).
// Four independent accumulators per n-tile (k-step mod 4) keep the MMA chains short.
// Q's A fragments of the first kQRegSteps k-steps stay in registers (q_reg, loaded once a CTA), the
// rest are ldmatrix'd from smem every tile: Q was half the shared-memory wavefronts a tile.
__device__ __forceinline__ void tile_scores(float (&s)[2][4], const uint8_t* tile, const __half* q_lane,
                                            const uint32_t (&q_reg)[kQRegSteps][4], int wq, int lane) {
  float s4[4][2][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) s4[i][nt][0] = s4[i][nt][1] = s4[i][nt][2] = s4[i][nt][3] = 0.f;
  const uint8_t* k_lane = tile + (wq * 16 + (lane & 15)) * kSmemRow + (lane >> 4) * 16;
#pragma unroll
  for (int kc = 0; kc < kRowBytes / 32; ++kc) {
    uint32_t kw[4];  // (nt 0, k-step 2kc), (nt 1, 2kc), (nt 0, 2kc+1), (nt 1, 2kc+1)
    ldmatrix_x4(kw, k_lane + kc * 32);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int ks = 2 * kc + half;
      uint32_t a[4];
      if (ks < kQRegSteps) {  // (ks is a constant once unrolled; the index guard is for the other branch)
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = q_reg[ks < kQRegSteps ? ks : 0][i];
      } else {
        ldmatrix_x4(a, q_lane + ks * 16);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const F16x4 b = e4m3x4_to_f16x4(kw[2 * half + nt]);
        mma_f16(s4[ks % 4][nt], a, b.lo, b.hi);
      }
    }
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) s[nt][i] = (s4[0][nt][i] + s4[1][nt][i]) + (s4[2][nt][i] + s4[3][nt][i]);
}

// Scale and mask the warp's scores (token tok_base + nt*8 + 2c + e against each row's limit);
// tile_max[h]: the warp's max of row g + 8h over its 16 tokens (the quad's max).
__device__ __forceinline__ void tile_mask_and_max(float (&s)[2][4], const float (&row_fac)[2], const int (&lim)[2],
                                                  int tok_base, int c, float (&tile_max)[2]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int tok = tok_base + nt * 8 + 2 * c + e;
        float v = s[nt][2 * h + e] * row_fac[h];
        v = tok < lim[h] ? v : -INFINITY;
        s[nt][2 * h + e] = v;
        mx = fmaxf(mx, v);
      }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    tile_max[h] = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  }
}

// The running max of rows g and g + 8 raised to the tile's (every warp's max published in
// red[w * red_stride + row] for the 4 warps of the m-tile), l and O rescaled to it.
__device__ __forceinline__ void raise_running_max(float (&m_run)[2], float (&l_run)[2], float (&acc)[16][4],
                                                  const float* red, int red_stride, int g) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = m_run[h];
#pragma unroll
    for (int w = 0; w < kWarpsPerM; ++w) mx = fmaxf(mx, red[w * red_stride + g + 8 * h]);
    const float alpha = fast_exp2(m_run[h] - (mx == -INFINITY ? 0.f : mx));
    m_run[h] = mx;
    l_run[h] *= alpha;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      acc[j][2 * h] *= alpha;
      acc[j][2 * h + 1] *= alpha;
    }
  }
}

// s becomes P = 2^(s - m_run) (lazy rescaling: kMaxSlack), added to l; P (f16) goes to p_rows
// (row, token within the tile).
__device__ __forceinline__ void tile_softmax(float (&s)[2][4], const float (&m_run)[2], float (&l_run)[2],
                                             __half* p_rows, int wq, int g, int c) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const float m_safe = m_run[h] == -INFINITY ? 0.f : m_run[h];
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pv = fast_exp2(s[nt][2 * h + e] - m_safe);
        s[nt][2 * h + e] = pv;
        sum += pv;
      }
    l_run[h] += sum;
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<uint32_t*>(&p_rows[(g + 8 * h) * kPStride + wq * 16 + nt * 8 + 2 * c]) =
          pack_half2(s[nt][2 * h], s[nt][2 * h + 1]);
}

// O += P V over the tile's 64 tokens and the warp's 128 columns. acc[4*grp + j] column n (0..7)
// is latent wq*128 + grp*32 + 4n + j. V^T's fragments come from the K tile (v_token_pairs).
// The thread arrives on low_half_read before the third k-step: its reads of tokens 0-31 are issued
// (QK read them in warps 0-1, before the P barrier).
__device__ __forceinline__ void tile_pv(float (&acc)[16][4], const uint8_t* tile, const __half* p_lane, int wq, int g,
                                        int c, uint64_t* low_half_read) {
#pragma unroll
  for (int kk = 0; kk < kTileN / 16; ++kk) {
    if (kk == 2) mbar_arrive(low_half_read);
    uint32_t pa[4];
    ldmatrix_x4(pa, p_lane + kk * 16);
    const uint8_t* v0 = tile + (kk * 16 + 2 * c) * kSmemRow + wq * 128 + 4 * g;
#pragma unroll
    for (int grp = 0; grp < 4; ++grp) {
      uint32_t x[4], b01[4], b89[4];  // latents 4g+j at tokens (2c, 2c+1) and (2c+8, 2c+9)
      v_token_words(v0, grp * 32, x);
      v_token_pairs(x, b01, b89);
#pragma unroll
      for (int j = 0; j < 4; ++j) mma_f16(acc[grp * 4 + j], pa, b01[j], b89[j]);
    }
  }
}

// ---- M1c, 16 rows a CTA ------------------------------------------------------------------------
//
// splitkv_kernel: 8 warps. Warps 0-3 (consumers) compute; the second warpgroup gives its registers
// to them (setmaxnreg: kProducerRegs each, the consumers kConsumerRegs) and one of its warps (the
// producer) gathers the tiles: one cp.async.bulk of 576 bytes a token row onto the stage's `full`
// mbarrier (a row past the split or outside the cache is copied from g_zero_row). The consumers
// wait on `full` and release the stage by halves: tokens 0-31 on `empty_lo` once PV's first two
// k-steps have read them, tokens 32-63 on `empty_hi` after PV, so the producer refills the first
// half half a PV sooner. Every consumer thread arrives (an arrive releases only the thread's own
// reads: one lane's arrive after __syncwarp left the other lanes' reads unordered before the
// producer's next copy, racecheck's WAR hazards). The consumers synchronize among themselves on
// named barrier 1; the other three warps of the second warpgroup exit.
constexpr int kSplitKVThreads = 256;
constexpr int kConsumerRegs = 232, kProducerRegs = 24;
// setmaxnreg.inc waits until the CTA's pool has the registers: two CTAs a SM of 256 threads launch
// with 128 a thread, so the two warpgroups' counts must sum to at most 256
static_assert(kConsumerRegs + kProducerRegs <= 2 * (65536 / (2 * kSplitKVThreads)),
              "setmaxnreg counts exceed the CTA's register pool");

// kFp8Q: the fp8 query, staged as f16 (stage_query_rows<..., kFp8 = true>); the rest is the same.
template <int STAGES, bool kFp8Q = false>
__global__ void __launch_bounds__(kSplitKVThreads, 2) splitkv_kernel(const SplitKVParams p) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<SplitKVSmem<STAGES>*>(smem_raw);
  constexpr int kRows = 16;
  constexpr int kWarps = kWarpsPerM;  // consumers
  constexpr int kThreads = 32 * kWarps;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, c = lane % 4;
  const int rows_per_req = p.qlen * p.heads;
  const int row0 = blockIdx.x * kRows;  // first row of this CTA within its request
  if (!p.kv_before_wait) wait_prior_grid();
  const CtaWork work = cta_work(p, kRows);
  if (!work.exists) return;
  const int lo = work.lo, ntiles = work.ntiles, valid_rows = work.valid_rows;
  const int64_t flat0 = work.flat0;
  if (ntiles == 0) {  // an empty split: the slot goes to the next CTA at once
    wait_prior_grid();  // (again: a no-op where it came first) every write after it
    write_empty_split(p, work, tid, kSplitKVThreads);
    return;
  }
  if (tid == 0) {
#pragma unroll
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&sm.full[s], 1);
      mbar_init(&sm.empty_lo[s], kThreads);
      mbar_init(&sm.empty_hi[s], kThreads);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp >= kWarps) {  // ---- the second warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs) : "memory");
    // the producer's scheduler (warp % 4) varies with the work item, so two CTAs of a SM rarely share it
    if (warp != kWarps + static_cast<int>(blockIdx.y % 4)) return;
    // lane l copies token rows l and l + 32 of each tile; their indices are fetched a tile ahead
    const int* idx_base = p.indices + work.start;
    auto row_index = [&](int t, int m) {  // -1 past the split
      const int j = lo + t * kTileN + lane + 32 * m;
      return j < work.hi ? idx_base[j] : -1;
    };
    int next[2] = {row_index(0, 0), row_index(0, 1)};
    for (int t = 0; t < ntiles; ++t) {
      const int s = t % STAGES;
      const uint8_t* src[2];
#pragma unroll
      for (int m = 0; m < 2; ++m) {
        const bool ok = next[m] >= 0 && next[m] < p.num_kv_rows;
        src[m] = ok ? p.kv + static_cast<int64_t>(next[m]) * kRowBytes : g_zero_row;
        next[m] = row_index(t + 1, m);
      }
      const uint32_t parity = ((t / STAGES) - 1) & 1;
      if (t >= STAGES) mbar_wait(&sm.empty_lo[s], parity);
      if (lane == 0) mbar_arrive_expect_tx(&sm.full[s], kTileN * kRowBytes);
      __syncwarp();
      bulk_copy_g2s(sm.kv[s] + lane * kSmemRow, src[0], kRowBytes, &sm.full[s]);
      if (t >= STAGES) mbar_wait(&sm.empty_hi[s], parity);
      bulk_copy_g2s(sm.kv[s] + (lane + 32) * kSmemRow, src[1], kRowBytes, &sm.full[s]);
    }
    return;
  }

  // ---- consumers
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs) : "memory");
  wait_prior_grid();  // q, and every write; with kv_before_wait the producer's copies are on their way
  const int wq = warp;
  stage_query_rows<kRows, kWarps, kFp8Q>(p, sm.q, sm.row_fac, flat0, valid_rows, warp, lane);
  // each row's token limit (the tokens it sees, capped at the split's end), one thread a row, not
  // every thread its 2 (integer divisions each): B1 / B4 -1.1 to -1.9% on an H100, splitkv_kernel<2>
  // 3392 -> 3232 SASS instructions with QueryRows' addresses (docs/perf-history.md "Session 46")
  if (tid < kRows) sm.row_lim[tid] = work.row_limit(p, row0 + tid);
  float m_run[2], l_run[2];
  float acc[16][4];
  init_row_state(m_run, l_run, acc);
  named_sync<kThreads>();  // Q, row_fac and row_lim in smem
  const int lim[2] = {sm.row_lim[g], sm.row_lim[g + 8]};
  const float row_fac[2] = {sm.row_fac[g], sm.row_fac[g + 8]};
  const __half* q_lane = &sm.q[(lane & 15) * kQStride + (lane >> 4) * 8];
  uint32_t q_reg[kQRegSteps][4];
#pragma unroll
  for (int ks = 0; ks < kQRegSteps; ++ks) ldmatrix_x4(q_reg[ks], q_lane + ks * 16);
  const __half* p_lane = &sm.p[(lane & 15) * kPStride + (lane >> 4) * 8];

  for (int t = 0; t < ntiles; ++t) {
    const int s_idx = t % STAGES;
    mbar_wait(&sm.full[s_idx], (t / STAGES) & 1);
    const uint8_t* tile = sm.kv[s_idx];
    const int tok_base = lo + t * kTileN + wq * 16;  // request-relative token of this warp's first row

    float s[2][4], tile_max[2];
    tile_scores(s, tile, q_lane, q_reg, wq, lane);
    tile_mask_and_max(s, row_fac, lim, tok_base, c, tile_max);
    const bool raise = tile_max[0] > m_run[0] + kMaxSlack || tile_max[1] > m_run[1] + kMaxSlack;
    if (named_sync_or<kThreads>(raise)) {  // also: every consumer is done with red and P
      if (c == 0) {
        sm.red[wq][g] = tile_max[0];
        sm.red[wq][g + 8] = tile_max[1];
      }
      named_sync<kThreads>();
      raise_running_max(m_run, l_run, acc, sm.red[0], kRows, g);
    }
    tile_softmax(s, m_run, l_run, sm.p, wq, g, c);
    named_sync<kThreads>();  // P
    tile_pv(acc, tile, p_lane, wq, g, c, &sm.empty_lo[s_idx]);
    mbar_arrive(&sm.empty_hi[s_idx]);
  }
  allow_next_grid();

  // --- epilogue: row sums across the quad and the warps, O staged in smem as bf16, 16-byte stores.
  // Every bulk copy has landed: the producer issued ntiles tiles and the consumers waited for each.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
  named_sync<kThreads>();  // every consumer is done with the K tiles and the last tile's row maxima
  if (c == 0) {
    sm.red[wq][g] = l_run[0];
    sm.red[wq][g + 8] = l_run[1];
  }
  named_sync<kThreads>();
  // O staged as [kRows][kOStageStride] bf16: a lane's 8 columns of a row and 32-column group are
  // contiguous (acc[4 grp + jj][2h + e] is column 8c + 4e + jj of the group), one 16-byte store;
  // rows 1088 bytes apart put a quarter-warp's two rows in different banks (the 2-byte stores at
  // 1024 bytes were 8-way conflicts: 512 wavefronts a warp)
  constexpr int kOStageStride = kLatent + 32;
  __nv_bfloat16* o_stage = reinterpret_cast<__nv_bfloat16*>(sm.kv[0]);
  static_assert(kRows * kOStageStride * 2 <= STAGES * kTileN * kSmemRow, "O staging must fit the K ring");
  float* lse_out = work.lse_out(p);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < kWarpsPerM; ++w) l += sm.red[w][r];
    const float inv = l > 0.f ? p.kv_scale / l : 0.f;
#pragma unroll
    for (int grp = 0; grp < 4; ++grp) {
      uint32_t words[4];
#pragma unroll
      for (int w = 0; w < 4; ++w) {  // columns 8c + 2w, 8c + 2w + 1: e = w / 2, jj = 2w % 4 and + 1
        const __nv_bfloat162 v = __floats2bfloat162_rn(acc[grp * 4 + (2 * w) % 4][2 * h + w / 2] * inv,
                                                       acc[grp * 4 + (2 * w) % 4 + 1][2 * h + w / 2] * inv);
        words[w] = *reinterpret_cast<const uint32_t*>(&v);
      }
      *reinterpret_cast<uint4*>(&o_stage[r * kOStageStride + wq * 128 + grp * 32 + 8 * c]) =
          make_uint4(words[0], words[1], words[2], words[3]);
    }
    if (wq == 0 && c == 0 && row0 + r < rows_per_req)
      lse_out[r] = l > 0.f ? (m_run[h] + log2f(l)) * kLn2 : -INFINITY;
  }
  named_sync<kThreads>();
  uint4* o_out = reinterpret_cast<uint4*>(work.o_out(p));
  const uint4* o_src = reinterpret_cast<const uint4*>(o_stage);
  constexpr int kChunksPerRow = kLatent / 8, kStageChunks = kOStageStride / 8;
  for (int i = tid; i < valid_rows * kChunksPerRow; i += kThreads)
    o_out[i] = o_src[(i / kChunksPerRow) * kStageChunks + i % kChunksPerRow];
}

}  // namespace
}  // namespace kimi_ops::sm90
