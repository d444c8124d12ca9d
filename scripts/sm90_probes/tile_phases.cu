// splitkv_tm_kernel's per-tile pieces timed apart on sm_90a (a maintainers' probe; run.sh builds
// and runs it): the 48-row, 128-token-tile instance (q8 at 12 heads, 96 heads), one CTA a SM, its
// own TokenMajorSmem and device functions (decode_token_major.cuh), random operands. Prints us a
// tile and TFLOP/s (QK 2 x 128 x 48 x 576, PV 2 x 128 x 48 x 512 a tile) for
//   tm_scores alone (and variants: no e4m3 -> f16 conversion, ldmatrix prefetch distance 1 / 4),
//   tm_pv alone, the two back to back,
//   and the kernel's tile loop with pieces left out: copies (TileLoader's cp.async of the next
//   tile from contiguous cache rows, as the kernel issues them inside tm_scores) and
//   softmax (mask, max, vote, exp, P store and the two CTA barriers), the copies alone, and the
//   copies issued in one burst at the tile's top.
// The loop's outputs are not checked: timing only (tests/test_cuda_attention.py checks the kernel).
#include <cstdio>
#include <vector>
#include <algorithm>
#include "decode_token_major.cuh"
using namespace kimi_ops::sm90;
constexpr int NT = 6, TILE = 128;
using Smem = TokenMajorSmem<NT, 2, TILE>;
__device__ __forceinline__ uint32_t hsh(uint32_t x) { x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b; x ^= x >> 16; return x; }

// tm_scores (no copies) with ldmatrix prefetch distance kDist; kCvt false feeds the fp8 words
// to the MMA unconverted (wrong values, the same instruction stream less the cvt)
template <int HT, int kDist, bool kCvt>
__device__ __forceinline__ void scores_var(float (&s)[HT][4], const uint8_t* k_lane, uint64_t q_desc) {
  constexpr int kChunks = kRowBytes / 32, kBufs = kDist + 1;
  uint32_t kw[kBufs][4];
#pragma unroll
  for (int i = 0; i < kDist; ++i) ldmatrix_x4(kw[i], k_lane + i * 32);
#pragma unroll
  for (int kc = 0; kc < kChunks; ++kc) {
    if (kc + kDist < kChunks) ldmatrix_x4(kw[(kc + kDist) % kBufs], k_lane + (kc + kDist) * 32);
    const uint32_t(&w)[4] = kw[kc % kBufs];
    uint32_t a0[4], a1[4];
    if constexpr (kCvt) {
      const F16x4 k0 = e4m3x4_to_f16x4(w[0]), k1 = e4m3x4_to_f16x4(w[1]);
      const F16x4 k2 = e4m3x4_to_f16x4(w[2]), k3 = e4m3x4_to_f16x4(w[3]);
      a0[0] = k0.lo; a0[1] = k1.lo; a0[2] = k0.hi; a0[3] = k1.hi;
      a1[0] = k2.lo; a1[1] = k3.lo; a1[2] = k2.hi; a1[3] = k3.hi;
    } else {
      a0[0] = w[0]; a0[1] = w[1]; a0[2] = w[2]; a0[3] = w[3];
      a1[0] = w[1]; a1[1] = w[0]; a1[2] = w[3]; a1[3] = w[2];
    }
    wgmma_fence();
    WgmmaF16RS<8 * HT>::run(s, a0, q_desc + (kc * 512 >> 4), kc > 0);
    WgmmaF16RS<8 * HT>::run(s, a1, q_desc + ((kc * 512 + 256) >> 4));
    if (kc % 2 == 1 || kc + 1 == kChunks) { wgmma_commit(); wgmma_wait<1>(); }
  }
  wgmma_wait<0>();
  fence_operands(s);
}

// random operands: e4m3 tiles (never NaN), Q in [-1, 1), P in [0, 1), row_scale 0.9
__device__ void fill_random(Smem& sm, int tid) {
  for (int i = tid; i < int(sizeof(sm.kv)) / 4; i += 256) reinterpret_cast<uint32_t*>(sm.kv)[i] = hsh(i + blockIdx.x * 7919) & 0x77777777u;
  for (int i = tid; i < int(sizeof(sm.q)) / 2; i += 256) sm.q[i] = __float2half((int)(hsh(3 * i + 1) & 0xffff) / 32768.f - 1.f);
  for (int i = tid; i < int(sizeof(sm.p)) / 2; i += 256) sm.p[i] = __float2half((hsh(5 * i + 2) & 0xffff) / 65536.f);
  for (int i = tid; i < Smem::kRows; i += 256) sm.row_scale[i] = 0.9f, sm.row_max[i] = -INFINITY;
  fence_proxy_async_smem();
  __syncthreads();
}

template <int MODE>
__global__ void __launch_bounds__(256, 1) phase(int iters, float* out) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  fill_random(sm, tid);
  const int tq = warp;
  const int k_lane = (tq * 16 + (lane & 15)) * kSmemRow + (lane >> 4) * 16;
  const uint64_t q_desc = smem_desc(sm.q, 128, kQCoreGroup * 2);
  const uint64_t p_desc = smem_desc(sm.p, 128, 16 * TILE);
  float sink = 0.f;
  float acc[4][NT][4];
  uint32_t tail[2][2][4] = {};
  for (int t = 0; t < iters; ++t) {
    const uint8_t* tile = sm.kv[t % 2];
    float s[NT][4];
    if constexpr (MODE == 0 || MODE == 2) {
      tm_scores<NT>(s, tile + k_lane, q_desc, [](int) {}, [] {});
      sink += s[t % NT][t % 4];
    }
    if constexpr (MODE == 3) { scores_var<NT, 2, false>(s, tile + k_lane, q_desc); sink += s[t % NT][t % 4]; }
    if constexpr (MODE == 4) { scores_var<NT, 4, true>(s, tile + k_lane, q_desc); sink += s[t % NT][t % 4]; }
    if constexpr (MODE == 5) { scores_var<NT, 1, true>(s, tile + k_lane, q_desc); sink += s[t % NT][t % 4]; }
    if constexpr (MODE == 1 || MODE == 2) {
      tm_pv<NT, TILE>(acc, tile, p_desc, sm.row_scale, (t & 7) == 0, warp, g, c, tail, t == 0, [] {});
      wgmma_wait<0>();
      keep_alive(tail);
#pragma unroll
      for (int m = 0; m < 4; ++m) fence_operands(acc[m]);
    }
  }
  if constexpr (MODE == 1 || MODE == 2) sink += acc[0][0][0] + acc[3][NT - 1][3];
  out[blockIdx.x * 256 + tid] = sink;
}

// The kernel's tile loop (splitkv_tm_kernel, 48 rows, 128-token tiles) with pieces left out:
// kCopies: the next tile's cp.async copies (TileLoader, contiguous rows of kv) and their wait, the
// whole tile during QK (the kernel's halves loader is not modelled);
// kSoftmax: mask / max / vote / exp / P store and the two barriers (else QK then PV only);
// kBarriers false drops the softmax's two barriers (the vote is the thread's own); kBurst issues
// the next tile's copies all at the top of the tile (TileLoader::load) instead of spread over
// tm_scores' first chunks; kCompute false leaves only the copies, their waits and the barrier.
template <bool kCopies, bool kSoftmax, bool kBarriers, bool kBurst = false, bool kCompute = true>
__global__ void __launch_bounds__(256, 1) loop(int iters, const uint8_t* kv, const int* idx, int64_t n_rows, float* out) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  auto& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  fill_random(sm, tid);
  SplitKVParams p{};
  p.kv = kv; p.indices = idx; p.num_kv_rows = n_rows;
  CtaWork w{};
  w.start = 0; w.lo = (int)((int64_t)blockIdx.x * iters * TILE % (n_rows - (int64_t)iters * TILE)); w.hi = w.lo + iters * TILE;
  TileLoader<kTmWarps, TILE> loader(p, w, warp, lane);
  if (kCopies) loader.load(0, sm.kv[0]);
  cp_async_commit();
  const int tq = warp;
  constexpr int kHT = NT;
  const int k_lane = (tq * 16 + (lane & 15)) * kSmemRow + (lane >> 4) * 16;
  const uint64_t q_desc = smem_desc(sm.q, 128, kQCoreGroup * 2);
  const uint64_t p_desc = smem_desc(sm.p, 128, 16 * TILE);
  int lim[kHT][2];
  float m_run[kHT][2], l_run[kHT][2], row_fac[kHT][2];
  for (int j = 0; j < kHT; ++j) for (int h = 0; h < 2; ++h) { lim[j][h] = 1 << 30; m_run[j][h] = -INFINITY; l_run[j][h] = 0.f; row_fac[j][h] = 1e-4f; }
  float acc[4][NT][4];
  uint32_t pv_tail[2][2][4] = {};
  auto wait_pv_tail = [&] { wgmma_wait<0>(); keep_alive(pv_tail); for (int m = 0; m < 4; ++m) fence_operands(acc[m]); };
  for (int t = 0; t < iters; ++t) {
    cp_async_wait<0>();
    __syncthreads();
    const uint8_t* tile = sm.kv[t % 2];
    uint8_t* next_stage = sm.kv[(t + 1) % 2];
    const bool load_next = kCopies && t + 1 < iters;
    float s[kHT][4];
    if (kBurst && load_next) loader.load(t + 1, next_stage);
    if constexpr (!kCompute) {
      if (!kBurst && load_next) loader.load(t + 1, next_stage);
      cp_async_commit();
      continue;
    }
    tm_scores<kHT>(s, tile + k_lane, q_desc, [&](int piece) { if (!kBurst && load_next) loader.load_piece(t + 1, piece, next_stage); }, wait_pv_tail);
    cp_async_commit();
    bool rescale = (t & 15) == 0;
    if constexpr (kSoftmax) {
      float tile_max[kHT][2];
      const bool raise = tm_mask_and_max<kHT>(s, tile_max, row_fac, lim, m_run, w.lo + t * TILE + tq * 16, g, true);
      rescale = kBarriers ? __syncthreads_or(raise) : raise;
      if (rescale) tm_raise_running_max<kHT, 8>(m_run, l_run, tile_max, sm.red[0], sm.row_max, sm.row_scale,
                                             Smem::kRows, 0, tq, g, c, tid);
      tm_exp<kHT>(s, m_run, l_run);
      tm_store_p<kHT, TILE>(sm.p, s, 0, tq * 16, g, c);
      fence_proxy_async_smem();
      if (kBarriers) __syncthreads();
    } else {
      l_run[0][0] += s[0][0] + s[kHT - 1][3];
    }
    tm_pv<NT, TILE>(acc, tile, p_desc, sm.row_scale, rescale, warp, g, c, pv_tail, t == 0, [] {});
  }
  wait_pv_tail();
  cp_async_wait<0>();
  float sink = acc[0][0][0] + acc[3][NT - 1][3];
  for (int j = 0; j < kHT; ++j) sink += l_run[j][0] + l_run[j][1];
  out[blockIdx.x * 256 + tid] = sink;
}

template <bool kCopies, bool kSoftmax, bool kBarriers = true, bool kBurst = false, bool kCompute = true>
void run_loop(const char* name, const uint8_t* kv, const int* idx, int64_t n_rows) {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* out; cudaMalloc(&out, sms * 256 * 4);
  auto k = loop<kCopies, kSoftmax, kBarriers, kBurst, kCompute>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, sizeof(Smem));
  const int iters = 64;
  std::vector<float> ts;
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  for (int r = 0; r < 7; ++r) {
    cudaEventRecord(e0); k<<<sms, 256, sizeof(Smem)>>>(iters, kv, idx, n_rows, out); cudaEventRecord(e1); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1); ts.push_back(ms);
  }
  std::sort(ts.begin(), ts.end());
  printf("%-34s %7.3f us/tile  (%d tiles of 128 a CTA, %d CTAs: %.1f us)  %s\n", name, ts[3] * 1e3 / iters, iters, sms, ts[3] * 1e3,
         cudaGetErrorString(cudaGetLastError()));
}

template <int MODE>
void run(const char* name, double flop_tile) {
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  float* out; cudaMalloc(&out, sms * 256 * 4);
  auto k = phase<MODE>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, sizeof(Smem));
  const int iters = 2000;
  k<<<sms, 256, sizeof(Smem)>>>(50, out);
  std::vector<float> ts;
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  for (int r = 0; r < 5; ++r) {
    cudaEventRecord(e0); k<<<sms, 256, sizeof(Smem)>>>(iters, out); cudaEventRecord(e1); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1); ts.push_back(ms);
  }
  std::sort(ts.begin(), ts.end());
  printf("%-34s %7.3f us/tile  %6.1f TFLOP/s  %s\n", name, ts[2] * 1e3 / iters, flop_tile * iters * sms / (ts[2] * 1e-3) / 1e12,
         cudaGetErrorString(cudaGetLastError()));
}
int main() {
  const double qk = 2.0 * TILE * 48 * 576, pv = 2.0 * TILE * 48 * 512;
  run<0>("QK tm_scores (dist 2, cvt)", qk);
  run<3>("QK dist 2, no cvt", qk);
  run<4>("QK dist 4, cvt", qk);
  run<5>("QK dist 1, cvt", qk);
  run<1>("PV tm_pv", pv);
  run<2>("QK + PV", qk + pv);
  const int64_t n_rows = 132LL * 64 * 128 + 4096;
  uint8_t* kv; int* idx;
  cudaMalloc(&kv, n_rows * 576); cudaMalloc(&idx, n_rows * 4);
  std::vector<int> h(n_rows); for (int64_t i = 0; i < n_rows; ++i) h[i] = (int)i;
  cudaMemcpy(idx, h.data(), n_rows * 4, cudaMemcpyHostToDevice);
  std::vector<uint8_t> hk(n_rows * 576); for (size_t i = 0; i < hk.size(); ++i) hk[i] = (uint8_t)((i * 2654435761u >> 13) & 0x77);
  cudaMemcpy(kv, hk.data(), hk.size(), cudaMemcpyHostToDevice);
  for (int rep = 0; rep < 2; ++rep) {
    run_loop<false, false>("loop: QK + PV", kv, idx, n_rows);
    run_loop<true, false>("loop: QK + PV + copies", kv, idx, n_rows);
    run_loop<false, true>("loop: QK + softmax + PV", kv, idx, n_rows);
    run_loop<true, true>("loop: all (the kernel's tile loop)", kv, idx, n_rows);
    run_loop<false, true, false>("loop: QK + softmax - barriers + PV", kv, idx, n_rows);
    run_loop<true, true, false>("loop: all - softmax barriers", kv, idx, n_rows);
    run_loop<true, false, true, false, false>("loop: copies only", kv, idx, n_rows);
    run_loop<true, false, true, true>("loop: QK + PV + copies in a burst", kv, idx, n_rows);
    run_loop<true, true, true, true>("loop: all, copies in a burst", kv, idx, n_rows);
  }
  return 0;
}
