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
On sm_90 at M >= 33 (:func:`use_swap`) the same kernel computes the transpose, ``y^T = w x^T``:
the converted weight tile is the MMA's A operand straight from registers, x's rows its N; the
same products and sums, in the same order of K tiles.

Split K (``SPLIT_K > 1``): decode's M is 1..64 rows, so an [N, K] weight gives few (N, M) tiles
(Kimi-K3's fused qkv_a + gate: N 3648; at BLOCK_N 128 that is 29 programs for 132 SMs); the K
tiles are then shared out among SPLIT_K programs, each writing a float32 partial ``[SPLIT_K, M,
N]``, and :func:`_reduce_splits_kernel` sums them into y (one more launch). A wide N tile keeps
the activations' re-reads from L2 (``N / BLOCK_N`` times ``M x K x 2`` bytes) below the weight's
``N x K`` bytes; split K restores the parallelism. Config: :func:`gemm_config` from shapes and
the SM count, or ``KIMI_OPS_FP8_GEMM_CONFIG="BLOCK_M,BLOCK_N,BLOCK_K,SPLIT_K,num_warps,num_stages"``
(every call; for sweeps).

GEMV kernel for small M (:func:`_gemv_a16w8_block_kernel`, no tl.dot): at decode's M = 1..4 the
MMA is mostly padding and the weight stream is the whole cost. One program per (BLOCK_N weight
rows, K split) covers every M row (BLOCK_M = M's power of two, M <= GEMV_LIMIT_M = 16). Its tiles
are 4-D ``(K slot, m, n, column in the slot)``: each thread loads VEC = 16 fp8 bytes of a weight
row at once (VEC = the largest power of two <= 16 dividing ``block_k``, so a slot lies in one
scale block), the next K tile's load issued before this tile's math; the weight is converted to
float32, multiplied by the broadcast x rows (each row loaded per tile, a tile smaller than the
CTA's thread count: Triton loads it straight in the product's layout, no shared memory), summed
over the slot's 16 columns inside the thread (float32), multiplied by the slot's scale once, and
accumulated in float32 per (slot, m, n); the K slots are reduced across threads once at the end.
Split K as above (float32 partials + :func:`_reduce_splits_kernel`) where ``N / BLOCK_N`` programs
are too few. Config: :func:`gemv_config`, or
``KIMI_OPS_FP8_GEMV_CONFIG="BLOCK_N,BLOCK_K,SPLIT_K,num_warps,DEPTH,X_AHEAD"``
(DEPTH: weight tiles in flight ahead of the math, 1..4; X_AHEAD 1: x's rows one tile ahead too).
Numerics: float32 products and sums as the tl.dot kernel's, in another order (the K slot's 16
products first, then the scale, then the slots), one rounding to bf16.

Which kernel runs: :func:`use_gemv`, the one place of the rule: the GEMV at ``1 <= M <=
GEMV_MAX_M`` (4), the tl.dot kernel above. ``KIMI_OPS_FP8_GEMV`` (read at each call) overrides it
for sweeps: ``0`` never the GEMV, ``1`` the GEMV at every M <= 16, an integer L the GEMV at M <=
min(L, 16). :func:`gemm_a16w8_block`'s ``gemv=True/False`` forces one (its ``config`` is that kernel's).

Measured (H200, 2026-12-03, docs/PERF.md): correct at Kimi-K3's shapes (rel L2 1.6-1.7e-3 vs
float64, the bf16 output's rounding), but not yet at the bandwidth: at M = 1 the fused
qkv_a + gate GEMM (26 MB of fp8) took about as long as cuBLAS's bf16 GEMM of twice the bytes.
"""
import os

import torch
import triton
import triton.language as tl

from ..device import device_index, is_sm90, multiprocessor_count
from . import interpreting
from .attention import FN_BYTES, NATIVE, _as_codes
from .cache import fp8_value
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
    W_BYTES: tl.constexpr = 0,  # 0: w as its fp8 type; 1 / 2: e4m3fn / e4m3fnuz codes (uint8), decoded
    SWAP: tl.constexpr = False,  # y^T = w x^T: the weight tile is the MMA's A (M), x's rows its N
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
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(TILES_PER_SPLIT):
        kt = pid_s * TILES_PER_SPLIT + i
        k0 = kt * BLOCK_K
        kx = k0 + offs_k
        mask_k = kx < K
        x = tl.load(x_rows + kx[None, :] * stride_xk, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_rows + kx[None, :] * stride_wk, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        s = tl.load(s_rows + (k0 // block_k) * stride_sk, mask=mask_n & (kt < K_TILES), other=0.0)
        if W_BYTES:
            w = fp8_value(w, W_BYTES == 2)
        if SWAP:
            acc += tl.dot(_operand(w, INTERP), tl.trans(_operand(x, INTERP))) * s[:, None]
        else:
            acc += tl.dot(_operand(x, INTERP), tl.trans(_operand(w, INTERP))) * s[None, :]
    if SWAP:
        acc = tl.trans(acc)
    if SPLIT_K == 1:
        y = y_ptr + offs_m[:, None] * N + offs_n[None, :]
        tl.store(y, _to_bf16(acc, INTERP), mask=mask_m[:, None] & mask_n[None, :])
    else:
        p = p_ptr + pid_s.to(tl.int64) * M * N + offs_m[:, None] * N + offs_n[None, :]
        tl.store(p, acc, mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _gemv_w_tile(w_rows, k_start, kk, j, mask_n, K, stride_wk, BLOCK_K: tl.constexpr, TILES: tl.constexpr):
    """The split's K tile j of the weight rows, fp8 ``[BK / VEC, 1, BN, VEC]`` (zeros past K or past
    the split's TILES tiles)."""
    kx = k_start + j * BLOCK_K + kk
    return tl.load(w_rows + kx * stride_wk, mask=mask_n & (kx < K) & (j < TILES), other=0.0)


@triton.jit
def _gemv_x_tile(x_ptr, kx, m4, M, K, stride_xm, stride_xk, BLOCK_M: tl.constexpr, BKO: tl.constexpr,
                 VEC: tl.constexpr):
    """x rows 0..BLOCK_M-1 at columns kx ``[BKO, 1, 1, VEC]`` -> float32 ``[BKO, BLOCK_M, 1, VEC]``
    (columns >= K and rows >= M read as 0), one row load at a time put in place with where."""
    xt = tl.zeros((BKO, BLOCK_M, 1, VEC), dtype=tl.float32)
    for mi in tl.static_range(BLOCK_M):
        row = tl.load(x_ptr + mi * stride_xm + kx * stride_xk, mask=(kx < K) & (mi < M), other=0.0)
        xt = tl.where(m4 == mi, row.to(tl.float32), xt)
    return xt


@triton.jit
def _gemv_a16w8_block_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, p_ptr,
    M, N, K, block_n, block_k,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, VEC: tl.constexpr,
    TILES_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr, DEPTH: tl.constexpr, X_AHEAD: tl.constexpr,
    INTERP: tl.constexpr, W_BYTES: tl.constexpr = 0,
):
    """Small-M GEMM without tl.dot: one program per (BLOCK_N weight rows, K split), all M <= BLOCK_M
    x rows. Tensors are 4-D ``(ko, m, n, ki)``: K slot of VEC columns, x row, weight row, column
    inside the slot. The fp8 tile ``[BK / VEC, 1, BN, VEC]`` is one load of VEC bytes a thread
    (DEPTH tiles are in flight: tile i + DEPTH's load is issued before tile i's math; X_AHEAD: x's
    rows one tile ahead too), converted to float32; each x row
    ``[BK / VEC, 1, 1, VEC]`` is put in place with where (a tile with fewer elements than the CTA
    has threads: Triton loads it straight in the product's layout); the product is summed over
    the VEC columns inside each thread, times the slot's scale (one scale per (row, slot): a slot
    lies inside one scale block), and added to ``acc [BK / VEC, BM, BN, 1]``; the K slots are
    reduced across threads once, at the end."""
    BKO: tl.constexpr = BLOCK_K // VEC
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    ko = (tl.arange(0, BKO) * VEC)[:, None, None, None]
    m4 = tl.arange(0, BLOCK_M)[None, :, None, None]
    n4 = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, None, :, None]
    kk = ko + tl.arange(0, VEC)[None, None, None, :]              # [BKO, 1, 1, VEC]
    mask_n = n4 < N
    w_rows = w_ptr + n4.to(tl.int64) * stride_wn                  # [1, 1, BN, 1]
    s_rows = s_ptr + (n4 // block_n) * stride_sn
    k_start = pid_s * (TILES_PER_SPLIT * BLOCK_K)
    acc = tl.zeros((BKO, BLOCK_M, BLOCK_N, 1), dtype=tl.float32)
    w0 = _gemv_w_tile(w_rows, k_start, kk, 0, mask_n, K, stride_wk, BLOCK_K, TILES_PER_SPLIT)
    if DEPTH >= 2:
        w1 = _gemv_w_tile(w_rows, k_start, kk, 1, mask_n, K, stride_wk, BLOCK_K, TILES_PER_SPLIT)
    if DEPTH >= 3:
        w2 = _gemv_w_tile(w_rows, k_start, kk, 2, mask_n, K, stride_wk, BLOCK_K, TILES_PER_SPLIT)
    if DEPTH >= 4:
        w3 = _gemv_w_tile(w_rows, k_start, kk, 3, mask_n, K, stride_wk, BLOCK_K, TILES_PER_SPLIT)
    if X_AHEAD:
        x_cur = _gemv_x_tile(x_ptr, k_start + kk, m4, M, K, stride_xm, stride_xk, BLOCK_M, BKO, VEC)
    for i in range(TILES_PER_SPLIT):
        k0 = k_start + i * BLOCK_K
        kx = k0 + kk
        w_new = _gemv_w_tile(w_rows, k_start, kk, i + DEPTH, mask_n, K, stride_wk, BLOCK_K, TILES_PER_SPLIT)
        if X_AHEAD:
            more = i + 1 < TILES_PER_SPLIT
            x_nxt = _gemv_x_tile(x_ptr, kx + BLOCK_K, m4, M, tl.where(more, K, 0), stride_xm, stride_xk,
                                 BLOCK_M, BKO, VEC)
            xt = x_cur
        else:
            xt = _gemv_x_tile(x_ptr, kx, m4, M, K, stride_xm, stride_xk, BLOCK_M, BKO, VEC)
        ks = k0 + ko                                              # [BKO, 1, 1, 1]: slot starts
        s = tl.load(s_rows + (ks // block_k) * stride_sk, mask=mask_n & (ks < K), other=0.0)
        if W_BYTES:
            wf = fp8_value(w0, W_BYTES == 2)
        else:
            wf = w0.to(tl.float32)
        blk = tl.sum(xt * wf, axis=3, keep_dims=True)   # [BKO, BM, BN, 1]
        acc += blk * s
        if DEPTH == 1:
            w0 = w_new
        elif DEPTH == 2:
            w0 = w1
            w1 = w_new
        elif DEPTH == 3:
            w0 = w1
            w1 = w2
            w2 = w_new
        else:
            w0 = w1
            w1 = w2
            w2 = w3
            w3 = w_new
        if X_AHEAD:
            x_cur = x_nxt
    out = tl.sum(tl.sum(acc, axis=3), axis=0)                     # [BM, BN]
    offs_m = tl.arange(0, BLOCK_M)[:, None]
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    mask = (offs_m < M) & (offs_n < N)
    if SPLIT_K == 1:
        tl.store(y_ptr + offs_m * N + offs_n, _to_bf16(out, INTERP), mask=mask)
    else:
        tl.store(p_ptr + pid_s.to(tl.int64) * M * N + offs_m * N + offs_n, out, mask=mask)


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
    return multiprocessor_count(device_index(device))


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, int(v)).bit_length() - 1)


def max_block_k(block_k: int) -> int:
    """The largest BLOCK_K (a power of two, at most 128) that divides the scale block's width."""
    return min(128, block_k & -block_k)


def gemm_config(m: int, n: int, k: int, block_k: int = 128, sms: int = 132,
                amd: bool = False) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) from shapes and the SM count;
    ``amd``: for gfx950 / gfx942 (the launcher: a ROCm build; see the end).

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
    * 33 <= M <= 64: BLOCK_M 64, BLOCK_N 128, BLOCK_K 128, 8 warps, 4 stages (2026-12-03: qkv_a +
      gate 39.6 -> 32.5, q_b 20.8 -> 15.3, o_proj 24.0 -> 22.3 against the first guess), and the
      split count whose programs (N tiles x effective splits) come closest to one wave without
      passing the SM count (:func:`one_wave_split`). Measured on an H100 (2026-12-07, 24 calls a
      CUDA graph, scripts/bench_layer.py --gemms --sweep, M = 64, us; splits 1 / 2 / 4 / 8 at 8
      warps, 4 stages): qkv_a + gate 85.1 / 47.4 / **26.8** / 30.3 (4: 116 programs), q_b 20.4 /
      14.2 / 9.9 / **8.8** (8 = 6 effective: 108 programs), o_proj 20.3 / **15.3** / 17.5 / 20.1 (2:
      112 programs); the fixed split of 4 before cost q_b 1.1 and o_proj 2.3 us. Of the other
      tiles swept (64 x 64 and 64 x 256 at 4 / 8 warps, 3 / 6 stages, BLOCK_K 64) none beat these
      by more than 0.1 us (o_proj's 4 warps at split 4: 15.2).
    * M > 64 (prefill sizes, not measured): BLOCK_M 64, BLOCK_N 128, the split rule, 8 warps.

    The split rule: the power of two that brings the programs to about 2 per SM, each split at
    least 2 K tiles (the fixed-config rows cap theirs the same way), and its float32 partials
    (``SPLIT_K x M x N x 4`` bytes) at most half the weight's. BLOCK_K = 128 (or the largest power
    of two dividing ``block_k``). ``KIMI_OPS_FP8_GEMM_CONFIG`` overrides all of it.

    AMD (not timed there; scripts/cross_compile.py, Triton 3.6 and 3.8, gfx950 and gfx942): the
    32 x 64 tile of M <= 4 and 17..32 takes 318-482 VGPRs + 62-226 AGPRs, 1 wave a SIMD (8 warps:
    22-152 VGPRs spilled), the 64 x 128 tile spills on gfx950 with Triton 3.6 (2026-12-04). Compiled
    as the launch specializes it (N, K and the row strides multiples of 16: ``DIVISIBLE_16``;
    2026-12-05), Triton 3.6's gfx950 code is erratic in the tile, warps and stages: over 14-tile
    K splits 32 x 32 at 8 warps spills 790-802 VGPRs at 2-4 stages and 64 x 64 at 8 warps 799 at
    2 and 4 (none at 3); over one 12-tile split both spill 520-635 at 1-3 stages, and 64 x 64 at 4
    warps 250 at 2-3; 16 x 32 at 4 warps takes 284 VGPRs (1 wave). AMD therefore runs 16 x 16 at
    8 warps (5..16 rows), 32 x 32 at 4 warps (17..32, and M <= 4 when forced off the GEMV) and
    64 x 64 at 8 warps (33..64), all at 3 stages, and 64 x 64 at 4 warps and 1 stage beyond 64
    rows (prefill sizes): 0 spills and >= 2 waves a SIMD on both targets with both Tritons
    (tests/test_cross_compile.py checks the installed Triton's).
    """
    bk = max_block_k(block_k)
    k_tiles = max(1, triton.cdiv(k, bk))
    cap = _pow2_floor(max(1, k_tiles // 2))
    m = max(1, m)
    if m <= 4 or 17 <= m <= 32:
        return (32, 32, bk, min(4, cap), 4, 3) if amd else (32, 64, bk, min(4, cap), 4, 6)
    if 33 <= m <= 64:
        if amd:
            return 64, 64, bk, min(4, cap), 8, 3
        bm, bn = 64, 128
        return bm, bn, bk, one_wave_split(triton.cdiv(n, bn) * triton.cdiv(m, bm), k_tiles, sms), 8, 4
    bm = min(64, max(16, triton.next_power_of_2(m)))
    bn = min(128, max(16, triton.next_power_of_2(4 * min(m, bm))))
    tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
    split = _pow2_floor(max(1, (2 * sms) // tiles))
    split = min(split, cap, _pow2_floor(max(1, k // (8 * m))))
    stage_bytes = bm * bk * 2 + bn * bk
    stages = 8 if stage_bytes <= 8192 else 6 if stage_bytes < 16384 else 4
    if amd:
        if bm == 16:
            bn, warps, stages = 16, 8, 3
        else:
            bm, bn, warps, stages = 64, 64, 4, 1
        return bm, bn, bk, max(1, split), warps, stages
    return bm, bn, bk, max(1, split), (8 if m > 64 else 4), stages


def one_wave_split(tiles: int, k_tiles: int, sms: int) -> int:
    """The largest power-of-two split count whose programs, ``tiles`` x the effective splits of
    :func:`_split_plan`, are at most ``sms`` (one wave); 1 where even that is more."""
    split = 1
    while split < k_tiles and tiles * _split_plan(k_tiles, 2 * split)[0] <= sms:
        split *= 2
    return split


def _env_ints(name: str, valid, expected: str) -> tuple[int, ...] | None:
    """The comma list of integers in environment variable ``name`` (None where unset or empty);
    ValueError naming ``expected`` unless ``valid(values)``."""
    env = os.environ.get(name, "").strip()
    if not env:
        return None
    try:
        vals = tuple(int(v) for v in env.split(","))
    except ValueError:
        vals = ()
    if not vals or not valid(vals):
        raise ValueError(f"{name} must be {expected}, got {env!r}")
    return vals


def _env_config() -> tuple[int, ...] | None:
    return _env_ints(CONFIG_ENV, lambda v: len(v) == 6 and min(v) >= 1,
                     "'BLOCK_M,BLOCK_N,BLOCK_K,SPLIT_K,num_warps,num_stages' (positive integers)")


SWAP_ENV = "KIMI_OPS_FP8_GEMM_SWAP"
SWAP_MIN_M = 33


def use_swap(m: int, block_m: int, hopper: bool) -> bool:
    """Whether the tl.dot kernel computes ``y^T = w x^T`` (the fp8 weight tile, converted to bf16
    in registers, as the MMA's A operand; x's BLOCK_M rows as its N, from shared memory) rather
    than ``y = x w^T`` (the converted weight stored to shared memory as the MMA's B, x's rows
    padded to the MMA's M). Default: on sm_90 (``hopper``) at ``m >= SWAP_MIN_M`` (33), off
    elsewhere (not timed there). ``KIMI_OPS_FP8_GEMM_SWAP`` (read at each call): ``1`` / ``0`` forces it on / off.
    Either way only where ``block_m >= 16`` (tl.dot's smallest N).

    Measured (H200, 2026-12-05, the fp8 layer compiled + CUDA graph, 8k context, two alternating
    rounds of off / on, us a step): batch 16 91.7 / 91.3 -> 94.9 / 95.0, 32 115.4 / 115.5 -> 118.4
    / 118.5, 48 160.6 / 159.6 -> 153.9 / 154.5, 64 178.3 / 178.1 -> 172.4 / 172.4, 128 311.2 /
    308.4 -> 298.0 / 297.7: slower up to 32 rows (the 16- and 32-row tiles), 3-4% faster above."""
    env = os.environ.get(SWAP_ENV, "").strip()
    if env not in ("", "0", "1"):
        raise ValueError(f"{SWAP_ENV} must be 0 or 1, got {env!r}")
    if env:
        return env == "1" and block_m >= 16
    return default_swap(m, block_m, hopper)


def default_swap(m: int, block_m: int, hopper: bool) -> bool:
    """:func:`use_swap` with no override: sm_90 at ``m >= SWAP_MIN_M`` rows and ``block_m >= 16``
    (what the launch picks; the cross-compile registry builds the same)."""
    return hopper and m >= SWAP_MIN_M and block_m >= 16


GEMV_ENV = "KIMI_OPS_FP8_GEMV"
GEMV_CONFIG_ENV = "KIMI_OPS_FP8_GEMV_CONFIG"
GEMV_MAX_M = 4
"""Default M limit of the GEMV kernel (:func:`use_gemv`; the kernel itself takes M <= 16). H200,
Kimi-K3 TP8's three projections (gemv_config's numbers): the GEMV beats the tl.dot kernel at M = 1,
2 (0.68-0.76x its time) and 4 (0.87-0.92x on q_b / o_proj, 1.03x on qkv_a + gate) and loses at
M = 8 (its best config 1.17x (q_b) to 1.65x (o_proj) the tl.dot kernel's time) and 16 (2.5-4x).
M = 3, 5..7 were not timed."""
GEMV_LIMIT_M = 16


def use_gemv(m: int, n: int, k: int, device: torch.device | None = None) -> bool:
    """Which kernel runs an [M, K] x [N, K]^T product: True for the dot-free GEMV, False for the
    tl.dot kernel. The one place of the rule. ``KIMI_OPS_FP8_GEMV`` (read at each call): ``0``
    never, ``1`` at every M <= GEMV_LIMIT_M, an integer ``L >= 2``: at M <= min(L, GEMV_LIMIT_M);
    unset or empty: M <= GEMV_MAX_M (4). ``device`` is not used yet (the rule was measured on the
    H200 only)."""
    env = os.environ.get(GEMV_ENV, "").strip()
    limit = GEMV_MAX_M
    if env:
        try:
            v = int(env)
        except ValueError:
            raise ValueError(f"{GEMV_ENV} must be 0, 1 or an M limit (an integer), got {env!r}") from None
        if v < 0:
            raise ValueError(f"{GEMV_ENV} must be 0, 1 or an M limit (an integer >= 0), got {env!r}")
        limit = GEMV_LIMIT_M if v == 1 else min(v, GEMV_LIMIT_M)
    return 1 <= m <= limit


def gemv_vec(block_k: int) -> int:
    """K columns a thread loads at once (16 bytes of fp8 where the scale block allows): the largest
    power of two <= 16 dividing ``block_k``, so that a slot never straddles two scale blocks."""
    return min(16, block_k & -block_k)


def gemv_config(m: int, n: int, k: int, block_k: int = 128, sms: int = 132,
                amd: bool = False) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, DEPTH, X_AHEAD) of the GEMV kernel from shapes and the SM count;
    ``amd``: for gfx950 / gfx942 (a ROCm build).

    * BLOCK_K 128 at 8 warps: 256 threads, 8 along K (16 bytes each) by 4 along N a warp, warps
      along N; an x row tile (128 elements) has fewer elements than the CTA has threads, which
      Triton's layout passes load straight in the product's layout (no shared memory in the loop;
      BLOCK_K 256 at 8 warps converts through shared memory each iteration: 3632 us at M 8).
    * BLOCK_N 128 for M <= 2, 64 above (the float32 slot sums, BLOCK_M x BLOCK_N x BLOCK_K / VEC /
      256 a thread, and the x rows held: 126 registers at M 1 BLOCK_N 128, 102 at M 4 BLOCK_N 64).
    * SPLIT_K: about 2 programs an SM (``2 sms / (N / BLOCK_N)``), each split at least 2 K tiles.
    * DEPTH 1, X_AHEAD 0: the only depth that has run on a GPU (deeper prefetch: not yet timed).

    Measured on the H200 (2026-12-03, this session's first sweep, DEPTH 1; scripts/bench_fp8_gemv.py:
    CUDA graphs of 24 calls over >= 4 weight copies, median of 15 replays; us a call, the split-K
    reduce launch included). M = 1: qkv_a + gate (N 3648, K 7168) 14.69 (tl.dot 19.40, cuBLAS bf16
    17.28), q_b (2304, 1536) 5.91 (7.70, 5.55), o_proj (7168, 1536) 8.54 (12.58, 8.40). M = 2: 16.25,
    6.09, 9.29 (tl.dot 22.41, 7.98, 13.35). M = 4 at BLOCK_N 64: 23.35, 6.93, 12.28 (tl.dot 22.64,
    7.95, 13.38; BLOCK_N 256 SPLIT_K 8 gave qkv_a + gate 20.69). Of ~20 other configs a shape at
    M = 1 (BLOCK_N 32..256, the split at 1, 132, 264, 528 programs, 4 warps with BLOCK_K 64, 2 warps
    with 32, X_AHEAD) none beat these by more than 0.15 us except q_b's (64, 128, 6, 8, X_AHEAD 1),
    5.76. Split 1 is 2-3x slower (too few programs, one tile in flight each).

    AMD (not timed there; scripts/cross_compile.py): BLOCK_N 32 at M = 3..8 (above 4 only where
    KIMI_OPS_FP8_GEMV forces the GEMV). With 64, Triton 3.6's gfx950 code for qkv_a + gate at M 4
    (7 K tiles a split) spilled 149 VGPRs at 256 (Triton 3.8: none; the same tile at 14 tiles a
    split: 90 VGPRs, at 4: 23 spilled); 32 takes 104 VGPRs, 4 waves (2026-12-06).
    """
    m = max(1, m)
    bk, warps = 128, 8
    bn = 128 if m <= 2 else 32 if amd or m > 8 else 64
    bn = min(bn, max(32, triton.next_power_of_2(n)))
    k_tiles = max(1, triton.cdiv(k, bk))
    tiles = triton.cdiv(n, bn)
    split = max(1, min(k_tiles // 2, (2 * sms) // tiles))
    return bn, bk, split, warps, 1, 0


def _env_gemv_config() -> tuple[int, ...] | None:
    return _env_ints(GEMV_CONFIG_ENV,
                     lambda v: len(v) == 6 and min(v[:4]) >= 1 and 1 <= v[4] <= 4 and v[5] in (0, 1),
                     "'BLOCK_N,BLOCK_K,SPLIT_K,num_warps,DEPTH,X_AHEAD' (positive integers, DEPTH 1..4, "
                     "X_AHEAD 0 or 1)")


def _split_plan(k_tiles: int, split: int) -> tuple[int, int]:
    """(SPLIT_K, tiles a split) with no empty split."""
    split = max(1, min(split, k_tiles))
    per = triton.cdiv(k_tiles, split)
    return triton.cdiv(k_tiles, per), per


def _reduce(partial: torch.Tensor, y: torch.Tensor, split: int) -> None:
    total = y.numel()
    block = 1024
    _reduce_splits_kernel[(triton.cdiv(total, block),)](partial, y, total, SPLIT_K=split, BLOCK=block,
                                                        INTERP=interpreting(), num_warps=4)


def _gemv(x, w, w_scale_inv, y, block_n, block_k, cfg):
    m, k = x.shape
    w, w_bytes = _as_codes(w)  # codes where Triton lacks the weight's fp8 type
    n = w.shape[0]
    bn, bk, split, warps, depth, ahead = cfg
    vec = gemv_vec(block_k)
    if not 1 <= depth <= 4 or ahead not in (0, 1, False, True):
        raise ValueError(f"gemm_a16w8_block: GEMV DEPTH must be 1..4 and X_AHEAD 0 or 1, got {depth}, {ahead}")
    if m > GEMV_LIMIT_M:
        raise ValueError(f"gemm_a16w8_block: the GEMV kernel takes M <= {GEMV_LIMIT_M}, got {m}")
    if bk < vec or bk & (bk - 1) or bn & (bn - 1):
        raise ValueError(f"gemm_a16w8_block: GEMV BLOCK_N and BLOCK_K must be powers of two, BLOCK_K >= {vec}, "
                         f"got {bn}, {bk}")
    split, per = _split_plan(triton.cdiv(k, bk), split)
    partial = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    _gemv_a16w8_block_kernel[(triton.cdiv(n, bn), split)](
        x, w, w_scale_inv, y, partial, m, n, k, block_n, block_k,
        *x.stride(), *w.stride(), *w_scale_inv.stride(),
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=bn, BLOCK_K=bk, VEC=vec, TILES_PER_SPLIT=per, SPLIT_K=split,
        DEPTH=depth, X_AHEAD=bool(ahead), INTERP=interpreting(), W_BYTES=w_bytes, num_warps=warps, num_stages=1,
    )
    if split > 1:
        _reduce(partial, y, split)
    return y


def gemm_a16w8_block(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor, *, block_n: int = 128,
                     block_k: int = 128, config: tuple[int, ...] | None = None, gemv: bool | None = None,
                     out: torch.Tensor | None = None, constant_w: bool = False,
                     swap: bool | None = None) -> torch.Tensor:
    """``y = x @ dequant(w)^T`` -> bf16 ``[M, N]`` (inputs validated by the op layer; the op's
    ``constant_w`` is not used: these kernels wait for the previous one before any load).

    ``gemv``: True / False run the GEMV / the tl.dot kernel; None: :func:`use_gemv`. ``config``:
    the config of the kernel that runs: for the tl.dot kernel (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K,
    num_warps, num_stages), default ``KIMI_OPS_FP8_GEMM_CONFIG`` when set, else :func:`gemm_config`
    (BLOCK_K must divide ``block_k`` and be a power of two >= 16, else ValueError); for the GEMV
    (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, DEPTH, X_AHEAD), default ``KIMI_OPS_FP8_GEMV_CONFIG``, else
    :func:`gemv_config` (DEPTH 1..4, X_AHEAD 0 / 1, else ValueError). ``out``: a
    contiguous bf16 [M, N] tensor to write (tests); every element is written. ``swap``: the tl.dot
    kernel's transposed form on / off (ValueError with a BLOCK_M below 16); None: :func:`use_swap`.
    """
    m, k = x.shape
    n = w.shape[0]
    if out is None:
        y = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
    else:
        if out.shape != (m, n) or out.dtype != torch.bfloat16 or not out.is_contiguous():
            raise ValueError(f"gemm_a16w8_block: out must be a contiguous bf16 [{m}, {n}] tensor")
        y = out
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    if gemv is None:
        gemv = use_gemv(m, n, k, x.device)
    if gemv:
        cfg = config or _env_gemv_config() or gemv_config(m, n, k, block_k, _sm_count(x.device),
                                                          amd=torch.version.hip is not None)
        if len(cfg) != 6:
            raise ValueError(f"gemm_a16w8_block: the GEMV kernel's config is (BLOCK_N, BLOCK_K, SPLIT_K, num_warps, "
                             f"DEPTH, X_AHEAD), got {cfg}")
        return _gemv(x, w, w_scale_inv, y, block_n, block_k, cfg)
    cfg = config or _env_config() or gemm_config(m, n, k, block_k, _sm_count(x.device),
                                                  amd=torch.version.hip is not None)
    if len(cfg) != 6:
        raise ValueError(f"gemm_a16w8_block: the tl.dot kernel's config is (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, "
                         f"num_warps, num_stages), got {cfg}")
    bm, bn, bk, split, warps, stages = cfg
    if bk < 16 or bk & (bk - 1) or block_k % bk:
        raise ValueError(f"gemm_a16w8_block: BLOCK_K must be a power of two >= 16 dividing block_k = {block_k}, "
                         f"got {bk}")
    k_tiles = triton.cdiv(k, bk)
    split, per_split = _split_plan(k_tiles, split)
    partial = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), split)
    w, w_bytes = _as_codes(w)
    if swap is None:
        swap = use_swap(m, bm, hopper=is_sm90(x.device))
    elif swap and bm < 16 and not interpreting():
        raise ValueError(f"gemm_a16w8_block: swap needs BLOCK_M >= 16 (the MMA's N), got {bm}")
    _gemm_a16w8_block_kernel[grid](
        x, w, w_scale_inv, y, partial, m, n, k, block_n, block_k,
        *x.stride(), *w.stride(), *w_scale_inv.stride(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, K_TILES=k_tiles, TILES_PER_SPLIT=per_split, SPLIT_K=split,
        INTERP=interpreting(), W_BYTES=w_bytes, SWAP=bool(swap), num_warps=warps, num_stages=stages,
    )
    if split > 1:
        _reduce(partial, y, split)
    return y


def split_count(m: int, n: int, k: int, block_k: int = 128, sms: int = 132) -> int:
    """The K splits :func:`gemm_a16w8_block` runs for these shapes by default (tests, benches)."""
    _, _, bk, split, _, _ = gemm_config(m, n, k, block_k, sms)
    return _split_plan(triton.cdiv(k, bk), split)[0]  # as gemm_a16w8_block plans it


# ----------------------------------------------------------------------------------------------
# cross-compilation registry (scripts/cross_compile.py; format in kimi_ops/kernels/__init__.py).
# gfx942 has no OCP fp8 (float8_e4m3fn) conversion of its own: Triton converts the weight's bytes
# in software there.

KIMI_K3_SHAPES = ((3648, 7168), (2304, 1536), (7168, 1536))
"""Kimi-K3 TP8's fp8 projections (N, K): fused qkv_a + gate, q_b, o_proj."""

TARGET_SMS = {"sm90": 132, "gfx950": 256, "gfx942": 304, "sm80": 108}
"""The multiprocessor count of each target's part (H200, MI355X, MI300X, A100): the configs' split
rule. sm80 (no e4m3fn in Triton) takes the weight as uint8 codes (W_BYTES)."""


TARGETS_WITHOUT_E4M3FN = ("sm80",)

DIVISIBLE_16 = ("N", "K", "block_n", "block_k", "stride_xm", "stride_wn")
"""The GEMMs' integer arguments that are multiples of 16 at Kimi-K3's shapes (and so specialized by
Triton's JIT at launch; M and the scales' row stride, ceil(K / 128), are not)."""


def _gemv_launch(m: int, n: int, k: int, block_k: int = 128, sms: int = 132, amd: bool = False):
    """(BLOCK_M, BLOCK_N, BLOCK_K, VEC, TILES_PER_SPLIT, SPLIT_K, num_warps, DEPTH, X_AHEAD) the GEMV
    launches by default."""
    bn, bk, split, warps, depth, ahead = gemv_config(m, n, k, block_k, sms, amd=amd)
    split, per = _split_plan(-(-k // bk), split)
    return triton.next_power_of_2(m), bn, bk, gemv_vec(block_k), per, split, warps, depth, ahead


def _gemv_spec_name(m: int, n: int, k: int, sms: int = 132, amd: bool = False) -> str:
    bm, bn, bk, vec, per, split, warps, depth, ahead = _gemv_launch(m, n, k, sms=sms, amd=amd)
    return f"gemv_a16w8_block_m{bm}n{bn}k{bk}v{vec}p{per}s{split}w{warps}d{depth}a{ahead}"


def _specs():
    """Per target: every launch the default rule picks at Kimi-K3's shapes (the GEMV at M <= 4, the
    tl.dot kernel above; on sm90 also the GEMV up to M = 16, KIMI_OPS_FP8_GEMV's sweeps) and the
    split-K reduce of each split count."""
    sig = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "y_ptr": "*bf16", "p_ptr": "*fp32",
           "M": "i32", "N": "i32", "K": "i32", "block_n": "i32", "block_k": "i32"}
    for name in ("stride_xm", "stride_wn", "stride_sn"):
        sig[name] = "i32"
    for name in ("stride_xk", "stride_wk", "stride_sk"):
        sig[name] = "constexpr"       # 1 at run time (the JIT specializes it): contiguous K
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "K_TILES", "TILES_PER_SPLIT", "SPLIT_K", "INTERP", "W_BYTES"):
        sig[name] = "constexpr"
    gsig = dict(sig)
    del gsig["K_TILES"], gsig["TILES_PER_SPLIT"], gsig["BLOCK_M"], gsig["BLOCK_N"], gsig["BLOCK_K"]
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "VEC", "TILES_PER_SPLIT", "DEPTH", "X_AHEAD"):
        gsig[name] = "constexpr"
    unit = {"INTERP": False, "stride_xk": 1, "stride_wk": 1, "stride_sk": 1}
    specs = []
    for target, sms in TARGET_SMS.items():
        amd = target.startswith("gfx")
        codes = target in TARGETS_WITHOUT_E4M3FN
        tsig = dict(sig, w_ptr="*u8" if codes else "*fp8e4nv")
        tgsig = dict(gsig, w_ptr=tsig["w_ptr"])
        tunit = dict(unit, W_BYTES=FN_BYTES if codes else NATIVE)
        dots, gemvs, splits = {}, {}, set()  # dicts: each distinct launch once, in order
        for n, k in KIMI_K3_SHAPES:
            for m in (5, 8, 16, 32, 64, 256):
                bm, bn, bk, split, warps, stages = gemm_config(m, n, k, 128, sms, amd=amd)
                split, per = _split_plan(-(-k // bk), split)
                swap = default_swap(m, bm, hopper=target == "sm90")
                dots[(bm, bn, bk, -(-k // bk), per, split, warps, stages, swap)] = None
            for m in range(1, (GEMV_LIMIT_M if target == "sm90" else GEMV_MAX_M) + 1):
                gemvs[_gemv_spec_name(m, n, k, sms, amd)] = _gemv_launch(m, n, k, sms=sms, amd=amd)
        for bm, bn, bk, k_tiles, per, split, warps, stages, swap in dots:
            splits.add(split)
            specs.append({
                "name": f"gemm_a16w8_block_m{bm}n{bn}k{bk}t{k_tiles}p{per}s{split}w{warps}st{stages}"
                        + ("_swap" if swap else ""),
                "kernel": _gemm_a16w8_block_kernel, "signature": dict(tsig, SWAP="constexpr"),
                "constexprs": {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "K_TILES": k_tiles,
                               "TILES_PER_SPLIT": per, "SPLIT_K": split, "SWAP": swap, **tunit},
                "num_warps": warps, "num_stages": stages, "targets": (target,), "divisible_16": DIVISIBLE_16})
        for name, (bm, bn, bk, vec, per, split, warps, depth, ahead) in gemvs.items():
            splits.add(split)
            specs.append({
                "name": name, "kernel": _gemv_a16w8_block_kernel, "signature": dict(tgsig),
                "constexprs": {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "VEC": vec, "TILES_PER_SPLIT": per,
                               "SPLIT_K": split, "DEPTH": depth, "X_AHEAD": bool(ahead), **tunit},
                "num_warps": warps, "num_stages": 1, "targets": (target,), "divisible_16": DIVISIBLE_16})
        for split in sorted(splits - {1}):
            specs.append({
                "name": f"gemm_a16w8_reduce_s{split}", "kernel": _reduce_splits_kernel,
                "signature": {"p_ptr": "*fp32", "y_ptr": "*bf16", "total": "i32", "SPLIT_K": "constexpr",
                              "BLOCK": "constexpr", "INTERP": "constexpr"},
                "constexprs": {"SPLIT_K": split, "BLOCK": 1024, "INTERP": False},
                "num_warps": 4, "num_stages": 1, "targets": (target,)})
    return specs


CROSS_COMPILE_SPECS = _specs()
