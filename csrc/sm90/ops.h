// The Hopper (sm_90a) ops' CUDA kernels, bound to their schemas (defined in csrc/registration.cpp)
// by impl_sm90_ops, which mla_decode_sm90.cu defines:
//   _mla_decode_splitkv_sm90  q [T, H, 576] bf16, kv_cache [N, 576] fp8 e4m3fn, kv_indptr
//                             [T / qlen + 1] int32, kv_indices [kv_indptr[-1]] int32, seq_lens
//                             [T / qlen] int32 or none, q_scale [1] f32 or none (with it q is fp8
//                             e4m3fn [T, H, 576], real q = q * q_scale), constant_kv (the cache
//                             and metadata not written by the kernel before: programmatic
//                             dependent launch, the first copies before the wait)
//                             -> o_part [S, T, H, 512] bf16, lse_part [S, T, H] f32
//   _mla_decode_sm90          the same inputs -> o [T, H, 512] bf16, lse [T, H] f32 (work-list grid + merge)
//   _mla_merge_sm90           o_part [S, T, H, 512] bf16, lse_part [S, T, H] f32 -> o, lse
// and by impl_sm90_gemv_ops, which gemv_sm90.cu defines:
//   _gemv_sm90                x [M, K] bf16 (M <= 32 with a bf16 w, 64 with an fp8 one), w [N, K]
//                             bf16 or fp8 e4m3fn, w_scale_inv [ceil(N / block_n), ceil(K / 128)]
//                             f32 with an fp8 w, constant_w (programmatic dependent launch)
//                             -> y [M, N] bf16
//   _norm_q_b_sm90            the decode layer's q_b with its RMSNorm, the kv RMSNorm + cache write
//                             and the gate's sigmoid in the same launch: q_c [T <= 16, K] bf16,
//                             kv_c [T, 512], k_pe [T, 64], q / kv norm weights bf16, kv_cache
//                             [N, 576] fp8 e4m3fn (rows slot_mapping[t] written), w / w_scale_inv
//                             as _gemv_sm90's, g [T, G] bf16 or none -> (q [T, N] bf16, gate [T, G])
// (CUDA tensors, contiguous; kimi_ops/kernels/sm90.py calls them.)
#pragma once

#include <torch/library.h>

namespace kimi_ops::sm90 {

// m.impl of the ops above (m: a TORCH_LIBRARY_IMPL(kimi_ops, CUDA, m) block).
void impl_sm90_ops(torch::Library& m);
void impl_sm90_gemv_ops(torch::Library& m);

}  // namespace kimi_ops::sm90
