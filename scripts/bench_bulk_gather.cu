// The copy roofline of splitkv_kernel's K ring: how fast a CTA can stream random 576-byte cache
// rows through a shared-memory ring when it does nothing else, by the two ways the 16-row kernel
// has gathered them:
//   bulk     one producer warp issues a cp.async.bulk of 576 bytes a row onto the stage's `full`
//            mbarrier (splitkv_kernel since v12); 4 consumer warps wait on it and release the
//            stage on `empty` (every consumer thread arrives)
//   cpasync  4 warps gather with 16-byte cp.async into the ring, cp.async.wait_group + a CTA
//            barrier a tile (splitkv_kernel before v12, the token-major kernels' loader)
// In both, the 4 consumer warps read every 4-byte word of a landed tile from shared memory and
// xor it into a checksum (compared with a plain-load kernel's), so a skipped row shows.
// Swept: ring stages (64 rows, 592-byte smem rows as in the kernel) and CTAs a SM (set through
// the dynamic shared-memory size). Its TB/s against scripts/bench_gather.py's (a Triton gather,
// 4.04 TB/s on the H200 with random rows) tells whether the bulk-copy path caps the kernel.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a scripts/bench_bulk_gather.cu \
//        -o /tmp/bench_bulk_gather && /tmp/bench_bulk_gather [tokens] [pool_rows]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../csrc/sm90_copy.cuh"

namespace kimi_ops::sm90::bench {

constexpr int kRowBytes = 576, kSmemRow = 592, kTileN = 64, kConsumers = 128;
constexpr int kBulkThreads = kConsumers + 32;  // bulk_ring: the consumers and the producer warp

#define CHECK(x)                                                                         \
  do {                                                                                   \
    cudaError_t e = (x);                                                                 \
    if (e != cudaSuccess) {                                                              \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e)); \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

// The consumer threads' share of a landed tile: thread t xors words t, t + 128, ... of its rows.
__device__ __forceinline__ uint32_t consume_tile(const uint8_t* tile, int rows, int tid) {
  uint32_t x = 0;
  for (int w = tid; w < rows * (kRowBytes / 4); w += kConsumers) {
    const int r = w / (kRowBytes / 4), c = w % (kRowBytes / 4);
    x ^= *reinterpret_cast<const uint32_t*>(tile + r * kSmemRow + 4 * c);
  }
  return x;
}

// CTA b streams tokens [b * per_cta, (b + 1) * per_cta) of idx (rows of kv); out[b] = its xor.
template <int STAGES>
__global__ void __launch_bounds__(kBulkThreads) bulk_ring(const uint8_t* kv, const int* idx, int n, int per_cta,
                                                 uint32_t* out) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + STAGES * kTileN * kSmemRow);
  uint64_t* empty = full + STAGES;
  const int tid = threadIdx.x, lane = tid % 32;
  const int lo = blockIdx.x * per_cta, hi = min(n, lo + per_cta);
  const int ntiles = hi > lo ? (hi - lo + kTileN - 1) / kTileN : 0;
  if (tid == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], kConsumers);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (tid >= kConsumers) {  // the producer warp: lane l copies rows l and l + 32 of each tile
    auto row_index = [&](int t, int m) {  // fetched a tile ahead, as in splitkv_kernel; -1 past the chunk
      const int j = lo + t * kTileN + lane + 32 * m;
      return j < hi ? idx[j] : -1;
    };
    int next[2] = {row_index(0, 0), row_index(0, 1)};
    for (int t = 0; t < ntiles; ++t) {
      const int s = t % STAGES;
      const int rows = min(kTileN, hi - lo - t * kTileN);
      const int cur[2] = {next[0], next[1]};
      next[0] = row_index(t + 1, 0);
      next[1] = row_index(t + 1, 1);
      if (t >= STAGES) mbar_wait(&empty[s], ((t / STAGES) - 1) & 1);
      if (lane == 0) mbar_arrive_expect_tx(&full[s], rows * kRowBytes);
      __syncwarp();
      for (int m = 0; m < 2; ++m)
        if (cur[m] >= 0)
          bulk_copy_g2s(smem + (s * kTileN + lane + 32 * m) * kSmemRow, kv + static_cast<int64_t>(cur[m]) * kRowBytes,
                        kRowBytes, &full[s]);
    }
    return;
  }
  uint32_t x = 0;
  for (int t = 0; t < ntiles; ++t) {
    const int s = t % STAGES;
    mbar_wait(&full[s], (t / STAGES) & 1);
    x ^= consume_tile(smem + s * kTileN * kSmemRow, min(kTileN, hi - lo - t * kTileN), tid);
    mbar_arrive(&empty[s]);
  }
  for (int o = 16; o > 0; o >>= 1) x ^= __shfl_xor_sync(0xffffffffu, x, o);
  if (lane == 0) atomicXor(&out[blockIdx.x], x);
}

template <int STAGES>
__global__ void __launch_bounds__(kConsumers) cpasync_ring(const uint8_t* kv, const int* idx, int n, int per_cta,
                                                    uint32_t* out) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int lo = blockIdx.x * per_cta, hi = min(n, lo + per_cta);
  const int ntiles = hi > lo ? (hi - lo + kTileN - 1) / kTileN : 0;
  // warp w copies rows 16w .. 16w + 15 of a tile, 8 lanes a row (chunks lane % 8 + 8j of row 4p + lane / 8);
  // a lane's 4 row indices are fetched one load ahead, as in the kernel's TileLoader (-1 past the chunk)
  int next[4];
  auto fetch = [&](int t) {
    for (int pass = 0; pass < 4; ++pass) {
      const int tok = lo + t * kTileN + warp * 16 + pass * 4 + lane / 8;
      next[pass] = t < ntiles && tok < hi ? idx[tok] : -1;
    }
  };
  auto load = [&](int t) {
    const int s = t % STAGES;
    int cur[4];
    for (int pass = 0; pass < 4; ++pass) cur[pass] = next[pass];
    fetch(t + 1);
    for (int pass = 0; pass < 4; ++pass) {
      const int r = warp * 16 + pass * 4 + lane / 8;
      const uint8_t* src = kv + static_cast<int64_t>(max(cur[pass], 0)) * kRowBytes;
      for (int chunk = lane % 8; chunk < kRowBytes / 16; chunk += 8)
        cp_async_16(smem + (s * kTileN + r) * kSmemRow + 16 * chunk, src + 16 * chunk, cur[pass] >= 0 ? 16 : 0);
    }
  };
  fetch(0);
  for (int t = 0; t < STAGES - 1; ++t) {
    if (t < ntiles) load(t);
    cp_async_commit();
  }
  uint32_t x = 0;
  for (int t = 0; t < ntiles; ++t) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // tile t landed for every warp; every warp is done with tile t - 1's stage
    if (t + STAGES - 1 < ntiles) load(t + STAGES - 1);
    cp_async_commit();
    x ^= consume_tile(smem + (t % STAGES) * kTileN * kSmemRow, min(kTileN, hi - lo - t * kTileN), tid);
  }
  for (int o = 16; o > 0; o >>= 1) x ^= __shfl_xor_sync(0xffffffffu, x, o);
  if (lane == 0) atomicXor(&out[blockIdx.x], x);
}

// The same checksum by plain loads (the reference for both rings), one thread a word.
__global__ void xor_rows(const uint8_t* kv, const int* idx, int n, uint32_t* out) {
  uint32_t x = 0;
  for (int64_t w = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; w < static_cast<int64_t>(n) * 144;
       w += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x ^= *reinterpret_cast<const uint32_t*>(kv + static_cast<int64_t>(idx[w / 144]) * kRowBytes + 4 * (w % 144));
  atomicXor(out, x);
}

__global__ void fill_pool(uint32_t* words, int64_t count) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint64_t z = static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    words[i] = static_cast<uint32_t>(z ^ (z >> 31));
  }
}

uint32_t xor_all(const std::vector<uint32_t>& v) {
  uint32_t x = 0;
  for (uint32_t w : v) x ^= w;
  return x;
}

using RingKernel = void (*)(const uint8_t*, const int*, int, int, uint32_t*);
struct Case {
  const char* name;
  RingKernel kernel;
  int threads, stages, ctas_per_sm;
};
template <int STAGES>
Case bulk_case(int ctas_per_sm) {
  return {"bulk", bulk_ring<STAGES>, kBulkThreads, STAGES, ctas_per_sm};
}
template <int STAGES>
Case cpasync_case(int ctas_per_sm) {
  return {"cpasync", cpasync_ring<STAGES>, kConsumers, STAGES, ctas_per_sm};
}

}  // namespace kimi_ops::sm90::bench

int main(int argc, char** argv) {
  using namespace kimi_ops::sm90::bench;
  const int n = argc > 1 ? std::atoi(argv[1]) : 1 << 20;
  const int pool = argc > 2 ? std::atoi(argv[2]) : 2000000;
  if (n <= 0 || pool < n) {
    std::fprintf(stderr, "usage: %s [tokens > 0] [pool_rows >= tokens]\n", argv[0]);
    return 2;
  }
  int dev = 0, sms = 0, smem_per_sm = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
  CHECK(cudaDeviceGetAttribute(&smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, dev));
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, dev));

  uint8_t* kv;
  int* idx;
  uint32_t *out, *ref;
  CHECK(cudaMalloc(&kv, static_cast<size_t>(pool) * kRowBytes));
  CHECK(cudaMalloc(&idx, static_cast<size_t>(n) * sizeof(int)));
  CHECK(cudaMalloc(&out, 4096 * sizeof(uint32_t)));
  CHECK(cudaMalloc(&ref, sizeof(uint32_t)));
  fill_pool<<<4 * sms, 256>>>(reinterpret_cast<uint32_t*>(kv), static_cast<int64_t>(pool) * kRowBytes / 4);
  std::vector<int> perm(pool);  // a random permutation's first n rows (bench_attention's layout)
  for (int i = 0; i < pool; ++i) perm[i] = i;
  uint64_t state = 12345;
  for (int i = 0; i < n; ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    std::swap(perm[i], perm[i + static_cast<int>((state >> 33) % static_cast<uint64_t>(pool - i))]);
  }
  CHECK(cudaMemcpy(idx, perm.data(), static_cast<size_t>(n) * sizeof(int), cudaMemcpyHostToDevice));
  CHECK(cudaMemset(ref, 0, sizeof(uint32_t)));
  xor_rows<<<4 * sms, 256>>>(kv, idx, n, ref);
  uint32_t want = 0;
  CHECK(cudaMemcpy(&want, ref, sizeof(uint32_t), cudaMemcpyDeviceToHost));

  std::printf("%s, %d SMs; %d random rows of 576 B from a pool of %d; TB/s of rows, median of 20\n", prop.name,
              sms, n, pool);
  const Case cases[] = {bulk_case<2>(1),    bulk_case<2>(2),    bulk_case<2>(3),    bulk_case<4>(1),
                        cpasync_case<2>(2), cpasync_case<2>(3), cpasync_case<3>(2), cpasync_case<4>(1)};
  for (const Case& c : cases) {
    const size_t ring = static_cast<size_t>(c.stages) * kTileN * kSmemRow + 2 * c.stages * sizeof(uint64_t);
    // pad the CTA's shared memory so that exactly ctas_per_sm fit a SM (1 KB a CTA is reserved)
    const size_t smem = std::max(ring, static_cast<size_t>(smem_per_sm / (c.ctas_per_sm + 1) + 1024));
    if (c.ctas_per_sm * (smem + 1024) > static_cast<size_t>(smem_per_sm) || smem > 227 * 1024) {
      std::printf("%-8s stages %d, %d CTAs a SM: does not fit\n", c.name, c.stages, c.ctas_per_sm);
      continue;
    }
    CHECK(cudaFuncSetAttribute(c.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    const int ctas = std::min(4096, sms * c.ctas_per_sm);
    const int per_cta = (n + ctas - 1) / ctas;
    auto launch = [&] { c.kernel<<<ctas, c.threads, smem>>>(kv, idx, n, per_cta, out); };
    CHECK(cudaMemset(out, 0, ctas * sizeof(uint32_t)));
    launch();
    CHECK(cudaGetLastError());
    std::vector<uint32_t> got(ctas);
    CHECK(cudaMemcpy(got.data(), out, ctas * sizeof(uint32_t), cudaMemcpyDeviceToHost));
    const bool ok = xor_all(got) == want;
    std::vector<float> ms;
    cudaEvent_t a, b;
    CHECK(cudaEventCreate(&a));
    CHECK(cudaEventCreate(&b));
    for (int rep = 0; rep < 20; ++rep) {
      CHECK(cudaEventRecord(a));
      launch();
      CHECK(cudaEventRecord(b));
      CHECK(cudaEventSynchronize(b));
      float t = 0.f;
      CHECK(cudaEventElapsedTime(&t, a, b));
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    const double us = 1e3 * ms[ms.size() / 2];
    std::printf("%-8s stages %d, %d CTAs a SM (%3zu KB smem): %8.1f us  %.2f TB/s  checksum %s\n", c.name, c.stages,
                c.ctas_per_sm, smem / 1024, us, static_cast<double>(n) * kRowBytes / us / 1e6, ok ? "ok" : "WRONG");
    if (!ok) return 1;
  }
  return 0;
}
