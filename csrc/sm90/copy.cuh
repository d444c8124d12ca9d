// Shared-memory copy and mbarrier wrappers for sm_90a (PTX inline assembly): cp.async (16-byte
// chunks, zero-filled past src_bytes), cp.async.bulk (global -> shared, completing on an
// mbarrier's transaction count), mbarrier init / arrive / expect_tx / parity wait, and the
// generic-to-async proxy fence. Used by the M1c kernels (csrc/sm90/) and scripts/bench_bulk_gather.cu.
//
// Byte layouts: cp.async copies 16 bytes global -> shared (zero-filled past src_bytes);
// bulk_copy_g2s copies `bytes` (a multiple of 16, 16-byte aligned both sides) and adds them to the
// mbarrier's transaction count; an mbarrier is one 8-byte shared word.
#pragma once

#include <cstdint>

#include "params.cuh"

namespace kimi_ops::sm90 {
namespace {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(src_bytes));
}
// The same, zero-filling all 16 bytes (reading nothing) when `index` < 0.
__device__ __forceinline__ void cp_async_16_unless_negative(void* dst, const void* src, int index) {
  asm volatile(
      "{\n .reg .pred p;\n setp.lt.s32 p, %2, 0;\n cp.async.cg.shared.global [%0], [%1], 16, p;\n}\n" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(index));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// mbarrier and bulk-copy wrappers
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred P1;\n LAB_WAIT:\n mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
      " @P1 bra DONE;\n bra LAB_WAIT;\n DONE:\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
          smem_addr(dst)),
      "l"(src), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
// A zero row: the source of a bulk-copied token row past the split or outside the cache.
__device__ __align__(16) uint8_t g_zero_row[kRowBytes];

// generic-proxy shared-memory accesses ordered with the async proxy's (wgmma operand reads, bulk copies)
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

}  // namespace
}  // namespace kimi_ops::sm90
