// Hopper (sm_90a) M1c (split-KV MLA decode) and M1b (merge of split partials).
//
// Layouts (DESIGN.md):
//   q         [T*H, 576] bf16      flat row (r*qlen + i)*H + h: request r, position i, head h
//   kv        [N, 576] fp8 e4m3fn  token row = [kv_c (512) | k_pe (64)], value = fp8 * kv_scale
//   indptr    [R+1] int32, indices [indptr[R]] int32 (page-size-1 CSR; an index outside
//             [0, N) reads as an all-zero row, nothing outside the cache is touched)
//   o_part    [S, T*H, 512] bf16, lse_part [S, T*H] f32 (natural log; o = 0, lse = -inf
//             for a row that sees no token of its split)
//
// splitkv_kernel (16 query rows a CTA): one CTA of 4 compute warps and a producer warp per (16
// consecutive query rows of one request, split or work item). The split's tokens stream through a
// ring of STAGES shared-memory tiles of 64 rows (a cp.async.bulk of 576 bytes a token row, issued
// by the producer; a token past the split or with an index out of range reads a zero row), read
// from HBM once for all the CTA's rows. Per tile:
//   S  = Q K^T   warp w takes the tile's tokens [16w, 16w+16); mma.sync m16n8k16 f16 with
//                query rows as M; K's fp8 bytes become f16 with cvt.e4m3x2 (exact), Q is the
//                bf16 query scaled per row by 2^k into [2^14, 2^15) and stored as f16 (exact
//                for every element above 2^-24 of the row max); the A fragments of its first
//                kQRegSteps k-steps stay in registers, the rest are read from smem every tile
//   softmax      online, base 2, rescaled lazily (kMaxSlack): P = 2^(s - m) against the running
//                max m, which moves only when a tile raises some row's max by more than 2^8 (a
//                vote on a named barrier; then the warps' maxima go through smem and O, l rescale)
//   O += P V     warp w owns output columns [128w, 128w+128); P (f16, <= 2^8) goes through
//                smem; V^T's fragments come from the same K tile: four 32-bit loads of two
//                token rows each are byte-permuted (prmt) into (token, token+1) pairs and
//                converted, so no second pass over the tile's bytes and no transpose in memory
// splitkv_tm_kernel (32, 48 or 64 rows a CTA, two warpgroups): the same numerics and fragments,
// but token-major wgmma products, S^T = K Q^T and O^T = V^T P^T, with the query rows as N, so each
// fp8 byte is converted once per CTA (32, 48 rows: 128-token tiles) or once per warpgroup (64
// rows) rather than once per 16 rows (its section below).
// Accumulation is f32 throughout: within DESIGN.md's accuracy contract with margin (the
// products are exact; P is rounded to f16, 2^-11 relative).
// Split lengths are computed here from kv_indptr (cta_work): a long request of a mixed batch
// takes more, equally long splits; a split with no token exits at once (writing lse = -inf, and
// o = 0 unless the caller's partials are private: zero_empty).
// Work-list grid (mla_decode_sm90, p.work_list): blockIdx.y is a work item, not a split; the items
// are the requests' non-empty splits, whole chunks first and partial ones by length after
// (find_work_item), so no CTA is launched for a split with no token and the last to start are
// short. A request of one split writes o / lse directly; the others' go to
//   o_part [W, qlen*H, 512] bf16, lse_part [W, qlen*H] f32: slot w's rows of its request
// with W >= the items (an upper bound from shapes), a request's splits in consecutive slots, and
// the merge finds a row's slots from kv_indptr and work_first (each request's first slot,
// written by its split 0).
//
// M1b: merge_rows_kernel for rows of about 16 splits or fewer (one warp a row, lane l reading 32
// bytes of 4 or 8 split rows a round), merge_kernel above (one CTA of 4 warps per (query row,
// block of 64 or 128 output columns); thread t reads 8 bytes of split rows t / (columns / 4), ...
// with 8 split rows a thread in flight).

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "sm90_copy.cuh"

namespace kimi_ops::sm90 {
namespace {

constexpr int kRowBytes = 576;      // fp8 cache row
constexpr int kLatent = 512;        // kv_c columns (= V and O width)
constexpr int kSmemRow = 592;       // smem row stride of a K tile: 576 + 16 (conflict-free ldmatrix / lds)
constexpr int kTileN = 64;          // tokens per pipeline stage
constexpr int kWarpsPerM = 4;       // splitkv_kernel's compute warps, sharing its 16-row m-tile
constexpr int kQStride = 584;       // f16 per smem Q row: 576 + 8 (conflict-free ldmatrix)
constexpr int kPStride = 72;        // f16 per smem P row: 64 + 8
constexpr int kLoadPieces = (kRowBytes / 16 + 7) / 8;  // TileLoader: a lane's 16-byte copies of one token row
constexpr int kQExp = 14;           // query rows scaled so the row max is in [2^14, 2^15)
constexpr int kQRegSteps = 16;      // splitkv_kernel: Q's k-steps (of 36) held in registers (tile_scores)
constexpr float kLn2 = 0.6931471805599453f;
// Lazy rescaling: P = 2^(s - m) against the running max m, which moves (the warps' maxima
// exchanged, O and l rescaled) only when some row's tile max exceeds it by more than kMaxSlack
// (log2 units), so P <= 2^kMaxSlack in f16. Any m gives the same o and lse; most tiles skip the
// exchange and its barrier.
constexpr float kMaxSlack = 8.f;

template <int STAGES>
struct SplitKVSmem {
  uint8_t kv[STAGES][kTileN * kSmemRow];
  __half q[16 * kQStride];
  __half p[16 * kPStride];
  float red[kWarpsPerM][16];
  float row_fac[16];
  uint64_t full[STAGES];      // the stage's 64 rows landed (bulk copies)
  uint64_t empty_lo[STAGES];  // tokens 0-31 of the stage read by every compute thread
  uint64_t empty_hi[STAGES];  // tokens 32-63 read
};

struct SplitKVParams {
  const __nv_bfloat16* q;
  const uint8_t* kv;
  const int* indptr;
  const int* indices;
  const int* seq_lens;  // nullptr: causal bounds from the listed lengths
  __nv_bfloat16* o_part;
  float* lse_part;
  int64_t num_kv_rows;
  int rows_total;  // T*H
  int num_requests, heads, qlen, num_splits, dcp_rank, dcp_world;
  int balance_ctas;  // > 0: a split holds at least (all requests' tokens) / balance_ctas tokens
  bool zero_empty;   // false: an empty split writes only lse = -inf (its o is never read: the
                     // partials are private to mla_decode, whose merge skips -inf splits)
  bool work_list;    // blockIdx.y is a work item (find_work_item), the partials [W, qlen*H, ...]
  __nv_bfloat16* o_final;  // work list: a request with one used split writes o / lse here, [T*H, 512]
  float* lse_final;        //   and [T*H] (its rows skip the merge)
  int* work_first;         // work list: [R], a request's first partials slot (written by its split 0)
  float qk_scale_log2;  // scale * kv_scale * log2(e)
  float kv_scale;
};

// ---- PTX wrappers ----------------------------------------------------------------------------

// named barrier 1 among kThreadsB threads (the consumer warps; the others never use it)
template <int kThreadsB>
__device__ __forceinline__ void named_sync() {
  asm volatile("bar.sync 1, %0;\n" ::"n"(kThreadsB) : "memory");
}
template <int kThreadsB>
__device__ __forceinline__ bool named_sync_or(bool pred) {
  uint32_t r;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, 1, %2, p;\n selp.u32 %0, 1, 0, q;\n}\n"
      : "=r"(r)
      : "r"(static_cast<uint32_t>(pred)), "n"(kThreadsB)
      : "memory");
  return r != 0;
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// keeps registers an in-flight wgmma reads alive (unreused) up to this point
template <int A, int B, int C>
__device__ __forceinline__ void keep_alive(const uint32_t (&x)[A][B][C]) {
#pragma unroll
  for (int i = 0; i < A; ++i)
#pragma unroll
    for (int j = 0; j < B; ++j)
#pragma unroll
      for (int k = 0; k < C; ++k) asm volatile("" ::"r"(x[i][j][k]) : "memory");
}
// keeps the compiler from moving accesses of a wgmma accumulator across the fence / wait
template <int A, int B>
__device__ __forceinline__ void fence_operands(float (&x)[A][B]) {
#pragma unroll
  for (int i = 0; i < A; ++i)
#pragma unroll
    for (int j = 0; j < B; ++j) asm volatile("" : "+f"(x[i][j])::"memory");
}
// wgmma shared-memory descriptor, no swizzle: core matrices of 8 rows x 16 bytes (128 contiguous
// bytes), lbo = bytes between core matrices adjacent in K, sbo = in M / N
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((smem_addr(p) & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32);
}

// wgmma (f16 in, f32 accumulate) with A from registers (the m16n8k16 A fragment of each warp's 16
// of the 64 M rows) and B from shared memory (a descriptor); the accumulators are the m16n8
// layout per n-tile of 8 columns: d[j] holds (row g, col 8j + 2c), (g, 8j + 2c + 1),
// (g + 8, 8j + 2c), (g + 8, 8j + 2c + 1). Always accumulates (scale-d true). N = 32, 48 or 64 query rows.
// B's core matrices are K-major (8 N rows x 8 k, k contiguous), or with kTransB MN-major (8 k rows x 8 N).
template <int N, int kTransB = 0>
struct WgmmaF16RS;
template <int kTransB>
struct WgmmaF16RS<32, kTransB> {
  __device__ __forceinline__ static void run(float (&d)[4][4], const uint32_t (&a)[4], uint64_t b_desc,
                                             int scale_d = 1) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %21, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15"
        "}, {%16, %17, %18, %19}, %20, p, 1, 1, %22;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
          "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d), "n"(kTransB));
  }
};
template <int kTransB>
struct WgmmaF16RS<48, kTransB> {
  __device__ __forceinline__ static void run(float (&d)[6][4], const uint32_t (&a)[4], uint64_t b_desc,
                                             int scale_d = 1) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %29, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n48k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23"
        "}, {%24, %25, %26, %27}, %28, p, 1, 1, %30;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
          "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
          "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d), "n"(kTransB));
  }
};
template <int kTransB>
struct WgmmaF16RS<64, kTransB> {
  __device__ __forceinline__ static void run(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b_desc,
                                             int scale_d = 1) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %37, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, %38;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
          "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]),
          "+f"(d[3][0]), "+f"(d[3][1]), "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]),
          "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]),
          "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), "+f"(d[7][0]), "+f"(d[7][1]),
          "+f"(d[7][2]), "+f"(d[7][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d), "n"(kTransB));
  }
};

__device__ __forceinline__ uint32_t lds32(const void* p) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(smem_addr(p)));
  return v;
}

// four e4m3 bytes (byte i -> f16 i) to two f16x2, exact. The 32-bit word is split into its 16-bit
// halves with mov, which ptxas turns into a half selector on F2FP (no shift or mask instruction).
struct F16x4 {
  uint32_t lo, hi;
};
__device__ __forceinline__ F16x4 e4m3x4_to_f16x4(uint32_t four_bytes) {
  F16x4 out;
  asm("{\n .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;\n}\n"
      : "=r"(out.lo), "=r"(out.hi)
      : "r"(four_bytes));
  return out;
}

__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Tokens (of the n listed) that query position pos sees: listed token j is global position
// j*W + rank; position pos sees global positions <= n_global - qlen + pos.
__device__ __forceinline__ int visible_tokens(int n, int n_global, int qlen, int pos, int rank, int world) {
  const int last = n_global - qlen + pos - rank;
  return min(last >= 0 ? last / world + 1 : 0, n);
}

// PTX prmt.b32 (default mode): result byte i is byte (selector nibble i) of {y, x} (x = bytes 0..3).
__device__ __forceinline__ uint32_t prmt(uint32_t x, uint32_t y, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(x), "r"(y), "r"(selector));
  return d;
}

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

// The splits of a request that hold a token: ceil(n / chunk) (<= S).
__device__ __forceinline__ int used_splits(int n, int num_splits, int balanced) {
  const int chunk = split_chunk(n, num_splits, balanced);
  return chunk > 0 ? (n + chunk - 1) / chunk : 0;
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
// work_first.
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
  __device__ __forceinline__ RequestSplits(int n, int num_splits, int balanced) {
    const int chunk = split_chunk(n, num_splits, balanced);
    used = chunk > 0 ? (n + chunk - 1) / chunk : 0;
    const int tail = n - (used - 1) * chunk;  // tokens of the last split, (0, chunk]
    whole = tail == chunk ? used : used - 1;
    const int quarter = chunk / 4;  // exact: chunk is a multiple of 64
    tail_cls = tail == chunk || used == 0 ? 0 : 1 + (tail < 3 * quarter) + (tail < 2 * quarter) + (tail < quarter);
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
                                                   int item) {
  const int lane = threadIdx.x % 32;
  auto length = [&](int r) { return r < num_requests ? max(indptr[r + 1] - indptr[r], 0) : 0; };
  int counts[kTailClasses + 1] = {};  // items of each class
#pragma unroll 4
  for (int r = lane; r < num_requests; r += 32) {
    const RequestSplits rs(length(r), num_splits, balanced);
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
    const RequestSplits rs(length(r0 + lane), num_splits, balanced);
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

// Every thread of the CTA calls this (find_work_item is warp-wide).
__device__ __forceinline__ CtaWork cta_work(const SplitKVParams& p, int rows_per_cta) {
  CtaWork w;
  const int balanced = balanced_tokens(p.indptr, p.num_requests, p.balance_ctas);
  int split = blockIdx.y, req = blockIdx.z, used = 0, slot = 0;
  if (p.work_list) {
    const WorkItem item = find_work_item(p.indptr, p.num_requests, p.num_splits, balanced, blockIdx.y);
    req = item.req, split = item.split, used = item.used, slot = item.slot;
  }
  w.exists = req < p.num_requests;
  if (!w.exists) return w;
  const int rows_per_req = p.qlen * p.heads;
  const int row0 = blockIdx.x * rows_per_cta;
  w.flat0 = static_cast<int64_t>(req) * rows_per_req + row0;
  int64_t part0 = static_cast<int64_t>(split) * p.rows_total + w.flat0;  // [S, T*H] partials
  if (p.work_list) {
    if (split == 0 && blockIdx.x == 0 && threadIdx.x == 0) p.work_first[req] = slot;
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
  w.hi = min(w.lo + chunk, hi_rows);
  w.ntiles = w.hi > w.lo ? (w.hi - w.lo + kTileN - 1) / kTileN : 0;
  w.valid_rows = min(rows_per_cta, rows_per_req - row0);
  return w;
}

// An empty split's rows: lse = -inf, and o = 0 unless its o is never read (w.zero_o false).
__device__ __forceinline__ void write_empty_split(const SplitKVParams& p, const CtaWork& w, int tid, int threads) {
  if (w.zero_o) {
    uint4* o_out = reinterpret_cast<uint4*>(w.o_out(p));
    for (int i = tid; i < w.valid_rows * (kLatent / 8); i += threads) o_out[i] = make_uint4(0, 0, 0, 0);
  }
  if (tid < w.valid_rows) w.lse_out(p)[tid] = -INFINITY;
}

// ---- per-tile pieces of splitkv_kernel ---------------------------------------------------------

// Query rows r = first, first + step, ... (< rows) of the CTA, one warp a row: bf16 -> f16 scaled
// by 2^k into [2^14, 2^15) (exact), columns permuted inside each 16-column chunk so that ldmatrix's
// A fragment pairs physical columns (4c, 4c+1) and (4c+2, 4c+3), the pairs the K fragment gets
// from one 32-bit word of fp8 bytes; row_fac[r] = qk_scale_log2 * 2^-k. Row r, permuted column k
// is q_smem[r * kQStride + k], or with kCoreMatrix wgmma's no-swizzle K-major layout: core
// matrices of 8 rows x 8 columns (128 bytes), K-adjacent ones 128 bytes apart (lbo), 8-row groups
// kQCoreGroup halves apart (sbo).
constexpr int kQCoreGroup = 8 * kRowBytes;  // f16 per 8-row group of the core-matrix layout
template <bool kCoreMatrix = false>
__device__ __forceinline__ void stage_query_rows(const SplitKVParams& p, __half* q_smem, float* row_fac,
                                                 int64_t flat0, int valid_rows, int rows, int first, int step,
                                                 int lane) {
  for (int r = first; r < rows; r += step) {
    const bool valid = r < valid_rows;
    const uint32_t* src = reinterpret_cast<const uint32_t*>(p.q + (flat0 + r) * kRowBytes);
    float2 v[9];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < 9; ++i) {
      uint32_t w = valid ? src[lane + 32 * i] : 0u;
      v[i] = __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&w));
      amax = fmaxf(amax, fmaxf(fabsf(v[i].x), fabsf(v[i].y)));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    int k = 0;
    if (amax > 0.f) {
      int e;
      frexpf(amax, &e);  // amax = m * 2^e, m in [0.5, 1)
      k = max(-100, min(100, kQExp + 1 - e));
    }
#pragma unroll
    for (int i = 0; i < 9; ++i) {
      const int col = 2 * (lane + 32 * i);  // physical column of this pair (even)
      const int within = col % 16, c4 = within / 4;
      const int scol = col - within + ((within % 4) == 0 ? 2 * c4 : 8 + 2 * c4);
      const int at =
          kCoreMatrix ? (r / 8) * kQCoreGroup + (scol / 8) * 64 + (r % 8) * 8 + scol % 8 : r * kQStride + scol;
      *reinterpret_cast<uint32_t*>(&q_smem[at]) = pack_half2(ldexpf(v[i].x, k), ldexpf(v[i].y, k));
    }
    if (lane == 0) row_fac[r] = ldexpf(p.qk_scale_log2, -k);
  }
}

// The thread's two query rows, r0 and r0 + 8 (request-relative): each row's token limit (the
// tokens it sees, capped at the split's end), the online-softmax state, and O = 0.
__device__ __forceinline__ void init_row_state(const SplitKVParams& p, const CtaWork& w, int r0, int (&lim)[2],
                                               float (&m_run)[2], float (&l_run)[2], float (&acc)[16][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    lim[h] = w.row_limit(p, r0 + 8 * h);
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

// Gathers a split's 64-token tiles into a shared-memory ring with cp.async (16-byte chunks,
// zero-filled past the split's end or for an index outside the cache). Warp w gathers tokens
// [kLoadRows*w, kLoadRows*(w+1)) of a tile, 8 lanes a token row: in pass m lane l copies 16-byte
// chunks l % 8, + 8, ... of row 4m + l / 8, so each copy instruction takes whole 128-byte lines of
// 4 rows (measured: 2 lanes a row, 32 bytes of each of 16 rows an instruction, ran at 55% of this
// rate from HBM). Each lane fetches its rows' indices one tile ahead (their latency hides behind a
// tile of compute) and computes their addresses once a tile.
template <int kWarps, int kTile = kTileN>
struct TileLoader {
  static constexpr int kLoadRows = kTile / kWarps;
  static constexpr int kPasses = kLoadRows / 4;
  static constexpr int kChunks = kRowBytes / 16;
  static_assert(kLoadRows % 4 == 0, "a warp loads whole passes of 4 rows");
  const uint8_t* kv;
  const int* idx_base;
  int64_t num_kv_rows;
  int lo, hi, load_row, load_chunk;
  int next_index[kPasses];

  __device__ __forceinline__ TileLoader(const SplitKVParams& p, const CtaWork& w, int warp, int lane)
      : kv(p.kv), idx_base(p.indices + w.start), num_kv_rows(p.num_kv_rows), lo(w.lo), hi(w.hi),
        load_row(warp * kLoadRows + lane / 8), load_chunk(lane % 8) {
    fetch_indices(0);
  }
  __device__ __forceinline__ void fetch_indices(int t) {
#pragma unroll
    for (int m = 0; m < kPasses; ++m) {
      const int j = lo + t * kTile + load_row + 4 * m;
      next_index[m] = j < hi ? idx_base[j] : -1;  // past the split (or its last tile): zero-filled
    }
  }
  // Tile t into `stage` (a [kTile][kSmemRow] byte ring slot), then tile t + 1's indices: at
  // once (load: row pass by row pass, each pass's copies back to back; chunk by chunk measured
  // slower for splitkv_kernel, docs/PERF.md session 10) or in kLoadPieces parts spread over the
  // caller's MMAs (load_piece: piece k issues copy k of every pass). The index loads go out after
  // the copies have consumed next_index, so they land in its registers (fetched before the copies,
  // ptxas moved each into next_index right away: a wait for the load).
  __device__ __forceinline__ void load(int t, uint8_t* stage) {
#pragma unroll
    for (int m = 0; m < kPasses; ++m)
#pragma unroll
      for (int k = 0; k < kLoadPieces; ++k) copy(m, k, stage);
    fetch_indices(t + 1);
  }
  __device__ __forceinline__ void load_piece(int t, int k, uint8_t* stage) {
#pragma unroll
    for (int m = 0; m < kPasses; ++m) copy(m, k, stage);
    if (k == kLoadPieces - 1) fetch_indices(t + 1);
  }
  // pass m's copy k: 16-byte chunk 8k + load_chunk of row load_row + 4m
  __device__ __forceinline__ void copy(int m, int k, uint8_t* stage) const {
    const int idx = next_index[m];
    const bool ok = idx >= 0 && idx < num_kv_rows;
    const uint8_t* src = kv + (ok ? static_cast<int64_t>(idx) * kRowBytes : 0) + load_chunk * 16;
    if (k < kChunks / 8 || load_chunk < kChunks % 8)
      cp_async_16(stage + (load_row + 4 * m) * kSmemRow + load_chunk * 16 + k * 128, src + k * 128, ok ? 16 : 0);
  }
};

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
__device__ __align__(16) uint8_t g_zero_row[kRowBytes];

template <int STAGES>
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
  const CtaWork work = cta_work(p, kRows);
  if (!work.exists) return;
  const int lo = work.lo, ntiles = work.ntiles, valid_rows = work.valid_rows;
  const int64_t flat0 = work.flat0;
  if (ntiles == 0) {  // an empty split: the slot goes to the next CTA at once
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
  const int wq = warp;
  stage_query_rows(p, sm.q, sm.row_fac, flat0, valid_rows, kRows, warp, kWarps, lane);
  int lim[2];
  float m_run[2], l_run[2];
  float acc[16][4];
  init_row_state(p, work, row0 + g, lim, m_run, l_run, acc);
  named_sync<kThreads>();  // Q and row_fac in smem
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
  __nv_bfloat16* o_stage = reinterpret_cast<__nv_bfloat16*>(sm.kv[0]);  // [kRows][512]
  static_assert(kRows * kLatent * 2 <= STAGES * kTileN * kSmemRow, "O staging must fit the K ring");
  float* lse_out = work.lse_out(p);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < kWarpsPerM; ++w) l += sm.red[w][r];
    const float inv = l > 0.f ? p.kv_scale / l : 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = wq * 128 + (j / 4) * 32 + 4 * (2 * c + e) + (j % 4);
        o_stage[r * kLatent + col] = __float2bfloat16_rn(acc[j][2 * h + e] * inv);
      }
    if (wq == 0 && c == 0 && row0 + r < rows_per_req)
      lse_out[r] = l > 0.f ? (m_run[h] + log2f(l)) * kLn2 : -INFINITY;
  }
  named_sync<kThreads>();
  uint4* o_out = reinterpret_cast<uint4*>(work.o_out(p));
  const uint4* o_src = reinterpret_cast<const uint4*>(o_stage);
  for (int i = tid; i < valid_rows * (kLatent / 8); i += kThreads) o_out[i] = o_src[i];
}

// ---- M1c, token-major: 32, 48 or 64 query rows a CTA -------------------------------------------
//
// splitkv_tm_kernel: one CTA of two warpgroups (8 warps) per (group of N = 8*NT query rows, split
// or work item), streaming TILE-token tiles (128 for N = 32, 48; 64 for N = 64, whose Q leaves no
// room for two 128-token stages). The MMAs are wgmma with tokens (and latents) as the 64 M rows and
// the query rows as N, S^T = K Q^T and O^T = V^T P^T. A is always in registers, converted from the
// tile's fp8 bytes exactly as splitkv_kernel builds its fragments; B is in shared memory in
// wgmma's no-swizzle layout (core matrices of 8 x 16 bytes: Q K-major, P MN-major). Per tile:
//   S^T = K Q^T     TILE 128: warpgroup h takes the tokens [64h, 64h+64) of all N rows, its warp w
//                   the tokens [16w, 16w+16) (M), so each K byte is converted once a CTA;
//                   TILE 64: warpgroup h takes the rows [N/2 h, N/2 (h+1)) of all 64 tokens, warp
//                   w the tokens [16(w%4), +16). A = K (ldmatrix of the fp8 bytes, cvt to f16, with
//                   Q's columns permuted as in stage_query_rows), B = Q (stage_query_rows<true>),
//                   36 wgmma m64 k16 a warpgroup (n = N, or N/2 at TILE 64); the next tile's copies
//                   are issued between them (TileLoader::load_piece)
//   softmax         lazy (kMaxSlack): the tile's row maxima through smem (TILE / 16 token warps)
//                   only when the vote says some row's max rose by more than 2^8, each such row's O
//                   rescale (alpha) to smem; P (f16) to smem, MN-major for B (tm_store_p)
//   O^T += V^T P^T  warp w owns latents [64w, 64w+64) of all N rows: A = V^T (v_token_pairs, as
//                   in tile_pv), B = P, TILE / 4 wgmma m64 nN k16 a warpgroup
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
};

constexpr int kTmWarps = 8;
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
// through red[tq * red_stride + row] (rows row0 + 8j + 2c + h), the running max raised to them, l
// rescaled, and each row's O rescale factor to row_scale[row].
template <int HT, int kTokWarps>
__device__ __forceinline__ void tm_raise_running_max(float (&m_run)[HT][2], float (&l_run)[HT][2],
                                                     float (&tile_max)[HT][2], float* red, int red_stride,
                                                     float* row_scale, int row0, int tq, int g, int c) {
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
      for (int h = 0; h < 2; ++h) red[tq * red_stride + row0 + 8 * j + 2 * c + h] = tile_max[j][h];
  __syncthreads();
#pragma unroll
  for (int j = 0; j < HT; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = row0 + 8 * j + 2 * c + h;
      float mx = m_run[j][h];
#pragma unroll
      for (int w = 0; w < kTokWarps; ++w) mx = fmaxf(mx, red[w * red_stride + r]);
      const float alpha = fast_exp2(m_run[j][h] - (mx == -INFINITY ? 0.f : mx));
      m_run[j][h] = mx;
      l_run[j][h] *= alpha;
      if (tq == 0 && g == 0) row_scale[r] = alpha;
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
// only after every warp has passed that wait and a barrier.
template <int NT, int TILE>
__device__ __forceinline__ void tm_pv(float (&acc)[4][NT][4], const uint8_t* tile, uint64_t p_desc,
                                      const float* row_scale, bool rescale, int warp, int g, int c,
                                      uint32_t (&tail)[2][2][4], bool first) {
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
    wgmma_wait<1>();
  }
}

template <int NT, int STAGES, int TILE>
__global__ void __launch_bounds__(32 * kTmWarps, 1) splitkv_tm_kernel(const SplitKVParams p) {
  static_assert(NT % 2 == 0 && NT >= 4 && NT <= 8, "two warpgroups of NT / 2 n-tiles: 32..64 rows");
  static_assert(TILE == 64 || TILE == 128, "64- or 128-token tiles");
  using Smem = TokenMajorSmem<NT, STAGES, TILE>;
  extern __shared__ __align__(128) uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<Smem*>(smem_raw);
  // kWide (128-token tiles): in S^T = K Q^T warpgroup h takes the tokens [64h, 64h+64) of all rows
  // (K converted once a CTA); else all 64 tokens of the rows [N/2 h, N/2 (h+1))
  constexpr bool kWide = TILE == 128;
  constexpr int kRows = Smem::kRows, kHT = kWide ? NT : NT / 2, kTokWarps = TILE / 16, kThreads = 32 * kTmWarps;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  // the warp's 16 tokens of a tile; the first of the thread's S^T rows (shuffled: the compiler then
  // knows it is warp-uniform and keeps the wgmma descriptors built from it in uniform registers)
  const int tq = kWide ? warp : warp % 4;
  const int half_row0 = kWide ? 0 : __shfl_sync(0xffffffffu, warp / 4, 0) * (kRows / 2);
  const int g = lane / 4, c = lane % 4;
  const int rows_per_req = p.qlen * p.heads;
  const int row0 = blockIdx.x * kRows;
  const CtaWork work = cta_work(p, kRows);
  if (!work.exists) return;
  if (work.ntiles == 0) {
    write_empty_split(p, work, tid, kThreads);
    return;
  }
  const int ntiles = (work.ntiles * kTileN + TILE - 1) / TILE;  // the last may be half empty

  TileLoader<kTmWarps, TILE> loader(p, work, warp, lane);
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ntiles) loader.load(s, sm.kv[s]);
    cp_async_commit();
  }
  stage_query_rows<true>(p, sm.q, sm.row_fac, work.flat0, work.valid_rows, kRows, warp, kTmWarps, lane);
  fence_proxy_async_smem();

  // the thread's S^T rows (CTA-relative): half_row0 + 8j + 2c + h
  int lim[kHT][2];
  float m_run[kHT][2], l_run[kHT][2];
#pragma unroll
  for (int j = 0; j < kHT; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      lim[j][h] = work.row_limit(p, row0 + half_row0 + 8 * j + 2 * c + h);
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

  __syncthreads();  // Q and row_fac in smem
  float row_fac[kHT][2];
#pragma unroll
  for (int j = 0; j < kHT; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) row_fac[j][h] = sm.row_fac[half_row0 + 8 * j + 2 * c + h];
  // the fewest tokens any of the CTA's rows sees: its first row's (visible_tokens grows with the position)
  const int cta_lim = work.row_limit(p, row0);
  const int k_lane = (tq * 16 + (lane & 15)) * kSmemRow + (lane >> 4) * 16;
  const uint64_t q_desc = smem_desc(&sm.q[(half_row0 / 8) * kQCoreGroup], 128, kQCoreGroup * 2);
  const uint64_t p_desc = smem_desc(sm.p, 128, 16 * TILE);

  for (int t = 0; t < ntiles; ++t) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile t landed; every warp is done with tile t - 1 (its stage, P, row_scale)
    const uint8_t* tile = sm.kv[t % STAGES];
    const int tok_base = work.lo + t * TILE + tq * 16;  // request-relative token of the warp's M row 0
    float s[kHT][4];
    const bool load_next = t + STAGES - 1 < ntiles;
    uint8_t* next_stage = sm.kv[(t + STAGES - 1) % STAGES];
    tm_scores<kHT>(
        s, tile + k_lane, q_desc,
        [&](int piece) {
          if (load_next) loader.load_piece(t + STAGES - 1, piece, next_stage);
        },
        wait_pv_tail);
    cp_async_commit();
    float tile_max[kHT][2];
    const bool whole = work.lo + (t + 1) * TILE <= cta_lim;  // no token of the tile is masked
    const bool raise = tm_mask_and_max<kHT>(s, tile_max, row_fac, lim, m_run, tok_base, g, whole);
    const bool rescale = __syncthreads_or(raise);  // also: every warp is done with red, row_scale
    if (rescale)
      tm_raise_running_max<kHT, kTokWarps>(m_run, l_run, tile_max, sm.red[0], kRows, sm.row_scale, half_row0, tq, g,
                                           c);
    tm_exp<kHT>(s, m_run, l_run);
    tm_store_p<kHT, TILE>(sm.p, s, half_row0, tq * 16, g, c);
    fence_proxy_async_smem();
    __syncthreads();  // P and row_scale
    tm_pv<NT, TILE>(acc, tile, p_desc, sm.row_scale, rescale, warp, g, c, pv_tail, t == 0);
  }
  wait_pv_tail();
  cp_async_wait<0>();

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
  if (tq == 0 && g == 0) {
    float* lse_out = work.lse_out(p);
#pragma unroll
    for (int j = 0; j < kHT; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = half_row0 + 8 * j + 2 * c + h;
        float l = 0.f;
#pragma unroll
        for (int w = 0; w < kTokWarps; ++w) l += sm.red[w][r];
        sm.row_scale[r] = l > 0.f ? p.kv_scale / l : 0.f;
        if (row0 + r < rows_per_req) lse_out[r] = l > 0.f ? (m_run[j][h] + log2f(l)) * kLn2 : -INFINITY;
      }
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

// ---- M1b ---------------------------------------------------------------------------------------

constexpr int kMergeThreads = 128;   // merge_kernel's CTA
constexpr int kMergeUnroll = 8;      // merge_kernel: split rows a thread loads a round
constexpr int kMergeFewSplits = 16;  // rows of about this many splits or fewer: merge_rows_kernel
constexpr int kMergeWarpRows = 4;    // merge_rows_kernel: rows a CTA (a warp each)

// Two kernels, both with two rounds of global-memory latency before the sums (the request's
// kv_indptr bounds with its first slot, then the first round's lse and o with the lse loads of the
// row's max):
//   merge_kernel       one CTA per (row, block of `cols` output columns: 64..512, launch_merge
//                      picks 64 or 128 for the rows of more splits it is used for). Thread t reads
//                      4 columns (8 bytes) of split rows t / (cols / 4), + slots, ...: with 64
//                      columns a CTA has 8 x kMergeUnroll split rows in flight, so a few rows with
//                      many splits (one request, long context) take ~1 round of latency.
//   merge_rows_kernel  one warp per row (kMergeWarpRows a CTA), lane l reading columns
//                      [16l, 16l+16) (32 bytes) of ROUND (4 or 8) split rows a round: for rows
//                      of few splits, where a CTA a row spends most of its time starting.
// Partials [S, rows, ...] (split s of row r at s * rows + r), or with work_indptr the work-list
// partials [W, rows_per_req, ...] of splitkv_kernel: the row's request's used splits (from
// kv_indptr with the split kernel's num_splits and balance_ctas) from its first slot on
// (work_first); a request with one used split was written to the output by the split kernel.
struct MergeParams {
  const __nv_bfloat16* o_part;
  const float* lse_part;
  __nv_bfloat16* o;
  float* lse;
  int rows, splits, cols;
  const int* work_indptr;  // nullptr: [S, rows] partials
  const int* work_first;
  int num_requests, rows_per_req, balance_ctas;
  int splits_hint;  // about how many splits a row has (sets launch_merge's grid)
};

// Where query row `row`'s split rows are: split s at part_row + s * part_stride. `written`: the
// split kernel wrote the row to the output itself (work list: its request has one used split).
struct MergeRow {
  int64_t part_row, part_stride;
  int splits;
  bool written;
};

__device__ __forceinline__ MergeRow merge_row(const MergeParams& p, int row) {
  if (p.work_indptr == nullptr) return {row, p.rows, p.splits, false};
  const int req = row / p.rows_per_req;
  // loaded beside kv_indptr, not after it (one round of latency less); unwritten, and unused,
  // when the request has no split
  const int first = p.work_first[req];
  const int balanced = balanced_tokens(p.work_indptr, p.num_requests, p.balance_ctas);
  const int splits = used_splits(max(p.work_indptr[req + 1] - p.work_indptr[req], 0), p.splits, balanced);
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
  __shared__ float red_sum[kLatent / 64];    // [slots], at most 8
  const int row = blockIdx.x, cols = p.cols, col0 = blockIdx.y * cols;
  const MergeRow r = merge_row(p, row);
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
  if (row >= p.rows) return;
  const MergeRow r = merge_row(p, row);
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

// ---- host --------------------------------------------------------------------------------------

void check_cuda_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), "kimi_ops._C: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == dtype, "kimi_ops._C: ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "kimi_ops._C: ", name, " must be contiguous");
}

template <typename Smem, typename Kernel>
void launch_kernel(Kernel* kernel, int threads, const SplitKVParams& params, dim3 grid, cudaStream_t stream) {
  constexpr size_t smem = sizeof(Smem);
  static bool configured[64] = {};  // per device: the dynamic smem limit is a per-context attribute
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= 64 || !configured[device]) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    if (device < 64) configured[device] = true;
  }
  kernel<<<grid, threads, smem, stream>>>(params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int STAGES>
void launch_splitkv(const SplitKVParams& params, dim3 grid, cudaStream_t stream) {
  launch_kernel<SplitKVSmem<STAGES>>(splitkv_kernel<STAGES>, kSplitKVThreads, params, grid, stream);
}

template <int NT, int STAGES, int TILE = kTileN>
void launch_splitkv_tm(const SplitKVParams& params, dim3 grid, cudaStream_t stream) {
  launch_kernel<TokenMajorSmem<NT, STAGES, TILE>>(splitkv_tm_kernel<NT, STAGES, TILE>, 32 * kTmWarps, params, grid,
                                                  stream);
}

// Work items of the work-list grid for R requests of at most num_splits splits: the used splits
// sum to less than balance_ctas + R (each request's chunk is >= all tokens / balance_ctas, so its
// ceil(n / chunk) < n * balance_ctas / all tokens + 1), and to at most R * num_splits.
int64_t work_list_items(int64_t num_requests, int64_t num_splits, int64_t balance_ctas) {
  const int64_t by_splits = num_requests * num_splits;
  return balance_ctas > 0 ? std::min(by_splits, balance_ctas + num_requests) : by_splits;
}

// The split kernel's arguments, checked; the outputs, zero_empty and work_list are the caller's to set.
SplitKVParams splitkv_params(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indptr,
                             const at::Tensor& indices, const std::optional<at::Tensor>& seq_lens, int64_t qlen,
                             double qk_scale_log2, double kv_scale, int64_t num_splits, int64_t dcp_rank,
                             int64_t dcp_world_size, int64_t rows_per_cta, int64_t stages, int64_t balance_ctas) {
  check_cuda_tensor(q, "q", at::kBFloat16);
  check_cuda_tensor(kv, "kv_cache", at::ScalarType::Float8_e4m3fn);
  check_cuda_tensor(indptr, "kv_indptr", at::kInt);
  check_cuda_tensor(indices, "kv_indices", at::kInt);
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kRowBytes, "kimi_ops._C: q must be [T, H, 576]");
  TORCH_CHECK(kv.dim() == 2 && kv.size(1) == kRowBytes, "kimi_ops._C: kv_cache must be [N, 576]");
  TORCH_CHECK(qlen >= 1 && q.size(0) % qlen == 0, "kimi_ops._C: qlen must divide T");
  TORCH_CHECK(num_splits >= 1 && num_splits <= 65535, "kimi_ops._C: num_splits must be in [1, 65535]");
  TORCH_CHECK(rows_per_cta == 16 || rows_per_cta == 32 || rows_per_cta == 48 || rows_per_cta == 64,
              "kimi_ops._C: rows_per_cta must be 16, 32, 48 or 64");
  TORCH_CHECK(stages >= 2 && stages <= (rows_per_cta == 16 ? 4 : rows_per_cta == 64 ? 3 : 2),
              "kimi_ops._C: stages must be 2..4 (16 rows per CTA), 2 (32 or 48) or 2..3 (64)");
  const int64_t T = q.size(0), H = q.size(1), R = T / qlen;
  TORCH_CHECK(indptr.numel() == R + 1, "kimi_ops._C: kv_indptr must have T / qlen + 1 entries");
  TORCH_CHECK(R <= 65535, "kimi_ops._C: at most 65535 requests");
  TORCH_CHECK((qlen * H + rows_per_cta - 1) / rows_per_cta <= 65535, "kimi_ops._C: too many query rows per request");
  if (seq_lens.has_value()) check_cuda_tensor(*seq_lens, "seq_lens", at::kInt);
  SplitKVParams params{};
  params.q = reinterpret_cast<const __nv_bfloat16*>(q.data_ptr());
  params.kv = reinterpret_cast<const uint8_t*>(kv.data_ptr());
  params.indptr = indptr.data_ptr<int>();
  params.indices = indices.numel() > 0 ? indices.data_ptr<int>() : indptr.data_ptr<int>();
  params.seq_lens = seq_lens.has_value() ? seq_lens->data_ptr<int>() : nullptr;
  params.num_kv_rows = kv.size(0);
  params.rows_total = static_cast<int>(T * H);
  params.num_requests = static_cast<int>(R);
  params.balance_ctas = static_cast<int>(std::min<int64_t>(std::max<int64_t>(balance_ctas, 0), INT32_MAX));
  params.heads = static_cast<int>(H);
  params.qlen = static_cast<int>(qlen);
  params.num_splits = static_cast<int>(num_splits);
  params.dcp_rank = static_cast<int>(dcp_rank);
  params.dcp_world = static_cast<int>(dcp_world_size);
  params.qk_scale_log2 = static_cast<float>(qk_scale_log2);
  params.kv_scale = static_cast<float>(kv_scale);
  return params;
}

// 16 rows: splitkv_kernel; 32 or 48: splitkv_tm_kernel on 128-token tiles; 64: on 64-token tiles
// (two 128-token stages and 64 rows' Q do not fit).
void launch_splitkv(const SplitKVParams& params, int64_t rows_per_cta, int64_t stages, dim3 grid) {
  auto stream = c10::cuda::getCurrentCUDAStream();
  switch (rows_per_cta * 10 + stages) {
    case 162: launch_splitkv<2>(params, grid, stream); break;
    case 163: launch_splitkv<3>(params, grid, stream); break;
    case 164: launch_splitkv<4>(params, grid, stream); break;
    case 322: launch_splitkv_tm<4, 2, 128>(params, grid, stream); break;
    case 482: launch_splitkv_tm<6, 2, 128>(params, grid, stream); break;
    case 642: launch_splitkv_tm<8, 2>(params, grid, stream); break;
    default: launch_splitkv_tm<8, 3>(params, grid, stream); break;
  }
}

// Rows of about kMergeFewSplits splits or fewer: merge_rows_kernel, in rounds of 4 split rows up to
// 4 splits, else 8 (docs/PERF.md, session 17). Else merge_kernel, one CTA per (row, column block):
// as few blocks (1, 2, 4 or 8: 512..64 columns) as cover a row's splits (about splits_hint) in one
// load round of kMergeUnroll x blocks split rows a CTA, and at least one CTA a SM. (The previous
// rule, blocks doubled while the grid stayed within 16 CTAs a SM, launched twice the CTAs at b32
// 8k / 32k and was 1-3% slower there: docs/PERF.md, session 11.)
void launch_merge(MergeParams params) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (params.splits_hint <= kMergeFewSplits) {
    const unsigned ctas = static_cast<unsigned>((params.rows + kMergeWarpRows - 1) / kMergeWarpRows);
    auto kernel = params.splits_hint <= 4 ? merge_rows_kernel<4> : merge_rows_kernel<8>;
    kernel<<<ctas, 32 * kMergeWarpRows, 0, stream>>>(params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  int col_blocks = 1;
  while (col_blocks < 8 && (kMergeUnroll * col_blocks < params.splits_hint ||
                            static_cast<int64_t>(params.rows) * col_blocks < static_cast<int64_t>(sms)))
    col_blocks *= 2;
  params.cols = kLatent / col_blocks;
  const dim3 grid(static_cast<unsigned>(params.rows), static_cast<unsigned>(col_blocks));
  merge_kernel<<<grid, kMergeThreads, 0, stream>>>(params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// M1c: o_part [S, T, H, 512] bf16, lse_part [S, T, H] f32 (the public partials' layout).
// zero_empty false: an empty split writes only lse = -inf (with one split o is always written).
std::tuple<at::Tensor, at::Tensor> mla_decode_splitkv_sm90(const at::Tensor& q, const at::Tensor& kv,
                                                           const at::Tensor& indptr, const at::Tensor& indices,
                                                           const std::optional<at::Tensor>& seq_lens, int64_t qlen,
                                                           double qk_scale_log2, double kv_scale, int64_t num_splits,
                                                           int64_t dcp_rank, int64_t dcp_world_size,
                                                           int64_t rows_per_cta, int64_t stages,
                                                           int64_t balance_ctas, bool zero_empty) {
  const c10::cuda::CUDAGuard guard(q.device());
  SplitKVParams params = splitkv_params(q, kv, indptr, indices, seq_lens, qlen, qk_scale_log2, kv_scale, num_splits,
                                        dcp_rank, dcp_world_size, rows_per_cta, stages, balance_ctas);
  const int64_t T = q.size(0), H = q.size(1), R = T / qlen;
  auto o_part = at::empty({num_splits, T, H, kLatent}, q.options());
  auto lse_part = at::empty({num_splits, T, H}, q.options().dtype(at::kFloat));
  if (T == 0 || H == 0) return {o_part, lse_part};
  params.o_part = reinterpret_cast<__nv_bfloat16*>(o_part.data_ptr());
  params.lse_part = lse_part.data_ptr<float>();
  params.zero_empty = zero_empty || num_splits == 1;  // one split: o_part[0] is the output
  const int64_t groups = (qlen * H + rows_per_cta - 1) / rows_per_cta;
  launch_splitkv(params, rows_per_cta, stages,
                 dim3(static_cast<unsigned>(groups), static_cast<unsigned>(num_splits), static_cast<unsigned>(R)));
  return {o_part, lse_part};
}

// M1c + M1b on the work-list grid: (o [T, H, 512] bf16, lse [T, H] f32). One CTA per (row group,
// work item), W = work_list_items of them; a request's splits of more than one go through private
// partials [W, qlen, H, 512] and the merge, a request of one split is written to o directly.
std::tuple<at::Tensor, at::Tensor> mla_decode_sm90(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indptr,
                                                   const at::Tensor& indices, const std::optional<at::Tensor>& seq_lens,
                                                   int64_t qlen, double qk_scale_log2, double kv_scale,
                                                   int64_t num_splits, int64_t dcp_rank, int64_t dcp_world_size,
                                                   int64_t rows_per_cta, int64_t stages, int64_t balance_ctas) {
  const c10::cuda::CUDAGuard guard(q.device());
  SplitKVParams params = splitkv_params(q, kv, indptr, indices, seq_lens, qlen, qk_scale_log2, kv_scale, num_splits,
                                        dcp_rank, dcp_world_size, rows_per_cta, stages, balance_ctas);
  const int64_t T = q.size(0), H = q.size(1), R = T / qlen;
  const int64_t items = work_list_items(R, num_splits, balance_ctas);
  TORCH_CHECK(items <= 65535, "kimi_ops._C: the work-list grid takes at most 65535 items, got ", items);
  auto o = at::empty({T, H, kLatent}, q.options());
  auto lse = at::empty({T, H}, q.options().dtype(at::kFloat));
  if (T == 0 || H == 0) return {o, lse};
  auto o_part = at::empty({items, qlen, H, kLatent}, q.options());
  auto lse_part = at::empty({items, qlen, H}, q.options().dtype(at::kFloat));
  auto work_first = at::empty({R}, indptr.options());
  params.o_part = reinterpret_cast<__nv_bfloat16*>(o_part.data_ptr());
  params.lse_part = lse_part.data_ptr<float>();
  params.o_final = reinterpret_cast<__nv_bfloat16*>(o.data_ptr());
  params.lse_final = lse.data_ptr<float>();
  params.work_first = work_first.data_ptr<int>();
  params.work_list = true;
  params.zero_empty = false;
  const int64_t groups = (qlen * H + rows_per_cta - 1) / rows_per_cta;
  launch_splitkv(params, rows_per_cta, stages, dim3(static_cast<unsigned>(groups), static_cast<unsigned>(items), 1));
  MergeParams merge{};
  merge.o_part = params.o_part;
  merge.lse_part = params.lse_part;
  merge.o = params.o_final;
  merge.lse = params.lse_final;
  merge.rows = static_cast<int>(T * H);
  merge.splits = static_cast<int>(num_splits);
  merge.work_indptr = params.indptr;
  merge.work_first = params.work_first;
  merge.num_requests = static_cast<int>(R);
  merge.rows_per_req = static_cast<int>(qlen * H);
  merge.balance_ctas = params.balance_ctas;
  // a request's used splits: about balance_ctas / R whole chunks and a partial one
  merge.splits_hint = static_cast<int>(
      balance_ctas > 0 ? std::min<int64_t>(num_splits, balance_ctas / std::max<int64_t>(R, 1) + 2) : num_splits);
  launch_merge(merge);
  return {o, lse};
}

// M1b: o_part [S, T, H, 512] / lse_part [S, T, H] -> (o [T, H, 512], lse [T, H]).
std::tuple<at::Tensor, at::Tensor> mla_merge_sm90(const at::Tensor& o_part, const at::Tensor& lse_part) {
  check_cuda_tensor(o_part, "o_part", at::kBFloat16);
  check_cuda_tensor(lse_part, "lse_part", at::kFloat);
  TORCH_CHECK(o_part.dim() == 4 && o_part.size(3) == kLatent, "kimi_ops._C: o_part must be [S, T, H, 512]");
  TORCH_CHECK(lse_part.sizes() == o_part.sizes().slice(0, 3), "kimi_ops._C: lse_part must be [S, T, H]");
  const c10::cuda::CUDAGuard guard(o_part.device());
  const int64_t S = o_part.size(0), T = o_part.size(1), H = o_part.size(2);
  auto o = at::empty({T, H, kLatent}, o_part.options());
  auto lse = at::empty({T, H}, lse_part.options());
  const int64_t rows = T * H;
  TORCH_CHECK(rows <= INT32_MAX && S <= INT32_MAX, "kimi_ops._C: merge too large");
  if (rows == 0) return {o, lse};
  TORCH_CHECK(S >= 1, "kimi_ops._C: o_part must hold at least one split");
  MergeParams params{};
  params.o_part = reinterpret_cast<const __nv_bfloat16*>(o_part.data_ptr());
  params.lse_part = lse_part.data_ptr<float>();
  params.o = reinterpret_cast<__nv_bfloat16*>(o.data_ptr());
  params.lse = lse.data_ptr<float>();
  params.rows = static_cast<int>(rows);
  params.splits = static_cast<int>(S);
  params.splits_hint = params.splits;
  launch_merge(params);
  return {o, lse};
}

}  // namespace kimi_ops::sm90

TORCH_LIBRARY_FRAGMENT(kimi_ops, m) {
  m.def(
      "_mla_decode_splitkv_sm90(Tensor q, Tensor kv_cache, Tensor kv_indptr, Tensor kv_indices, "
      "Tensor? seq_lens, int qlen, float qk_scale_log2, float kv_scale, int num_splits, int dcp_rank, "
      "int dcp_world_size, int rows_per_cta, int stages, int balance_ctas, bool zero_empty) -> (Tensor, Tensor)");
  m.def(
      "_mla_decode_sm90(Tensor q, Tensor kv_cache, Tensor kv_indptr, Tensor kv_indices, "
      "Tensor? seq_lens, int qlen, float qk_scale_log2, float kv_scale, int num_splits, int dcp_rank, "
      "int dcp_world_size, int rows_per_cta, int stages, int balance_ctas) -> (Tensor, Tensor)");
  m.def("_mla_merge_sm90(Tensor o_part, Tensor lse_part) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kimi_ops, CUDA, m) {
  m.impl("_mla_decode_splitkv_sm90", &kimi_ops::sm90::mla_decode_splitkv_sm90);
  m.impl("_mla_decode_sm90", &kimi_ops::sm90::mla_decode_sm90);
  m.impl("_mla_merge_sm90", &kimi_ops::sm90::mla_merge_sm90);
}
