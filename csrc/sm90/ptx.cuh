// PTX wrappers for sm_90a shared by the M1c kernels: named barriers (bar.sync / bar.red on
// barrier 1), grid dependency control (programmatic dependent launch), ldmatrix, wgmma (fence /
// commit / wait, shared-memory descriptors, the f16 RS instruction for N = 24, 32, 48, 64), 32-bit
// shared loads, e4m3 -> f16 conversion, mma.sync m16n8k16 f16, ex2.approx, f16x2 packing and prmt.
// (No mma.sync e4m3: sm_90 emulates it, ptxas emitting f16 HMMA and conversions of both operands;
// the fp8 query is staged as f16.)
//
// Byte layouts: registers only, except ldmatrix_x4 / lds32 (shared memory, 16 / 4 bytes a lane)
// and the wgmma B operand, read through smem_desc: no swizzle, core matrices of 8 rows x 16
// bytes (128 contiguous bytes), lbo bytes between core matrices adjacent in K, sbo in M / N.
// F16x4: byte i of a 32-bit word of e4m3 -> f16 i (lo = bytes 0, 1; hi = bytes 2, 3).
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "copy.cuh"

namespace kimi_ops::sm90 {
namespace {

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

// Programmatic dependent launch (the host launches with it only with KIMI_OPS_SM90_PDL=1:
// mla_decode_sm90.cu): a kernel may start while the previous kernel on the stream is still running,
// so every kernel here waits for that grid (its completion and its memory) before it touches global
// memory, and lets the next one start launching once its own main loop is done (a next kernel
// launched with PDL, such as the Triton W_UV after the merge, may then start). Without the launch
// attribute the wait is a no-op.
__device__ __forceinline__ void wait_prior_grid() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void allow_next_grid() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }

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
// (g + 8, 8j + 2c), (g + 8, 8j + 2c + 1). Always accumulates (scale-d true). N = 24, 32, 48 or 64 query rows.
// B's core matrices are K-major (8 N rows x 8 k, k contiguous), or with kTransB MN-major (8 k rows x 8 N).
template <int N, int kTransB = 0>
struct WgmmaF16RS;
template <int kTransB>
struct WgmmaF16RS<24, kTransB> {
  __device__ __forceinline__ static void run(float (&d)[3][4], const uint32_t (&a)[4], uint64_t b_desc,
                                             int scale_d = 1) {
    asm volatile(
        "{\n .reg .pred p;\n setp.ne.b32 p, %17, 0;\n"
        " wgmma.mma_async.sync.aligned.m64n24k16.f32.f16.f16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11"
        "}, {%12, %13, %14, %15}, %16, p, 1, 1, %18;\n}\n"
        : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]),
          "+f"(d[1][2]), "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b_desc), "r"(scale_d), "n"(kTransB));
  }
};
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

// PTX prmt.b32 (default mode): result byte i is byte (selector nibble i & 7) of {y, x} (x = bytes
// 0..3), or that byte's sign bit replicated where the nibble's bit 3 is set.
__device__ __forceinline__ uint32_t prmt(uint32_t x, uint32_t y, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(d) : "r"(x), "r"(y), "r"(selector));
  return d;
}

}  // namespace
}  // namespace kimi_ops::sm90
