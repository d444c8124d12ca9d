"""Host side of the Hopper small-M projection kernels in ``kimi_ops._C`` (``csrc/sm90/gemv.cuh`` and,
for an fp8 weight at 33-64 rows, ``csrc/sm90/gemm_fp8_rows64.cuh``; launched by
``csrc/sm90/gemv_sm90.cu`` as the private op ``torch.ops.kimi_ops._gemv_sm90``).

The ``cuda`` backend of :func:`kimi_ops.gemm_a16w16` and :func:`kimi_ops.gemm_a16w8_block`: at
``M <= 32`` rows of x (a decode step of up to 32 tokens) a projection is a stream of its weight's
bytes, which cuBLAS's bf16 kernels and the Triton fp8 GEMV move at 1.8-3.3 TB/s on the H200
(docs/perf-history.md, sessions 20-25). The kernel takes 16 weight rows a CTA (the MMA's M) and
the tokens as the MMA's N (two / four 8-token MMAs on each weight fragment at 9-16 / 17-32 rows),
and keeps all of a lane's 16-byte loads of a step in flight at once (a 256-column k-block of a
bf16 weight, 128 / 64 columns at two / four token tiles; three 128-column ones of an fp8 weight,
one above 8 rows). With an fp8 weight up to 16 rows a token's sums do not depend on M (16 rows in
one launch give the bits of two launches of 8); elsewhere the order changes with the tiles,
within the same bound.

Numerics: the products are exact in float32 (bf16 x bf16; an fp8 e4m3 weight becomes bf16
exactly, as its value times 2^-120, and x is multiplied by 2^60 to match: exact for |x| < 2^67);
sums in float32, one k-block at a time, the fp8 block scale applied to each k-block's sum
(``gemm_a16w8_block``'s contract), one rounding to bf16.

``constant_w=True`` (the ops' keyword; the decode layer passes it for its weights): the kernel
launches with programmatic dependent launch and issues its first weight loads before it waits
for the previous kernel on the stream (x after the wait), so the weight streams while that kernel
finishes. On the H200 this took 1.2-1.9 us off the compiled fp8 step at batch 1 and 8, 0.3-0.9
us off the MXFP4 one (docs/perf-history.md, session 28). Only sound when nothing queued just
before writes w; ``KIMI_OPS_PDL=0`` turns it off.

What it takes (:func:`serves`; anything else runs the other backend's code: cuBLAS for bf16, the
Triton kernels for fp8): ``1 <= M <= 64`` (MAX_M; gemv.cuh to 32 rows, gemm_fp8_rows64.cuh above:
K split over a cluster of CTAs; on an H100, session 57: 1.09-1.36x the Triton tl.dot GEMM on
Kimi-K3's qkv_a + gate and o_proj at 33-64 rows, 0.75-0.90x on q_b, yet the fp8 layer's step
2.6-3.4 us slower with q_b left to Triton; the step 4-10% faster than with Triton's three) with an
fp8 w, ``1 <= M <= 16`` (BF16_MAX_M) with a bf16 w (at 24 and 32 rows cuBLAS was faster on the
K-1536 projections: q_b 6.1 against 8.4 / 9.0 us, o_proj 10.8 against 12.4 / 13.1 on an H100,
session 34); x bf16 with contiguous, 16-byte aligned rows; w contiguous and 16-byte aligned; bf16
w with ``K % 32 == 0``; fp8 (``float8_e4m3fn``) w with ``K % 64 == 0``, ``block_k == 128``,
``block_n % 16 == 0`` and a scale of unit stride along K.
The decode layer's q_b runs in a form of the kernel fused with the step's norms
(:func:`mla_norm_cache_write_q_b`, the op of the same name): each token's RMSNorm is applied to the
float32 sums, the norm weight to x as it is loaded, and CTAs after the product's write the cache
rows and the gate (csrc/sm90/pre_norm.cuh), so no kernel runs between qkv_a and q_b.

``KIMI_OPS_SM90_GEMV`` (read at each call), for A/B measurements: ``0`` turns the kernel off;
``8`` / ``16`` / ``32`` / ``64`` set the row limit for both weight dtypes (``32`` lets bf16 weights
take the four-tile path and gives an fp8 weight's 33-64 rows back to Triton; bf16 weights stop at
32). ``KIMI_OPS_SM90_ROWS64_MT=2`` (read at each launch): gemm_fp8_rows64.cuh with 32 weight rows a
warp, one CTA a SM (session 56: faster on qkv_a + gate and o_proj at 64 rows, 22.8 / 13.8 against
26.1 / 14.8 us; session 57, against the default with its 2^60 on W: the fp8 layer's step within
1.1-1.7 us either way at batch 32-64).
"""
import os

import torch

from ..reference.linear import gemm_a16w16 as _linear
from .sm90 import _ops  # kimi_ops._C's private ops (importing it registers them)

MAX_M = 64        # fp8 weights: gemv.cuh to 32 rows, gemm_fp8_rows64.cuh at 33-64
GEMV_MAX_M = 32   # gemv.cuh's limit (bf16 weights never go past it)
BF16_MAX_M = 16   # bf16 weights by default: at 24 / 32 rows cuBLAS is faster on q_b and o_proj (K 1536)
ENV = "KIMI_OPS_SM90_GEMV"
NORM_Q_B_ENV = "KIMI_OPS_SM90_NORM_Q_B"  # "0": mla_norm_cache_write_q_b as two ops (A/B measurements)
NORM_Q_B_MAX_M = 16  # the fused kernel's tokens: the fp8 layer at 32 was 1.8% slower fused (H100, session 37)


def _x_ok(x: torch.Tensor, max_m: int) -> bool:
    return (x.dtype == torch.bfloat16 and 1 <= x.shape[0] <= max_m and x.stride(1) == 1
            and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0)


def serves(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor | None = None, block_n: int = 128,
           block_k: int = 128) -> bool:
    """Whether the kernel computes ``x @ w^T`` (with ``w_scale_inv``'s block scales for an fp8
    w): the conditions in the module's docstring."""
    env = os.environ.get(ENV, "").strip()
    if env not in ("", "0", "1", "8", "16", "32", "64"):
        raise ValueError(f"{ENV} must be 0, 1, 8, 16, 32 or 64, got {env!r}")
    if env == "0":
        return False
    max_m = int(env) if env not in ("", "1") else (BF16_MAX_M if w.dtype == torch.bfloat16 else MAX_M)
    if w.dtype == torch.bfloat16:
        max_m = min(max_m, GEMV_MAX_M)
    if not (x.is_cuda and w.is_cuda and w.is_contiguous() and w.data_ptr() % 16 == 0 and _x_ok(x, max_m)):
        return False
    k = x.shape[1]
    if w.dtype == torch.bfloat16:
        return w_scale_inv is None and k % 32 == 0
    return (w.dtype == torch.float8_e4m3fn and w_scale_inv is not None and k % 64 == 0 and block_k == 128
            and block_n % 16 == 0 and w_scale_inv.stride(1) == 1)


def norm_q_b_serves(q_c, kv_c, k_pe, g, q_norm_weight, kv_norm_weight, kv_rows, q_b_weight, q_b_scale_inv=None,
                    block_n=128, block_k=128) -> bool:
    """Whether the fused kernel (``_norm_q_b_sm90``: gemv.cuh's kNorm form with pre_norm.cuh's side
    CTAs) takes a :func:`mla_norm_cache_write_q_b` call: the projection's kernel serves q_b
    (:func:`serves`), at most NORM_Q_B_MAX_M (16) tokens, K <= 8192 with at least 4 k-blocks (512
    fp8 / 1024 bf16 columns), bf16 norm weights (q_norm_weight 16-byte aligned), kv_c / k_pe / g
    rows in whole 4-byte words, an e4m3fn cache, and ``KIMI_OPS_SM90_NORM_Q_B`` not ``0``."""
    if os.environ.get(NORM_Q_B_ENV, "").strip() == "0":
        return False
    if q_c.shape[0] > NORM_Q_B_MAX_M or not serves(q_c, q_b_weight, q_b_scale_inv, block_n, block_k):
        return False
    k = q_c.shape[1]
    min_k = 512 if q_b_scale_inv is not None else 1024
    words = all(x.stride(0) % 2 == 0 and x.data_ptr() % 4 == 0 for x in (kv_c, k_pe, g) if x is not None)
    return (min_k <= k <= 8192 and words and kv_rows.dtype == torch.float8_e4m3fn
            and q_norm_weight.dtype == kv_norm_weight.dtype == torch.bfloat16
            and q_norm_weight.data_ptr() % 16 == 0 and kv_norm_weight.data_ptr() % 4 == 0)


def mla_norm_cache_write_q_b(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_rows, slot_mapping, q_b_weight,
                             q_b_scale_inv=None, g=None, *, eps: float, kv_scale: float, block_n: int = 128,
                             block_k: int = 128, constant_w: bool = False):
    """-> (q [T, N] bf16, gate [T, G] bf16): one launch where :func:`norm_q_b_serves`, else the two
    ops in turn (kimi_ops.kernels.pre_norm). Inputs validated by the op layer; ``kv_rows`` the cache
    as [N, 576] rows."""
    if norm_q_b_serves(q_c, kv_c, k_pe, g, q_norm_weight, kv_norm_weight, kv_rows, q_b_weight, q_b_scale_inv,
                       block_n, block_k):
        return _ops()._norm_q_b_sm90(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_rows, slot_mapping,
                                     q_b_weight, q_b_scale_inv, g, block_n, float(eps), float(kv_scale), constant_w)
    from . import pre_norm
    return pre_norm.mla_norm_cache_write_q_b(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_rows, slot_mapping,
                                             q_b_weight, q_b_scale_inv, g, eps=eps, kv_scale=kv_scale,
                                             block_n=block_n, block_k=block_k, constant_w=constant_w)


def gemm_a16w16(x: torch.Tensor, w: torch.Tensor, *, constant_w: bool = False) -> torch.Tensor:
    """``x [M, K] @ w [N, K]^T`` -> bf16 ``[M, N]``: the kernel where it serves, else the reference's
    ``F.linear`` (inputs validated by the op layer). ``constant_w``: the module's docstring."""
    if serves(x, w):
        return _ops()._gemv_sm90(x, w, None, 0, constant_w)
    return _linear(x, w)


def gemm_a16w8_block(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor, *, block_n: int = 128,
                     block_k: int = 128, constant_w: bool = False) -> torch.Tensor:
    """``x @ dequant(w)^T`` -> bf16 ``[M, N]``: the kernel where it serves, else the Triton
    kernels (inputs validated by the op layer). ``constant_w``: the module's docstring."""
    if serves(x, w, w_scale_inv, block_n, block_k):
        return _ops()._gemv_sm90(x, w, w_scale_inv, block_n, constant_w)
    from . import fp8_gemm
    return fp8_gemm.gemm_a16w8_block(x, w, w_scale_inv, block_n=block_n, block_k=block_k)
