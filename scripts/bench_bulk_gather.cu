// The copy roofline of splitkv_kernel's K ring: how fast a CTA can stream random 576-byte cache
// rows through a shared-memory ring when it does nothing else, by each way a warp can gather them:
//   bulk P   P producer warps issue a cp.async.bulk of 576 bytes a row onto the stage's `full`
//            mbarrier (splitkv_kernel since v12 has P = 1); 4 consumer warps wait on it and
//            release the stage on `empty` (every consumer thread arrives)
//   cpasync  the 4 consumer warps gather with 16-byte cp.async into the ring, cp.async.wait_group
//            + a CTA barrier a tile (splitkv_kernel before v12, the token-major kernels' loader)
//   mixed L  one producer warp bulk-copies rows 0-31 of a tile and L loader warps cp.async rows
//            32-63, their completion tracked on the same `full` barrier (cp.async.mbarrier.arrive)
//   ldg G    G groups of 4 loader warps, group g filling the tiles t = g mod G: 16-byte loads into
//            registers (issued before the stage is free), then st.shared and an arrive on `full`
// In every case the 4 consumer warps read every 4-byte word of a landed tile from shared memory
// and xor it into a checksum (compared with a plain-load kernel's), so a skipped row shows.
// Swept: ring stages (64 rows, 592-byte smem rows as in the kernel) and CTAs a SM (set through
// the dynamic shared-memory size; the occupancy calculator's count is printed beside it). Its
// TB/s against scripts/bench_gather.py's (a Triton gather, 4.04 TB/s on the H200 with random rows)
// tells which copy path caps the kernel. Then the hold sweep: splitkv_kernel's ring shape (2
// stages, 2 CTAs a SM) with each tile held a given number of SM clocks before it is released, as
// the kernel holds a stage while it computes on it: how much compute a tile the ring hides.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a scripts/bench_bulk_gather.cu \
//        -o /tmp/bench_bulk_gather && /tmp/bench_bulk_gather [tokens] [pool_rows] [page_rows]
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "../csrc/sm90/copy.cuh"

namespace kimi_ops::sm90::bench {

constexpr int kRowBytes = 576, kSmemRow = 592, kTileN = 64, kConsumers = 128;
constexpr int kChunks = kRowBytes / 16, kRowWords = kRowBytes / 4;  // 16-byte pieces, 4-byte words of a row

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
  for (int w = tid; w < rows * kRowWords; w += kConsumers) {
    const int r = w / kRowWords, c = w % kRowWords;
    x ^= *reinterpret_cast<const uint32_t*>(tile + r * kSmemRow + 4 * c);
  }
  return x;
}

// A CTA's ring and its chunk of the tokens: STAGES tiles in shared memory, then full[s] (the tile
// landed; full_count arrivals) and empty[s] (every consumer thread read it); CTA b streams tokens
// [lo, hi) = [b * per_cta, (b + 1) * per_cta) of idx in ntiles tiles.
template <int STAGES>
struct RingCta {
  uint8_t* smem;
  uint64_t *full, *empty;
  int lo, hi, ntiles;
  __device__ __forceinline__ RingCta(uint8_t* smem_, int n, int per_cta, int full_count) : smem(smem_) {
    full = reinterpret_cast<uint64_t*>(smem + STAGES * kTileN * kSmemRow);
    empty = full + STAGES;
    lo = blockIdx.x * per_cta;
    hi = min(n, lo + per_cta);
    ntiles = hi > lo ? (hi - lo + kTileN - 1) / kTileN : 0;
    if (threadIdx.x == 0) {
      for (int s = 0; s < STAGES; ++s) {
        mbar_init(&full[s], full_count);
        mbar_init(&empty[s], kConsumers);
      }
      asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
  }
  __device__ __forceinline__ int tile_rows(int t) const { return min(kTileN, hi - lo - t * kTileN); }
  __device__ __forceinline__ uint8_t* row_ptr(int s, int r) const { return smem + (s * kTileN + r) * kSmemRow; }
  // a filler's wait until tile t's stage is free (its tile t - STAGES released)
  __device__ __forceinline__ void wait_free(int t) const {
    if (t >= STAGES) mbar_wait(&empty[t % STAGES], ((t / STAGES) - 1) & 1);
  }
};

// Hold a stage hold_cycles SM clocks after reading it (a stand-in for the kernel's compute; the
// warps sleep, so they take no issue slots).
__device__ __forceinline__ void hold(int hold_cycles) {
  if (hold_cycles <= 0) return;
  const long long t0 = clock64();
  while (clock64() - t0 < hold_cycles) __nanosleep(32);
}

// Threads 0..127: wait for each tile on full, xor it, hold it, release it on empty;
// out[blockIdx.x] ^= the xor.
template <int STAGES>
__device__ __forceinline__ void consume_ring(const RingCta<STAGES>& ring, int hold_cycles, uint32_t* out) {
  const int tid = threadIdx.x;
  uint32_t x = 0;
  for (int t = 0; t < ring.ntiles; ++t) {
    const int s = t % STAGES;
    mbar_wait(&ring.full[s], (t / STAGES) & 1);
    x ^= consume_tile(ring.row_ptr(s, 0), ring.tile_rows(t), tid);
    hold(hold_cycles);
    mbar_arrive(&ring.empty[s]);
  }
  for (int o = 16; o > 0; o >>= 1) x ^= __shfl_xor_sync(0xffffffffu, x, o);
  if (tid % 32 == 0) atomicXor(&out[blockIdx.x], x);
}

// A warp's cache rows of tile t and t + 1 (fetched a tile ahead, as in splitkv_kernel): lane l holds
// those of the tile's rows l and l + 32, -1 past the chunk [lo, hi).
struct TileRows {
  const int* idx;
  int lo, hi, cur[2], next[2];
  __device__ __forceinline__ TileRows(const int* idx_, int lo_, int hi_) : idx(idx_), lo(lo_), hi(hi_) { fetch(0); }
  __device__ __forceinline__ void fetch(int t) {
    for (int m = 0; m < 2; ++m) {
      const int j = lo + t * kTileN + threadIdx.x % 32 + 32 * m;
      next[m] = j < hi ? idx[j] : -1;
    }
  }
  __device__ __forceinline__ void advance(int t) {  // cur = tile t's rows; fetch tile t + 1's
    cur[0] = next[0];
    cur[1] = next[1];
    fetch(t + 1);
  }
  __device__ __forceinline__ int row(int r) const {  // tile row r's cache row; every lane must call it
    const int a = __shfl_sync(0xffffffffu, cur[0], r % 32), b = __shfl_sync(0xffffffffu, cur[1], r % 32);
    return r < 32 ? a : b;
  }
};

// Rows [first, first + count) (count <= 64) of each tile by bulk copies from one warp: lane l copies
// rows first + l and first + l + 32. It arms full[s] with their bytes itself (full counts one
// arrival a copying warp).
template <int STAGES>
__device__ __forceinline__ void bulk_rows(const RingCta<STAGES>& ring, const uint8_t* kv, const int* idx, int first,
                                          int count) {
  const int lane = threadIdx.x % 32;
  TileRows rows(idx, ring.lo, ring.hi);
  for (int t = 0; t < ring.ntiles; ++t) {
    const int s = t % STAGES;
    rows.advance(t);
    const int src[2] = {rows.row(first + lane), rows.row(first + lane + 32)};
    const int n_rows = max(0, min(count, ring.tile_rows(t) - first));
    ring.wait_free(t);
    if (lane == 0) mbar_arrive_expect_tx(&ring.full[s], n_rows * kRowBytes);
    __syncwarp();
    for (int m = 0; m < 2; ++m)
      if (lane + 32 * m < n_rows)
        bulk_copy_g2s(ring.row_ptr(s, first + lane + 32 * m), kv + static_cast<int64_t>(src[m]) * kRowBytes, kRowBytes,
                      &ring.full[s]);
  }
}

// Each kernel: CTA b streams its chunk of idx (rows of kv) through the ring; out[b] = its xor.
// bulk_ring: PRODUCERS warps after the consumers, warp p copying rows [64p / P, 64(p + 1) / P) of each tile.
template <int STAGES, int PRODUCERS>
__global__ void __launch_bounds__(kConsumers + 32 * PRODUCERS)
    bulk_ring(const uint8_t* kv, const int* idx, int n, int per_cta, int hold_cycles, uint32_t* out) {
  extern __shared__ __align__(128) uint8_t smem[];
  const RingCta<STAGES> ring(smem, n, per_cta, PRODUCERS);
  const int warp = threadIdx.x / 32;
  constexpr int kShare = kTileN / PRODUCERS;
  if (warp >= kConsumers / 32) {
    bulk_rows(ring, kv, idx, (warp - kConsumers / 32) * kShare, kShare);
    return;
  }
  consume_ring(ring, hold_cycles, out);
}

// One producer warp bulk-copies rows 0-31 of each tile; LOADERS warps cp.async rows 32-63 (lane i
// of the loaders takes 16-byte pieces i, i + 32 LOADERS, ... of those rows) and each loader lane
// arrives on full once its copies land (cp.async.mbarrier.arrive.noinc: full counts 1 + 32 LOADERS).
template <int STAGES, int LOADERS>
__global__ void __launch_bounds__(kConsumers + 32 + 32 * LOADERS)
    mixed_ring(const uint8_t* kv, const int* idx, int n, int per_cta, int hold_cycles, uint32_t* out) {
  extern __shared__ __align__(128) uint8_t smem[];
  const RingCta<STAGES> ring(smem, n, per_cta, 1 + 32 * LOADERS);
  const int warp = threadIdx.x / 32;
  if (warp == kConsumers / 32) {
    bulk_rows(ring, kv, idx, 0, 32);
    return;
  }
  if (warp > kConsumers / 32) {
    const int li = threadIdx.x - kConsumers - 32;
    TileRows rows(idx, ring.lo, ring.hi);
    for (int t = 0; t < ring.ntiles; ++t) {
      const int s = t % STAGES;
      rows.advance(t);
      ring.wait_free(t);
      for (int k = li; k < 32 * kChunks; k += 32 * LOADERS) {  // the same trip count in every lane
        const int r = k / kChunks, c = k % kChunks;
        const int src_row = rows.row(32 + r);
        if (src_row >= 0)
          cp_async_16(ring.row_ptr(s, 32 + r) + 16 * c,
                      kv + static_cast<int64_t>(src_row) * kRowBytes + 16 * c, 16);
      }
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(&ring.full[s]))
                   : "memory");
    }
    return;
  }
  consume_ring(ring, hold_cycles, out);
}

// GROUPS groups of 4 loader warps; group g fills tiles g, g + GROUPS, ...: each thread loads its 18
// 16-byte pieces (i, i + 128, ... of the tile's 64 x 36) into registers, waits for the stage, stores
// them and arrives on full (which counts the group's 128 threads).
template <int STAGES, int GROUPS>
__global__ void __launch_bounds__(kConsumers + 128 * GROUPS, GROUPS == 1 ? 2 : 1)
    ldg_ring(const uint8_t* kv, const int* idx, int n, int per_cta, int hold_cycles, uint32_t* out) {
  extern __shared__ __align__(128) uint8_t smem[];
  const RingCta<STAGES> ring(smem, n, per_cta, 128);
  if (threadIdx.x >= kConsumers) {
    const int li = (threadIdx.x - kConsumers) % 128, group = (threadIdx.x - kConsumers) / 128;
    constexpr int kPieces = kTileN * kChunks / 128;
    TileRows rows(idx, ring.lo, ring.hi);
    rows.fetch(group);
    for (int t = group; t < ring.ntiles; t += GROUPS) {
      const int s = t % STAGES;
      rows.advance(t + GROUPS - 1);  // cur = tile t's rows, next = tile t + GROUPS's
      uint4 v[kPieces];
#pragma unroll
      for (int j = 0; j < kPieces; ++j) {
        const int k = li + 128 * j, r = k / kChunks, c = k % kChunks;
        const int src_row = rows.row(r);
        v[j] = make_uint4(0, 0, 0, 0);
        if (src_row >= 0) {
          const uint8_t* src = kv + static_cast<int64_t>(src_row) * kRowBytes + 16 * c;
          asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                       : "=r"(v[j].x), "=r"(v[j].y), "=r"(v[j].z), "=r"(v[j].w)
                       : "l"(src));
        }
      }
      ring.wait_free(t);
#pragma unroll
      for (int j = 0; j < kPieces; ++j) {
        const int k = li + 128 * j, r = k / kChunks, c = k % kChunks;
        *reinterpret_cast<uint4*>(ring.row_ptr(s, r) + 16 * c) = v[j];
      }
      mbar_arrive(&ring.full[s]);
    }
    return;
  }
  consume_ring(ring, hold_cycles, out);
}

template <int STAGES>
__global__ void __launch_bounds__(kConsumers) cpasync_ring(const uint8_t* kv, const int* idx, int n, int per_cta,
                                                    int hold_cycles, uint32_t* out) {
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
      for (int chunk = lane % 8; chunk < kChunks; chunk += 8)
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
    hold(hold_cycles);
  }
  for (int o = 16; o > 0; o >>= 1) x ^= __shfl_xor_sync(0xffffffffu, x, o);
  if (lane == 0) atomicXor(&out[blockIdx.x], x);
}

// The same checksum by plain loads (the reference for every ring case), one thread a word.
__global__ void xor_rows(const uint8_t* kv, const int* idx, int n, uint32_t* out) {
  uint32_t x = 0;
  for (int64_t w = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; w < static_cast<int64_t>(n) * kRowWords;
       w += static_cast<int64_t>(gridDim.x) * blockDim.x)
    x ^= *reinterpret_cast<const uint32_t*>(kv + static_cast<int64_t>(idx[w / kRowWords]) * kRowBytes +
                                           4 * (w % kRowWords));
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

using RingKernel = void (*)(const uint8_t*, const int*, int, int, int, uint32_t*);
struct Case {
  const char* name;  // "bulk P=1" ...
  RingKernel kernel;
  int threads, stages, ctas_per_sm;
};
template <int STAGES, int PRODUCERS>
Case bulk_case(const char* name, int ctas_per_sm) {
  return {name, bulk_ring<STAGES, PRODUCERS>, kConsumers + 32 * PRODUCERS, STAGES, ctas_per_sm};
}
template <int STAGES>
Case cpasync_case(int ctas_per_sm) {
  return {"cpasync", cpasync_ring<STAGES>, kConsumers, STAGES, ctas_per_sm};
}
template <int STAGES, int LOADERS>
Case mixed_case(const char* name, int ctas_per_sm) {
  return {name, mixed_ring<STAGES, LOADERS>, kConsumers + 32 + 32 * LOADERS, STAGES, ctas_per_sm};
}
template <int STAGES, int GROUPS>
Case ldg_case(const char* name, int ctas_per_sm) {
  return {name, ldg_ring<STAGES, GROUPS>, kConsumers + 128 * GROUPS, STAGES, ctas_per_sm};
}

}  // namespace kimi_ops::sm90::bench

int main(int argc, char** argv) {
  using namespace kimi_ops::sm90::bench;
  const int n = argc > 1 ? std::atoi(argv[1]) : 1 << 20;
  const int pool = argc > 2 ? std::atoi(argv[2]) : 2000000;
  const int page = argc > 3 ? std::atoi(argv[3]) : 1;  // rows a page: runs of consecutive cache rows
  if (n <= 0 || pool < n || page <= 0 || pool % page != 0) {
    std::fprintf(stderr, "usage: %s [tokens > 0] [pool_rows >= tokens] [page_rows dividing pool_rows]\n", argv[0]);
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
  // the first n rows of a random permutation of the pool's pages (page 1: bench_attention's layout)
  const int pages = pool / page;
  std::vector<int> perm(pages), rows(n);
  for (int i = 0; i < pages; ++i) perm[i] = i;
  uint64_t state = 12345;
  for (int i = 0; i < std::min(pages - 1, n / page + 1); ++i) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    std::swap(perm[i], perm[i + static_cast<int>((state >> 33) % static_cast<uint64_t>(pages - i))]);
  }
  for (int j = 0; j < n; ++j) rows[j] = perm[j / page] * page + j % page;
  CHECK(cudaMemcpy(idx, rows.data(), static_cast<size_t>(n) * sizeof(int), cudaMemcpyHostToDevice));
  CHECK(cudaMemset(ref, 0, sizeof(uint32_t)));
  xor_rows<<<4 * sms, 256>>>(kv, idx, n, ref);
  uint32_t want = 0;
  CHECK(cudaMemcpy(&want, ref, sizeof(uint32_t), cudaMemcpyDeviceToHost));

  std::printf("%s, %d SMs; %d rows of 576 B in random pages of %d rows from a pool of %d; TB/s of rows, median of 20\n",
              prop.name, sms, n, page, pool);
  // One case at hold_cycles: checksum checked, then the median of 20 launches. Returns false where
  // the case does not fit a SM (printed) or its checksum is wrong.
  auto measure = [&](const Case& c, int hold_cycles) {
    const size_t ring = static_cast<size_t>(c.stages) * kTileN * kSmemRow + 2 * c.stages * sizeof(uint64_t);
    // pad the CTA's shared memory so that exactly ctas_per_sm fit a SM (1 KB a CTA is reserved)
    const size_t smem = std::max(ring, static_cast<size_t>(smem_per_sm / (c.ctas_per_sm + 1) + 1024));
    if (c.ctas_per_sm * (smem + 1024) > static_cast<size_t>(smem_per_sm) || smem > 227 * 1024) {
      std::printf("%-10s stages %d, %d CTAs a SM: does not fit\n", c.name, c.stages, c.ctas_per_sm);
      return false;
    }
    CHECK(cudaFuncSetAttribute(c.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    int resident = 0;  // CTAs a SM by the occupancy calculator (registers can make it fewer than asked)
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, c.kernel, c.threads, smem));
    const int ctas = std::min(4096, sms * c.ctas_per_sm);
    const int per_cta = (n + ctas - 1) / ctas;
    auto launch = [&] { c.kernel<<<ctas, c.threads, smem>>>(kv, idx, n, per_cta, hold_cycles, out); };
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
    CHECK(cudaEventDestroy(a));
    CHECK(cudaEventDestroy(b));
    std::sort(ms.begin(), ms.end());
    const double us = 1e3 * ms[ms.size() / 2];
    const int tiles = (per_cta + kTileN - 1) / kTileN;
    std::printf("%-10s stages %d, %d CTAs a SM (%d resident, %3d threads, %3zu KB smem), hold %5d: %8.1f us  "
                "%.2f TB/s  %.2f us a CTA's tile  checksum %s\n",
                c.name, c.stages, c.ctas_per_sm, resident, c.threads, smem / 1024, hold_cycles, us,
                static_cast<double>(n) * kRowBytes / us / 1e6, us / tiles, ok ? "ok" : "WRONG");
    return ok;
  };
  const Case cases[] = {
      bulk_case<2, 1>("bulk P=1", 1),   bulk_case<4, 1>("bulk P=1", 1),   bulk_case<2, 1>("bulk P=1", 2),
      bulk_case<2, 1>("bulk P=1", 3),   bulk_case<4, 2>("bulk P=2", 1),   bulk_case<2, 2>("bulk P=2", 2),
      bulk_case<4, 4>("bulk P=4", 1),   bulk_case<2, 4>("bulk P=4", 2),   bulk_case<2, 4>("bulk P=4", 3),
      cpasync_case<2>(2),               cpasync_case<4>(1),               mixed_case<2, 1>("mixed L=1", 2),
      mixed_case<2, 3>("mixed L=3", 2), mixed_case<4, 3>("mixed L=3", 1), ldg_case<2, 1>("ldg G=1", 2),
      ldg_case<4, 2>("ldg G=2", 1)};
  bool all_ok = true;
  for (const Case& c : cases) all_ok = measure(c, 0) && all_ok;
  // splitkv_kernel's shape (one producer, 2 stages, 2 CTAs a SM) with each tile held as if computed on:
  // where the held time starts to lengthen a tile's period is the compute the ring hides
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, dev));
  std::printf("hold sweep (SM clocks a tile, max clock %.2f GHz):\n", clock_khz / 1e6);
  const Case held[] = {bulk_case<2, 1>("bulk P=1", 2), bulk_case<2, 2>("bulk P=2", 2)};
  for (const Case& c : held)
    for (int hold_cycles : {1000, 2000, 3000, 3500, 4000, 4500, 5000, 6000}) all_ok = measure(c, hold_cycles) && all_ok;
  return all_ok ? 0 : 1;
}
