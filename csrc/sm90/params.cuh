// Shared constants and the split kernels' parameter block (SplitKVParams), for both M1c kernels
// (decode_rows16.cuh, decode_token_major.cuh), the work list (work_list.cuh) and the host launchers
// (mla_decode_sm90.cu).
//
// Byte layouts the kernels read and write through SplitKVParams (DESIGN.md):
//   q         [T*H, 576] bf16      flat row (r*qlen + i)*H + h: request r, position i, head h;
//             or [T*H, 576] fp8 e4m3fn (576-byte rows) with q_scale [1] f32 (the fp8 query)
//   kv        [N, 576] fp8 e4m3fn  token row = [kv_c (512) | k_pe (64)] (576 bytes), value = fp8 * kv_scale
//   indptr    [R+1] int32, indices [indptr[R]] int32 (page-size-1 CSR; an index outside
//             [0, N) reads as an all-zero row, nothing outside the cache is touched)
//   seq_lens  [R] int32 or null (the global lengths for the causal bound under DCP)
//   o_part    [S, T*H, 512] bf16, lse_part [S, T*H] f32 (natural log; o = 0, lse = -inf
//             for a row that sees no token of its split); on the work-list grid
//             [W, qlen*H, 512] / [W, qlen*H] (work_list.cuh), o_final [T*H, 512] bf16,
//             lse_final [T*H] f32
// Shared-memory K tile rows are kSmemRow = 592 bytes apart (576 + 16).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

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

struct SplitKVParams {
  const __nv_bfloat16* q;  // bf16 [T*H, 576], or with q_scale the fp8 e4m3fn bytes [T*H, 576]
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
  int tail_fold;     // work list: a request's last split of at most this many tokens joins the one before
  __nv_bfloat16* o_final;  // work list: a request with one used split writes o / lse here, [T*H, 512]
  float* lse_final;        //   and [T*H] (its rows skip the merge)
  float qk_scale_log2;  // scale * kv_scale * log2(e)
  float kv_scale;
  const float* q_scale;  // fp8 query: its scale, [1] f32 on the device (real q = fp8 q * q_scale); else nullptr
  bool kv_before_wait;   // a PDL launch whose caller promised kv, indptr, indices and seq_lens constant
                         // (mla_decode's constant_kv): a CTA finds its work item and starts copying its
                         // first tiles before wait_prior_grid; q, q_scale and every write come after it
};

}  // namespace
}  // namespace kimi_ops::sm90
