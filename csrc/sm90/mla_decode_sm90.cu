// Hopper (sm_90a) M1c (split-KV MLA decode) and M1b (merge of split partials): the host launchers
// (argument checks, outputs, grids, kernel choice) of the kernels in this directory:
//   params.cuh              constants, SplitKVParams
//   copy.cuh, ptx.cuh       PTX wrappers (cp.async / bulk copies / mbarriers; barriers, ldmatrix,
//                           wgmma, mma.sync, conversions)
//   work_list.cuh           split lengths, the split balance, the work list, a CTA's share
//   fragments.cuh           Q staging, V^T fragments, the cp.async tile loader
//   decode_rows16.cuh       splitkv_kernel (16 rows a CTA)
//   decode_token_major.cuh  splitkv_tm_kernel (24, 32, 48, 64 rows a CTA)
//   merge.cuh               merge_kernel, merge_rows_kernel
//   launch.h                cudaLaunchKernelEx with PDL on request, the switches' readers (host)
// The ops are registered in csrc/registration.cpp (entry points: ops.h). One translation unit:
// the headers are included in this order, each kernel's code as it was in the single file.
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
// splitkv_tm_kernel (24, 32, 48 or 64 rows a CTA, two warpgroups): the same numerics and
// fragments, but token-major wgmma products, S^T = K Q^T and O^T = V^T P^T, with the query rows as
// N, so each fp8 byte is converted once per CTA (24, 32, 48 rows: 128-token tiles) or once per
// warpgroup (64 rows) rather than once per 16 rows (decode_token_major.cuh). Its tiles come by
// cp.async (every thread's 16-byte chunks; for 48-row CTAs of a one-CTA request, a tile by halves)
// or, for 24- and 32-row CTAs of more than one tile, one bulk copy a token row (tm_load).
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
// the merge finds a row's slots from kv_indptr alone (first_slot: the used splits of the requests
// before its own), before its PDL wait.
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

#include <algorithm>
#include <cstdint>
#include <string>

#include "copy.cuh"
#include "params.cuh"
#include "ptx.cuh"
#include "work_list.cuh"
#include "fragments.cuh"
#include "decode_rows16.cuh"
#include "decode_token_major.cuh"
#include "launch.h"
#include "merge.cuh"
#include "ops.h"

namespace kimi_ops::sm90 {
namespace {

// ---- host --------------------------------------------------------------------------------------

// Programmatic dependent launch of these kernels (ptx.cuh: wait_prior_grid / allow_next_grid) only
// with KIMI_OPS_SM90_PDL=1 (and not KIMI_OPS_PDL=0): on the H200 it made mla_decode 2-7% slower at
// qlen 2-8 and batch 128 and no faster elsewhere (docs/PERF.md, session 21), so by default they
// launch plainly, where the two instructions are no-ops. Read at each launch; a CUDA graph keeps
// what its capture saw. (The Triton kernels around them take PDL by default: kimi_ops/kernels/pdl.py.)
bool pdl_enabled() { return pdl_env_allows() && env_equals("KIMI_OPS_SM90_PDL", "1"); }

// constant_kv (mla_decode's promise that the kernel queued before it writes neither the cache nor the
// metadata): the split kernel launches with PDL and each CTA finds its work item and starts its first
// tiles' copies before wait_prior_grid, so they overlap the previous kernel (M1a in the decode
// layer); the merge launches with PDL too, except at 2-4 requests (merge_pdl).
// KIMI_OPS_SM90_EARLY_KV=0 ignores the promise (A/Bs).
bool kv_before_wait(bool constant_kv) {
  return constant_kv && pdl_env_allows() && !env_equals("KIMI_OPS_SM90_EARLY_KV", "0");
}

// Each failing check's message is one std::string (or a literal), which TORCH_CHECK passes on as
// is: c10::str formats two or more arguments through an ostringstream, and on the H200 image
// (torch 2.11, nvcc 13 with /opt/gcc) a message formatting a number that way crashed the process
// instead of raising (gemv_sm90.cu; docs/perf-history.md, session 25). Numbers: std::to_string.
std::string message(const char* name, const char* what) { return std::string("kimi_ops._C: ") + name + what; }

void check_cuda_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), message(name, " must be a CUDA tensor"));
  TORCH_CHECK(t.scalar_type() == dtype, message(name, " must be ") + c10::toString(dtype) + ", got " +
                                            c10::toString(t.scalar_type()));
  TORCH_CHECK(t.is_contiguous(), message(name, " must be contiguous"));
}

// Whether a grid of `ctas` CTAs has at most one a SM (rows16_smem's early-launch rule).
bool at_most_one_cta_a_sm(int64_t ctas) { return ctas <= current_device_attribute(cudaDevAttrMultiProcessorCount); }

// kKernel<<<grid, threads, smem>>>(params), its dynamic shared-memory limit raised first where
// needed (launch.h: allow_dynamic_smem). smem: sizeof(Smem) or more (rows16_smem).
template <auto kKernel, typename Smem>
void launch_kernel(int threads, const SplitKVParams& params, dim3 grid, cudaStream_t stream,
                   size_t smem = sizeof(Smem)) {
  allow_dynamic_smem<kKernel>(smem);
  launch(kKernel, grid, threads, smem, stream, params, pdl_enabled() || params.kv_before_wait);
}

// The 16-row kernel's shared memory where its grid has at most one CTA a SM and it launches before
// the previous kernel is done (kv_before_wait): half a SM's, so that no SM takes two of its CTAs
// while another has none (the scheduler places them while the previous kernel still holds SMs;
// two one-tile CTAs on one SM share its copies and set the grid's time). Else sizeof(Smem).
template <typename Smem>
size_t rows16_smem(const SplitKVParams& params, dim3 grid) {
  if (!params.kv_before_wait || env_equals("KIMI_OPS_SM90_ONE_CTA", "0")) return sizeof(Smem);
  if (!at_most_one_cta_a_sm(static_cast<int64_t>(grid.x) * grid.y * grid.z)) return sizeof(Smem);
  return std::max(sizeof(Smem),
                  static_cast<size_t>(current_device_attribute(cudaDevAttrMaxSharedMemoryPerMultiprocessor) / 2));
}

// the fp8-query instance where params.q_scale is set
template <int STAGES>
void launch_splitkv(const SplitKVParams& params, dim3 grid, cudaStream_t stream) {
  using Smem = SplitKVSmem<STAGES>;
  const size_t smem = rows16_smem<Smem>(params, grid);
  if (params.q_scale != nullptr)
    launch_kernel<splitkv_kernel<STAGES, true>, Smem>(kSplitKVThreads, params, grid, stream, smem);
  else
    launch_kernel<splitkv_kernel<STAGES, false>, Smem>(kSplitKVThreads, params, grid, stream, smem);
}

// the fp8-query instance where params.q_scale is set
template <int NT, int STAGES, int TILE, TmLoad kLoad>
void launch_tm_instance(const SplitKVParams& params, dim3 grid, cudaStream_t stream) {
  using Smem = TokenMajorSmem<NT, STAGES, TILE>;
  if (params.q_scale != nullptr)
    launch_kernel<splitkv_tm_kernel<NT, STAGES, TILE, true, kLoad>, Smem>(32 * kTmWarps, params, grid, stream);
  else
    launch_kernel<splitkv_tm_kernel<NT, STAGES, TILE, false, kLoad>, Smem>(32 * kTmWarps, params, grid, stream);
}

// How a token-major CTA gathers its tiles (only these pairings are instantiated):
// - 32 rows: bulk copies where its CTAs average more than one 128-token tile (cta_tokens: the
//   listed tokens over the CTAs of a row group), else cp.async. Measured on an H100 (2026-12-06,
//   docs/perf-history.md "Session 42"): bulk 2-10% faster at >= 2 tiles a CTA (H12 q2 B32 8k
//   82.7 -> 74.9 us), 6% slower at one tile (B2 q2 8k); at 48 rows 6-9% slower, at 64 (64-token
//   tiles) 26%, so those keep cp.async.
// - 48 rows: the 128-token tiles by halves (up to 1.5 tiles in flight) where a request's rows are
//   one CTA, else whole (cp.async). Measured on an H100 (2026-12-06, perf-history.md "Session 50";
//   whole -> halves, us): H12 q4 B32 8k 79.8-80.0 -> 76.3-76.6, q4 B8 8k 39.2-39.3 -> 38.8-38.9,
//   but where two CTAs share a request's tokens (through L2, fewer HBM bytes a CTA) the mid-PV
//   barrier and copy burst cost more than they return: H12 q8 B32 8k 118.9-124.2 -> 124.9-125.4,
//   H96 B64 4k 123.3-124.9 -> 130.1-131.0, H96 B8 8k 43.1 -> 43.8-44.1.
// - 24 rows (a request of 17-24 rows, one CTA): the 32-row rule. H100 (session 63): cp.async
//   8.9-9.8% slower at H12 q2 B32 / B64 8k (16-32 tiles a CTA), 2.4% faster at B8 8k (4 tiles),
//   within 0.5% at one tile or less.
// - 64 rows: cp.async.
// KIMI_OPS_SM90_TM_LOAD=cp forces cp.async at 24, 32 and 48 rows, =bulk bulk copies at 24 and 32,
// =halves halves at 48 (A/Bs).
TmLoad tm_load(int rows, const SplitKVParams& params, int64_t cta_tokens) {
  const bool force_cp = env_equals("KIMI_OPS_SM90_TM_LOAD", "cp");
  if ((rows == 24 || rows == 32) && !force_cp)
    return env_equals("KIMI_OPS_SM90_TM_LOAD", "bulk") || cta_tokens > 128 ? TmLoad::kBulk : TmLoad::kCpAsync;
  if (rows == 48 && !force_cp)
    return env_equals("KIMI_OPS_SM90_TM_LOAD", "halves") || params.qlen * params.heads <= 48 ? TmLoad::kCpAsyncHalves
                                                                                              : TmLoad::kCpAsync;
  return TmLoad::kCpAsync;
}

template <int NT, int STAGES, int TILE = kTileN>
void launch_splitkv_tm(const SplitKVParams& params, dim3 grid, cudaStream_t stream, int64_t cta_tokens) {
  const TmLoad load = tm_load(8 * NT, params, cta_tokens);
  if constexpr (NT == 3 || NT == 4) {
    if (load == TmLoad::kBulk) return launch_tm_instance<NT, STAGES, TILE, TmLoad::kBulk>(params, grid, stream);
  }
  if constexpr (NT == 6) {
    if (load == TmLoad::kCpAsyncHalves)
      return launch_tm_instance<NT, STAGES, TILE, TmLoad::kCpAsyncHalves>(params, grid, stream);
  }
  launch_tm_instance<NT, STAGES, TILE, TmLoad::kCpAsync>(params, grid, stream);
}

// Work list: a request's last split of at most this many tokens (a partial tile, of a chunk of 2
// tiles or more) is taken by the split before it where the grid holds at least 1.5 CTAs an SM;
// else none. On an H100 (docs/perf-history.md, session 62: mla_decode H12 q1, us) B8 8193 tokens,
// 264 CTAs with 8 one-token tails, 31.6 -> 26.9 with them folded (8192: 25.8), B8 8200 30.4 ->
// 27.0, B4 8193 (260 CTAs) 19.8 -> 19.1; but where most CTAs have an SM to themselves a tail costs
// little and the longer chunk more: B16 1025 (144 CTAs) 16.8 -> 17.7, B1 8193 (129) 14.2 -> 15.0,
// B2 8193 (130) 16.6 -> 17.6. Between 144 and 260 CTAs, and for 32-64-row CTAs (one an SM),
// unmeasured. KIMI_OPS_SM90_TAIL_FOLD (tokens, 0: none) overrides it, for A/Bs and tests.
int tail_fold_tokens(int64_t ctas, int64_t sms) {
  return env_nonnegative_int("KIMI_OPS_SM90_TAIL_FOLD", 2 * ctas >= 3 * sms ? kTileN : 0);
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
                             int64_t dcp_world_size, int64_t rows_per_cta, int64_t stages, int64_t balance_ctas,
                             const std::optional<at::Tensor>& q_scale) {
  // the fp8 query: e4m3fn bytes with q_scale, a float32 [1] tensor on q's device (read by the kernel)
  check_cuda_tensor(q, "q", q_scale.has_value() ? at::ScalarType::Float8_e4m3fn : at::kBFloat16);
  if (q_scale.has_value()) {
    check_cuda_tensor(*q_scale, "q_scale", at::kFloat);
    TORCH_CHECK(q_scale->numel() == 1, "kimi_ops._C: q_scale must hold one element");
    TORCH_CHECK(q_scale->device() == q.device(), "kimi_ops._C: q_scale must be on q's device");
  }
  check_cuda_tensor(kv, "kv_cache", at::ScalarType::Float8_e4m3fn);
  check_cuda_tensor(indptr, "kv_indptr", at::kInt);
  check_cuda_tensor(indices, "kv_indices", at::kInt);
  TORCH_CHECK(q.dim() == 3 && q.size(2) == kRowBytes, "kimi_ops._C: q must be [T, H, 576]");
  TORCH_CHECK(kv.dim() == 2 && kv.size(1) == kRowBytes, "kimi_ops._C: kv_cache must be [N, 576]");
  TORCH_CHECK(qlen >= 1 && q.size(0) % qlen == 0, "kimi_ops._C: qlen must divide T");
  TORCH_CHECK(num_splits >= 1 && num_splits <= 65535, "kimi_ops._C: num_splits must be in [1, 65535]");
  TORCH_CHECK(rows_per_cta == 16 || rows_per_cta == 24 || rows_per_cta == 32 || rows_per_cta == 48 ||
                  rows_per_cta == 64,
              "kimi_ops._C: rows_per_cta must be 16, 24, 32, 48 or 64");
  TORCH_CHECK(stages >= 2 && stages <= (rows_per_cta == 16 ? 4 : rows_per_cta == 64 ? 3 : 2),
              "kimi_ops._C: stages must be 2..4 (16 rows per CTA), 2 (24, 32 or 48) or 2..3 (64)");
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
  params.q_scale = q_scale.has_value() ? q_scale->data_ptr<float>() : nullptr;
  return params;
}

// 16 rows: splitkv_kernel; 24, 32 or 48: splitkv_tm_kernel on 128-token tiles; 64: on 64-token tiles
// (two 128-token stages and 64 rows' Q do not fit). listed_tokens: kv_indices' length.
void launch_splitkv(const SplitKVParams& params, int64_t rows_per_cta, int64_t stages, dim3 grid,
                    int64_t listed_tokens) {
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int64_t cta_tokens = listed_tokens / std::max<int64_t>(1, static_cast<int64_t>(grid.y) * grid.z);
  switch (rows_per_cta * 10 + stages) {
    case 162: launch_splitkv<2>(params, grid, stream); break;
    case 163: launch_splitkv<3>(params, grid, stream); break;
    case 164: launch_splitkv<4>(params, grid, stream); break;
    case 242: launch_splitkv_tm<3, 2, 128>(params, grid, stream, cta_tokens); break;
    case 322: launch_splitkv_tm<4, 2, 128>(params, grid, stream, cta_tokens); break;
    case 482: launch_splitkv_tm<6, 2, 128>(params, grid, stream, cta_tokens); break;
    case 642: launch_splitkv_tm<8, 2>(params, grid, stream, cta_tokens); break;
    default: launch_splitkv_tm<8, 3>(params, grid, stream, cta_tokens); break;
  }
}

// The merge launches with PDL (its CTAs are placed while the split CTAs finish, and merge_row finds
// their rows before the wait), except after an early-started split grid (kv_before_wait) of 2 to
// kMergePlainMaxRequests requests, where the decode layer measured slower with it (not understood).
// A/B on an H100 (docs/perf-history.md, session 41; plain -> PDL, us): mla_decode H12 x 8k alone
// B2-B128 0.3-1.3 faster, qlen 4 2.0; the fp8 / bf16 layer b7 55.9 -> 55.0 / 66.7 -> 65.7, b8
// 58.6 -> 57.1 / 69.2 -> 68.1, b3 0.1-0.8 faster, b2 within 0.5, but b4 50.8 -> 51.2 / 61.8 -> 64.9.
// (Session 36, before the merge found its rows before its wait, PDL lost 1-4 us at b2-b8.)
// KIMI_OPS_SM90_MERGE_PDL=0 keeps it plain, =1 takes it everywhere (A/Bs).
constexpr int64_t kMergePlainMaxRequests = 4;

bool merge_pdl(const SplitKVParams& params) {
  if (!pdl_env_allows() || env_equals("KIMI_OPS_SM90_MERGE_PDL", "0")) return false;
  if (env_equals("KIMI_OPS_SM90_MERGE_PDL", "1") || pdl_enabled()) return true;
  return !(params.kv_before_wait && params.num_requests >= 2 && params.num_requests <= kMergePlainMaxRequests);
}

// Fewer rows than 2 x SMs (up to 21 requests of 12 heads at qlen 1): merge_kernel, one CTA
// per (row, column block), with the fewest blocks (2, 4, 8 or 16: 256..32 columns) that give every
// SM a CTA and cover a row's splits (about splits_hint) in two load rounds of kMergeUnroll x blocks
// split rows. On an H100 (docs/perf-history.md, session 61: each launch shape forced) the best
// shape follows the rows: 12 rows 16 blocks, 24 rows 8, 48 rows 4, 96 rows 2-4, 192 rows 2; this
// rule picks those, where the one below (KIMI_OPS_SM90_MERGE_FEW_ROWS=0 keeps it for A/Bs) took
// merge_rows_kernel at <= 16 splits (0.3-1.0 us slower at 48-192 rows) and twice the blocks at 96
// and 192 rows of 15-35 splits (0.6-1.4 us slower).
// More rows: of about kMergeFewSplits splits or fewer, merge_rows_kernel, in rounds of 4 split rows
// up to 4 splits, else 8 (docs/PERF.md, session 17). Else merge_kernel with as few blocks (1, 2, 4,
// 8 or 16: 512..32 columns) as cover a row's splits in one load round of kMergeUnroll x blocks
// split rows a CTA, and, up to 8 blocks, at least one CTA a SM; KIMI_OPS_SM90_MERGE_BLOCKS=8 keeps
// the limit of 8 (64 columns) it had before 16 (A/B measurements: at 1 x 8k, 128 splits, 16 blocks
// take one load round where 8 took two). (The previous rule, blocks doubled while the grid stayed
// within 16 CTAs a SM, launched twice the CTAs at b32 8k / 32k and was 1-3% slower there:
// docs/PERF.md, session 11.) pdl: a launch with programmatic dependent launch (the kernels wait
// for the split grid first thing).
void launch_merge(MergeParams params, bool pdl) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t sms = current_device_attribute(cudaDevAttrMultiProcessorCount);
  const int64_t rows = params.rows;
  const bool few_rows = rows < 2 * sms && !env_equals("KIMI_OPS_SM90_MERGE_FEW_ROWS", "0");
  if (!few_rows && params.splits_hint <= kMergeFewSplits) {
    const unsigned ctas = static_cast<unsigned>((rows + kMergeWarpRows - 1) / kMergeWarpRows);
    auto kernel = params.splits_hint <= 4 ? merge_rows_kernel<4> : merge_rows_kernel<8>;
    launch(kernel, dim3(ctas), 32 * kMergeWarpRows, 0, stream, params, pdl);
    return;
  }
  const int max_blocks = env_equals("KIMI_OPS_SM90_MERGE_BLOCKS", "8") ? 8 : kMergeMaxBlocks;
  int col_blocks;
  if (few_rows) {
    col_blocks = 2;
    while (col_blocks < max_blocks && (rows * col_blocks < sms || 2 * kMergeUnroll * col_blocks < params.splits_hint))
      col_blocks *= 2;
  } else {
    col_blocks = 1;
    while (col_blocks < max_blocks &&
           (kMergeUnroll * col_blocks < params.splits_hint || (col_blocks < 8 && rows * col_blocks < sms)))
      col_blocks *= 2;
  }
  params.cols = kLatent / col_blocks;
  const dim3 grid(static_cast<unsigned>(rows), static_cast<unsigned>(col_blocks));
  launch(merge_kernel, grid, kMergeThreads, 0, stream, params, pdl);
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
                                                           int64_t balance_ctas, bool zero_empty,
                                                           const std::optional<at::Tensor>& q_scale,
                                                           bool constant_kv) {
  const c10::cuda::CUDAGuard guard(q.device());
  SplitKVParams params = splitkv_params(q, kv, indptr, indices, seq_lens, qlen, qk_scale_log2, kv_scale, num_splits,
                                        dcp_rank, dcp_world_size, rows_per_cta, stages, balance_ctas, q_scale);
  const int64_t T = q.size(0), H = q.size(1), R = T / qlen;
  auto o_part = at::empty({num_splits, T, H, kLatent}, q.options().dtype(at::kBFloat16));
  auto lse_part = at::empty({num_splits, T, H}, q.options().dtype(at::kFloat));
  if (T == 0 || H == 0) return {o_part, lse_part};
  params.o_part = reinterpret_cast<__nv_bfloat16*>(o_part.data_ptr());
  params.lse_part = lse_part.data_ptr<float>();
  params.zero_empty = zero_empty || num_splits == 1;  // one split: o_part[0] is the output
  params.kv_before_wait = kv_before_wait(constant_kv);
  const int64_t groups = (qlen * H + rows_per_cta - 1) / rows_per_cta;
  launch_splitkv(params, rows_per_cta, stages,
                 dim3(static_cast<unsigned>(groups), static_cast<unsigned>(num_splits), static_cast<unsigned>(R)),
                 indices.numel());
  return {o_part, lse_part};
}

// M1c + M1b on the work-list grid: (o [T, H, 512] bf16, lse [T, H] f32). One CTA per (row group,
// work item), W = work_list_items of them; a request's splits of more than one go through private
// partials [W, qlen, H, 512] and the merge, a request of one split is written to o directly.
std::tuple<at::Tensor, at::Tensor> mla_decode_sm90(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& indptr,
                                                   const at::Tensor& indices, const std::optional<at::Tensor>& seq_lens,
                                                   int64_t qlen, double qk_scale_log2, double kv_scale,
                                                   int64_t num_splits, int64_t dcp_rank, int64_t dcp_world_size,
                                                   int64_t rows_per_cta, int64_t stages, int64_t balance_ctas,
                                                   const std::optional<at::Tensor>& q_scale, bool constant_kv) {
  const c10::cuda::CUDAGuard guard(q.device());
  SplitKVParams params = splitkv_params(q, kv, indptr, indices, seq_lens, qlen, qk_scale_log2, kv_scale, num_splits,
                                        dcp_rank, dcp_world_size, rows_per_cta, stages, balance_ctas, q_scale);
  const int64_t T = q.size(0), H = q.size(1), R = T / qlen;
  const int64_t items = work_list_items(R, num_splits, balance_ctas);
  TORCH_CHECK(items <= 65535, "kimi_ops._C: the work-list grid takes at most 65535 items, got " + std::to_string(items));
  auto o = at::empty({T, H, kLatent}, q.options().dtype(at::kBFloat16));
  auto lse = at::empty({T, H}, q.options().dtype(at::kFloat));
  if (T == 0 || H == 0) return {o, lse};
  auto o_part = at::empty({items, qlen, H, kLatent}, q.options().dtype(at::kBFloat16));
  auto lse_part = at::empty({items, qlen, H}, q.options().dtype(at::kFloat));
  params.o_part = reinterpret_cast<__nv_bfloat16*>(o_part.data_ptr());
  params.lse_part = lse_part.data_ptr<float>();
  params.o_final = reinterpret_cast<__nv_bfloat16*>(o.data_ptr());
  params.lse_final = lse.data_ptr<float>();
  params.work_list = true;
  params.zero_empty = false;
  params.kv_before_wait = kv_before_wait(constant_kv);
  const int64_t groups = (qlen * H + rows_per_cta - 1) / rows_per_cta;
  params.tail_fold = tail_fold_tokens(groups * items, current_device_attribute(cudaDevAttrMultiProcessorCount));
  launch_splitkv(params, rows_per_cta, stages, dim3(static_cast<unsigned>(groups), static_cast<unsigned>(items), 1),
                 indices.numel());
  MergeParams merge{};
  merge.o_part = params.o_part;
  merge.lse_part = params.lse_part;
  merge.o = params.o_final;
  merge.lse = params.lse_final;
  merge.rows = static_cast<int>(T * H);
  merge.splits = static_cast<int>(num_splits);
  merge.work_indptr = params.indptr;
  merge.num_requests = static_cast<int>(R);
  merge.rows_per_req = static_cast<int>(qlen * H);
  merge.balance_ctas = params.balance_ctas;
  merge.tail_fold = params.tail_fold;
  // a request's used splits: about balance_ctas / R whole chunks and a partial one
  merge.splits_hint = static_cast<int>(
      balance_ctas > 0 ? std::min<int64_t>(num_splits, balance_ctas / std::max<int64_t>(R, 1) + 2) : num_splits);
  launch_merge(merge, merge_pdl(params));
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
  launch_merge(params, pdl_enabled());
  return {o, lse};
}

void impl_sm90_ops(torch::Library& m) {
  m.impl("_mla_decode_splitkv_sm90", &mla_decode_splitkv_sm90);
  m.impl("_mla_decode_sm90", &mla_decode_sm90);
  m.impl("_mla_merge_sm90", &mla_merge_sm90);
}

}  // namespace kimi_ops::sm90
