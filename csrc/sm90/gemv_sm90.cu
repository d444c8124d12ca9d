// Hopper (sm_90a) small-M projections: the host launcher of gemv_kernel (gemv.cuh) and of
// gemm_fp8_rows64_kernel (gemm_fp8_rows64.cuh: an fp8 w at 33-64 rows) and their op, _gemv_sm90
// (schema in csrc/registration.cpp, entry point in ops.h):
//   x [M, K] bf16 (M <= 32 with a bf16 w, 64 with an fp8 one; unit stride along K, rows 16-byte
//   aligned), w [N, K] bf16 or fp8 e4m3fn (contiguous, 16-byte aligned), w_scale_inv
//   [ceil(N / block_n), ceil(K / 128)] f32 with an fp8 w (unit stride along K), else none;
//   constant_w: w and w_scale_inv are not written by the kernels before this one on the stream (the
//   launch may then start while they run)
//   -> y [M, N] bf16.
// and of its kNorm form, the decode layer's q_b fused with the step's norms, cache write and gate
// (pre_norm.cuh), _norm_q_b_sm90:
//   q_c [T <= 16, K] bf16 (q_b's x before its RMSNorm; rows 16-byte aligned), kv_c [T, 512], k_pe [T, 64],
//   g [T, G] or none (bf16, unit stride along a row), q_norm_weight [K] / kv_norm_weight [512] bf16
//   (contiguous), kv_cache [N, 576] fp8 e4m3fn (written in place at slot_mapping's rows), slot_mapping
//   [T] int32 / int64, w / w_scale_inv as above, eps, kv_scale
//   -> (q [T, N] bf16 = rms_norm(q_c) @ w^T, gate [T, G] bf16 = sigmoid(g)).
// The caller (kimi_ops/kernels/sm90_gemv.py) checks what the kernel needs and takes another path
// where it does not hold; the checks here only guard the kernel.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>

#include "gemm_fp8_rows64.cuh"
#include "gemv.cuh"
#include "launch.h"
#include "ops.h"

namespace kimi_ops::sm90 {
namespace {

template <int WARPS, bool kFp8, int kUnroll, int kNT = 1>
void launch_gemv(const GemvParams& p, bool pdl, cudaStream_t stream) {
  const dim3 grid((p.N + kGemvRows - 1) / kGemvRows);
  launch(gemv_kernel<WARPS, kFp8, kUnroll, kNT>, grid, WARPS * 32, 0, stream, p, pdl);
}

// kNorm: the product's CTAs and one a token (pre_norm.cuh); norm_w in dynamic shared memory
template <bool kFp8, int kUnroll, int kNT>
void launch_norm_gemv(const GemvParams& p, bool pdl, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(p.main_ctas + p.M));
  launch(gemv_kernel<kNormWarps, kFp8, kUnroll, kNT, true>, grid, kNormWarps * 32,
         static_cast<size_t>(p.K) * sizeof(__nv_bfloat16), stream, p, pdl);
}

// 33..64 rows of x, fp8 w (gemm_fp8_rows64.cuh): a grid of (row tiles, K splits), the splits of a
// row tile one cluster, as many splits as fill the SMs' CTA slots (at most 8, the portable cluster
// size, and the k-blocks); 6 token tiles at M <= 48, else 8. kMT: 16 weight rows a warp (128 a
// CTA, two CTAs a SM; the default) or 32 (256 a CTA, one a SM: KIMI_OPS_SM90_ROWS64_MT=2, an A/B
// switch read at each launch).
template <int kMT, int kTiles>
void launch_rows64_tiles(const Rows64Params& p0, bool pdl, cudaStream_t stream) {
  constexpr int kStages = 3;
  using S = Rows64Shape<kMT>;
  constexpr size_t smem = S::template smem_bytes<kStages>();
  constexpr auto kKernel = gemm_fp8_rows64_kernel<kMT, kStages, kTiles>;
  allow_dynamic_smem<kKernel>(smem);
  Rows64Params p = p0;
  const int tiles = (p.N + S::kRows - 1) / S::kRows;
  const int slots = current_device_attribute(cudaDevAttrMultiProcessorCount) * (kMT == 1 ? 2 : 1);
  p.splits = std::max(1, std::min({slots / tiles, kRows64MaxSplits, p.k_blocks}));
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(p.splits));
  launch(kKernel, grid, kRows64Warps * 32, smem, stream, p, pdl, static_cast<unsigned>(p.splits));
}

void launch_rows64(const GemvParams& g, bool pdl, cudaStream_t stream) {
  Rows64Params p{};
  p.x = g.x;
  p.x_stride = g.x_stride;
  p.w = static_cast<const uint8_t*>(g.w);
  p.scale = g.scale;
  p.scale_stride = g.scale_stride;
  p.y = g.y;
  p.M = g.M;
  p.N = g.N;
  p.K = g.K;
  p.block_n = g.block_n;
  p.k_blocks = (g.K + kFp8BlockK - 1) / kFp8BlockK;
  const bool mt2 = env_equals("KIMI_OPS_SM90_ROWS64_MT", "2");
  if (p.M <= 6 * kGemvMaxM)
    mt2 ? launch_rows64_tiles<2, 6>(p, pdl, stream) : launch_rows64_tiles<1, 6>(p, pdl, stream);
  else
    mt2 ? launch_rows64_tiles<2, 8>(p, pdl, stream) : launch_rows64_tiles<1, 8>(p, pdl, stream);
}

// The weight's checks and GemvParams' product fields (x, w, y set by the caller).
GemvParams gemv_params(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& w_scale_inv,
                       int64_t block_n) {
  TORCH_CHECK(x.is_cuda() && w.is_cuda() && x.device() == w.device(), "kimi_ops._C: x and w must be on one CUDA device");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "kimi_ops._C: x [M, K] and w [N, K] expected");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "kimi_ops._C: x must be bf16");
  const bool fp8 = w.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(fp8 || w.scalar_type() == at::kBFloat16, "kimi_ops._C: w must be bf16 or float8_e4m3fn");
  TORCH_CHECK(fp8 == w_scale_inv.has_value(), "kimi_ops._C: w_scale_inv is required with an fp8 w and refused with a bf16 one");
  TORCH_CHECK(w.is_contiguous() && reinterpret_cast<uintptr_t>(w.data_ptr()) % 16 == 0,
              "kimi_ops._C: w must be contiguous and 16-byte aligned");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  static_assert(kGemvMaxM == 8, "the messages below");
  TORCH_CHECK(M <= (fp8 ? kRows64MaxM : 4 * kGemvMaxM),
              "kimi_ops._C: the GEMV takes at most 64 rows of x with an fp8 w, 32 with a bf16 one");
  TORCH_CHECK(K % (fp8 ? 64 : 32) == 0, "kimi_ops._C: K must be a multiple of 32 (bf16 w) or 64 (fp8 w)");
  TORCH_CHECK(K <= INT32_MAX && N <= INT32_MAX, "kimi_ops._C: GEMV too large");
  TORCH_CHECK(x.stride(1) == 1 && x.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              "kimi_ops._C: x's rows must be contiguous and 16-byte aligned");
  GemvParams p{};
  if (fp8) {
    const at::Tensor& s = *w_scale_inv;
    TORCH_CHECK(s.is_cuda() && s.device() == w.device() && s.scalar_type() == at::kFloat && s.dim() == 2 &&
                    s.stride(1) == 1,
                "kimi_ops._C: w_scale_inv must be a float32 [N blocks, K blocks] tensor on w's device, unit stride along K");
    TORCH_CHECK(block_n % kGemvRows == 0 && block_n > 0, "kimi_ops._C: block_n must be a positive multiple of 16");
    TORCH_CHECK(s.size(0) == (N + block_n - 1) / block_n && s.size(1) == (K + kFp8BlockK - 1) / kFp8BlockK,
                "kimi_ops._C: w_scale_inv must be [ceil(N / block_n), ceil(K / 128)]");
    p.scale = s.data_ptr<float>();
    p.scale_stride = s.stride(0);
  }
  p.x = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  p.x_stride = x.stride(0);
  p.w = w.data_ptr();
  p.M = static_cast<int>(M);
  p.N = static_cast<int>(N);
  p.K = static_cast<int>(K);
  p.block_n = static_cast<int>(block_n);
  return p;
}

void check_bf16_rows(const at::Tensor& t, const at::Tensor& like, int64_t rows, int64_t cols, const char* what) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device() && t.scalar_type() == at::kBFloat16 && t.dim() == 2 &&
                  t.size(0) == rows && (cols < 0 || t.size(1) == cols) && t.stride(1) == 1 && t.stride(0) % 2 == 0 &&
                  reinterpret_cast<uintptr_t>(t.data_ptr()) % 4 == 0,
              std::string("kimi_ops._C: ") + what);
}

// The messages are literals: on the H200 image (torch 2.11, nvcc 13 with /opt/gcc) a failing
// TORCH_CHECK whose message formats a number (c10::str's ostringstream) in an nvcc-compiled file
// crashed the process instead of raising; a literal message raised (docs/perf-history.md, session 25).
at::Tensor gemv_sm90(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& w_scale_inv,
                     int64_t block_n, bool constant_w) {
  GemvParams p = gemv_params(x, w, w_scale_inv, block_n);
  const bool fp8 = w_scale_inv.has_value();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  p.y = reinterpret_cast<__nv_bfloat16*>(y.data_ptr());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  // 8 warps where K has enough k-blocks for them (Kimi-K3's hidden 7168), else 4 (its ranks 1536)
  const bool wide = K >= 4096;
  // PDL where the caller says w (and w_scale_inv) are not written by the kernels before this one on
  // the stream (constant_w: a model's weights): the kernel then streams W while the previous kernel
  // finishes (gemv.cuh).
  const bool pdl = constant_w && pdl_env_allows();
  // 9..32 rows (fp8): two / four 8-token MMA tiles on each W fragment, one k-block a step (x's
  // registers double / quadruple: 88 / 128 registers; two k-blocks a step at 16 rows took 128 and
  // spilled 8 bytes)
  if (fp8 && M > 4 * kGemvMaxM)
    launch_rows64(p, pdl, stream);
  else if (fp8 && M > 2 * kGemvMaxM)
    wide ? launch_gemv<8, true, 1, 4>(p, pdl, stream) : launch_gemv<4, true, 1, 4>(p, pdl, stream);
  else if (fp8 && M > kGemvMaxM)
    wide ? launch_gemv<8, true, 1, 2>(p, pdl, stream) : launch_gemv<4, true, 1, 2>(p, pdl, stream);
  else if (fp8)
    wide ? launch_gemv<8, true, 3>(p, pdl, stream) : launch_gemv<4, true, 3>(p, pdl, stream);
  // bf16: 128- / 64-column k-blocks at two / four token tiles (the x registers of one)
  else if (M > 2 * kGemvMaxM)
    wide ? launch_gemv<8, false, 1, 4>(p, pdl, stream) : launch_gemv<4, false, 1, 4>(p, pdl, stream);
  else if (M > kGemvMaxM)
    wide ? launch_gemv<8, false, 1, 2>(p, pdl, stream) : launch_gemv<4, false, 1, 2>(p, pdl, stream);
  else
    wide ? launch_gemv<8, false, 1>(p, pdl, stream) : launch_gemv<4, false, 1>(p, pdl, stream);
  return y;
}

std::tuple<at::Tensor, at::Tensor> norm_q_b_sm90(const at::Tensor& q_c, const at::Tensor& kv_c, const at::Tensor& k_pe,
                                                 const at::Tensor& q_norm_weight, const at::Tensor& kv_norm_weight,
                                                 const at::Tensor& kv_cache, const at::Tensor& slot_mapping,
                                                 const at::Tensor& w, const std::optional<at::Tensor>& w_scale_inv,
                                                 const std::optional<at::Tensor>& g, int64_t block_n, double eps,
                                                 double kv_scale, bool constant_w) {
  GemvParams p = gemv_params(q_c, w, w_scale_inv, block_n);
  const bool fp8 = w_scale_inv.has_value();
  const int64_t T = q_c.size(0), K = q_c.size(1), N = w.size(0);
  TORCH_CHECK(T <= kNormMaxM, "kimi_ops._C: the fused q_b takes at most 16 tokens");
  TORCH_CHECK(K <= kNormMaxK, "kimi_ops._C: the fused q_b takes K <= 8192");
  // every warp at least one k-block (gemv.cuh, kNorm): fp8 128 columns, bf16 256 / token tiles
  const int64_t k_block = fp8 ? kFp8BlockK : kBf16BlockK / (T > kGemvMaxM ? 2 : 1);
  TORCH_CHECK(K / k_block >= kNormWarps,
              "kimi_ops._C: the fused q_b needs K >= 4 k-blocks (512 fp8, 1024 bf16 columns)");
  TORCH_CHECK(q_norm_weight.is_cuda() && q_norm_weight.device() == q_c.device() &&
                  q_norm_weight.scalar_type() == at::kBFloat16 && q_norm_weight.dim() == 1 &&
                  q_norm_weight.size(0) == K && q_norm_weight.is_contiguous() &&
                  reinterpret_cast<uintptr_t>(q_norm_weight.data_ptr()) % 16 == 0,
              "kimi_ops._C: q_norm_weight must be a contiguous, 16-byte aligned bf16 [K] tensor on q_c's device");
  TORCH_CHECK(kv_norm_weight.is_cuda() && kv_norm_weight.device() == q_c.device() &&
                  kv_norm_weight.scalar_type() == at::kBFloat16 && kv_norm_weight.dim() == 1 &&
                  kv_norm_weight.size(0) == kNormLatent && kv_norm_weight.is_contiguous() &&
                  reinterpret_cast<uintptr_t>(kv_norm_weight.data_ptr()) % 4 == 0,
              "kimi_ops._C: kv_norm_weight must be a contiguous bf16 [512] tensor on q_c's device");
  check_bf16_rows(kv_c, q_c, T, kNormLatent, "kv_c must be bf16 [T, 512], unit stride along a row, 4-byte aligned");
  check_bf16_rows(k_pe, q_c, T, kNormRope, "k_pe must be bf16 [T, 64], unit stride along a row, 4-byte aligned");
  if (g.has_value()) check_bf16_rows(*g, q_c, T, -1, "g must be bf16 [T, G], unit stride along a row");
  TORCH_CHECK(kv_cache.is_cuda() && kv_cache.device() == q_c.device() &&
                  kv_cache.scalar_type() == at::kFloat8_e4m3fn && kv_cache.dim() == 2 &&
                  kv_cache.size(1) == kNormLatent + kNormRope && kv_cache.is_contiguous(),
              "kimi_ops._C: kv_cache must be a contiguous float8_e4m3fn [N, 576] tensor on q_c's device");
  TORCH_CHECK(slot_mapping.is_cuda() && slot_mapping.device() == q_c.device() && slot_mapping.dim() == 1 &&
                  slot_mapping.size(0) == T && slot_mapping.is_contiguous() &&
                  (slot_mapping.scalar_type() == at::kInt || slot_mapping.scalar_type() == at::kLong),
              "kimi_ops._C: slot_mapping must be a contiguous int32 / int64 [T] tensor on q_c's device");
  const c10::cuda::CUDAGuard guard(q_c.device());
  auto y = at::empty({T, N}, q_c.options());
  const int64_t G = g.has_value() ? g->size(1) : 0;
  auto gate = at::empty({T, G}, q_c.options());
  if (T == 0) return {y, gate};
  p.y = reinterpret_cast<__nv_bfloat16*>(y.data_ptr());
  p.norm_w = reinterpret_cast<const __nv_bfloat16*>(q_norm_weight.data_ptr());
  p.eps = static_cast<float>(eps);
  p.main_ctas = static_cast<int>((N + kGemvRows - 1) / kGemvRows);
  NormSideParams& s = p.side;
  s.kv_c = reinterpret_cast<const __nv_bfloat16*>(kv_c.data_ptr());
  s.kv_c_stride = kv_c.stride(0);
  s.k_pe = reinterpret_cast<const __nv_bfloat16*>(k_pe.data_ptr());
  s.k_pe_stride = k_pe.stride(0);
  s.kv_norm_w = reinterpret_cast<const __nv_bfloat16*>(kv_norm_weight.data_ptr());
  s.slot = slot_mapping.data_ptr();
  s.slot64 = slot_mapping.scalar_type() == at::kLong;
  s.cache = reinterpret_cast<uint8_t*>(kv_cache.data_ptr());
  s.cache_rows = kv_cache.size(0);
  s.kv_scale = static_cast<float>(kv_scale);
  s.g = g.has_value() ? reinterpret_cast<const __nv_bfloat16*>(g->data_ptr()) : nullptr;
  s.g_stride = g.has_value() ? g->stride(0) : 0;
  s.G = static_cast<int>(G);
  s.gate = reinterpret_cast<__nv_bfloat16*>(gate.data_ptr());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const bool pdl = constant_w && pdl_env_allows();
  // the token tiles as gemv_sm90's (4 warps: the fused q_b's K is a q_lora rank, 1536 in Kimi-K3)
  if (fp8 && T > kGemvMaxM)
    launch_norm_gemv<true, 1, 2>(p, pdl, stream);
  else if (fp8)
    launch_norm_gemv<true, 3, 1>(p, pdl, stream);
  else if (T > kGemvMaxM)
    launch_norm_gemv<false, 1, 2>(p, pdl, stream);
  else
    launch_norm_gemv<false, 1, 1>(p, pdl, stream);
  return {y, gate};
}

}  // namespace

void impl_sm90_gemv_ops(torch::Library& m) {
  m.impl("_gemv_sm90", &gemv_sm90);
  m.impl("_norm_q_b_sm90", &norm_q_b_sm90);
}

}  // namespace kimi_ops::sm90
