// Hopper (sm_90a) small-M projections: the host launcher of gemv_kernel (gemv.cuh) and its op,
// _gemv_sm90 (schema in csrc/registration.cpp, entry point in ops.h):
//   x [M, K] bf16 (M <= 32; unit stride along K, rows 16-byte aligned), w [N, K] bf16 or fp8
//   e4m3fn (contiguous, 16-byte aligned), w_scale_inv [ceil(N / block_n), ceil(K / 128)] f32 with
//   an fp8 w (unit stride along K), else none; constant_w: w and w_scale_inv are not written by
//   the kernels before this one on the stream (the launch may then start while they run)
//   -> y [M, N] bf16.
// The caller (kimi_ops/kernels/sm90_gemv.py) checks what the kernel needs and takes another path
// where it does not hold; the checks here only guard the kernel.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

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

// The messages are literals: on the H200 image (torch 2.11, nvcc 13 with /opt/gcc) a failing
// TORCH_CHECK whose message formats a number (c10::str's ostringstream) in an nvcc-compiled file
// crashed the process instead of raising; a literal message raised (docs/perf-history.md, session 25).
at::Tensor gemv_sm90(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& w_scale_inv,
                     int64_t block_n, bool constant_w) {
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
  TORCH_CHECK(M <= 4 * kGemvMaxM, "kimi_ops._C: the GEMV takes at most 32 rows of x");
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
  const c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  p.x = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
  p.x_stride = x.stride(0);
  p.w = w.data_ptr();
  p.y = reinterpret_cast<__nv_bfloat16*>(y.data_ptr());
  p.M = static_cast<int>(M);
  p.N = static_cast<int>(N);
  p.K = static_cast<int>(K);
  p.block_n = static_cast<int>(block_n);
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
  if (fp8 && M > 2 * kGemvMaxM)
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

}  // namespace

void impl_sm90_gemv_ops(torch::Library& m) { m.impl("_gemv_sm90", &gemv_sm90); }

}  // namespace kimi_ops::sm90
