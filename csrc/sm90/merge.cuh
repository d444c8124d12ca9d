// M1b: the merge of split partials, merge_kernel (a CTA per row and column block) and
// merge_rows_kernel (a warp per row), and MergeParams.
//
// Byte layouts:
//   reads   o_part bf16 and lse_part f32 (natural log, -inf: the split saw no token): split s of
//           row r at [s * rows + r] (x 512 columns for o), or with work_indptr the work-list
//           partials [W, rows_per_req] (the row's request's used splits from its first slot on:
//           kv_indptr [R+1] int32)
//   writes  o [rows, 512] bf16 (8 bytes a thread: merge_kernel; 32 bytes a lane:
//           merge_rows_kernel), lse [rows] f32
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "params.cuh"
#include "ptx.cuh"
#include "work_list.cuh"

namespace kimi_ops::sm90 {
namespace {

// ---- M1b ---------------------------------------------------------------------------------------

constexpr int kMergeThreads = 128;   // merge_kernel's CTA
constexpr int kMergeUnroll = 8;      // merge_kernel: split rows a thread loads a round
constexpr int kMergeMaxBlocks = 16;  // merge_kernel: column blocks a row at most (32 columns each)
constexpr int kMergeFewSplits = 16;  // rows of about this many splits or fewer: merge_rows_kernel
constexpr int kMergeWarpRows = 4;    // merge_rows_kernel: rows a CTA (a warp each)

// Two kernels, both with two rounds of global-memory latency before the sums (the request's
// kv_indptr bounds and its first slot, before the PDL wait where the launch has PDL; then the first
// round's lse and o with the lse loads of the row's max):
//   merge_kernel       one CTA per (row, block of `cols` output columns: 32..512, launch_merge
//                      picks 32, 64 or 128 for the rows of more splits it is used for). Thread t
//                      reads 4 columns (8 bytes) of split rows t / (cols / 4), + slots, ...: with
//                      32 columns a CTA has 16 x kMergeUnroll split rows in flight, so a few rows
//                      with many splits (one request, long context: 128 at 8k) take one round of
//                      latency.
//   merge_rows_kernel  one warp per row (kMergeWarpRows a CTA), lane l reading columns
//                      [16l, 16l+16) (32 bytes) of ROUND (4 or 8) split rows a round: for rows
//                      of few splits, where a CTA a row spends most of its time starting.
// Partials [S, rows, ...] (split s of row r at s * rows + r), or with work_indptr the work-list
// partials [W, rows_per_req, ...] of splitkv_kernel: the row's request's used splits (from
// kv_indptr with the split kernel's num_splits and balance_ctas) from its first slot on
// (first_slot); a request with one used split was written to the output by the split kernel.
struct MergeParams {
  const __nv_bfloat16* o_part;
  const float* lse_part;
  __nv_bfloat16* o;
  float* lse;
  int rows, splits, cols;
  const int* work_indptr;  // nullptr: [S, rows] partials
  int num_requests, rows_per_req, balance_ctas, tail_fold;
  int splits_hint;  // about how many splits a row has (sets launch_merge's grid)
};

// Where query row `row`'s split rows are: split s at part_row + s * part_stride. `written`: the
// split kernel wrote the row to the output itself (work list: its request has one used split).
struct MergeRow {
  int64_t part_row, part_stride;
  int splits;
  bool written;
};

// Reads kv_indptr only (the split kernel leaves it as it is), so it runs before wait_prior_grid.
// Warp-wide (first_slot): every lane of the calling warp, with the same row.
__device__ __forceinline__ MergeRow merge_row(const MergeParams& p, int row) {
  if (p.work_indptr == nullptr) return {row, p.rows, p.splits, false};
  const int req = row / p.rows_per_req;
  const int balanced = balanced_tokens(p.work_indptr, p.num_requests, p.balance_ctas);
  const int splits = used_splits(listed_tokens(p.work_indptr, req), p.splits, balanced, p.tail_fold);
  const int first = first_slot(p.work_indptr, p.splits, balanced, p.tail_fold, req);
  return {splits > 1 ? static_cast<int64_t>(first) * p.rows_per_req + row % p.rows_per_req : 0, p.rows_per_req,
          splits, splits == 1};
}

// merge_kernel: the thread's split rows s0, s0 + slots, ... (kMergeUnroll of them): lse and o
// loaded together. o is loaded whatever its lse (an empty split's o may be unwritten); add drops it.
struct MergeRound {
  float lse[kMergeUnroll];
  uint2 o[kMergeUnroll];  // 4 columns, bf16
  __device__ __forceinline__ void load(const MergeParams& p, int64_t part_row, int64_t part_stride, int splits,
                                       int s0, int slots, int col0, int quad) {
#pragma unroll
    for (int u = 0; u < kMergeUnroll; ++u) {
      const int s = s0 + u * slots;
      const int64_t at = part_row + static_cast<int64_t>(s < splits ? s : 0) * part_stride;
      lse[u] = s < splits ? p.lse_part[at] : -INFINITY;
      o[u] = s < splits ? reinterpret_cast<const uint2*>(p.o_part + at * kLatent + col0)[quad] : make_uint2(0, 0);
    }
  }
  // acc += 2^(lse - mx) o over the round's non-empty splits, wsum += their weights
  __device__ __forceinline__ void add(float mx, float (&acc)[4], float& wsum) const {
#pragma unroll
    for (int u = 0; u < kMergeUnroll; ++u) {
      const float wt = lse[u] == -INFINITY ? 0.f : __expf(lse[u] - mx);
      wsum += wt;
      const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&o[u]);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float2 f = __bfloat1622float2(b[i]);
        acc[2 * i] += wt > 0.f ? wt * f.x : 0.f;
        acc[2 * i + 1] += wt > 0.f ? wt * f.y : 0.f;
      }
    }
  }
};

__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const MergeParams p) {
  __shared__ float red[kMergeThreads / 32];
  __shared__ float red_acc[kLatent];         // [slots][cols]
  __shared__ float red_sum[kMergeThreads / 8];  // [slots], at most 16 (32 columns)
  const int row = blockIdx.x, cols = p.cols, col0 = blockIdx.y * cols;
  const MergeRow r = merge_row(p, row);
  wait_prior_grid();
  allow_next_grid();
  if (r.written) return;
  const int64_t part_row = r.part_row, part_stride = r.part_stride;
  const int splits = r.splits;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int quads = cols / 4;                 // threads a split row: 4 columns (8 bytes) each
  const int slots = kMergeThreads / quads;    // split rows a load round
  const int slot = tid / quads, quad = tid % quads;

  // the first round's lse and o go out with the lse loads of the row's max
  MergeRound round;
  round.load(p, part_row, part_stride, splits, slot, slots, col0, quad);
  float mx = -INFINITY;
  for (int s = tid; s < splits; s += kMergeThreads) mx = fmaxf(mx, p.lse_part[part_row + s * part_stride]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (lane == 0) red[warp] = mx;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kMergeThreads / 32; ++w) mx = fmaxf(mx, red[w]);
  __nv_bfloat16* o_row = p.o + static_cast<int64_t>(row) * kLatent + col0;
  if (mx == -INFINITY) {  // every split empty
    for (int c = tid * 8; c < cols; c += kMergeThreads * 8) *reinterpret_cast<uint4*>(o_row + c) = make_uint4(0, 0, 0, 0);
    if (blockIdx.y == 0 && tid == 0) p.lse[row] = -INFINITY;
    return;
  }
  // slot k sums splits k, k + slots, ...
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  float wsum = 0.f;
  round.add(mx, acc, wsum);
  for (int s0 = slot + slots * kMergeUnroll; s0 < splits; s0 += slots * kMergeUnroll) {
    round.load(p, part_row, part_stride, splits, s0, slots, col0, quad);
    round.add(mx, acc, wsum);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) red_acc[slot * cols + 4 * quad + i] = acc[i];
  if (quad == 0) red_sum[slot] = wsum;
  __syncthreads();
  float total = 0.f;
  for (int k = 0; k < slots; ++k) total += red_sum[k];
  const float inv = 1.f / total;
  for (int c = 2 * tid; c < cols; c += 2 * kMergeThreads) {
    float a0 = 0.f, a1 = 0.f;
    for (int k = 0; k < slots; ++k) {
      a0 += red_acc[k * cols + c];
      a1 += red_acc[k * cols + c + 1];
    }
    *reinterpret_cast<__nv_bfloat162*>(o_row + c) = __floats2bfloat162_rn(a0 * inv, a1 * inv);
  }
  if (blockIdx.y == 0 && tid == 0) p.lse[row] = mx + logf(total);
}

// Rows of few splits: one warp a row. The row's max comes from lane-strided lse loads, issued with
// the first round (ROUND split rows: their lse, the same address in every lane, and the lane's 32
// bytes of o); later rounds, for a row with more splits than its request's hint, follow.
// ROUND 4 takes 72 registers, 8 takes 128 (docs/PERF.md, session 17).
template <int ROUND>
__global__ void __launch_bounds__(32 * kMergeWarpRows) merge_rows_kernel(const MergeParams p) {
  const int lane = threadIdx.x % 32;
  const int row = blockIdx.x * kMergeWarpRows + threadIdx.x / 32;
  if (row >= p.rows) return;  // (the warp's lanes share the row)
  const MergeRow r = merge_row(p, row);
  wait_prior_grid();
  allow_next_grid();
  if (r.written) return;
  const int col0 = 16 * lane;
  auto load = [&](int s0, float (&lse)[ROUND], uint4 (&o)[ROUND][2]) {
#pragma unroll
    for (int u = 0; u < ROUND; ++u) {
      const int s = s0 + u;
      const int64_t at = r.part_row + static_cast<int64_t>(s < r.splits ? s : 0) * r.part_stride;
      const uint4* src = reinterpret_cast<const uint4*>(p.o_part + at * kLatent + col0);
      lse[u] = s < r.splits ? p.lse_part[at] : -INFINITY;
      o[u][0] = s < r.splits ? src[0] : make_uint4(0, 0, 0, 0);
      o[u][1] = s < r.splits ? src[1] : make_uint4(0, 0, 0, 0);
    }
  };
  float lse[ROUND];
  uint4 o[ROUND][2];
  load(0, lse, o);
  float mx = -INFINITY;
  for (int s = lane; s < r.splits; s += 32) mx = fmaxf(mx, p.lse_part[r.part_row + s * r.part_stride]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  uint4* o_row = reinterpret_cast<uint4*>(p.o + static_cast<int64_t>(row) * kLatent + col0);
  if (mx == -INFINITY) {  // every split empty
    o_row[0] = o_row[1] = make_uint4(0, 0, 0, 0);
    if (lane == 0) p.lse[row] = -INFINITY;
    return;
  }
  float acc[16] = {};
  float wsum = 0.f;
  for (int s0 = 0;;) {
#pragma unroll
    for (int u = 0; u < ROUND; ++u) {
      const float wt = lse[u] == -INFINITY ? 0.f : __expf(lse[u] - mx);
      wsum += wt;
      const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(o[u]);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float2 f = __bfloat1622float2(b[i]);
        acc[2 * i] += wt > 0.f ? wt * f.x : 0.f;
        acc[2 * i + 1] += wt > 0.f ? wt * f.y : 0.f;
      }
    }
    s0 += ROUND;
    if (s0 >= r.splits) break;
    load(s0, lse, o);
  }
  const float inv = 1.f / wsum;
  uint32_t out[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(acc[2 * i] * inv, acc[2 * i + 1] * inv);
    out[i] = *reinterpret_cast<const uint32_t*>(&h);
  }
  o_row[0] = make_uint4(out[0], out[1], out[2], out[3]);
  o_row[1] = make_uint4(out[4], out[5], out[6], out[7]);
  if (lane == 0) p.lse[row] = mx + logf(wsum);
}

}  // namespace
}  // namespace kimi_ops::sm90
