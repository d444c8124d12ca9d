// The split and work-list arithmetic of the M1c kernels: which tokens a query position sees
// (visible_tokens: causal bound, DCP interleave), a request's split length (split_chunk,
// balanced_tokens: the split balance of a mixed batch), its used splits, the work-list order
// (find_work_item), and each CTA's share (cta_work, write_empty_split).
//
// Byte layouts read: kv_indptr [R+1] int32, seq_lens [R] int32 (SplitKVParams, params.cuh).
// Written: an empty split's rows: lse [valid_rows] f32 = -inf and, if zero_o, o [valid_rows, 512]
// bf16 = 0 (16-byte stores), at lse_part / o_part row out0 (or lse_final / o_final when direct).
// Partials rows: [S, T*H] (split s of flat row f at s*T*H + f), or on the work-list grid
// [W, qlen*H] (slot w's rows of its request at w*qlen*H + request-relative row).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "params.cuh"

namespace kimi_ops::sm90 {
namespace {

// Tokens (of the n listed) that query position pos sees: listed token j is global position
// j*W + rank; position pos sees global positions <= n_global - qlen + pos.
__device__ __forceinline__ int visible_tokens(int n, int n_global, int qlen, int pos, int rank, int world) {
  const int last = n_global - qlen + pos - rank;
  return min(last >= 0 ? last / world + 1 : 0, n);
}

// Request r's listed tokens (kv_indptr's difference; a decreasing pair counts as none).
__device__ __forceinline__ int listed_tokens(const int* indptr, int r) { return max(indptr[r + 1] - indptr[r], 0); }

// A split's tokens for a request of n listed tokens: ceil(n / S), or more when the whole batch is
// long enough that balance_ctas CTAs of `balanced` = ceil(all tokens / balance_ctas) fill the
// device: then a long request's chunk is as long as a short one's and takes more of its S splits
// (its later splits stay empty for a short request). Whole 64-token tiles.
__device__ __forceinline__ int split_chunk(int n, int num_splits, int balanced) {
  const int per_split = n > 0 ? max((n + num_splits - 1) / num_splits, balanced) : 0;
  return (per_split + kTileN - 1) / kTileN * kTileN;
}

__device__ __forceinline__ int balanced_tokens(const int* indptr, int num_requests, int balance_ctas) {
  if (balance_ctas <= 0) return 0;
  const int total = indptr[num_requests] - indptr[0];
  return (total + balance_ctas - 1) / balance_ctas;
}

// The chunks of `chunk` tokens that n tokens fill: ceil(n / chunk), one fewer when the last would
// hold at most `fold` tokens of a longer chunk (work list: the split before it takes them, tail_fold).
__device__ __forceinline__ int used_chunks(int n, int chunk, int fold) {
  if (chunk == 0) return 0;
  const int used = (n + chunk - 1) / chunk;
  return used > 1 && chunk > fold && n - (used - 1) * chunk <= fold ? used - 1 : used;
}

// The splits of a request that hold a token (<= S).
__device__ __forceinline__ int used_splits(int n, int num_splits, int balanced, int fold) {
  return used_chunks(n, split_chunk(n, num_splits, balanced), fold);
}

// Work-list grid: the used splits of all requests in launch order (blockIdx.y), longest first, so
// that the last CTAs to start are short ones (longest-processing-time-first; on the H200 it took
// a variable-length batch from 1.16-1.21x to 1.01x the time of a uniform batch of the same
// tokens, docs/PERF.md "Session 7"):
//   class 0                  every request's whole chunks (`chunk` tokens each), request by request
//   classes 1..kTailClasses  each request's last, partial chunk, by length: tails of >= 3/4 of a
//                            chunk first, then >= 1/2, >= 1/4, the shortest last
// Whatever the launch order, a request's splits have consecutive partials slots: split s of
// request r is slot (used splits of the requests before r) + s, so the merge finds them from
// kv_indptr (first_slot).
constexpr int kTailClasses = 4;

struct WorkItem {
  int req;    // num_requests past the last item
  int split;  // the request's split (chunk) index
  int used;   // the request's used splits
  int slot;   // its partials' row block in [W, qlen*H, ...]: (used splits of requests < req) + split
};

// A request's work items: `used` splits, `whole` of them whole chunks, the last one (if partial)
// in tail class tail_cls (1 .. kTailClasses, 0: no partial chunk).
struct RequestSplits {
  int used, whole, tail_cls;
  __device__ __forceinline__ RequestSplits(int n, int num_splits, int balanced, int fold) {
    const int chunk = split_chunk(n, num_splits, balanced);
    used = used_chunks(n, chunk, fold);
    const int tail = n - (used - 1) * chunk;  // tokens of the last split, (0, chunk + fold]
    whole = tail >= chunk ? used : used - 1;  // a folded last split launches with the whole chunks
    const int quarter = chunk / 4;  // exact: chunk is a multiple of 64
    tail_cls = tail >= chunk || used == 0 ? 0 : 1 + (tail < 3 * quarter) + (tail < 2 * quarter) + (tail < quarter);
  }
  // the request's items in launch class cls
  __device__ __forceinline__ int items(int cls) const { return cls == 0 ? whole : (tail_cls == cls ? 1 : 0); }
};

// Warp-wide (every lane of the calling warp, all 32 active, gets the answer). Two passes over
// the requests, 32 a step: the items of each class (so the item's class and the items launched
// before that class are known), then that class's requests with inclusive scans of their items
// in the class and of their used splits, to the item's request. Device data only, so one grid
// of W >= the items serves every length mix.
__device__ __forceinline__ WorkItem find_work_item(const int* indptr, int num_requests, int num_splits, int balanced,
                                                   int fold, int item) {
  const int lane = threadIdx.x % 32;
  auto length = [&](int r) { return r < num_requests ? listed_tokens(indptr, r) : 0; };
  int counts[kTailClasses + 1] = {};  // items of each class
#pragma unroll 4
  for (int r = lane; r < num_requests; r += 32) {
    const RequestSplits rs(length(r), num_splits, balanced, fold);
#pragma unroll
    for (int c = 0; c <= kTailClasses; ++c) counts[c] += rs.items(c);
  }
#pragma unroll
  for (int c = 0; c <= kTailClasses; ++c)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) counts[c] += __shfl_xor_sync(0xffffffffu, counts[c], o);
  int cls = 0, before = 0;  // the item's class; the items of the classes launched before it
  int launched = counts[0];  // items of classes 0..c-1
#pragma unroll
  for (int c = 1; c <= kTailClasses; ++c) {
    if (item >= launched) cls = c, before = launched;  // an empty class is passed over
    launched += counts[c];
  }
  int used_before = 0;  // used splits of the requests scanned
  for (int r0 = 0; r0 < num_requests; r0 += 32) {
    const RequestSplits rs(length(r0 + lane), num_splits, balanced, fold);
    const int count = rs.items(cls);
    int upto = count, used_upto = rs.used;  // over requests r0..r0 + lane
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, upto, o);
      const int u = __shfl_up_sync(0xffffffffu, used_upto, o);
      if (lane >= o) upto += v, used_upto += u;
    }
    const unsigned hit = __ballot_sync(0xffffffffu, item < before + upto);
    if (hit != 0u) {
      const int l = __ffs(hit) - 1;
      const int first = before + __shfl_sync(0xffffffffu, upto - count, l);  // the request's first item
      const int split = cls == 0 ? item - first : __shfl_sync(0xffffffffu, rs.whole, l);
      WorkItem w;
      w.req = r0 + l;
      w.split = split;
      w.used = __shfl_sync(0xffffffffu, rs.used, l);
      w.slot = used_before + __shfl_sync(0xffffffffu, used_upto - rs.used, l) + split;
      return w;
    }
    before += __shfl_sync(0xffffffffu, upto, 31);
    used_before += __shfl_sync(0xffffffffu, used_upto, 31);
  }
  return WorkItem{num_requests, 0, 0, 0};
}

// The tokens [lo, hi) of the listed n that CTA (row group, split, request) attends, what its
// rows need, and where its o / lse rows go.
struct CtaWork {
  bool exists;             // false: a work-list item past the last (the CTA does nothing)
  int start, n, n_global;  // the request's first index, listed tokens, global length
  int lo, hi, ntiles;      // the split's tokens and its 64-token tiles (0: an empty split)
  int valid_rows;          // the CTA's rows that exist (the last row group may be short)
  int64_t flat0;           // the CTA's first flat query row
  int64_t out0;            // the CTA's first row in lse_part (x 512: o_part), or with `direct` in
  bool direct;             //   lse_final / o_final (work list: the request has one split)
  bool zero_o;             // an empty split must write o = 0 (the public partials, or the output)

  __device__ __forceinline__ __nv_bfloat16* o_out(const SplitKVParams& p) const {
    return (direct ? p.o_final : p.o_part) + out0 * kLatent;
  }
  __device__ __forceinline__ float* lse_out(const SplitKVParams& p) const {
    return (direct ? p.lse_final : p.lse_part) + out0;
  }
  // the tokens request-relative query row r sees in this split (0 for a row past the request's)
  __device__ __forceinline__ int row_limit(const SplitKVParams& p, int r) const {
    const int rows_per_req = p.qlen * p.heads;
    return r < rows_per_req ? min(visible_tokens(n, n_global, p.qlen, r / p.heads, p.dcp_rank, p.dcp_world), hi) : 0;
  }
};

// Every thread of the CTA calls this (find_work_item is warp-wide). It reads kv_indptr and seq_lens
// and writes nothing, so with kv_before_wait it runs before wait_prior_grid.
__device__ __forceinline__ CtaWork cta_work(const SplitKVParams& p, int rows_per_cta) {
  CtaWork w;
  const int balanced = balanced_tokens(p.indptr, p.num_requests, p.balance_ctas);
  int split = blockIdx.y, req = blockIdx.z, used = 0, slot = 0;
  if (p.work_list) {
    const WorkItem item = find_work_item(p.indptr, p.num_requests, p.num_splits, balanced, p.tail_fold, blockIdx.y);
    req = item.req, split = item.split, used = item.used, slot = item.slot;
  }
  w.exists = req < p.num_requests;
  if (!w.exists) return w;
  const int rows_per_req = p.qlen * p.heads;
  const int row0 = blockIdx.x * rows_per_cta;
  w.flat0 = static_cast<int64_t>(req) * rows_per_req + row0;
  int64_t part0 = static_cast<int64_t>(split) * p.rows_total + w.flat0;  // [S, T*H] partials
  if (p.work_list) {
    part0 = static_cast<int64_t>(slot) * rows_per_req + row0;  // [W, qlen*H] partials
  }
  w.direct = used == 1;
  w.zero_o = p.zero_empty || w.direct;
  w.out0 = w.direct ? w.flat0 : part0;
  w.start = p.indptr[req];
  w.n = max(p.indptr[req + 1] - w.start, 0);
  w.n_global = p.seq_lens != nullptr ? p.seq_lens[req] : w.n;
  const int last_row = min(row0 + rows_per_cta, rows_per_req) - 1;
  const int hi_rows = visible_tokens(w.n, w.n_global, p.qlen, last_row / p.heads, p.dcp_rank, p.dcp_world);
  const int chunk = split_chunk(w.n, p.num_splits, balanced);
  w.lo = split * chunk;
  w.hi = min(p.work_list && split == used - 1 ? w.n : w.lo + chunk, hi_rows);  // the last takes a folded tail
  w.ntiles = w.hi > w.lo ? (w.hi - w.lo + kTileN - 1) / kTileN : 0;
  w.valid_rows = min(rows_per_cta, rows_per_req - row0);
  return w;
}

// Work list: request req's first partials slot, the used splits of the requests before it (the
// slot find_work_item gives its split 0). Reads kv_indptr only. Warp-wide (every lane of the
// calling warp, all 32 active, gets the answer).
__device__ __forceinline__ int first_slot(const int* indptr, int num_splits, int balanced, int fold, int req) {
  int sum = 0;
#pragma unroll 4
  for (int r = threadIdx.x % 32; r < req; r += 32)
    sum += used_splits(listed_tokens(indptr, r), num_splits, balanced, fold);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  return sum;
}

// An empty split's rows: lse = -inf, and o = 0 unless its o is never read (w.zero_o false).
__device__ __forceinline__ void write_empty_split(const SplitKVParams& p, const CtaWork& w, int tid, int threads) {
  if (w.zero_o) {
    uint4* o_out = reinterpret_cast<uint4*>(w.o_out(p));
    for (int i = tid; i < w.valid_rows * (kLatent / 8); i += threads) o_out[i] = make_uint4(0, 0, 0, 0);
  }
  if (tid < w.valid_rows) w.lse_out(p)[tid] = -INFINITY;
}

}  // namespace
}  // namespace kimi_ops::sm90
