"""Triton ``gemm_a16w8_block``: bf16 activations times fp8 e4m3 block-scaled weights, f32
accumulation, bf16 out, with no dequantized copy of the weight.

``y [M, N] = x [M, K] @ dequant(w)^T``, ``dequant(w)[n, k] = w[n, k] * w_scale_inv[n // block_n,
k // block_k]`` (the layout of :mod:`kimi_ops.reference.fp8`: DeepSeek-V3's / Kimi-K2's
checkpoints). x bf16 (any strides), w ``torch.float8_e4m3fn`` ``[N, K]`` (any strides), scales
float32 ``[ceil(N / block_n), ceil(K / block_k)]``; y bf16 contiguous.

One program per (N tile, M tile, K split). Each K tile of BLOCK_K columns lies inside one scale
block column (``block_k % BLOCK_K == 0``): the fp8 tile is converted to bf16 in registers
(exact: every e4m3 value is a bf16 value), ``tl.dot`` gives the tile's float32 product, and
that is multiplied by its columns' scales (``[BLOCK_N]``, one per output column n: scale row
``n // block_n``, so any ``block_n`` works, including the layer's 64-row grid of a fused
``[q_a | kv_a | gate]`` weight) before it is added to the accumulator: the sum is exactly
``sum_k x w s`` up to float32 rounding, as the reference computes it.

Split K (``SPLIT_K > 1``): decode's M is 1..64 rows, so an [N, K] weight gives few (N, M) tiles
(Kimi-K3's fused qkv_a + gate: N 3648; at BLOCK_N 128 that is 29 programs for 132 SMs); the K
tiles are then shared out among SPLIT_K programs, each writing a float32 partial ``[SPLIT_K, M,
N]``, and :func:`_reduce_splits_kernel` sums them into y (one more launch). A wide N tile keeps
the activations' re-reads from L2 (``N / BLOCK_N`` times ``M x K x 2`` bytes) below the weight's
``N x K`` bytes; split K restores the parallelism. Config: :func:`gemm_config` from shapes and
the SM count, or ``KIMI_OPS_FP8_GEMM_CONFIG="BLOCK_M,BLOCK_N,BLOCK_K,SPLIT_K,num_warps,num_stages"``
(every call; for sweeps).

Measured (H200, 2026-12-03, docs/PERF.md): correct at Kimi-K3's shapes (rel L2 1.6-1.7e-3 vs
float64, the bf16 output's rounding), but not yet at the bandwidth: at M = 1 the fused
qkv_a + gate GEMM (26 MB of fp8) took about as long as cuBLAS's bf16 GEMM of twice the bytes.
"""
import math
import os

import torch
import triton
import triton.language as tl

from . import interpreting
from .mxfp4 import _to_bf16

CONFIG_ENV = "KIMI_OPS_FP8_GEMM_CONFIG"


@triton.jit
def _operand(v, INTERP: tl.constexpr):
    """bf16 for the MMA; float32 under the interpreter (whose tl.dot multiplies bf16's raw bits).
    (The output's float32 -> bf16 is :func:`kimi_ops.kernels.mxfp4._to_bf16`, whose interpreter
    path rounds by integer ops: the interpreter's own cast does not carry into the exponent.)"""
    if INTERP:
        return v.to(tl.float32)
    else:
        return v.to(tl.bfloat16)


@triton.jit
def _gemm_a16w8_block_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, p_ptr,
    M, N, K, block_n, block_k,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr, TILES_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, INTERP: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    s_rows = s_ptr + (offs_n // block_n) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(TILES_PER_SPLIT):
        kt = pid_s * TILES_PER_SPLIT + i
        k0 = kt * BLOCK_K
        kx = k0 + offs_k
        mask_k = kx < K
        x = tl.load(x_rows + kx[None, :] * stride_xk, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_rows + kx[None, :] * stride_wk, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        s = tl.load(s_rows + (k0 // block_k) * stride_sk, mask=mask_n & (kt < K_TILES), other=0.0)
        part = tl.dot(_operand(x, INTERP), tl.trans(_operand(w, INTERP)))
        acc += part * s[None, :]
    if SPLIT_K == 1:
        y = y_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(y, _to_bf16(acc, INTERP), mask=mask_m[:, None] & mask_n[None, :])
    else:
        p = p_ptr + pid_s.to(tl.int64) * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(p, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _reduce_splits_kernel(p_ptr, y_ptr, total, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr):
    """y[i] = bf16(sum_s p[s, i]) over the flat [M * N] elements."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(p_ptr + s * total + offs, mask=mask, other=0.0)
    tl.store(y_ptr + offs, _to_bf16(acc, INTERP), mask=mask)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 132
    from ..device import device_index, multiprocessor_count
    return multiprocessor_count(device_index(device))


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, int(v)).bit_length() - 1)


def max_block_k(block_k: int) -> int:
    """The largest BLOCK_K (a power of two, at most 128) that divides the scale block's width."""
    return min(128, block_k & -block_k)


def gemm_config(m: int, n: int, k: int, block_k: int = 128, sms: int = 132) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) from shapes and the SM count.

    Measured on the H200 (2026-12-03, Kimi-K3 TP8's three fp8 projections, M = 1, 8, 32, 64;
    scripts/bench_layer.py --gemms / --sweep; that run timed one call a CUDA-graph replay, so each
    number carries ~10 us of launch latency and +-5 us of noise: only the large, same-direction
    differences below were taken). us (first guess -> the config below):

    * M = 1: (32, 64, 128, 4, 4, 6): qkv_a + gate 32.7 -> 21.6, q_b 15.7 -> 10.6, o_proj 19.2 ->
      16.8 (the first guess (16, 16, 128, 1, 4, 8): 228 programs of 16 rows over K = 7168).
      M = 2..4 take it too (not measured: the byte-count rule below would give them the slow
      16 x 16 tiles of the first guess).
    * 5 <= M <= 16: the byte-count rule (BLOCK_N about 4 M, SPLIT_K to about 2 programs an SM);
      at M = 8 no config of the five tried beat it by more than the noise.
    * 17 <= M <= 32: (32, 64, 128, 4, 4, 6): qkv_a + gate 26.8 -> 22.7 (q_b, o_proj: within the noise).
    * 33 <= M <= 64: (64, 128, 128, 4, 8, 4): qkv_a + gate 39.6 -> 32.5, q_b 20.8 -> 15.3, o_proj
      24.0 -> 22.3 (8 warps; the first guess had 4 and 8 splits).
    * M > 64 (prefill sizes, not measured): BLOCK_M 64, BLOCK_N 128, the split rule, 8 warps.

    The split rule: the power of two that brings the programs to about 2 per SM, each split at
    least 2 K tiles (the fixed-config rows cap theirs the same way), and its float32 partials
    (``SPLIT_K x M x N x 4`` bytes) at most half the weight's. BLOCK_K = 128 (or the largest power
    of two dividing ``block_k``). ``KIMI_OPS_FP8_GEMM_CONFIG`` overrides all of it.
    """
    bk = max_block_k(block_k)
    k_tiles = max(1, triton.cdiv(k, bk))
    cap = _pow2_floor(max(1, k_tiles // 2))
    m = max(1, m)
    if m <= 4:
        return 32, 64, bk, min(4, cap), 4, 6
    if 17 <= m <= 32:
        return 32, 64, bk, min(4, cap), 4, 6
    if 33 <= m <= 64:
        return 64, 128, bk, min(4, cap), 8, 4
    bm = min(64, max(16, triton.next_power_of_2(m)))
    bn = min(128, max(16, triton.next_power_of_2(4 * min(m, bm))))
    tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
    split = _pow2_floor(max(1, (2 * sms) // tiles))
    split = min(split, cap, _pow2_floor(max(1, k // (8 * m))))
    stage_bytes = bm * bk * 2 + bn * bk
    stages = 8 if stage_bytes <= 8192 else 6 if stage_bytes < 16384 else 4
    return bm, bn, bk, max(1, split), (8 if m > 64 else 4), stages


def _env_config() -> tuple[int, ...] | None:
    env = os.environ.get(CONFIG_ENV, "").strip()
    if not env:
        return None
    try:
        vals = tuple(int(v) for v in env.split(","))
    except ValueError:
        vals = ()
    if len(vals) != 6 or min(vals) < 1:
        raise ValueError(f"{CONFIG_ENV} must be 'BLOCK_M,BLOCK_N,BLOCK_K,SPLIT_K,num_warps,num_stages' "
                         f"(positive integers), got {env!r}")
    return vals


def gemm_a16w8_block(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor, *, block_n: int = 128,
                     block_k: int = 128, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """``y = x @ dequant(w)^T`` -> bf16 ``[M, N]`` (inputs validated by the op layer).

    ``config``: (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages); default
    ``KIMI_OPS_FP8_GEMM_CONFIG`` when set, else :func:`gemm_config`. BLOCK_K must divide
    ``block_k`` and be a power of two >= 16 (else ValueError).
    """
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    cfg = config or _env_config() or gemm_config(m, n, k, block_k, _sm_count(x.device))
    bm, bn, bk, split, warps, stages = cfg
    if bk < 16 or bk & (bk - 1) or block_k % bk:
        raise ValueError(f"gemm_a16w8_block: BLOCK_K must be a power of two >= 16 dividing block_k = {block_k}, "
                         f"got {bk}")
    k_tiles = triton.cdiv(k, bk)
    split = max(1, min(split, k_tiles))
    per_split = triton.cdiv(k_tiles, split)
    split = triton.cdiv(k_tiles, per_split)           # no empty split
    partial = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    _gemm_a16w8_block_kernel[grid](
        x, w, w_scale_inv, y, partial, m, n, k, block_n, block_k,
        *x.stride(), *w.stride(), *w_scale_inv.stride(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, K_TILES=k_tiles, TILES_PER_SPLIT=per_split, SPLIT_K=split,
        INTERP=interpreting(), num_warps=warps, num_stages=stages,
    )
    if split > 1:
        block = 1024
        _reduce_splits_kernel[(triton.cdiv(m * n, block),)](partial, y, m * n, SPLIT_K=split, BLOCK=block,
                                                            INTERP=interpreting(), num_warps=4)
    return y


def split_count(m: int, n: int, k: int, block_k: int = 128, sms: int = 132) -> int:
    """The K splits :func:`gemm_a16w8_block` runs for these shapes by default (tests, benches)."""
    bm, bn, bk, split, _, _ = gemm_config(m, n, k, block_k, sms)
    k_tiles = math.ceil(k / bk)
    split = max(1, min(split, k_tiles))
    return math.ceil(k_tiles / math.ceil(k_tiles / split))


# ----------------------------------------------------------------------------------------------
# cross-compilation registry (scripts/cross_compile.py; format in kimi_ops/kernels/__init__.py).
# Not yet listed in CROSS_COMPILE_MODULES: float8_e4m3fn weights are the OCP format, which gfx942
# (fnuz fp8) does not convert natively; sm90 and gfx950 only.

KIMI_K3_SHAPES = ((3648, 7168), (2304, 1536), (7168, 1536))
"""Kimi-K3 TP8's fp8 projections (N, K): fused qkv_a + gate, q_b, o_proj."""


def _specs():
    sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "y_ptr": "*bf16", "p_ptr": "*fp32",
           "M": "i32", "N": "i32", "K": "i32", "block_n": "i32", "block_k": "i32"}
    for name in ("stride_xm", "stride_wn", "stride_sn"):
        sig[name] = "i32"
    for name in ("stride_xk", "stride_wk", "stride_sk"):
        sig[name] = "constexpr"       # 1 at run time (the JIT specializes it): contiguous K
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "K_TILES", "TILES_PER_SPLIT", "SPLIT_K", "INTERP"):
        sig[name] = "constexpr"
    configs = {}  # each distinct launch the shapes below pick, in order (a dict keeps insertion order)
    for n, k in KIMI_K3_SHAPES:
        for m in (1, 8, 32, 64, 256):
            bm, bn, bk, split, warps, stages = gemm_config(m, n, k, 128, 132)
            k_tiles = -(-k // bk)
            per = -(-k_tiles // split)
            configs[(bm, bn, bk, k_tiles, per, -(-k_tiles // per), warps, stages)] = None
    specs = [{
        "name": f"gemm_a16w8_block_m{bm}n{bn}k{bk}t{k_tiles}p{per}s{split}w{warps}st{stages}",
        "kernel": _gemm_a16w8_block_kernel, "signature": dict(sig),
        "constexprs": {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "K_TILES": k_tiles,
                       "TILES_PER_SPLIT": per, "SPLIT_K": split, "INTERP": False,
                       "stride_xk": 1, "stride_wk": 1, "stride_sk": 1},
        "num_warps": warps, "num_stages": stages, "targets": ("gfx950", "sm90")}
        for bm, bn, bk, k_tiles, per, split, warps, stages in configs]
    for split in sorted({s["constexprs"]["SPLIT_K"] for s in specs} - {1}):
        specs.append({
            "name": f"gemm_a16w8_reduce_s{split}", "kernel": _reduce_splits_kernel,
            "signature": {"p_ptr": "*fp32", "y_ptr": "*bf16", "total": "i32", "SPLIT_K": "constexpr",
                          "BLOCK": "constexpr", "INTERP": "constexpr"},
            "constexprs": {"SPLIT_K": split, "BLOCK": 1024, "INTERP": False},
            "num_warps": 4, "num_stages": 1, "targets": ("gfx950", "sm90")})
    return specs


CROSS_COMPILE_SPECS = _specs()
