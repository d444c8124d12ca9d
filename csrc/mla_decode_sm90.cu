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
// splitkv_kernel: one CTA of 4*MT warps per (row group, split, request). A row group is 16*MT
// consecutive query rows of one request; warps 4m..4m+3 take its m-th 16 rows. The split's
// tokens stream through a ring of STAGES shared-memory tiles of 64 rows (cp.async, 16-byte
// chunks, zero-filled where a token is past the split or its index is out of range), read from
// HBM once for all the CTA's rows. Per tile, in each group of 4 warps:
//   S  = Q K^T   warp w takes the tile's tokens [16w, 16w+16); mma.sync m16n8k16 f16 with
//                query rows as M; K's fp8 bytes become f16 with cvt.e4m3x2 (exact), Q is the
//                bf16 query scaled per row by 2^k into [2^14, 2^15) and stored as f16 (exact
//                for every element above 2^-24 of the row max)
//   softmax      online, base 2; the tile's row max is shared across warps through smem
//   O += P V     warp w owns output columns [128w, 128w+128); P (f16, in [0, 1]) goes through
//                smem; V^T's fragments come from the same K tile: four 32-bit loads of two
//                token rows each are byte-permuted (prmt) into (token, token+1) pairs and
//                converted, so no second pass over the tile's bytes and no transpose in memory
// Accumulation is f32 throughout: within DESIGN.md's accuracy contract with margin (the
// products are exact; P is rounded to f16, 2^-11 relative).
// Split lengths are computed here from kv_indptr (cta_work): a long request of a mixed batch
// takes more, equally long splits; a split with no token exits at once (writing lse = -inf, and
// o = 0 unless the caller's partials are private: zero_empty).
// The per-tile pieces (stage_query_rows, tile_scores, tile_mask_and_max, tile_softmax, tile_pv)
// serve both this kernel and splitkv_ws_kernel (a producer warp + two consumer warpgroups, below).
// CVT (16-row, 2-stage CTAs only): the fp8 -> f16 operands by integer ops (fp8_bits.h) instead of
// cvt.rn.f16x2.e4m3x2, for K, V or both.
//
// merge_kernel: one CTA of 4 warps per (query row, block of 64..512 output columns); thread t
// reads 8 bytes of split rows t / (columns / 4), ... with 8 split rows a thread in flight. With
// pdl it is launched as a programmatic dependent of the split kernel (griddepcontrol), so its
// launch overlaps the split kernel's last wave.

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "fp8_bits.h"

namespace kimi_ops::sm90 {
namespace {

constexpr int kRowBytes = 576;      // fp8 cache row
constexpr int kLatent = 512;        // kv_c columns (= V and O width)
constexpr int kSmemRow = 592;       // smem row stride of a K tile: 576 + 16 (conflict-free ldmatrix / lds)
constexpr int kTileN = 64;          // tokens per pipeline stage
constexpr int kWarpsPerM = 4;       // warps sharing one 16-row m-tile
constexpr int kQStride = 584;       // f16 per smem Q row: 576 + 8 (conflict-free ldmatrix)
constexpr int kPStride = 72;        // f16 per smem P row: 64 + 8
constexpr int kQExp = 14;           // query rows scaled so the row max is in [2^14, 2^15)
constexpr float kLn2 = 0.6931471805599453f;

template <int MT, int STAGES>
struct SplitKVSmem {
  uint8_t kv[STAGES][kTileN * kSmemRow];
  __half q[MT * 16 * kQStride];
  __half p[MT * 16 * kPStride];
  float red[kWarpsPerM][MT * 16];
  float row_fac[MT * 16];
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
  float qk_scale_log2;  // scale * kv_scale * log2(e)
  float kv_scale;
};

// ---- PTX wrappers ----------------------------------------------------------------------------

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ uint32_t lds32(const void* p) {
  uint32_t v;
  asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(v) : "r"(smem_addr(p)));
  return v;
}

// two e4m3 bytes (low byte -> low half) to f16x2, exact
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two_bytes) {
  uint32_t out;
  asm("{\n .reg .b16 t;\n cvt.u16.u32 t, %1;\n cvt.rn.f16x2.e4m3x2 %0, t;\n}\n"
      : "=r"(out)
      : "r"(two_bytes));
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

// Programmatic dependent launch (sm_90): the split kernels let a dependent grid (the merge, when
// launched with programmatic stream serialization) start once all their CTAs are resident; the
// merge waits for the split grid's completion and memory before it reads. Both instructions are
// no-ops for launches without the attribute.
__device__ __forceinline__ void griddep_launch_dependents() {
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}
__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

// The tokens [lo, hi) of the listed n that CTA (row group, split, request) attends, and what its
// rows need. A split's tokens: ceil(n / S), or more when the whole batch is long enough that
// balance_ctas CTAs of (all tokens / balance_ctas) fill the device: then a long request's chunk is
// as long as a short one's and takes more of its S splits (its later splits stay empty for a short
// request). Device data only: the same grid serves every length mix.
struct CtaWork {
  int start, n, n_global;  // the request's first index, listed tokens, global length
  int lo, hi, ntiles;      // the split's tokens and its 64-token tiles (0: an empty split)
  int valid_rows;          // the CTA's rows that exist (the last row group may be short)
  int64_t flat0;           // the CTA's first flat query row
};

__device__ __forceinline__ CtaWork cta_work(const SplitKVParams& p, int rows_per_cta) {
  CtaWork w;
  const int split = blockIdx.y, req = blockIdx.z;
  const int rows_per_req = p.qlen * p.heads;
  const int row0 = blockIdx.x * rows_per_cta;
  w.flat0 = static_cast<int64_t>(req) * rows_per_req + row0;
  w.start = p.indptr[req];
  w.n = max(p.indptr[req + 1] - w.start, 0);
  w.n_global = p.seq_lens != nullptr ? p.seq_lens[req] : w.n;
  const int last_row = min(row0 + rows_per_cta, rows_per_req) - 1;
  const int hi_rows = visible_tokens(w.n, w.n_global, p.qlen, last_row / p.heads, p.dcp_rank, p.dcp_world);
  int per_split = w.n > 0 ? (w.n + p.num_splits - 1) / p.num_splits : 0;
  if (p.balance_ctas > 0 && w.n > 0) {
    const int total = p.indptr[p.num_requests] - p.indptr[0];
    per_split = max(per_split, (total + p.balance_ctas - 1) / p.balance_ctas);
  }
  const int chunk = (per_split + kTileN - 1) / kTileN * kTileN;
  w.lo = split * chunk;
  w.hi = min(w.lo + chunk, hi_rows);
  w.ntiles = w.hi > w.lo ? (w.hi - w.lo + kTileN - 1) / kTileN : 0;
  w.valid_rows = min(rows_per_cta, rows_per_req - row0);
  return w;
}

// An empty split's partials: lse = -inf, and o = 0 unless p.zero_empty is false.
__device__ __forceinline__ void write_empty_split(const SplitKVParams& p, const CtaWork& w, int tid, int threads) {
  const int64_t first = static_cast<int64_t>(blockIdx.y) * p.rows_total + w.flat0;
  if (p.zero_empty) {
    uint4* o_out = reinterpret_cast<uint4*>(p.o_part + first * kLatent);
    for (int i = tid; i < w.valid_rows * (kLatent / 8); i += threads) o_out[i] = make_uint4(0, 0, 0, 0);
  }
  if (tid < w.valid_rows) p.lse_part[first + tid] = -INFINITY;
}

// ---- per-tile pieces shared by splitkv_kernel and splitkv_ws_kernel ---------------------------

// Query rows r = first, first + step, ... (< rows) of the CTA, one warp a row: bf16 -> f16 scaled
// by 2^k into [2^14, 2^15) (exact), columns permuted inside each 16-column chunk so that ldmatrix's
// A fragment pairs physical columns (4c, 4c+1) and (4c+2, 4c+3), the pairs the K fragment gets
// from one 32-bit word of fp8 bytes; row_fac[r] = qk_scale_log2 * 2^-k (2^(8-k) when K's f16
// values are 2^-8 x the cache's, int_k).
__device__ __forceinline__ void stage_query_rows(const SplitKVParams& p, __half* q_smem, float* row_fac,
                                                 int64_t flat0, int valid_rows, int rows, int first, int step,
                                                 int lane, bool int_k) {
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
      *reinterpret_cast<uint32_t*>(&q_smem[r * kQStride + scol]) = pack_half2(ldexpf(v[i].x, k), ldexpf(v[i].y, k));
    }
    if (lane == 0) row_fac[r] = ldexpf(p.qk_scale_log2, (int_k ? 8 : 0) - k);
  }
}

// The thread's two query rows, r0 and r0 + 8 (request-relative): each row's token limit (the
// tokens it sees, capped at the split's end), the online-softmax state, and O = 0.
__device__ __forceinline__ void init_row_state(const SplitKVParams& p, const CtaWork& w, int r0, int (&lim)[2],
                                               float (&m_run)[2], float (&l_run)[2], float (&acc)[16][4]) {
  const int rows_per_req = p.qlen * p.heads;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = r0 + 8 * h;
    lim[h] = r < rows_per_req
                 ? min(visible_tokens(w.n, w.n_global, p.qlen, r / p.heads, p.dcp_rank, p.dcp_world), w.hi)
                 : 0;
    m_run[h] = -INFINITY;
    l_run[h] = 0.f;
  }
#pragma unroll
  for (int j = 0; j < 16; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
}

// S = Q K^T over the warp's 16 tokens of a tile: s[nt] holds (row g / g+8, token nt*8 + 2c + {0,1}).
// Four independent accumulators per n-tile (k-step mod 4) keep the MMA chains short.
template <bool kIntK>
__device__ __forceinline__ void tile_scores(float (&s)[2][4], const uint8_t* tile, const __half* q_lane, int wq,
                                            int lane) {
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
      ldmatrix_x4(a, q_lane + ks * 16);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const uint32_t w = kw[2 * half + nt];
        if constexpr (kIntK)
          mma_f16(s4[ks % 4][nt], a, e4m3x2_to_f16x2_scaled(w, w, kSelBytes01), e4m3x2_to_f16x2_scaled(w, w, kSelBytes23));
        else
          mma_f16(s4[ks % 4][nt], a, e4m3x2_to_f16x2(w & 0xffffu), e4m3x2_to_f16x2(w >> 16));
      }
    }
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) s[nt][i] = (s4[0][nt][i] + s4[1][nt][i]) + (s4[2][nt][i] + s4[3][nt][i]);
}

// Scale and mask the warp's scores (token tok_base + nt*8 + 2c + e against each row's limit) and
// publish its per-row max of the tile: red_rows[g], red_rows[g + 8] (the quad's max).
__device__ __forceinline__ void tile_mask_and_max(float (&s)[2][4], const float (&row_fac)[2], const int (&lim)[2],
                                                  int tok_base, int g, int c, float* red_rows) {
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
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    if (c == 0) red_rows[g + 8 * h] = mx;
  }
}

// Online softmax step once every warp's row max is published (red[w * red_stride + row] for the 4
// warps of the m-tile): s becomes P = 2^(s - m), alpha the rescale of the running O, and P (f16)
// goes to p_rows (row, token within the tile).
__device__ __forceinline__ void tile_softmax(float (&s)[2][4], float (&m_run)[2], float (&l_run)[2], float (&alpha)[2],
                                             const float* red, int red_stride, __half* p_rows, int wq, int g, int c) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float mx = m_run[h];
#pragma unroll
    for (int w = 0; w < kWarpsPerM; ++w) mx = fmaxf(mx, red[w * red_stride + g + 8 * h]);
    const float m_safe = mx == -INFINITY ? 0.f : mx;
    alpha[h] = fast_exp2(m_run[h] - m_safe);
    m_run[h] = mx;
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float pv = fast_exp2(s[nt][2 * h + e] - m_safe);
        s[nt][2 * h + e] = pv;
        sum += pv;
      }
    l_run[h] = l_run[h] * alpha[h] + sum;
  }
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<uint32_t*>(&p_rows[(g + 8 * h) * kPStride + wq * 16 + nt * 8 + 2 * c]) =
          pack_half2(s[nt][2 * h], s[nt][2 * h + 1]);
}

// O = alpha O + P V over the tile's 64 tokens and the warp's 128 columns. acc[4*grp + j] column n
// (0..7) is latent wq*128 + grp*32 + 4n + j. V^T's fragments come from the K tile's bytes: four
// 32-bit loads of two token rows each, byte-permuted into (token, token+1) pairs.
template <bool kIntV>
__device__ __forceinline__ void tile_pv(float (&acc)[16][4], const float (&alpha)[2], const uint8_t* tile,
                                        const __half* p_lane, int wq, int g, int c) {
#pragma unroll
  for (int j = 0; j < 16; ++j) {
    acc[j][0] *= alpha[0];
    acc[j][1] *= alpha[0];
    acc[j][2] *= alpha[1];
    acc[j][3] *= alpha[1];
  }
#pragma unroll
  for (int kk = 0; kk < kTileN / 16; ++kk) {
    uint32_t pa[4];
    ldmatrix_x4(pa, p_lane + kk * 16);
    const uint8_t* v0 = tile + (kk * 16 + 2 * c) * kSmemRow + wq * 128 + 4 * g;
#pragma unroll
    for (int grp = 0; grp < 4; ++grp) {
      const uint32_t x0 = lds32(v0 + grp * 32);                 // token 2c,   latents 4g..4g+3
      const uint32_t x1 = lds32(v0 + kSmemRow + grp * 32);      // token 2c+1
      const uint32_t x2 = lds32(v0 + 8 * kSmemRow + grp * 32);  // token 2c+8
      const uint32_t x3 = lds32(v0 + 9 * kSmemRow + grp * 32);  // token 2c+9
      uint32_t b01[4], b23[4];
      if constexpr (kIntV) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          b01[j] = e4m3x2_to_f16x2_scaled(x0, x1, sel_byte_of_each(j));
          b23[j] = e4m3x2_to_f16x2_scaled(x2, x3, sel_byte_of_each(j));
        }
      } else {
        const uint32_t lo01 = prmt(x0, x1, 0x5140), hi01 = prmt(x0, x1, 0x7362);
        const uint32_t lo23 = prmt(x2, x3, 0x5140), hi23 = prmt(x2, x3, 0x7362);
        b01[0] = e4m3x2_to_f16x2(lo01 & 0xffffu), b01[1] = e4m3x2_to_f16x2(lo01 >> 16);
        b01[2] = e4m3x2_to_f16x2(hi01 & 0xffffu), b01[3] = e4m3x2_to_f16x2(hi01 >> 16);
        b23[0] = e4m3x2_to_f16x2(lo23 & 0xffffu), b23[1] = e4m3x2_to_f16x2(lo23 >> 16);
        b23[2] = e4m3x2_to_f16x2(hi23 & 0xffffu), b23[3] = e4m3x2_to_f16x2(hi23 >> 16);
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) mma_f16(acc[grp * 4 + j], pa, b01[j], b23[j]);
    }
  }
}

// ---- M1c ---------------------------------------------------------------------------------------

// CVT: how the fp8 bytes become f16 operands. 0: cvt.rn.f16x2.e4m3x2 (the conversion pipe);
// bit 1 (K for S) / bit 0 (V for PV): integer ops instead (fp8_bits.h: 2^-8 x the value, the
// 2^8 undone in the row scale / the epilogue), moving that work to the ALU pipe.
template <int MT, int STAGES, int CVT = 0>
__global__ void __launch_bounds__(128 * MT, 1) splitkv_kernel(const SplitKVParams p) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<SplitKVSmem<MT, STAGES>*>(smem_raw);
  constexpr bool kIntK = (CVT & 2) != 0, kIntV = (CVT & 1) != 0;
  constexpr int kRows = MT * 16;
  constexpr int kThreads = 128 * MT;
  constexpr int kWarps = 4 * MT;
  constexpr int kLoadRows = kTileN / kWarps;  // tokens of a tile each warp gathers

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int mg = warp / kWarpsPerM, wq = warp % kWarpsPerM;  // m-tile; token / column quarter
  const int g = lane / 4, c = lane % 4;
  const int split = blockIdx.y;
  const int rows_per_req = p.qlen * p.heads;
  const int row0 = blockIdx.x * kRows;  // first row of this CTA within its request
  griddep_launch_dependents();
  const CtaWork work = cta_work(p, kRows);
  const int start = work.start;
  const int lo = work.lo, hi = work.hi, ntiles = work.ntiles, valid_rows = work.valid_rows;
  const int64_t flat0 = work.flat0;
  if (ntiles == 0) {  // an empty split: the slot goes to the next CTA at once
    write_empty_split(p, work, tid, kThreads);
    return;
  }

  // --- KV tile loader: warp w gathers tokens [kLoadRows*w, kLoadRows*(w+1)) of a tile; lane l <
  // kLoadRows holds the index of token l, fetched one tile ahead so its latency hides behind a
  // tile of compute.
  const int* idx_base = p.indices + start;
  auto fetch_index = [&](int t) -> int {
    const int j = lo + t * kTileN + warp * kLoadRows + lane;
    return (lane < kLoadRows && t < ntiles && j < hi) ? idx_base[j] : -1;
  };
  int next_index = fetch_index(0);
  auto load_tile = [&](int t) {
    const int idx_mine = next_index;
    next_index = fetch_index(t + 1);
    uint8_t* dst = sm.kv[t % STAGES] + warp * kLoadRows * kSmemRow;
#pragma unroll
    for (int r = 0; r < kLoadRows; ++r) {  // the first 512 bytes of each row: one chunk a lane
      const int idx = __shfl_sync(0xffffffffu, idx_mine, r);
      const bool ok = idx >= 0 && idx < p.num_kv_rows;
      const uint8_t* src = p.kv + (ok ? static_cast<int64_t>(idx) * kRowBytes + lane * 16 : 0);
      cp_async_16(dst + r * kSmemRow + lane * 16, src, ok ? 16 : 0);
    }
#pragma unroll
    for (int i = 0; i < (kLoadRows * 4 + 31) / 32; ++i) {  // the last 64 bytes: 4 chunks a row
      const int e = i * 32 + lane;
      const int r = min(e / 4, kLoadRows - 1), ch = 32 + e % 4;
      const int idx = __shfl_sync(0xffffffffu, idx_mine, r);
      const bool ok = idx >= 0 && idx < p.num_kv_rows;
      const uint8_t* src = p.kv + (ok ? static_cast<int64_t>(idx) * kRowBytes + ch * 16 : 0);
      if (e < kLoadRows * 4) cp_async_16(dst + r * kSmemRow + ch * 16, src, ok ? 16 : 0);
    }
  };
  // the first tiles' loads go out before the query is staged
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < ntiles) load_tile(s);
    cp_async_commit();
  }

  // --- Q: bf16 -> 2^k-scaled f16 in smem (stage_query_rows)
  stage_query_rows(p, sm.q, sm.row_fac, flat0, valid_rows, kRows, warp, kWarps, lane, kIntK);

  // --- per-thread row state: rows g and g+8 of the warp's m-tile
  int lim[2];
  float m_run[2], l_run[2];
  float acc[16][4];
  init_row_state(p, work, row0 + mg * 16 + g, lim, m_run, l_run, acc);

  __syncthreads();  // Q and row_fac in smem
  const float row_fac[2] = {sm.row_fac[mg * 16 + g], sm.row_fac[mg * 16 + g + 8]};
  const __half* q_lane = &sm.q[(mg * 16 + (lane & 15)) * kQStride + (lane >> 4) * 8];
  const __half* p_lane = &sm.p[(mg * 16 + (lane & 15)) * kPStride + (lane >> 4) * 8];

  for (int t = 0; t < ntiles; ++t) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile t landed for every warp; stage (t-1) % STAGES is free
    if (t + STAGES - 1 < ntiles) load_tile(t + STAGES - 1);
    cp_async_commit();

    const uint8_t* tile = sm.kv[t % STAGES];
    const int tok_base = lo + t * kTileN + wq * 16;  // request-relative token of this warp's first row

    float s[2][4];
    tile_scores<kIntK>(s, tile, q_lane, wq, lane);
    tile_mask_and_max(s, row_fac, lim, tok_base, g, c, &sm.red[wq][mg * 16]);
    __syncthreads();
    float alpha[2];
    tile_softmax(s, m_run, l_run, alpha, &sm.red[0][mg * 16], MT * 16, &sm.p[mg * 16 * kPStride], wq, g, c);
    __syncthreads();
    tile_pv<kIntV>(acc, alpha, tile, p_lane, wq, g, c);
  }
  cp_async_wait<0>();

  // --- epilogue: row sums across the quad and the warps, O staged in smem as bf16, 16-byte stores
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
  __syncthreads();  // every warp is done with the K tiles and the last tile's row maxima
  if (c == 0) {
    sm.red[wq][mg * 16 + g] = l_run[0];
    sm.red[wq][mg * 16 + g + 8] = l_run[1];
  }
  __syncthreads();
  __nv_bfloat16* o_stage = reinterpret_cast<__nv_bfloat16*>(sm.kv[0]);  // [kRows][512]
  static_assert(kRows * kLatent * 2 <= STAGES * kTileN * kSmemRow, "O staging must fit the K ring");
  float* lse_out = p.lse_part + static_cast<int64_t>(split) * p.rows_total + flat0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = mg * 16 + g + 8 * h;
    float l = 0.f;
#pragma unroll
    for (int w = 0; w < kWarpsPerM; ++w) l += sm.red[w][r];
    const float inv = l > 0.f ? (kIntV ? p.kv_scale * kIntConvertScale : p.kv_scale) / l : 0.f;
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
  __syncthreads();
  uint4* o_out = reinterpret_cast<uint4*>(p.o_part + (static_cast<int64_t>(split) * p.rows_total + flat0) * kLatent);
  const uint4* o_src = reinterpret_cast<const uint4*>(o_stage);
  for (int i = tid; i < valid_rows * (kLatent / 8); i += kThreads) o_out[i] = o_src[i];
}

// ---- M1c, warp-specialized (16-row CTAs) --------------------------------------------------------
//
// One CTA per (16-row group, split, request), 9 warps: warp 8 is the producer, gathering the
// split's 64-token tiles with cp.async into a kWsStages-deep ring and signalling each stage's
// "full" mbarrier (cp.async.mbarrier.arrive); warps 0-3 (consumer 0) and 4-7 (consumer 1) take
// the even and odd tiles, each with its own online-softmax state and the same per-tile math as
// splitkv_kernel (their syncs are named barriers of 128 threads, never the whole CTA), and give
// the stage back on its "empty" mbarrier. With 4 stages, stage s only ever serves consumer s % 2.
// At the end consumer 1 hands (max, sum, O) to consumer 0 through smem, which merges and stores.

constexpr int kWsStages = 4;
constexpr int kWsConsumers = 2;
constexpr int kWsThreads = 32 * (4 * kWsConsumers + 1);

struct WsSmem {
  uint8_t kv[kWsStages][kTileN * kSmemRow];
  __half q[16 * kQStride];
  __half p[kWsConsumers][2][16 * kPStride];  // double-buffered: a warp's next P never meets a slower warp's PV
  float red[kWsConsumers][kWarpsPerM][16];
  float row_fac[16];
  float m_other[16];
  uint64_t full[kWsStages];
  uint64_t empty[kWsStages];
};

__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// arrives once this thread's earlier cp.async copies have landed
__device__ __forceinline__ void mbar_arrive_cp_async(uint64_t* bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, int parity) {
  asm volatile(
      "{\n .reg .pred done;\n wait_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra wait_%=;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void named_barrier(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__global__ void __launch_bounds__(kWsThreads, 1) splitkv_ws_kernel(const SplitKVParams p) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<WsSmem*>(smem_raw);
  constexpr int kRows = 16;
  constexpr int kConsumerThreads = 128 * kWsConsumers;

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int split = blockIdx.y;
  const int rows_per_req = p.qlen * p.heads;
  const int row0 = blockIdx.x * kRows;
  griddep_launch_dependents();
  const CtaWork work = cta_work(p, kRows);
  const int start = work.start;
  const int lo = work.lo, hi = work.hi, ntiles = work.ntiles, valid_rows = work.valid_rows;
  const int64_t flat0 = work.flat0;
  if (ntiles == 0) {
    write_empty_split(p, work, tid, kWsThreads);
    return;
  }
  if (tid == 0) {
    for (int s = 0; s < kWsStages; ++s) {
      mbar_init(&sm.full[s], 32);   // the producer's 32 lanes, each once its copies landed
      mbar_init(&sm.empty[s], 128);  // the consuming warpgroup's threads
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp == 4 * kWsConsumers) {
    // --- producer: lane l holds the indices of tokens l and l + 32 of a tile, one tile ahead
    const int* idx_base = p.indices + start;
    auto fetch = [&](int t, int k) -> int {
      const int j = lo + t * kTileN + k * 32 + lane;
      return (t < ntiles && j < hi) ? idx_base[j] : -1;
    };
    int idx0 = fetch(0, 0), idx1 = fetch(0, 1);
    for (int t = 0; t < ntiles; ++t) {
      const int s = t % kWsStages;
      const int cur0 = idx0, cur1 = idx1;
      idx0 = fetch(t + 1, 0);
      idx1 = fetch(t + 1, 1);
      if (t >= kWsStages) mbar_wait(&sm.empty[s], (t / kWsStages - 1) & 1);
      uint8_t* dst = sm.kv[s];
#pragma unroll 8
      for (int r = 0; r < kTileN; ++r) {  // the first 512 bytes of each row: one chunk a lane
        const int idx = __shfl_sync(0xffffffffu, r < 32 ? cur0 : cur1, r % 32);
        const bool ok = idx >= 0 && idx < p.num_kv_rows;
        const uint8_t* src = p.kv + (ok ? static_cast<int64_t>(idx) * kRowBytes + lane * 16 : 0);
        cp_async_16(dst + r * kSmemRow + lane * 16, src, ok ? 16 : 0);
      }
#pragma unroll
      for (int i = 0; i < kTileN * 4 / 32; ++i) {  // the last 64 bytes: 4 chunks a row
        const int e = i * 32 + lane;
        const int r = e / 4, ch = 32 + e % 4;
        const int i0 = __shfl_sync(0xffffffffu, cur0, r % 32), i1 = __shfl_sync(0xffffffffu, cur1, r % 32);
        const int idx = r < 32 ? i0 : i1;
        const bool ok = idx >= 0 && idx < p.num_kv_rows;
        const uint8_t* src = p.kv + (ok ? static_cast<int64_t>(idx) * kRowBytes + ch * 16 : 0);
        cp_async_16(dst + r * kSmemRow + ch * 16, src, ok ? 16 : 0);
      }
      mbar_arrive_cp_async(&sm.full[s]);
    }
    cp_async_commit();
    cp_async_wait<0>();  // no copy outlives its thread
    return;
  }

  // --- consumers
  const int cg = warp / 4, wq = warp % 4;  // consumer warpgroup; token / column quarter within it
  const int g = lane / 4, c = lane % 4;
  stage_query_rows(p, sm.q, sm.row_fac, flat0, valid_rows, kRows, warp, 4 * kWsConsumers, lane, false);
  int lim[2];
  float m_run[2], l_run[2];
  float acc[16][4];
  init_row_state(p, work, row0 + g, lim, m_run, l_run, acc);
  named_barrier(1, kConsumerThreads);  // Q and row_fac in smem
  const float row_fac[2] = {sm.row_fac[g], sm.row_fac[g + 8]};
  const __half* q_lane = &sm.q[(lane & 15) * kQStride + (lane >> 4) * 8];
  const int wg_bar = 2 + cg;

  for (int t = cg, it = 0; t < ntiles; t += kWsConsumers, ++it) {
    const int s = t % kWsStages;
    mbar_wait(&sm.full[s], (t / kWsStages) & 1);
    const uint8_t* tile = sm.kv[s];
    __half* p_buf = sm.p[cg][it % 2];
    const int tok_base = lo + t * kTileN + wq * 16;

    float s_acc[2][4];
    tile_scores<false>(s_acc, tile, q_lane, wq, lane);
    tile_mask_and_max(s_acc, row_fac, lim, tok_base, g, c, sm.red[cg][wq]);
    named_barrier(wg_bar, 128);
    float alpha[2];
    tile_softmax(s_acc, m_run, l_run, alpha, sm.red[cg][0], 16, p_buf, wq, g, c);
    named_barrier(wg_bar, 128);  // P complete; every warp of the group has read the row maxima
    tile_pv<false>(acc, alpha, tile, &p_buf[(lane & 15) * kPStride + (lane >> 4) * 8], wq, g, c);
    mbar_arrive(&sm.empty[s]);  // this thread is done with the stage
  }

  // --- epilogue: consumer 1's (max, row sums, O) through smem to consumer 0, which merges
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 1);
    l_run[h] += __shfl_xor_sync(0xffffffffu, l_run[h], 2);
  }
  named_barrier(1, kConsumerThreads);  // both groups are done with every tile and the row maxima
  float* o_other = reinterpret_cast<float*>(sm.kv[0]);  // [16][512] f32: 32 KB of the ring
  static_assert(16 * kLatent * 4 <= kTileN * kSmemRow, "consumer 1's O must fit one stage");
  if (c == 0) {
    sm.red[cg][wq][g] = l_run[0];
    sm.red[cg][wq][g + 8] = l_run[1];
  }
  if (cg == 1) {
    if (wq == 0 && c == 0) {
      sm.m_other[g] = m_run[0];
      sm.m_other[g + 8] = m_run[1];
    }
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < 16; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e)
          o_other[(g + 8 * h) * kLatent + wq * 128 + (j / 4) * 32 + 4 * (2 * c + e) + (j % 4)] = acc[j][2 * h + e];
  }
  named_barrier(1, kConsumerThreads);
  if (cg == 1) return;
  __nv_bfloat16* o_stage = reinterpret_cast<__nv_bfloat16*>(sm.kv[2]);  // [16][512] bf16
  float* lse_out = p.lse_part + static_cast<int64_t>(split) * p.rows_total + flat0;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = g + 8 * h;
    float l0 = 0.f, l1 = 0.f;
#pragma unroll
    for (int w = 0; w < kWarpsPerM; ++w) {
      l0 += sm.red[0][w][r];
      l1 += sm.red[1][w][r];
    }
    const float m0 = m_run[h], m1 = sm.m_other[r];
    const float mx = fmaxf(m0, m1);
    const float m_safe = mx == -INFINITY ? 0.f : mx;
    const float f0 = fast_exp2(m0 - m_safe), f1 = fast_exp2(m1 - m_safe);
    const float l = l0 * f0 + l1 * f1;
    const float inv = l > 0.f ? p.kv_scale / l : 0.f;
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int col = wq * 128 + (j / 4) * 32 + 4 * (2 * c + e) + (j % 4);
        o_stage[r * kLatent + col] = __float2bfloat16_rn((acc[j][2 * h + e] * f0 + o_other[r * kLatent + col] * f1) * inv);
      }
    if (wq == 0 && c == 0 && row0 + r < rows_per_req) lse_out[r] = l > 0.f ? (mx + log2f(l)) * kLn2 : -INFINITY;
  }
  named_barrier(2, 128);
  uint4* o_out = reinterpret_cast<uint4*>(p.o_part + (static_cast<int64_t>(split) * p.rows_total + flat0) * kLatent);
  const uint4* o_src = reinterpret_cast<const uint4*>(o_stage);
  for (int i = tid; i < valid_rows * (kLatent / 8); i += 128) o_out[i] = o_src[i];
}

// ---- M1b ---------------------------------------------------------------------------------------

constexpr int kMergeThreads = 128;
constexpr int kMergeUnroll = 8;

// One CTA per (row, block of `cols` output columns: 64..512). Thread t reads 4 columns (8 bytes)
// of split rows t / (cols / 4), + slots, ...: with 64 columns a CTA has 8 x 8 split rows in
// flight, so a few rows with many splits (one request, long context) take ~1 round of latency.

__global__ void __launch_bounds__(kMergeThreads) merge_kernel(const __nv_bfloat16* __restrict__ o_part,
                                                               const float* __restrict__ lse_part,
                                                               __nv_bfloat16* __restrict__ o, float* __restrict__ lse,
                                                               int rows, int splits, int cols) {
  __shared__ float red[kMergeThreads / 32];
  __shared__ float red_acc[kLatent];         // [slots][cols]
  __shared__ float red_sum[kLatent / 64];    // [slots], at most 8
  griddep_wait();  // the split grid's partials (a no-op unless launched programmatically)
  const int row = blockIdx.x, col0 = blockIdx.y * cols;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int quads = cols / 4;                 // threads a split row: 4 columns (8 bytes) each
  const int slots = kMergeThreads / quads;    // split rows a load round
  const int slot = tid / quads, quad = tid % quads;

  // the row's max LSE over all splits
  float mx = -INFINITY;
  for (int s = tid; s < splits; s += kMergeThreads) mx = fmaxf(mx, lse_part[static_cast<int64_t>(s) * rows + row]);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
  if (lane == 0) red[warp] = mx;
  __syncthreads();
#pragma unroll
  for (int w = 0; w < kMergeThreads / 32; ++w) mx = fmaxf(mx, red[w]);
  __nv_bfloat16* o_row = o + static_cast<int64_t>(row) * kLatent + col0;
  if (mx == -INFINITY) {  // every split empty
    for (int c = tid * 8; c < cols; c += kMergeThreads * 8) *reinterpret_cast<uint4*>(o_row + c) = make_uint4(0, 0, 0, 0);
    if (blockIdx.y == 0 && tid == 0) lse[row] = -INFINITY;
    return;
  }
  // slot k sums splits k, k + slots, ...; kMergeUnroll of them in flight; empty splits are not read
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  float wsum = 0.f;
  for (int s0 = slot; s0 < splits; s0 += slots * kMergeUnroll) {
    float wt[kMergeUnroll];
    uint2 v[kMergeUnroll];
#pragma unroll
    for (int u = 0; u < kMergeUnroll; ++u) {
      const int s = s0 + u * slots;
      const float l = s < splits ? lse_part[static_cast<int64_t>(s) * rows + row] : -INFINITY;
      wt[u] = l == -INFINITY ? 0.f : __expf(l - mx);
      const uint2* src = reinterpret_cast<const uint2*>(o_part + (static_cast<int64_t>(s) * rows + row) * kLatent + col0);
      v[u] = wt[u] > 0.f ? src[quad] : make_uint2(0, 0);
    }
#pragma unroll
    for (int u = 0; u < kMergeUnroll; ++u) {
      wsum += wt[u];
      const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&v[u]);
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float2 f = __bfloat1622float2(b[i]);
        acc[2 * i] += wt[u] * f.x;
        acc[2 * i + 1] += wt[u] * f.y;
      }
    }
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
  if (blockIdx.y == 0 && tid == 0) lse[row] = mx + logf(total);
}

// ---- host --------------------------------------------------------------------------------------

void check_cuda_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), "kimi_ops._C: ", name, " must be a CUDA tensor");
  TORCH_CHECK(t.scalar_type() == dtype, "kimi_ops._C: ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), "kimi_ops._C: ", name, " must be contiguous");
}

void launch_splitkv_ws(const SplitKVParams& params, dim3 grid, cudaStream_t stream) {
  constexpr size_t smem = sizeof(WsSmem);
  static bool configured[64] = {};
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= 64 || !configured[device]) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(splitkv_ws_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    if (device < 64) configured[device] = true;
  }
  splitkv_ws_kernel<<<grid, kWsThreads, smem, stream>>>(params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int MT, int STAGES, int CVT = 0>
void launch_splitkv(const SplitKVParams& params, dim3 grid, cudaStream_t stream) {
  constexpr size_t smem = sizeof(SplitKVSmem<MT, STAGES>);
  auto* kernel = splitkv_kernel<MT, STAGES, CVT>;
  static bool configured[64] = {};  // per device: the dynamic smem limit is a per-context attribute
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  if (device >= 64 || !configured[device]) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    if (device < 64) configured[device] = true;
  }
  kernel<<<grid, 128 * MT, smem, stream>>>(params);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

// The rows of one CTA (16, 32 or 64) and the depth of its K ring: chosen on the host from qlen * H.
std::tuple<at::Tensor, at::Tensor> mla_decode_splitkv_sm90(const at::Tensor& q, const at::Tensor& kv,
                                                           const at::Tensor& indptr, const at::Tensor& indices,
                                                           const std::optional<at::Tensor>& seq_lens, int64_t qlen,
                                                           double qk_scale_log2, double kv_scale, int64_t num_splits,
                                                           int64_t dcp_rank, int64_t dcp_world_size,
                                                           int64_t rows_per_cta, int64_t stages,
                                                           int64_t balance_ctas, bool warp_specialized,
                                                           bool zero_empty, int64_t convert_mode) {
  check_cuda_tensor(q, "q", at::kBFloat16);
  check_cuda_tensor(kv, "kv_cache", at::ScalarType::Float8_e4m3fn);
  check_cuda_tensor(indptr, "kv_indptr", at::kInt);
  check_cuda_tensor(indices, "kv_indices", at::kInt);
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kRowBytes, "kimi_ops._C: q must be [T, H, 576]");
  TORCH_CHECK(kv.dim() == 2 && kv.size(1) == kRowBytes, "kimi_ops._C: kv_cache must be [N, 576]");
  TORCH_CHECK(qlen >= 1 && q.size(0) % qlen == 0, "kimi_ops._C: qlen must divide T");
  TORCH_CHECK(num_splits >= 1 && num_splits <= 65535, "kimi_ops._C: num_splits must be in [1, 65535]");
  TORCH_CHECK(rows_per_cta == 16 || rows_per_cta == 32 || rows_per_cta == 64,
              "kimi_ops._C: rows_per_cta must be 16, 32 or 64");
  TORCH_CHECK(stages >= 2 && stages <= (rows_per_cta == 16 ? 4 : 3),
              "kimi_ops._C: stages must be 2..4 (16 rows per CTA) or 2..3 (32 or 64)");
  const int64_t T = q.size(0), H = q.size(1), R = T / qlen;
  TORCH_CHECK(indptr.numel() == R + 1, "kimi_ops._C: kv_indptr must have T / qlen + 1 entries");
  TORCH_CHECK(R <= 65535, "kimi_ops._C: at most 65535 requests");
  if (seq_lens.has_value()) check_cuda_tensor(*seq_lens, "seq_lens", at::kInt);
  const c10::cuda::CUDAGuard guard(q.device());
  auto o_part = at::empty({num_splits, T, H, kLatent}, q.options());
  auto lse_part = at::empty({num_splits, T, H}, q.options().dtype(at::kFloat));
  if (T == 0 || H == 0) return {o_part, lse_part};

  SplitKVParams params{};
  params.q = reinterpret_cast<const __nv_bfloat16*>(q.data_ptr());
  params.kv = reinterpret_cast<const uint8_t*>(kv.data_ptr());
  params.indptr = indptr.data_ptr<int>();
  params.indices = indices.numel() > 0 ? indices.data_ptr<int>() : indptr.data_ptr<int>();
  params.seq_lens = seq_lens.has_value() ? seq_lens->data_ptr<int>() : nullptr;
  params.o_part = reinterpret_cast<__nv_bfloat16*>(o_part.data_ptr());
  params.lse_part = lse_part.data_ptr<float>();
  params.num_kv_rows = kv.size(0);
  params.rows_total = static_cast<int>(T * H);
  params.num_requests = static_cast<int>(R);
  params.balance_ctas = static_cast<int>(std::min<int64_t>(std::max<int64_t>(balance_ctas, 0), INT32_MAX));
  params.zero_empty = zero_empty || num_splits == 1;  // with one split, o_part[0] is the output
  params.heads = static_cast<int>(H);
  params.qlen = static_cast<int>(qlen);
  params.num_splits = static_cast<int>(num_splits);
  params.dcp_rank = static_cast<int>(dcp_rank);
  params.dcp_world = static_cast<int>(dcp_world_size);
  params.qk_scale_log2 = static_cast<float>(qk_scale_log2);
  params.kv_scale = static_cast<float>(kv_scale);

  const int64_t groups = (qlen * H + rows_per_cta - 1) / rows_per_cta;
  TORCH_CHECK(groups <= INT32_MAX, "kimi_ops._C: too many query rows per request");
  const dim3 grid(static_cast<unsigned>(groups), static_cast<unsigned>(num_splits), static_cast<unsigned>(R));
  auto stream = c10::cuda::getCurrentCUDAStream();
  TORCH_CHECK(convert_mode >= 0 && convert_mode <= 3, "kimi_ops._C: convert_mode must be 0..3");
  TORCH_CHECK(convert_mode == 0 || (rows_per_cta == 16 && stages == 2 && !warp_specialized),
              "kimi_ops._C: convert_mode 1..3 is built for splitkv_kernel's 16-row, 2-stage CTAs only");
  if (warp_specialized) {
    TORCH_CHECK(rows_per_cta == 16, "kimi_ops._C: the warp-specialized kernel takes 16-row CTAs");
    launch_splitkv_ws(params, grid, stream);
    return {o_part, lse_part};
  }
  switch (rows_per_cta * 10 + stages) {
    case 162:
      switch (convert_mode) {
        case 1: launch_splitkv<1, 2, 1>(params, grid, stream); break;
        case 2: launch_splitkv<1, 2, 2>(params, grid, stream); break;
        case 3: launch_splitkv<1, 2, 3>(params, grid, stream); break;
        default: launch_splitkv<1, 2>(params, grid, stream); break;
      }
      break;
    case 163: launch_splitkv<1, 3>(params, grid, stream); break;
    case 164: launch_splitkv<1, 4>(params, grid, stream); break;
    case 322: launch_splitkv<2, 2>(params, grid, stream); break;
    case 323: launch_splitkv<2, 3>(params, grid, stream); break;
    case 642: launch_splitkv<4, 2>(params, grid, stream); break;
    default: launch_splitkv<4, 3>(params, grid, stream); break;
  }
  return {o_part, lse_part};
}

// pdl: launch with programmatic stream serialization, so the merge's launch and scheduling overlap
// the split kernel's last wave (it still reads nothing before that grid has completed).
std::tuple<at::Tensor, at::Tensor> mla_merge_sm90(const at::Tensor& o_part, const at::Tensor& lse_part, bool pdl) {
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
  // Column blocks: up to 8 (64 columns each) while the grid stays within 16 CTAs a SM.
  int device = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  int col_blocks = 1;
  while (col_blocks < 8 && rows * col_blocks * 2 <= 16 * static_cast<int64_t>(sms)) col_blocks *= 2;
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(col_blocks));
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = dim3(kMergeThreads);
  config.dynamicSmemBytes = 0;
  config.stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = pdl ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, merge_kernel, reinterpret_cast<const __nv_bfloat16*>(o_part.data_ptr()),
                                    lse_part.data_ptr<float>(),
                                    reinterpret_cast<__nv_bfloat16*>(o.data_ptr()), lse.data_ptr<float>(),
                                    static_cast<int>(rows), static_cast<int>(S), kLatent / col_blocks));
  return {o, lse};
}

}  // namespace kimi_ops::sm90

TORCH_LIBRARY_FRAGMENT(kimi_ops, m) {
  m.def(
      "_mla_decode_splitkv_sm90(Tensor q, Tensor kv_cache, Tensor kv_indptr, Tensor kv_indices, "
      "Tensor? seq_lens, int qlen, float qk_scale_log2, float kv_scale, int num_splits, int dcp_rank, "
      "int dcp_world_size, int rows_per_cta, int stages, int balance_ctas, bool warp_specialized, bool zero_empty, int convert_mode) -> (Tensor, Tensor)");
  m.def("_mla_merge_sm90(Tensor o_part, Tensor lse_part, bool pdl) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kimi_ops, CUDA, m) {
  m.impl("_mla_decode_splitkv_sm90", &kimi_ops::sm90::mla_decode_splitkv_sm90);
  m.impl("_mla_merge_sm90", &kimi_ops::sm90::mla_merge_sm90);
}
