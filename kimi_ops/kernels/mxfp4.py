"""Triton ``bmm_a16wfp4``: bf16 activations against MXFP4 weights, f32 accumulation, bf16 out.

``y[b] = x[b] @ dequant(w)[b]^T`` with x ``[B, M, K]`` bf16 (any strides: e.g.
``q_nope.transpose(0, 1)`` of a ``[T, H, 128]`` tensor is read in place), w in the OCP
MXFP4 layout of :mod:`kimi_ops.reference.mxfp4` (``w_packed [B, N, K/2]`` uint8,
``w_scale [B, N, K/32]`` E8M0 bytes) and y ``[B, M, N]`` bf16 contiguous.

One program per (M block, N block, batch). Two ways to multiply, picked on the host:

* ``DOT_SCALED=False`` (the default on NVIDIA, and on gfx942): the weight tile is decoded
  in registers to bf16 (exact: an E2M1 value times a power of two has <= 2 significant
  bits) and fed to ``tl.dot``; on sm_90 that is what ``tl.dot_scaled`` would lower to
  anyway (it upcasts fp4 to bf16 there), written out so the decode is ours.
* ``DOT_SCALED=True`` (the default on gfx950): the bf16 activation tile is split into
  MXFP8 ``hi + lo`` (E4M3 with one E8M0 scale per 32 elements each; the seeds' hi/lo trick,
  exact to ~2^-9 per element) and ``tl.dot_scaled(hi|lo, "e4m3", w^T, w_scale, "e2m1")``
  runs twice: gfx950's scaled fp8 x fp4 MFMA (``v_mfma_scale_f32_*_f8f6f4``) on the packed
  weights as stored. (``dot_scaled`` with a bf16 lhs lowers to a plain bf16 MFMA after an
  upcast of the weights, on gfx950 as on sm_90: no gain.)

Decoding: code ``c`` (bit 3 the sign, bits 2..1 the exponent E, bit 0 the mantissa m)
has ``2|v| = m`` when E = 0 else ``(2 + m) << (E - 1)``, an integer 0..12; the block's
value is ``2|v| * 2^(s - 128)`` with the scale byte s built as float32 bits (s = 0, 1 are
the float32 subnormals 2^-128, 2^-127; s = 0xFF is NaN, as in the reference).

GEMV kernel for small M (``_bmm_a16wfp4_gemv_kernel``): at M = T <= 8 rows the MMA is mostly
padding (sm_90's mma.sync has m16) and the decode-to-MMA-operand layout conversions cost (W_UV,
K = 512: 5.46 us on the H200 at T = 1 against cuBLAS's 3.58). One program per (BLOCK_N output
rows, batch) covers every M row (BLOCK_M = M's power of two) and loops over K in BLOCK_K chunks
(unrolled up to 8 chunks): the packed tile ``[1, BN, BK/2]`` is decoded by
:func:`_mxfp4_decode_even_odd` into float32 ``w_even`` (low nibbles: K elements 2j) and ``w_odd``
(high nibbles: 2j + 1) by elementwise integer ops (no ``tl.join`` / reshape; the scale byte is
loaded per packed column, column ``kp // 16`` of ``w_scale``), x's even and odd K columns
``[BM, 1, BK/2]`` are loaded row by row (one uint32 load a pair when K is contiguous and rows
are 4-byte aligned, else two strided loads), and ``x_even * w_even + x_odd * w_odd`` is added,
broadcast to ``[BM, BN, BK/2]``, into a float32 partial sum in registers (FMAs), reduced over K
once at the end with ``tl.sum``: no ``tl.dot``, so no MMA operand layouts. Results equal the
tl.dot kernel's up to the f32 summation order (code 8 decodes to -0.0 here, +0.0 in the joined
decode: no sum changes).

Which kernel runs (:func:`use_gemv`): the GEMV when the dot_scaled path is not picked, M <=
``GEMV_MAX_M`` = 8 and ``gemv=True``, or ``gemv`` None and ``KIMI_OPS_MXFP4_GEMV=1``, or both
unset and :func:`gemv_wins` (M = 1 always, M <= 8 at K >= 512, on NVIDIA and the interpreter,
not on ROCm, where it has not run; the H200 numbers are there); ``gemv=False`` /
``KIMI_OPS_MXFP4_GEMV=0`` keep the tl.dot kernel. Block sizes: :func:`gemv_config`.

(A "nibble split" form of the tl.dot kernel's decode, the same even / odd decode fed to two
``tl.dot`` over BK/2, was removed after its first H200 run: wrong at M = 64, K = 512 (rel err
0.86, and an illegal memory access in the benchmark) and slower than the joined decode
everywhere it ran.)
"""
import os

import torch
import triton
import triton.language as tl

from . import interpreting, mxfp4_paths
from .pdl import pdl_args, wait_prior_grid, weights_first


@triton.jit
def _mxfp4_decode(packed, scale, BN: tl.constexpr, BK: tl.constexpr):
    """packed [BN, BK/2] uint8 + scale [BN, BK/32] uint8 -> [BN, BK] float32 (exact)."""
    p = packed.to(tl.int32)
    c = tl.join(p & 0xF, p >> 4).reshape(BN, BK)          # element 2i = low nibble
    e = (c >> 1) & 3
    m = c & 1
    two_v = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0))
    two_v = tl.where((c & 8) != 0, -two_v, two_v)
    half_scale = _e8m0_half_scale(scale.to(tl.int32))        # 2^(s - 128)
    w = two_v.to(tl.float32).reshape(BN, BK // 32, 32) * half_scale[:, :, None]
    return w.reshape(BN, BK)


@triton.jit
def _e8m0_half_scale(s):
    """E8M0 scale bytes (int32 0..255, any shape) -> float32 2^(s - 128), elementwise:
    s >= 2 normal, s = 1, 0 the subnormals 2^-127, 2^-128, s = 255 NaN."""
    bits = tl.where(s >= 2, (s - 1) << 23, tl.where(s == 1, 0x00400000, 0x00200000))
    bits = tl.where(s == 255, 0x7FC00000, bits)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e2m1_twice(c):
    """E2M1 codes (int32 0..15, any shape) -> float32 2v, built as float32 bits: E = 0 gives
    m (0 or 1.0), E >= 1 gives (1 + m/2) * 2^E, i.e. biased exponent E + 127 and mantissa m << 22;
    bit 3 is the sign (code 8 is -0.0)."""
    e = (c >> 1) & 3
    m = c & 1
    bits = tl.where(e == 0, m * 0x3F800000, ((e + 127) << 23) | (m << 22))
    return (bits | ((c & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_decode_even_odd(packed, scale):
    """packed [BN, BK/2] uint8 + scale [BN, BK/2] uint8 (the E8M0 byte of each packed column,
    loaded at element granularity) -> (w_even, w_odd) float32 [BN, BK/2]: the low nibbles
    (K elements 2j) and the high nibbles (2j + 1), exact, with no join or reshape."""
    p = packed.to(tl.int32)
    half_scale = _e8m0_half_scale(scale.to(tl.int32))
    return _e2m1_twice(p & 0xF) * half_scale, _e2m1_twice(p >> 4) * half_scale


@triton.jit
def _load_mxfp4_even_odd(w_rows, s_rows, kp, mask, stride_k, stride_s):
    """Load and decode (even / odd halves) the packed weight columns kp (any shape broadcasting
    with the row pointers w_rows / s_rows) -> (w_even, w_odd) float32: the packed bytes at
    ``w_rows + kp * stride_k`` and each column's E8M0 byte at ``s_rows + (kp // 16) * stride_s``
    (one scale per 16 packed columns = 32 elements); masked-off columns decode to 0."""
    packed = tl.load(w_rows + kp * stride_k, mask=mask, other=0)
    scale = tl.load(s_rows + (kp // 16) * stride_s, mask=mask, other=0)
    return _mxfp4_decode_even_odd(packed, scale)


@triton.jit
def _round_e4m3(v):
    """Round float32 to 3 mantissa bits, to nearest even (exact E4M3 for |v| in [2^-6, 448])."""
    b = v.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFFF + ((b >> 20) & 1)) & 0xFFF00000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _split_mxfp8(x, BM: tl.constexpr, BK: tl.constexpr):
    """bf16 x [BM, BK] -> MXFP8 hi + lo (E4M3 [BM, BK] and E8M0 scales [BM, BK/32] each) with
    x = 2^e_hi * hi + 2^(e_hi - 5) * lo up to ~2^-9 relative per element (about bf16's own
    rounding). e_hi = floor(log2(amax)) - 7 per 32 elements, clamped to E8M0's range."""
    xf = x.to(tl.float32).reshape(BM, BK // 32, 32)
    amax = tl.max(tl.abs(xf), axis=2)
    e = ((amax.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127 - 7
    e = tl.minimum(tl.maximum(e, -127), 127)
    inv = (((127 - e) << 23).to(tl.float32, bitcast=True))   # 2^-e (normal for e in [-126, 127])
    inv = tl.where(e == -127, 2.0 ** 127, inv)
    v = xf * inv[:, :, None]
    hi = _round_e4m3(v).to(tl.float8e4nv)
    r = (v - hi.to(tl.float32)) * 32.0
    lo = _round_e4m3(r).to(tl.float8e4nv)
    hs = (e + 127).to(tl.uint8)
    ls = tl.maximum(e + 127 - 5, 0).to(tl.uint8)
    return hi.reshape(BM, BK), hs, lo.reshape(BM, BK), ls


@triton.jit
def _dot_mxfp4_scaled(x, wp, ws, acc, BM: tl.constexpr, BK: tl.constexpr):
    """acc + x @ dequant(w)^T through tl.dot_scaled with an MXFP8 hi + lo split of the bf16
    activations, so that AMD gfx950 runs the scaled fp8 x fp4 MFMA (v_mfma_scale_*_f8f6f4)
    twice instead of decoding the weights; x [BM, BK] bf16, wp [BN, BK/2], ws [BN, BK/32]."""
    hi, hs, lo, ls = _split_mxfp8(x, BM, BK)
    acc = tl.dot_scaled(hi, hs, "e4m3", tl.trans(wp), ws, "e2m1", acc)
    acc = tl.dot_scaled(lo, ls, "e4m3", tl.trans(wp), ws, "e2m1", acc)
    return acc


@triton.jit
def _dot_operand(v, INTERP: tl.constexpr):
    """bf16 for the MMA; float32 under the interpreter, whose tl.dot multiplies bf16's raw
    uint16 bits (Triton 3.6-3.8). Both are exact for bf16-representable values."""
    if INTERP:
        return v.to(tl.float32)
    else:
        return v.to(tl.bfloat16)


@triton.jit
def _to_bf16(x, INTERP: tl.constexpr):
    """float32 -> bf16, round to nearest even. The interpreter's own cast does not carry a
    rounded-up mantissa into the exponent, so there it is done by integer ops."""
    if INTERP:
        b = x.to(tl.uint32, bitcast=True)
        r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, 0x7FC0, r)
        return r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _bmm_a16wfp4_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, g_ptr,
    M, N, K,
    stride_xb, stride_xm, stride_xk,
    stride_wb, stride_wn, stride_wk,
    stride_sb, stride_sn, stride_sk,
    stride_yb, stride_ym, stride_yn,
    stride_gb, stride_gm, stride_gn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr, DOT_SCALED: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr = False,
    GATE: tl.constexpr = False,
):
    wait_prior_grid(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_kp = tl.arange(0, BLOCK_K // 2)
    offs_ks = tl.arange(0, BLOCK_K // 32)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_base = x_ptr + b * stride_xb + offs_m[:, None] * stride_xm
    w_base = w_ptr + b * stride_wb + offs_n[:, None] * stride_wn
    s_base = s_ptr + b * stride_sb + offs_n[:, None] * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # K_TILES = cdiv(K, BLOCK_K) is a constexpr: Triton 3.6's interpreter cannot loop to a
    # runtime bound, and K is a fixed model dim anyway. K % 32 == 0; masks take the tail.
    for kt in range(K_TILES):
        k0 = kt * BLOCK_K
        kx = k0 + offs_k
        x = tl.load(x_base + kx[None, :] * stride_xk, mask=mask_m[:, None] & (kx[None, :] < K), other=0.0)
        kp = k0 // 2 + offs_kp
        wp = tl.load(w_base + kp[None, :] * stride_wk, mask=mask_n[:, None] & (kp[None, :] < K // 2), other=0)
        ks = k0 // 32 + offs_ks
        ws = tl.load(s_base + ks[None, :] * stride_sk, mask=mask_n[:, None] & (ks[None, :] < K // 32), other=0)
        if DOT_SCALED:
            acc = _dot_mxfp4_scaled(x, wp, ws, acc, BLOCK_M, BLOCK_K)
        else:
            w = _dot_operand(_mxfp4_decode(wp, ws, BLOCK_N, BLOCK_K), INTERP)
            acc = tl.dot(_dot_operand(x, INTERP), tl.trans(w), acc)
    _store_y(acc, y_ptr, g_ptr, b, offs_m, offs_n, M, N, stride_yb, stride_ym, stride_yn,
             stride_gb, stride_gm, stride_gn, GATE, INTERP)


@triton.jit
def _store_y(acc, y_ptr, g_ptr, b, offs_m, offs_n, M, N, stride_yb, stride_ym, stride_yn,
             stride_gb, stride_gm, stride_gn, GATE: tl.constexpr, INTERP: tl.constexpr):
    """The bmm kernels' epilogue: acc [BM, BN] f32 (batch b, rows offs_m, columns offs_n) to y as
    bf16, times the gate g at the same (b, m, n) first when GATE (one rounding)."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if GATE:
        g = tl.load(g_ptr + b * stride_gb + offs_m[:, None] * stride_gm + offs_n[None, :] * stride_gn,
                    mask=mask, other=0.0)
        acc = acc * g.to(tl.float32)
    tl.store(y_ptr + b * stride_yb + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn,
             _to_bf16(acc, INTERP), mask=mask)


@triton.jit
def _gemv_x_row(x_row, kp, mask, stride_xk, X_PAIRS: tl.constexpr):
    """One row of x at packed K positions kp (any shape): (x[2 kp], x[2 kp + 1]) as float32.
    X_PAIRS (x contiguous along K, 4-byte aligned): one uint32 load a pair, whose low half is the
    even element's bf16 bits and the high half the odd one's (a bf16 is the top half of its
    float32); else two strided bf16 loads."""
    if X_PAIRS:
        pair = tl.load(x_row.to(tl.pointer_type(tl.uint32), bitcast=True) + kp, mask=mask, other=0)
        return (pair << 16).to(tl.float32, bitcast=True), (pair & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        xe = tl.load(x_row + 2 * kp * stride_xk, mask=mask, other=0.0).to(tl.float32)
        xo = tl.load(x_row + (2 * kp + 1) * stride_xk, mask=mask, other=0.0).to(tl.float32)
        return xe, xo


@triton.jit
def _gemv_x_tile(x_b, kp, mask_k, m3, M, stride_xm, stride_xk, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                 X_PAIRS: tl.constexpr):
    """x's even and odd columns at packed K positions kp [1, 1, BK/2] for rows 0 .. BLOCK_M - 1 of
    x_b (masked past M) -> (xe, xo) float32 [BM, 1, BK/2]. Loaded row by row ([1, 1, BK/2] tiles put
    in place with where): a tile with fewer elements than the CTA has threads is a "cheap" load to
    Triton's layout passes, which then load it straight in the product's layout (each thread its
    own K strip, repeated over N) instead of converting a [BM, 1, BK/2] tile through shared memory."""
    xe = tl.zeros((BLOCK_M, 1, BLOCK_K // 2), dtype=tl.float32)
    xo = tl.zeros((BLOCK_M, 1, BLOCK_K // 2), dtype=tl.float32)
    for mi in tl.static_range(BLOCK_M):
        re, ro = _gemv_x_row(x_b + mi * stride_xm, kp, mask_k & (mi < M), stride_xk, X_PAIRS)
        xe = tl.where(m3 == mi, re, xe)
        xo = tl.where(m3 == mi, ro, xo)
    return xe, xo


@triton.jit
def _gemv_w_tile(w_rows, s_rows, kp, mask, stride_wk, stride_sk, W_BF16: tl.constexpr):
    """The weight's even / odd K elements at packed positions kp [1, 1, BK/2] of the rows w_rows
    [1, BN, 1] (masked: 0) -> (we, wo) float32 [1, BN, BK/2]: an MXFP4 weight decoded (low nibbles:
    K elements 2j, high: 2j + 1), or with W_BF16 a bf16 weight (rows contiguous along K, 4-byte
    aligned) read as uint32 pairs like x's."""
    if W_BF16:
        return _gemv_x_row(w_rows, kp, mask, 1, True)
    else:
        return _load_mxfp4_even_odd(w_rows, s_rows, kp, mask, stride_wk, stride_sk)


@triton.jit
def _gemv_chunk(part, x_b, w_rows, s_rows, k0, m3, n3, M, N, K, stride_xm, stride_xk, stride_wk, stride_sk,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, X_PAIRS: tl.constexpr, W_BF16: tl.constexpr):
    """part [BM, BN, BK/2] + the products of K chunk [k0, k0 + BLOCK_K), elementwise: x's even and odd
    columns [BM, 1, BK/2] (:func:`_gemv_x_tile`) against the weight's [1, BN, BK/2]
    (:func:`_gemv_w_tile`), broadcast."""
    kp = k0 // 2 + tl.arange(0, BLOCK_K // 2)[None, None, :]     # [1, 1, BK/2] packed columns
    mask_k = kp < K // 2                                          # K % 32 == 0: 2 kp < K iff kp < K/2
    xe, xo = _gemv_x_tile(x_b, kp, mask_k, m3, M, stride_xm, stride_xk, BLOCK_M, BLOCK_K, X_PAIRS)
    we, wo = _gemv_w_tile(w_rows, s_rows, kp, (n3 < N) & mask_k, stride_wk, stride_sk, W_BF16)
    return _gemv_add(part, xe, xo, we, wo)


@triton.jit
def _gemv_add(part, xe, xo, we, wo):
    """part + one K chunk's products: the one expression every path sums with, so that W_FIRST
    (the weight loaded before the PDL wait) changes no bit of the sums."""
    return part + xe * we + xo * wo


@triton.jit
def _bmm_a16wfp4_gemv_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, g_ptr,
    M, N, K,
    stride_xb, stride_xm, stride_xk,
    stride_wb, stride_wn, stride_wk,
    stride_sb, stride_sn, stride_sk,
    stride_yb, stride_ym, stride_yn,
    stride_gb, stride_gm, stride_gn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    K_TILES: tl.constexpr, X_PAIRS: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr = False,
    W_BF16: tl.constexpr = False, GATE: tl.constexpr = False, W_FIRST: tl.constexpr = False,
):
    """Small-M bmm without tl.dot: one program per (N block, batch) for all M <= BLOCK_M rows.
    Products are summed elementwise into part [BM, BN, BK/2] over the K chunks (FMAs in each
    thread's registers) and reduced over K once at the end. W_BF16: w is bf16 ``[B, N, K]`` (K
    contiguous; s_ptr unused). GATE: y = (x @ w^T) * g elementwise before the one rounding to bf16
    (g bf16, y's shape, its own strides; :mod:`kimi_ops.kernels.up_proj`). W_FIRST (one or two K
    chunks, w a constant of the caller's: ``constant_w``): the weight tiles are loaded and decoded
    before the PDL wait, so their memory round trip overlaps the previous kernel's tail; x after
    it."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m3 = offs_m[:, None, None]                                    # [BM, 1, 1]
    n3 = offs_n[None, :, None]                                    # [1, BN, 1]
    x_b = x_ptr + b * stride_xb
    w_rows = w_ptr + b * stride_wb + n3 * stride_wn
    s_rows = s_ptr + b * stride_sb + n3 * stride_sn
    if W_FIRST:   # one or two K chunks, every weight load before the wait
        tl.static_assert(K_TILES <= 2, "W_FIRST holds one or two K chunks of the weight")
        kp0 = tl.arange(0, BLOCK_K // 2)[None, None, :]
        we0, wo0 = _gemv_w_tile(w_rows, s_rows, kp0, (n3 < N) & (kp0 < K // 2), stride_wk, stride_sk, W_BF16)
        if K_TILES == 2:
            kp1 = kp0 + BLOCK_K // 2
            we1, wo1 = _gemv_w_tile(w_rows, s_rows, kp1, (n3 < N) & (kp1 < K // 2), stride_wk, stride_sk, W_BF16)
        wait_prior_grid(PDL)
        xe, xo = _gemv_x_tile(x_b, kp0, kp0 < K // 2, m3, M, stride_xm, stride_xk, BLOCK_M, BLOCK_K, X_PAIRS)
        part = _gemv_add(tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // 2), dtype=tl.float32), xe, xo, we0, wo0)
        if K_TILES == 2:
            xe, xo = _gemv_x_tile(x_b, kp1, kp1 < K // 2, m3, M, stride_xm, stride_xk, BLOCK_M, BLOCK_K, X_PAIRS)
            part = _gemv_add(part, xe, xo, we1, wo1)
        acc = tl.sum(part, axis=2)
    else:
        wait_prior_grid(PDL)
        part = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
        if K_TILES <= 8:
            # unrolled (Kimi-K3's K = 128, 512: 1-4 chunks), no barrier between chunks, so later
            # chunks' loads may issue before earlier chunks' math (ptxas does so in part: gemv_config)
            for kt in tl.static_range(K_TILES):
                part = _gemv_chunk(part, x_b, w_rows, s_rows, kt * BLOCK_K, m3, n3, M, N, K,
                                   stride_xm, stride_xk, stride_wk, stride_sk, BLOCK_M, BLOCK_K, X_PAIRS, W_BF16)
        else:
            for kt in range(K_TILES):
                part = _gemv_chunk(part, x_b, w_rows, s_rows, kt * BLOCK_K, m3, n3, M, N, K,
                                   stride_xm, stride_xk, stride_wk, stride_sk, BLOCK_M, BLOCK_K, X_PAIRS, W_BF16)
        acc = tl.sum(part, axis=2)
    _store_y(acc, y_ptr, g_ptr, b, offs_m, offs_n, M, N, stride_yb, stride_ym, stride_yn,
             stride_gb, stride_gm, stride_gn, GATE, INTERP)


def _is_gfx950(device: torch.device) -> bool:
    if device.type != "cuda" or torch.version.hip is None:
        return False
    return "gfx950" in getattr(torch.cuda.get_device_properties(device), "gcnArchName", "")


def use_dot_scaled(device: torch.device) -> bool:
    """``KIMI_OPS_MXFP4_DOT_SCALED=0/1`` forces it; default: on gfx950 only."""
    env = os.environ.get("KIMI_OPS_MXFP4_DOT_SCALED")
    if env is not None:
        return env.strip() == "1"
    return _is_gfx950(device)


def bmm_config(m: int, n: int, k: int, amd: bool = False) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) from shapes alone; ``amd``: for gfx950 /
    gfx942 (the launcher: a ROCm build)."""
    # measured on the H200 (docs/PERF.md, query section's sweep), Kimi-K3 TP8 shapes
    if m >= 256:
        bm, bn, bk, warps, stages = (128, 128, 64, 8, 3) if n >= 256 else (64, 64, 128, 4, 3)
    else:
        bm = 16 if m <= 16 else 32 if m <= 32 else 64
        bn = 64 if n >= 256 else 32
        bk = min(128, max(32, triton.next_power_of_2(k)))
        warps, stages = 4, 3 if k > bk else 1
    if amd and bm >= 32:
        # at 4 warps (wavefronts) the decode path's 64 rows x 4 K tiles took 325-331 VGPRs + 69-75
        # AGPRs, 1 wave a SIMD, on both chips (stages change nothing on gfx942), and with Triton 3.6
        # its 32 / 64 rows x 1 K tile 272-346 on gfx950; at 8: 113-213 VGPRs, 2-4 waves a SIMD
        # (scripts/cross_compile.py, 2026-12-04; not timed on AMD)
        warps = 8
    return bm, bn, bk, warps, stages


# The GEMV path's M limit: up to 8 rows one program holds all of M (BLOCK_M = M's power of two)
# and multiplies by broadcast, each decoded weight used BLOCK_M times from registers; an MMA would
# pad those rows to 16 (sm_90's mma.sync m16, wgmma m64) anyway. Above 8 the per-thread partial
# sums (BLOCK_M * BLOCK_N * BLOCK_K/2 / threads) and the row-by-row x loads grow past what pays,
# and the tl.dot kernel runs.
GEMV_MAX_M = 8


def gemv_wins(m: int, n: int, k: int) -> bool:
    """The default choice (neither ``gemv`` nor ``KIMI_OPS_MXFP4_GEMV`` given): the GEMV kernel at
    M = 1, and at 2 <= M <= GEMV_MAX_M when K >= 512; the tl.dot kernel otherwise, and always on
    ROCm builds (the GEMV has not run on AMD; gfx950 takes the dot_scaled path anyway).

    Measured on the H200 (Kimi-K3 TP8, 12 heads; us per call, CUDA-graph replays of 256 calls
    over rotating inputs; scripts/bench_query.py --variants; GEMV config = gemv_config's 4-tuple
    (BLOCK_M, BLOCK_N, BLOCK_K, num_warps)):

    * W_UK (N 512, K 128), T = 1: tl.dot 3.55, GEMV (1, 16, 128, 4) 2.58, torch bf16 bmm 3.17.
    * W_UV (N 128, K 512), T = 1: tl.dot 5.46, GEMV (1, 16, 512, 8) 3.09, torch 3.58.
    * W_UK, T = 8: tl.dot 3.61, GEMV 5.09 at best ((8, 8, 128, 4); 5.36 at (8, 16, 128, 4)),
      torch 3.29: the tl.dot kernel stays.
    * W_UV, T = 8: tl.dot 5.39, GEMV (8, 16, 512, 8) 4.82, torch 3.63.

    M = 2..7 were not timed: the rule assumes they side with M = 8 (the GEMV's work grows with M,
    the tl.dot kernel's does not up to 16 rows). N does not enter: only these two (N, K) pairs
    were timed, and K separates them (one K tile of 128 in the tl.dot kernel vs a 4-step loop).
    """
    if torch.version.hip is not None:
        return False
    return m == 1 or (m <= GEMV_MAX_M and k >= 512)


def use_gemv(m: int, n: int, k: int, gemv: bool | None = None) -> bool:
    """Whether bmm_a16wfp4 runs the GEMV kernel for an [M, K] x [N, K]^T product (when its
    dot_scaled path is not picked): never at M > GEMV_MAX_M; else ``gemv`` when given, else
    ``KIMI_OPS_MXFP4_GEMV=1`` / ``0`` (forced on / off), else (unset or any other value)
    :func:`gemv_wins`."""
    forced = forced_gemv(m, gemv, "KIMI_OPS_MXFP4_GEMV")
    return gemv_wins(m, n, k) if forced is None else forced


def forced_gemv(m: int, gemv: bool | None, env: str) -> bool | None:
    """A GEMV form's forced choice at M rows: False above ``GEMV_MAX_M``, else ``gemv`` when given,
    else the environment variable ``env`` when it is ``1`` / ``0``; None when nothing forces it."""
    if m > GEMV_MAX_M:
        return False
    if gemv is not None:
        return bool(gemv)
    value = os.environ.get(env, "").strip()
    return value == "1" if value in ("0", "1") else None


def gemv_config(m: int, n: int, k: int, constant_w: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) of the GEMV kernel from shapes alone.

    * BLOCK_M: M's power of two (every row in one program).
    * BLOCK_N = 16: Kimi-K3 TP8's W_UV (N = 128) gets 8 x 12 heads = 96 programs, W_UK (N = 512)
      384, so most of the H200's 132 SMs have work at T <= 8, where the time is latency, not bytes.
    * K >= 512: BLOCK_K = 512 at 8 warps (W_UV: one chunk). Every load is issued before the math,
      though x's row tile (256 elements, one per thread) goes through shared memory. H200, W_UV:
      T = 1 3.09 us, against 3.17 at (16, 256, 8 warps), 3.69 at (8, 128, 4), 4.14 at (16, 128, 4)
      and 4.62 at (32, 128, 8); T = 8 4.82, against 5.08 at (8, 128, 4), 6.00 at (16, 256, 8) and
      14.16 at (16, 128, 4). Partial sums: BLOCK_M * 16 * 256 / 256 threads = 16 to 128 floats.
    * K < 512: BLOCK_K = 128 (K's power of two if smaller) at 4 warps: the x row tile (64
      elements) has fewer elements than the CTA has threads, which Triton's layout passes take as
      a cheap load and issue directly in the product's layout. H200, W_UK T = 1: 2.58 us, against
      2.64 at 8 warps, 2.67 at BLOCK_N 8, 2.82 at (32, 128, 8). (At T = 8, where the tl.dot
      kernel is the default, BLOCK_N 8 was 5.09 against 5.36.) More chunks than one: ptxas issues
      the later chunks' loads after the first chunk's math, up to a second DRAM round trip.
    * ``constant_w`` (the caller's promise that lets the weight load before the PDL wait,
      W_FIRST) and K >= 512: BLOCK_K = 256 (W_UV: two chunks, both loaded before the wait under
      PDL, so the second round trip above is gone). x's row tile is then 128 elements, a cheap
      load again; at 512 (as many elements as threads) both loads are anchors to Triton
      3.6-3.8's layout pass, whose conflict rule takes the later-defined one: x's, once the
      weight is loaded first. The decoded weight then goes through 16 KB of shared memory and the
      K sum becomes a cross-warp reduction (the sm_90 compile with the launch's specialization;
      unmeasured on a GPU). 256 with or without PDL: the chunking sets the order of the float32
      sums, and PDL must not change a bit of the output (tests/test_pdl.py: on the H200,
      2026-12-05, 512 without PDL and 256 with it gave the fp8 layer's decode loop outputs
      2.25e-4 apart).
    """
    bm = triton.next_power_of_2(max(1, m))
    if k >= 512:
        return bm, 16, 256 if constant_w else 512, 8
    return bm, 16, min(128, max(32, triton.next_power_of_2(k))), 4


# An MXFP4 weight with K >= 512 (W_UV) above 4 rows ignores constant_w: one 512-wide chunk loaded
# after the PDL wait beat two 256-wide ones loaded before it. H100, the MXFP4 layer compiled + in
# a CUDA graph, two rounds, us (docs/perf-history.md, session 36): batch 8 78.4, 78.6 -> 77.3, 77.5;
# batch 4 69.7, 69.6 -> 69.9, 69.9 (so not at 4); batch 1-2 within 0.1. 512-wide chunks loaded
# before the wait were slower still (batch 8 80.8, 80.9; batch 4 71.2, 71.3).
GEMV_MXFP4_W_FIRST_MAX_M = 4


def gemv_x_pairs(x: torch.Tensor) -> bool:
    """Whether the GEMV kernel may read x's (even, odd) K pairs as uint32: K contiguous and every
    row start 4-byte aligned."""
    return (x.stride(2) == 1 and x.data_ptr() % 4 == 0
            and (x.stride(0) % 2 == 0 or x.shape[0] == 1) and (x.stride(1) % 2 == 0 or x.shape[1] == 1))


def bmm_a16wfp4(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor,
                *, config: tuple[int, ...] | None = None,
                dot_scaled: bool | None = None, gemv: bool | None = None,
                out: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                constant_w: bool = False) -> torch.Tensor:
    """``y[b] = x[b] @ dequant(w)[b]^T`` -> bf16 ``[B, M, N]`` (inputs validated by the op layer).

    ``dot_scaled`` overrides the host's choice of multiply (benchmarks, tests). When the
    dot_scaled path is not picked, ``gemv`` picks the dot-free GEMV kernel (True) or the tl.dot
    kernel (False) for M <= ``GEMV_MAX_M``; None: :func:`use_gemv` (``KIMI_OPS_MXFP4_GEMV=0/1``
    forces, else :func:`gemv_wins`: the GEMV at M = 1, and at M <= 8 when K >= 512). Above
    ``GEMV_MAX_M`` the tl.dot kernel runs whatever ``gemv`` says.

    ``config`` is the config of the kernel that runs: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
    num_stages) for the tl.dot kernel (default :func:`bmm_config`), (BLOCK_M, BLOCK_N, BLOCK_K,
    num_warps) for the GEMV kernel (default :func:`gemv_config`; BLOCK_M >= M, a power of two).
    A config of the other kernel's length raises ValueError (a sweep never times the wrong kernel).

    ``out``: a bf16 ``[B, M, N]`` tensor (any strides, e.g. a transposed view) to write y into
    (returned); ``gate``: bf16 ``[B, M, N]`` (any strides), y = (x @ w^T) * gate with one rounding
    (:func:`kimi_ops.kernels.up_proj.v_up_proj`); ``constant_w``: as in :func:`launch_gemv` (the
    GEMV kernel only).
    """
    batch, m, k = x.shape
    n = w_packed.shape[1]
    w_scale = w_scale.view(torch.uint8)
    y = torch.empty((batch, m, n), dtype=torch.bfloat16, device=x.device) if out is None else out
    if batch == 0 or m == 0 or n == 0:
        return y
    if k == 0:
        return y.zero_()
    ds = use_dot_scaled(x.device) if dot_scaled is None else dot_scaled
    if not ds and use_gemv(m, n, k, gemv):
        return launch_gemv(x, w_packed, w_scale, y, gate, config, constant_w)
    if config is not None and len(config) != 5:
        raise ValueError(f"the tl.dot kernel runs: config must be (BLOCK_M, BLOCK_N, BLOCK_K, "
                         f"num_warps, num_stages), got {config}")
    bm, bn, bk, warps, stages = config or bmm_config(m, n, k, amd=torch.version.hip is not None)
    # BLOCK_K beyond K's power of two only wastes work; and an (untuned) BLOCK_K = 4 K config
    # once faulted on the H200 under Triton 3.6 (docs/PERF.md, query section): never launch one.
    bk = min(bk, max(32, triton.next_power_of_2(k)))
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), batch)
    _bmm_a16wfp4_kernel[grid](
        x, w_packed, w_scale, y, y if gate is None else gate, m, n, k,
        *x.stride(), *w_packed.stride(), *w_scale.stride(), *y.stride(), *_gate_strides(gate),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, K_TILES=triton.cdiv(k, bk), DOT_SCALED=ds,
        INTERP=interpreting(), **pdl_args(x.device), num_warps=warps, num_stages=stages,
        GATE=gate is not None,
    )
    return y


def _gate_strides(gate: torch.Tensor | None) -> tuple[int, int, int]:
    return (0, 0, 0) if gate is None else gate.stride()


def launch_gemv(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor | None, y: torch.Tensor,
                gate: torch.Tensor | None = None, config: tuple[int, ...] | None = None,
                constant_w: bool = False) -> torch.Tensor:
    """The GEMV kernel on ``x [B, M <= GEMV_MAX_M, K]`` bf16 (any strides) and an MXFP4 weight
    (``w`` packed ``[B, N, K/2]`` uint8 + ``w_scale`` ``[B, N, K/32]`` uint8) or a bf16 one (``w
    [B, N, K]``, K contiguous, rows 4-byte aligned; ``w_scale`` None) into ``y [B, M, N]`` bf16 (any
    strides), times ``gate`` (y's shape, any strides) when given; returns y. ``config``:
    (BLOCK_M, BLOCK_N, BLOCK_K, num_warps), default :func:`gemv_config`. ``constant_w``: nothing
    queued before on the stream writes w (a model's weight): with PDL and one or two K chunks the
    kernel loads its weight tiles before it waits for the previous kernel (W_FIRST), and K >= 512
    takes 256-wide chunks with or without PDL (:func:`gemv_config`); not for an MXFP4 weight with
    K >= 512 at more than ``GEMV_MXFP4_W_FIRST_MAX_M`` rows, which runs as without ``constant_w``."""
    batch, m, k = x.shape
    n = w.shape[1]
    if config is not None and len(config) != 4:
        raise ValueError(f"the GEMV kernel runs (M = {m}): config must be (BLOCK_M, BLOCK_N, "
                         f"BLOCK_K, num_warps), got {config}")
    pdl = pdl_args(x.device)
    if w_scale is not None and m > GEMV_MXFP4_W_FIRST_MAX_M and k >= 512:
        constant_w = False
    w_first = weights_first(constant_w, pdl)
    bm, bn, bk, warps = config or gemv_config(m, n, k, constant_w)
    if bm < m or bm & (bm - 1):
        raise ValueError(f"GEMV BLOCK_M must be a power of two >= M = {m}, got {bm}")
    bk = min(bk, max(32, triton.next_power_of_2(k)))
    w_bf16 = w_scale is None
    scale, s_strides = (w, (0, 0, 0)) if w_bf16 else (w_scale, w_scale.stride())
    k_tiles = triton.cdiv(k, bk)
    _bmm_a16wfp4_gemv_kernel[(triton.cdiv(n, bn), batch)](
        x, w, scale, y, y if gate is None else gate, m, n, k,
        *x.stride(), *w.stride(), *s_strides, *y.stride(), *_gate_strides(gate),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, K_TILES=k_tiles, X_PAIRS=gemv_x_pairs(x),
        INTERP=interpreting(), **pdl, num_warps=warps, num_stages=1,
        W_BF16=w_bf16, GATE=gate is not None, W_FIRST=w_first and k_tiles <= 2,
    )
    return y


# ----------------------------------------------------------------------------------------------
# cross-compilation registry (scripts/cross_compile.py; format in kimi_ops/kernels/__init__.py)

def _specs():
    sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "y_ptr": "*bf16", "g_ptr": "*bf16",
           "M": "i32", "N": "i32", "K": "i32"}
    for name in ("x", "w", "s", "y", "g"):
        for dim in ("b", "m" if name in ("x", "y", "g") else "n", "k" if name in ("x", "w", "s") else "n"):
            sig[f"stride_{name}{dim}"] = "i32"
    for kk in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "K_TILES", "DOT_SCALED", "INTERP", "PDL", "GATE"):
        sig[kk] = "constexpr"
    specs = []
    # PDL False: sm_90 launches PDL=True (kimi_ops.kernels.pdl: two griddepcontrol instructions more)
    # Kimi-K3 TP8: W_UK (N 512, K 128) and W_UV (N 128, K 512), M from 1 to 512.
    seen = set()
    # the decode path (also M <= 8 with gemv=False, and ROCm's gfx942 at every M) and gfx950's
    # dot_scaled path
    # W_UV's (N 128, K 512) also with the gate (kimi_ops.kernels.up_proj, M > GEMV_MAX_M: "_gate")
    for (n, k), gates in (((512, 128), (False,)), ((128, 512), (False, True))):
        for m in (1, 32, 64, 512):   # every config bmm_config returns for these shapes
            for ds, kind, amd, targets in mxfp4_paths("decode", "dotscaled"):
                bm, bn, bk, warps, stages = bmm_config(m, n, k, amd=amd)
                for gate in gates:
                    key = (bm, bn, bk, -(-k // bk), warps, stages, ds, amd, gate)
                    if key in seen:
                        continue
                    seen.add(key)
                    specs.append({
                        "name": f"bmm_a16wfp4_{kind}_m{bm}n{bn}k{bk}t{-(-k // bk)}w{warps}s{stages}"
                                + ("_amd" if amd and not ds else "") + ("_gate" if gate else ""),
                        "kernel": _bmm_a16wfp4_kernel, "signature": dict(sig),
                        "constexprs": {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "K_TILES": -(-k // bk),
                                       "DOT_SCALED": ds, "INTERP": False, "PDL": False, "GATE": gate},
                        "num_warps": warps, "num_stages": stages, "targets": targets})
    # the dot-free GEMV kernel (the default at M = 1, and at M <= 8 when K >= 512: gemv_wins; gemv=True
    # or KIMI_OPS_MXFP4_GEMV=1 at any M <= 8): every config gemv_config returns
    # for these shapes at M 1 .. GEMV_MAX_M (BLOCK_M 1, 2, 4, 8), with x read as uint32 pairs (the
    # model's case: q_nope / o transposed, K contiguous) and as strided halves ("_xs"). Like the
    # entries above, the strides are plain i32 here; the JIT also specializes an int equal to 1 (a
    # constant) and one divisible by 16, and the GEMV's layouts depend on that (contiguous, aligned
    # weight rows: vectorized loads, each thread a K strip), so its PTX at run time differs from
    # this generic compile (fewer shuffles, one shared-memory round trip instead of 3-17).
    # kimi_ops.kernels.up_proj's W_UV (M <= GEMV_MAX_M, x pairs): with the gate, MXFP4 ("_gate") or
    # bf16 ("_bf16_gate", w_ptr / s_ptr bf16) weights.
    gsig = {a: t for a, t in sig.items() if a != "DOT_SCALED"}
    gsig["X_PAIRS"] = gsig["W_BF16"] = gsig["W_FIRST"] = "constexpr"
    gseen = set()
    for (n, k), forms in (((512, 128), ((True, False, False), (False, False, False))),
                          ((128, 512), ((True, False, False), (False, False, False), (True, False, True),
                                        (True, True, True)))):
        for m in range(1, GEMV_MAX_M + 1):
            bm, bn, bk, warps = gemv_config(m, n, k)
            for pairs, w_bf16, gate in forms:
                key = (bm, bn, bk, -(-k // bk), warps, pairs, w_bf16, gate)
                if key in gseen:
                    continue
                gseen.add(key)
                specs.append({
                    "name": f"bmm_a16wfp4_gemv_m{bm}n{bn}k{bk}t{-(-k // bk)}w{warps}" + ("" if pairs else "_xs")
                            + ("_bf16" if w_bf16 else "") + ("_gate" if gate else ""),
                    "kernel": _bmm_a16wfp4_gemv_kernel,
                    "signature": {**gsig, **({"w_ptr": "*bf16", "s_ptr": "*bf16"} if w_bf16 else {})},
                    "constexprs": {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "K_TILES": -(-k // bk),
                                   "X_PAIRS": pairs, "INTERP": False, "PDL": False, "W_BF16": w_bf16,
                                   "GATE": gate, "W_FIRST": False},
                    "num_warps": warps, "num_stages": 1, "targets": ("gfx950", "gfx942", "sm90")})
    # the decode layer's W_UV launches on sm_90 as they run: PDL, the weight tile before the wait
    # (constant_w; tests/test_cross_compile.py checks the order of the loads in the PTX)
    for m in (1, 8):
        bm, bn, bk, warps = gemv_config(m, 128, 512, constant_w=True)
        for w_bf16 in (False, True):
            specs.append({
                "name": f"bmm_a16wfp4_gemv_m{bm}n{bn}k{bk}t{512 // bk}w{warps}" + ("_bf16" if w_bf16 else "")
                        + "_gate_pdl_wfirst",
                "kernel": _bmm_a16wfp4_gemv_kernel,
                "signature": {**gsig, **({"w_ptr": "*bf16", "s_ptr": "*bf16"} if w_bf16 else {})},
                "constexprs": {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "K_TILES": 512 // bk, "X_PAIRS": True,
                               "INTERP": False, "PDL": True, "W_BF16": w_bf16, "GATE": True, "W_FIRST": True},
                "num_warps": warps, "num_stages": 1, "targets": ("sm90",)})
    return specs


CROSS_COMPILE_SPECS = _specs()
