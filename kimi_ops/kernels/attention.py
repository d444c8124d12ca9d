"""Triton M1c (split-KV MLA decode) and M1b (merge of split partials).

``mla_decode_splitkv``: one program per (row block, split, request).  A request's
``qlen * H`` query rows are contiguous in ``q`` (row ``r*qlen + i``, head ``h`` is flat
row ``(r*qlen + i)*H + h``), so a program takes ``BLOCK_M`` consecutive flat rows of its
request (several heads and positions); the programs of one (split, request) are adjacent
in the grid so their KV chunk is read from HBM once and then from L2.

A request of ``n`` tokens is cut into ``num_splits`` contiguous chunks of
``ceil(ceil(n / num_splits) / BLOCK_N) * BLOCK_N`` tokens (later splits may be empty:
they store o = 0, lse = -inf).  Inside a chunk the causal bound of each row masks the
scores; tokens are gathered through ``kv_indices`` with a masked load, an index outside
``[0, N)`` reads as an all-zero row and nothing but the named rows is read.

Numerics (``MMA="fp8"``, the seeds' scheme): each query row is scaled by 2^k (k from the
row's max exponent) and split into exact E4M3 ``hi + lo``; S = (Q_hi + Q_lo) K^T with fp8 x
fp8 dots on the cache as stored; P = exp2(S - m) * 2^PLOG is split into E4M3 ``hi + lo`` and
O += (P_hi + P_lo) V as fp8 x fp8 dots.  ``MMA="bf16"``: the K tile is converted to a 16-bit
type (exact) and both products run as 16-bit dots: f16 on NVIDIA sm_89+ (``F16``: one
cvt.rn.f16x2.e4m3x2 a byte pair; a bf16 q is scaled by a power of two, one a program, into f16's
range and the factor's inverse folded into the score scale; P <= 1 rounds to f16), else bf16.
``S_CHAINS`` sums S as several short MMA chains (a tensor core's chained accumulation
truncates); ``WORDS`` (with ``PREFETCH``, up to 32 rows a program; :func:`_words`) carries the next
tile as int32 words (one register per 4 bytes, not one per byte) and splits S and O by byte of
the word (``_word_bytes``: Q_b K_b^T summed, O_b = P V_b, channel 4 j + b).  ``KV_BYTES``: a
cache of an fp8 type the backend lacks (e4m3fnuz on NVIDIA, e4m3fn before sm_89) is read as
bytes and decoded in the kernel by integer arithmetic (``fp8_value``; 16-bit dots); ``Q_BYTES``
the same for an fp8 q.

fp8 query (issue 28, ``q_scale`` given): q is loaded as stored (e4m3fn, or e4m3fnuz read as
bytes where the backend has no such type) and converted exactly to the dots' 16-bit type (every
e4m3 value is a bf16 and an f16 value), then runs the 16-bit (or fp8 hi + lo) path above
unchanged; ``q_scale`` is loaded from its device pointer in the kernel and multiplied into the
score scale (``scale * kv_scale * q_scale``), so no host sync and a CUDA graph replays a new scale.

The second generation (:mod:`kimi_ops.kernels.triton_m1c`, token-major) takes its prologue,
score scale, fp8 conversion and lse epilogue (``_program_rows``, ``_score_scale``,
``_fp8_to16``, ``_row_inv``, ``_row_lse``: Triton inlines them) and its host checks from here.
"""
import functools
import os

import torch
import triton
import triton.language as tl

from ..device import compute_capability, device_index
from ..formats import KV_LORA_RANK, KV_ROW
from . import interpreting
from .cache import fp8_bits, fp8_value

# how an fp8 tensor reaches a kernel (its KV_BYTES / Q_BYTES): as its fp8 type, or as bytes of
# e4m3fn / e4m3fnuz codes where the backend lacks the type (decoded by fp8_value)
NATIVE, FN_BYTES, FNUZ_BYTES = 0, 1, 2

LOG2E = 1.4426950408889634


@triton.jit
def _to_fp8(x, FP8: tl.constexpr, FNUZ: tl.constexpr, SOFT: tl.constexpr):
    # x is in the format's range; SOFT: exact RNE encode by integer ops (the interpreter's
    # fp32 -> fp8 cast does not round to nearest); else the hardware conversion (RNE)
    if SOFT:
        return fp8_bits(x, FNUZ).to(tl.uint8).to(FP8, bitcast=True)
    else:
        return x.to(FP8)


@triton.jit
def _to_bf16(x, INTERP: tl.constexpr):
    # f32 -> bf16, RNE (finite x). The interpreter's own cast does not carry a rounded-up
    # mantissa into the exponent, so it is done by integer ops there.
    if INTERP:
        b = x.to(tl.uint32, bitcast=True)
        b = b + 0x7FFF + ((b >> 16) & 1)
        return (b >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _q_half(ptrs, row_ok, Q_FP8: tl.constexpr, Q_BYTES: tl.constexpr):
    # q's channels at ptrs [BLOCK_M, W], f32 (exact)
    x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
    if Q_FP8 and Q_BYTES:
        x = fp8_value(x, Q_BYTES == 2)
    return x.to(tl.float32)


@triton.jit
def _to16(x, DT16: tl.constexpr, F16: tl.constexpr):
    # f32 -> the dots' 16-bit type (RNE); in the interpreter (DT16 f32) f16 dots round through f16
    if F16 and DT16 == tl.float32:
        return x.to(tl.float16).to(tl.float32)
    return x.to(DT16)


@triton.jit
def _fp8_to16(x, BYTES: tl.constexpr, DT16: tl.constexpr):
    # an fp8 tile (or codes: BYTES 1 e4m3fn, 2 e4m3fnuz) -> DT16, exact (every e4m3 value is a bf16
    # and an f16 value)
    if BYTES:
        return fp8_value(x, BYTES == 2).to(DT16)
    return x.to(DT16)


@triton.jit
def _load_words(kv_ptr, idx, ok):
    """A tile's cache rows ``idx`` [BN] (int64; rows not ``ok`` read as 0) as int32 words, 4 fp8
    bytes each: the latent halves [BN, 64] twice and the rope channels [BN, 16]. Held as words, a
    prefetched tile takes one register per 4 bytes (a tile of fp8 elements takes one per byte)."""
    kvw = kv_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    rows = kvw + idx[:, None] * 144
    lat = tl.arange(0, 64)[None, :]
    return (tl.load(rows + lat, mask=ok[:, None], other=0),
            tl.load(rows + 64 + lat, mask=ok[:, None], other=0),
            tl.load(rows + 128 + tl.arange(0, 16)[None, :], mask=ok[:, None], other=0))


@triton.jit
def _word_byte(w, SHIFT: tl.constexpr, FP8: tl.constexpr, BYTES: tl.constexpr, DT16: tl.constexpr):
    b = ((w >> SHIFT) & 0xFF).to(tl.uint8)
    if not BYTES:
        b = b.to(FP8, bitcast=True)
    return _fp8_to16(b, BYTES, DT16)


@triton.jit
def _word_bytes(w, FP8: tl.constexpr, BYTES: tl.constexpr, DT16: tl.constexpr):
    """[BN, W] int32 words of 4 fp8 bytes (little-endian) -> four [BN, W] DT16 tensors, exact: the
    b-th holds byte b of each word (cache channel c0 + 4 j + b). Kept apart, not interleaved: the
    products are split the same way (S = sum over b of Q_b K_b^T, O_b = P V_b), so no reshape
    reorders the tile (Triton 3.6 then stages it for the dots with LDS.64 and register moves, not
    ldmatrix). f16 on NVIDIA: two cvt.rn.f16x2.e4m3x2 a word, each on a 16-bit half (Triton's own
    conversion extracts and re-pairs the bytes: ~3x the instructions)."""
    if DT16 == tl.float16 and not BYTES:
        # two words j, j + 1 a call: prmt pairs their bytes b (b0 b0' b1 b1' / b2 b2' b3 b3'), so
        # each cvt yields the f16x2 (byte b of word j, of word j + 1) that output b holds
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 lo, hi;
            .reg .b16 l0, l1, h0, h1;
            prmt.b32 lo, $4, $5, 0x5140;
            prmt.b32 hi, $4, $5, 0x7362;
            mov.b32 {l0, l1}, lo;
            mov.b32 {h0, h1}, hi;
            cvt.rn.f16x2.e4m3x2 $0, l0;
            cvt.rn.f16x2.e4m3x2 $1, l1;
            cvt.rn.f16x2.e4m3x2 $2, h0;
            cvt.rn.f16x2.e4m3x2 $3, h1;
            }""", "=r,=r,=r,=r,r,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16),
            is_pure=True, pack=2)
    return (_word_byte(w, 0, FP8, BYTES, DT16), _word_byte(w, 8, FP8, BYTES, DT16),
            _word_byte(w, 16, FP8, BYTES, DT16), _word_byte(w, 24, FP8, BYTES, DT16))


@triton.jit
def _q_bytes(q_ptr, flat_row, row_ok, C0: tl.constexpr, W: tl.constexpr, Q_FP8: tl.constexpr,
             Q_BYTES: tl.constexpr):
    # q's channels C0 + 4 j + b (j < W), b = 0..3: four [BLOCK_M, W] f32 tensors (exact), the
    # channels of _word_bytes' four K tensors
    ptrs = q_ptr + flat_row[:, None] * 576 + C0 + 4 * tl.arange(0, W)[None, :]
    return (_q_half(ptrs, row_ok, Q_FP8, Q_BYTES), _q_half(ptrs + 1, row_ok, Q_FP8, Q_BYTES),
            _q_half(ptrs + 2, row_ok, Q_FP8, Q_BYTES), _q_half(ptrs + 3, row_ok, Q_FP8, Q_BYTES))


@triton.jit
def _absmax4(x0, x1, x2, x3):
    return tl.maximum(tl.maximum(tl.max(tl.abs(x0)), tl.max(tl.abs(x1))),
                      tl.maximum(tl.max(tl.abs(x2)), tl.max(tl.abs(x3))))


@triton.jit
def _to16x4(x0, x1, x2, x3, mul, DT16: tl.constexpr, F16: tl.constexpr):
    return (_to16(x0 * mul, DT16, F16), _to16(x1 * mul, DT16, F16), _to16(x2 * mul, DT16, F16),
            _to16(x3 * mul, DT16, F16))


@triton.jit
def _qk4(q0, q1, q2, q3, k0, k1, k2, k3):
    # sum over b of Q_b K_b^T: four short MMA chains added in f32
    return (tl.dot(q0, tl.trans(k0)) + tl.dot(q1, tl.trans(k1))) + (tl.dot(q2, tl.trans(k2)) + tl.dot(q3, tl.trans(k3)))


@triton.jit
def _pv4(p, k0, k1, k2, k3, a0, a1, a2, a3):
    # O_b += P V_b (V_b: K_b, the latent channels' bytes b)
    return tl.dot(p, k0, a0), tl.dot(p, k1, a1), tl.dot(p, k2, a2), tl.dot(p, k3, a3)


@triton.jit
def _scale4(a0, a1, a2, a3, alpha):
    return a0 * alpha[:, None], a1 * alpha[:, None], a2 * alpha[:, None], a3 * alpha[:, None]


@triton.jit
def _store4(o_rows, C0: tl.constexpr, W: tl.constexpr, a0, a1, a2, a3, inv, row_ok, INTERP: tl.constexpr):
    ptrs = o_rows[:, None] + C0 + 4 * tl.arange(0, W)[None, :]
    tl.store(ptrs, _to_bf16(a0 * inv[:, None], INTERP), mask=row_ok[:, None])
    tl.store(ptrs + 1, _to_bf16(a1 * inv[:, None], INTERP), mask=row_ok[:, None])
    tl.store(ptrs + 2, _to_bf16(a2 * inv[:, None], INTERP), mask=row_ok[:, None])
    tl.store(ptrs + 3, _to_bf16(a3 * inv[:, None], INTERP), mask=row_ok[:, None])


@triton.jit
def _visible_tokens(n, n_global, qlen, pos, dcp_rank, dcp_world_size):
    """Tokens (of the n listed) that query position ``pos`` sees: the listed token j is global
    position ``j * W + rank`` and position pos sees global positions ``<= n_global - qlen + pos``
    (one rank: ``n - qlen + pos + 1``, clipped to [0, n])."""
    last = n_global - qlen + pos - dcp_rank
    return tl.minimum(tl.where(last >= 0, last // dcp_world_size + 1, 0), n)


# ----------------------------------------------------------------------------------------------
# the parts both M1c kernels share (this module's and kimi_ops.kernels.triton_m1c's; Triton
# inlines them)

@triton.jit
def _program_rows(indptr_ptr, seq_lens_ptr, pid_m, pid_s, pid_r, H, qlen, num_splits,
                  dcp_rank, dcp_world_size,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GLOBAL_LENS: tl.constexpr):
    """A program's rows and tokens: row block ``pid_m`` (BLOCK_M consecutive flat rows of
    request ``pid_r``'s ``qlen * H``) over split ``pid_s``'s chunk of the request's tokens.

    Returns (start, flat_row, row_ok, lim, lo, hi): the request's first entry in the index
    list; the rows' flat row in q viewed [T*H, 576] (int64 [BLOCK_M]) and which exist; each
    row's causal bound ``lim`` (tokens it sees, 0 for a missing row); the split's token range
    [lo, hi), its chunk ``ceil(ceil(n / num_splits) / BLOCK_N) * BLOCK_N`` tokens long and
    clipped to what the block's last row sees."""
    start = tl.load(indptr_ptr + pid_r)
    n = tl.load(indptr_ptr + pid_r + 1) - start
    n = tl.maximum(n, 0)
    rows_per_req = qlen * H
    m_offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = m_offs < rows_per_req
    pos = m_offs // H
    if GLOBAL_LENS:
        n_global = tl.load(seq_lens_ptr + pid_r)
    else:
        n_global = n
    lim = tl.where(row_ok, _visible_tokens(n, n_global, qlen, pos, dcp_rank, dcp_world_size), 0)
    # the block's last row sees the most (a scalar, not a reduction: Triton 3.6's interpreter
    # cannot take a loop bound from a reduction)
    last_pos = (tl.minimum(pid_m * BLOCK_M + BLOCK_M, rows_per_req) - 1) // H
    hi_rows = _visible_tokens(n, n_global, qlen, last_pos, dcp_rank, dcp_world_size)

    chunk = tl.cdiv(tl.cdiv(n, num_splits), BLOCK_N) * BLOCK_N
    lo = pid_s * chunk
    hi = tl.minimum(lo + chunk, hi_rows)
    flat_row = pid_r.to(tl.int64) * rows_per_req + m_offs
    return start, flat_row, row_ok, lim, lo, hi


@triton.jit
def _row_pow2(amax, EXP: tl.constexpr):
    """Per row, (2^k, 2^-k) with k such that amax * 2^k lies in [2^EXP, 2^(EXP+1)) (1, 1 where amax
    is 0): scales a row exactly into a narrower format's range."""
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    k = tl.minimum(tl.maximum(EXP - e, -126), 126)
    k = tl.where(amax > 0, k, 0)
    return ((k + 127) << 23).to(tl.float32, bitcast=True), ((127 - k) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _score_scale(c_hi, c_lo, q_scale_ptr, HAS_QSCALE: tl.constexpr):
    """c = scale * kv_scale [* q_scale, loaded from the device] as an f32 hi + lo pair (the
    product's rounding error recovered by an FMA).  Returns (|c| hi, |c| lo, sign of c): with a
    negative scale the scores are |c| * (-d), so the running max is taken over sign * d."""
    if HAS_QSCALE:
        qs = tl.load(q_scale_ptr)
        ch = c_hi * qs
        cl = tl.fma(c_hi, qs, -ch) + c_lo * qs
    else:
        ch = c_hi
        cl = c_lo
    sgn = tl.where(ch < 0, -1.0, 1.0)
    return ch * sgn, cl * sgn, sgn


@triton.jit
def _row_inv(l_i, out_scale):
    """A row's output factor from its softmax sum ``l_i``: out_scale / l, 0 where it saw nothing."""
    has = l_i > 0
    return tl.where(has, out_scale / tl.where(has, l_i, 1.0), 0.0)


@triton.jit
def _row_lse(m_i, l_i, c, c_lo):
    """A row's lse = m * c + ln l from its running max ``m_i`` (raw dot units) and sum ``l_i``
    (-inf where it saw nothing): the product m * c formed with its rounding error (FMA) and c's
    low part added back."""
    has = l_i > 0
    mm = tl.where(has, m_i, 0.0)
    big = mm * c
    small = tl.fma(mm, c, -big) + mm * c_lo + tl.log2(tl.where(has, l_i, 1.0)) * 0.6931471805599453
    return tl.where(has, big + small, float("-inf"))


@triton.jit
def _split_kv_kernel(
    q_ptr, kv_ptr, indptr_ptr, indices_ptr, seq_lens_ptr, o_ptr, lse_ptr, q_scale_ptr,
    T, H, N, qlen, num_splits, dcp_rank, dcp_world_size,
    c_hi, c_lo,  # scale * kv_scale (natural units) as hi + lo f32
    kv_scale,
    Q_FP8: tl.constexpr,  # q is fp8 (q_ptr's type, or its codes with Q_BYTES); q_scale_ptr -> f32 [1]
    Q_BYTES: tl.constexpr,  # 0: q as its type; 1 / 2: e4m3fn / e4m3fnuz codes (uint8)
    MMA_FP8: tl.constexpr,
    KV_BYTES: tl.constexpr,  # 0: the cache as its fp8 type; 1 / 2: e4m3fn / e4m3fnuz codes (uint8)
    FNUZ: tl.constexpr,
    INTERP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREFETCH: tl.constexpr,
    GLOBAL_LENS: tl.constexpr,  # seq_lens given: causal bounds in global (DCP) positions
    INTERP_STEPS: tl.constexpr,  # interpreter: a fixed trip count (Triton 3.6's cannot loop to a runtime bound)
    S_CHAINS: tl.constexpr = False,  # bf16: S as three independent products (256 + 256 + 64 channels)
    F16: tl.constexpr = False,  # bf16 mode's dots in f16: K by one conversion, q scaled a row into range
    WORDS: tl.constexpr = False,  # (with S_CHAINS and PREFETCH) the prefetched tile as int32 words, S / O by byte
):
    DC: tl.constexpr = 512
    DH: tl.constexpr = 256
    DP: tl.constexpr = 64
    D: tl.constexpr = 576
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_r = tl.program_id(2)

    start, flat_row, row_ok, lim, lo, hi = _program_rows(
        indptr_ptr, seq_lens_ptr, pid_m, pid_s, pid_r, H, qlen, num_splits, dcp_rank, dcp_world_size,
        BLOCK_M, BLOCK_N, GLOBAL_LENS)  # flat_row: the row of q viewed [T*H, 576]

    offs_c = tl.arange(0, DC)
    offs_h = tl.arange(0, DH)
    offs_p = tl.arange(0, DP)
    offs_n = tl.arange(0, BLOCK_N)

    qc = tl.load(q_ptr + flat_row[:, None] * D + offs_c[None, :], mask=row_ok[:, None], other=0.0)
    qp = tl.load(q_ptr + flat_row[:, None] * D + DC + offs_p[None, :], mask=row_ok[:, None], other=0.0)
    if Q_FP8:
        # the fp8 query as stored -> f32 (exact; exact in bf16 too); its scale: _score_scale
        if Q_BYTES:
            qc = fp8_value(qc, Q_BYTES == 2)
            qp = fp8_value(qp, Q_BYTES == 2)
        else:
            qc = qc.to(tl.float32)
            qp = qp.to(tl.float32)
    ch, cl, sgn = _score_scale(c_hi, c_lo, q_scale_ptr, Q_FP8)

    if KV_BYTES:
        FP8: tl.constexpr = tl.float8e4nv  # (unused: codes are decoded to the 16-bit dots' type)
    else:
        FP8: tl.constexpr = kv_ptr.dtype.element_ty
    if FNUZ:
        QEXP: tl.constexpr = 6  # row max scaled into [64, 128): e4m3fnuz max 240
        PLOG: tl.constexpr = 7
    else:
        QEXP: tl.constexpr = 7  # row max scaled into [128, 256): e4m3fn max 448
        PLOG: tl.constexpr = 8

    # the interpreter multiplies bf16 as integers (stored as uint16): f32 there
    if INTERP:
        DT16: tl.constexpr = tl.float32
    elif F16:
        DT16: tl.constexpr = tl.float16
    else:
        DT16: tl.constexpr = tl.bfloat16
    if MMA_FP8:
        qcf = qc.to(tl.float32)
        qpf = qp.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(qcf), axis=1), tl.max(tl.abs(qpf), axis=1))
        qsc, qinv = _row_pow2(amax, QEXP)
        xc = qcf * (qsc * sgn)[:, None]  # the sign of the scale folded into q (exact)
        xp = qpf * (qsc * sgn)[:, None]
        qc_hi = _to_fp8(xc, FP8, FNUZ, INTERP)
        qc_lo = _to_fp8(xc - qc_hi.to(tl.float32), FP8, FNUZ, INTERP)
        qp_hi = _to_fp8(xp, FP8, FNUZ, INTERP)
        qp_lo = _to_fp8(xp - qp_hi.to(tl.float32), FP8, FNUZ, INTERP)
        row_c = qinv * ch  # exact: 2^-k
        row_cl = qinv * cl
    else:
        # f16 dots with a bf16 q: the program's q scaled by 2^k into f16's range (max |q| in
        # [2^14, 2^15)), exact for every element above 2^-24 of the max (an fp8 q is exact in f16
        # as it is); 2^-k goes into the score scale. The scale's sign is folded into q (exact).
        qsc = 1.0
        qinv = 1.0
        if WORDS:
            # q in byte-strided channel groups, as the K tile's words hold them (_word_bytes)
            qa0, qa1, qa2, qa3 = _q_bytes(q_ptr, flat_row, row_ok, 0, DH // 4, Q_FP8, Q_BYTES)
            qb0, qb1, qb2, qb3 = _q_bytes(q_ptr, flat_row, row_ok, DH, DH // 4, Q_FP8, Q_BYTES)
            qr0, qr1, qr2, qr3 = _q_bytes(q_ptr, flat_row, row_ok, DC, DP // 4, Q_FP8, Q_BYTES)
            if F16 and not Q_FP8:
                amax = tl.maximum(tl.maximum(_absmax4(qa0, qa1, qa2, qa3), _absmax4(qb0, qb1, qb2, qb3)),
                                  _absmax4(qr0, qr1, qr2, qr3))
                qsc, qinv = _row_pow2(amax, 14)
            qa0, qa1, qa2, qa3 = _to16x4(qa0, qa1, qa2, qa3, qsc * sgn, DT16, F16)
            qb0, qb1, qb2, qb3 = _to16x4(qb0, qb1, qb2, qb3, qsc * sgn, DT16, F16)
            qr0, qr1, qr2, qr3 = _to16x4(qr0, qr1, qr2, qr3, qsc * sgn, DT16, F16)
        else:
            qcf = qc.to(tl.float32)
            qpf = qp.to(tl.float32)
            if F16 and not Q_FP8:
                qsc, qinv = _row_pow2(tl.maximum(tl.max(tl.abs(qcf)), tl.max(tl.abs(qpf))), 14)
            qmul = qsc * sgn
            qc = _to16(qcf * qmul, DT16, F16)
            qp = _to16(qpf * qmul, DT16, F16)
            if S_CHAINS:
                qc0 = _to16(_q_half(q_ptr + flat_row[:, None] * D + offs_h[None, :], row_ok, Q_FP8, Q_BYTES) * qmul,
                            DT16, F16)
                qc1 = _to16(_q_half(q_ptr + flat_row[:, None] * D + DH + offs_h[None, :], row_ok, Q_FP8, Q_BYTES)
                            * qmul, DT16, F16)
        row_c = tl.zeros([BLOCK_M], dtype=tl.float32) + qinv * ch
        row_cl = tl.zeros([BLOCK_M], dtype=tl.float32) + qinv * cl
    # the softmax runs on raw dots d (max m in dot units), p = 2^((d - m) * c * log2 e): d - m is
    # exact near the max, and the lse m * c + ln l is formed once, its product's rounding error
    # recovered by an FMA (issue 29 item 4: (m_log2 + log2 l) * ln 2 rounded s * c * log2 e, the
    # sum and the product, ~1 ulp of |lse| each)
    row_scale = row_c * 1.4426950408889634

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if WORDS:
        # O by channel group: oa_b / ob_b [BLOCK_M, 64] hold the channels 4 j + b / 256 + 4 j + b
        oa0 = tl.zeros([BLOCK_M, DH // 4], dtype=tl.float32)
        oa1 = tl.zeros([BLOCK_M, DH // 4], dtype=tl.float32)
        oa2 = tl.zeros([BLOCK_M, DH // 4], dtype=tl.float32)
        oa3 = tl.zeros([BLOCK_M, DH // 4], dtype=tl.float32)
        ob0 = tl.zeros([BLOCK_M, DH // 4], dtype=tl.float32)
        ob1 = tl.zeros([BLOCK_M, DH // 4], dtype=tl.float32)
        ob2 = tl.zeros([BLOCK_M, DH // 4], dtype=tl.float32)
        ob3 = tl.zeros([BLOCK_M, DH // 4], dtype=tl.float32)
    elif S_CHAINS:
        acc0 = tl.zeros([BLOCK_M, DH], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_M, DH], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, DC], dtype=tl.float32)

    if PREFETCH:
        # software pipeline in registers: the K tile of the next step and the indices of the
        # one after are in flight while this step computes (the gathered tile is converted
        # before its dots, so Triton's own cp.async pipelining does not apply)
        tok1 = lo + offs_n
        idx1 = tl.load(indices_ptr + start + tok1, mask=tok1 < hi, other=-1).to(tl.int64)
        ok1 = (tok1 < hi) & (idx1 >= 0) & (idx1 < N)
        if WORDS:
            kc0_nx, kc1_nx, kp_nx = _load_words(kv_ptr, idx1, ok1)
        elif S_CHAINS:
            kc0_nx = tl.load(kv_ptr + idx1[:, None] * D + offs_h[None, :], mask=ok1[:, None], other=0.0)
            kc1_nx = tl.load(kv_ptr + idx1[:, None] * D + DH + offs_h[None, :], mask=ok1[:, None], other=0.0)
            kp_nx = tl.load(kv_ptr + idx1[:, None] * D + DC + offs_p[None, :], mask=ok1[:, None], other=0.0)
        else:
            kc_nx = tl.load(kv_ptr + idx1[:, None] * D + offs_c[None, :], mask=ok1[:, None], other=0.0)
            kp_nx = tl.load(kv_ptr + idx1[:, None] * D + DC + offs_p[None, :], mask=ok1[:, None], other=0.0)
        tok2 = lo + BLOCK_N + offs_n
        idx_nx = tl.load(indices_ptr + start + tok2, mask=tok2 < hi, other=-1).to(tl.int64)

    # the interpreter's trip count is >= the split's tiles (the extra ones are fully masked)
    for step in range(0, INTERP_STEPS if INTERP_STEPS > 0 else tl.cdiv(hi - lo, BLOCK_N)):
        j0 = lo + step * BLOCK_N
        tok = j0 + offs_n
        tok_ok = tok < hi
        if PREFETCH:
            tokn = j0 + BLOCK_N + offs_n
            okn = (tokn < hi) & (idx_nx >= 0) & (idx_nx < N)
            if WORDS:
                kc0, kc1, kp = kc0_nx, kc1_nx, kp_nx
                kc0_nx, kc1_nx, kp_nx = _load_words(kv_ptr, idx_nx, okn)
            elif S_CHAINS:
                kc0, kc1, kp = kc0_nx, kc1_nx, kp_nx
                kc0_nx = tl.load(kv_ptr + idx_nx[:, None] * D + offs_h[None, :], mask=okn[:, None], other=0.0)
                kc1_nx = tl.load(kv_ptr + idx_nx[:, None] * D + DH + offs_h[None, :], mask=okn[:, None], other=0.0)
                kp_nx = tl.load(kv_ptr + idx_nx[:, None] * D + DC + offs_p[None, :], mask=okn[:, None],
                                other=0.0)
            else:
                kc, kp = kc_nx, kp_nx
                kc_nx = tl.load(kv_ptr + idx_nx[:, None] * D + offs_c[None, :], mask=okn[:, None], other=0.0)
                kp_nx = tl.load(kv_ptr + idx_nx[:, None] * D + DC + offs_p[None, :], mask=okn[:, None],
                                other=0.0)
            tokn2 = j0 + 2 * BLOCK_N + offs_n
            idx_nx = tl.load(indices_ptr + start + tokn2, mask=tokn2 < hi, other=-1).to(tl.int64)
        else:
            idx = tl.load(indices_ptr + start + tok, mask=tok_ok, other=-1).to(tl.int64)
            ld_ok = tok_ok & (idx >= 0) & (idx < N)
            if S_CHAINS:
                kc0 = tl.load(kv_ptr + idx[:, None] * D + offs_h[None, :], mask=ld_ok[:, None], other=0.0)
                kc1 = tl.load(kv_ptr + idx[:, None] * D + DH + offs_h[None, :], mask=ld_ok[:, None], other=0.0)
            else:
                kc = tl.load(kv_ptr + idx[:, None] * D + offs_c[None, :], mask=ld_ok[:, None], other=0.0)
            kp = tl.load(kv_ptr + idx[:, None] * D + DC + offs_p[None, :], mask=ld_ok[:, None], other=0.0)
        if WORDS:
            # words -> DT16 byte groups
            ka0, ka1, ka2, ka3 = _word_bytes(kc0, FP8, KV_BYTES, DT16)
            kb0, kb1, kb2, kb3 = _word_bytes(kc1, FP8, KV_BYTES, DT16)
            kr0, kr1, kr2, kr3 = _word_bytes(kp, FP8, KV_BYTES, DT16)
        elif S_CHAINS:
            kc0 = _fp8_to16(kc0, KV_BYTES, DT16)
            kc1 = _fp8_to16(kc1, KV_BYTES, DT16)
            kp = _fp8_to16(kp, KV_BYTES, DT16)
        elif KV_BYTES:
            kc = _fp8_to16(kc, KV_BYTES, DT16)  # fp8 codes, decoded
            kp = _fp8_to16(kp, KV_BYTES, DT16)

        if MMA_FP8:
            s = tl.dot(qc_hi, tl.trans(kc))
            s = tl.dot(qc_lo, tl.trans(kc), s)
            s = tl.dot(qp_hi, tl.trans(kp), s)
            s = tl.dot(qp_lo, tl.trans(kp), s)
        else:
            # S_CHAINS: short MMA chains added in f32 (RNE): a tensor core's chained accumulation
            # truncates, and one 36-step chain of dots ~1e5 biases the scores (and the lse) by up
            # to ~1e-3 (issue 29 item 4). As compiled for sm_90 (Triton 3.6 and 3.8), Triton folds
            # `dot(a, b) + c` into dot(a, b, c): the words tile's twelve chains become six (four
            # of 8 k-steps, two of 2 for the rope channels) and the three products below one chain
            # of 36 k-steps; the dense-climb GPU tests pass all the same (H100, 2026-12-07: worst
            # |dlse| 4.2e-4 at 12 and 96 heads, step 256). Keeping them apart (tl.fma(x, 1.0, y))
            # spilled 184 bytes at 64 rows against 80 and added 25% to the tile loop
            # (perf-history.md "Session 54").
            if WORDS:
                # twelve chains of 4 k-steps (1 for the rope channels) as written
                s = _qk4(qa0, qa1, qa2, qa3, ka0, ka1, ka2, ka3) + _qk4(qb0, qb1, qb2, qb3, kb0, kb1, kb2, kb3)
                s = s + _qk4(qr0, qr1, qr2, qr3, kr0, kr1, kr2, kr3)
            elif S_CHAINS:
                # three: 256 + 256 + 64 channels
                s = tl.dot(qc0, tl.trans(kc0)) + tl.dot(qc1, tl.trans(kc1))
                s = s + tl.dot(qp, tl.trans(kp))
            else:
                if not KV_BYTES:
                    kc = kc.to(DT16)
                    kp = kp.to(DT16)
                s = tl.dot(qc, tl.trans(kc))
                s = tl.dot(qp, tl.trans(kp), s)
        vis = tok_ok[None, :] & (tok[None, :] < lim[:, None])
        s = tl.where(vis, s, float("-inf"))  # (the scale's sign is in q)
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        # (a zero scale: -inf * 0 would be NaN, so masked scores and an empty start are selected)
        alpha = tl.where(m_i == float("-inf"), 0.0, tl.exp2((m_i - m_safe) * row_scale))
        p = tl.where(vis, tl.exp2((s - m_safe[:, None]) * row_scale[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if WORDS:
            pb = _to16(p, DT16, F16)
            oa0, oa1, oa2, oa3 = _pv4(pb, ka0, ka1, ka2, ka3, *_scale4(oa0, oa1, oa2, oa3, alpha))
            ob0, ob1, ob2, ob3 = _pv4(pb, kb0, kb1, kb2, kb3, *_scale4(ob0, ob1, ob2, ob3, alpha))
        elif S_CHAINS:
            pb = _to16(p, DT16, F16)
            acc0 = tl.dot(pb, kc0, acc0 * alpha[:, None])
            acc1 = tl.dot(pb, kc1, acc1 * alpha[:, None])
        elif MMA_FP8:
            acc = acc * alpha[:, None]
            ps = p * (2.0**PLOG)
            p_hi = _to_fp8(ps, FP8, FNUZ, INTERP)
            p_lo = _to_fp8(ps - p_hi.to(tl.float32), FP8, FNUZ, INTERP)
            acc = tl.dot(p_hi, kc, acc)
            acc = tl.dot(p_lo, kc, acc)
        else:
            acc = tl.dot(_to16(p, DT16, F16), kc, acc * alpha[:, None])
        m_i = m_new

    if MMA_FP8:
        out_scale = kv_scale * (2.0**(-PLOG))
    else:
        out_scale = kv_scale
    inv = _row_inv(l_i, out_scale)
    lse = _row_lse(m_i, l_i, row_c, row_cl)
    out_row = (pid_s.to(tl.int64) * T) * H + flat_row
    if WORDS:
        o_rows = o_ptr + out_row * DC
        _store4(o_rows, 0, DH // 4, oa0, oa1, oa2, oa3, inv, row_ok, INTERP)
        _store4(o_rows, DH, DH // 4, ob0, ob1, ob2, ob3, inv, row_ok, INTERP)
    elif S_CHAINS:
        o_rows = o_ptr + out_row[:, None] * DC
        tl.store(o_rows + offs_h[None, :], _to_bf16(acc0 * inv[:, None], INTERP), mask=row_ok[:, None])
        tl.store(o_rows + DH + offs_h[None, :], _to_bf16(acc1 * inv[:, None], INTERP), mask=row_ok[:, None])
    else:
        o = acc * inv[:, None]
        tl.store(o_ptr + out_row[:, None] * DC + offs_c[None, :], _to_bf16(o, INTERP), mask=row_ok[:, None])
    tl.store(lse_ptr + out_row, lse, mask=row_ok)


@triton.jit
def _merge_kernel(
    o_part_ptr, lse_part_ptr, o_ptr, lse_ptr,
    TH, S,
    BLOCK_S: tl.constexpr,  # splits loaded at once (a power of two; S > BLOCK_S loops over chunks)
    BLOCK_C: tl.constexpr,  # columns of the 512 a program owns (divides 512)
    INTERP_CHUNKS: tl.constexpr,  # interpreter: cdiv(S, BLOCK_S) as a constant (Triton 3.6's cannot loop to a runtime bound)
    INTERP: tl.constexpr,
):
    # One program per (row, column block); the column blocks of a row are adjacent in the grid
    # (they share the row's LSE reads through L2).  Each chunk of BLOCK_S splits is one
    # [BLOCK_S] LSE load and then one [BLOCK_S, BLOCK_C] o_part load (every split of the
    # chunk in flight at once), folded into an f32 [BLOCK_S, BLOCK_C] accumulator by the
    # online-softmax rescale; the split axis is reduced once at the end.
    DC: tl.constexpr = 512
    NCB: tl.constexpr = DC // BLOCK_C
    pid = tl.program_id(0)
    row = (pid // NCB).to(tl.int64)
    cb = pid % NCB
    offs_s = tl.arange(0, BLOCK_S)
    offs_c = cb * BLOCK_C + tl.arange(0, BLOCK_C)
    m = tl.full((), float("-inf"), tl.float32)
    l = tl.full((), 0.0, tl.float32)
    acc = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    for c in range(0, INTERP_CHUNKS if INTERP_CHUNKS > 0 else tl.cdiv(S, BLOCK_S)):
        s = c * BLOCK_S + offs_s
        base = s.to(tl.int64) * TH + row
        lse_s = tl.load(lse_part_ptr + base, mask=s < S, other=float("-inf"))
        live = lse_s > float("-inf")  # an empty split's o is not read (never NaN * 0)
        o_s = tl.load(o_part_ptr + base[:, None] * DC + offs_c[None, :],
                      mask=live[:, None], other=0.0).to(tl.float32)
        m_new = tl.maximum(m, tl.max(lse_s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        w = tl.exp(lse_s - m_safe)
        l = l * alpha + tl.sum(w, axis=0)
        acc = acc * alpha + o_s * w[:, None]
        m = m_new
    has = l > 0
    inv = tl.where(has, 1.0 / tl.where(has, l, 1.0), 0.0)
    o = tl.sum(acc, axis=0) * inv
    tl.store(o_ptr + row * DC + offs_c, _to_bf16(o, INTERP))
    lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
    tl.store(lse_ptr + row, lse, mask=cb == 0)


# ----------------------------------------------------------------------------------------------
# host side

def _split_f32(x: float):
    """x (a Python float) as (hi, lo) float32 values with hi + lo = x to ~2^-48 relative."""
    hi = float(torch.tensor(x, dtype=torch.float32))
    return hi, float(torch.tensor(x - hi, dtype=torch.float32))


def _mma_mode() -> str:
    mode = os.environ.get("KIMI_OPS_TRITON_MMA", DEFAULT_MMA)
    if mode not in ("fp8", "bf16"):
        raise ValueError(f"KIMI_OPS_TRITON_MMA must be 'fp8' or 'bf16', got {mode!r}")
    return mode


DEFAULT_MMA = "bf16"  # fp8 (the seeds' scheme) is slower and less accurate on sm_90: docs/perf-history.md


SMALL_PROGRAM_TOKENS = 512  # 16-row programs of fewer tokens keep one 8-warp program an SM (_config)
SHORT_PROGRAM_CONFIG = (16, 64, 8, 2)  # _config's 16-row short programs (the byte tile: _words)


def _config(rows_per_req: int, mma: str, tokens_a_program: int | None = None):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a request's qlen * H rows, whose programs
    cover ``tokens_a_program`` tokens on average (None: many).

    Chosen from ptxas's register report for sm_90 (scripts/cross_compile.py + ptxas -v) and
    scripts/sweep_triton_m1c.py on the GPU (docs/perf-history.md, session 52, an H100): the
    [BLOCK_M, 512] f32 accumulator and the gathered K tile must fit the registers.
    - Up to 16 rows: 32-token tiles, 4 warps, the words tile (:func:`_words`): 239 registers and
      55 KB of shared memory, so two programs share an SM (:data:`PROGRAMS_PER_SM`): 11-17%
      faster at qlen 1, 12 heads, batch 32-128 than one 64-token, 8-warp program an SM, 3-4% at
      batch 8 and one request of 64k. Programs of fewer than SMALL_PROGRAM_TOKENS tokens (batch
      1-4 of <= 8k) keep that 64-token, 8-warp program with the byte tile: 15.0 us at H12 B1 8k
      against 18.6.
    - Up to 32 rows (qlen 2): 64-token tiles, 8 warps, the words tile: 174.9 us at H12 B32 8k
      against 197.6 with 32 x 4 and 237 with the 32-token byte tile of before.
    - More rows: one 64-row block (it spills ~0.9 KB a thread, but measured 1.6-2.3x faster on
      the H200 than 32-row blocks that redo the K conversion per block)."""
    if mma == "bf16":
        if rows_per_req <= 16:
            if tokens_a_program is not None and tokens_a_program < SMALL_PROGRAM_TOKENS:
                return SHORT_PROGRAM_CONFIG
            return 16, 32, 4, 2
        if rows_per_req <= 32:
            return 32, 64, 8, 2
        return 64, 64, 8, 2
    bm = 16
    while bm < rows_per_req and bm < 64:
        bm *= 2
    return bm, 64, 8, 2


S_CHAINS_ENV = "KIMI_OPS_TRITON_S_CHAINS"


def _s_chains(mma: str) -> bool:
    """bf16: S as three independent MMA chains (``KIMI_OPS_TRITON_S_CHAINS=0`` turns it off)."""
    return mma == "bf16" and os.environ.get(S_CHAINS_ENV, "1") != "0"


F16_ENV = "KIMI_OPS_TRITON_F16"


def _f16_dots(mma: str, device: torch.device) -> bool:
    """bf16 mode: the dots take f16 operands where the GPU converts e4m3 to f16 in one instruction
    (NVIDIA sm_89 and later; ``KIMI_OPS_TRITON_F16=0``: bf16). A pair of e4m3 bytes becomes an
    f16x2 in one cvt.rn.f16x2.e4m3x2, where bf16 takes two more conversions (f16 -> bf16, one value
    an instruction, on the conversion pipe) and a pack; a bf16 q is scaled by a power of two into
    f16's range (the kernel). AMD keeps bf16 (the second generation runs there; gfx950 converts fp8
    to bf16 directly); the interpreter (CPU tensors) emulates the f16 roundings."""
    if mma != "bf16" or os.environ.get(F16_ENV, "1") == "0":
        return False
    if device.type != "cuda":
        return True
    return torch.version.hip is None and compute_capability(device_index(device)) >= (8, 9)


WORDS_ENV = "KIMI_OPS_TRITON_WORDS"


def _words(mma: str, bm: int, bn: int) -> bool:
    """The tile carried as int32 words, S / O split by byte (S_CHAINS with the prefetch, up to 32
    rows): by default but for 16-row programs of 64-token tiles (:func:`_config`'s short
    programs: a words program's q loads and conversions cost more than they save over a few
    tiles); ``KIMI_OPS_TRITON_WORDS=1`` / ``0`` forces it on / off. With the 32-token, 4-warp
    programs it is what fits two an SM (ptxas, Triton 3.8, sm_90a: 239 registers at 16 rows, where
    the byte tile takes 255 and spills 72 bytes)."""
    if not (_s_chains(mma) and _prefetch(mma, bm)):
        return False
    env = os.environ.get(WORDS_ENV, "")
    if env in ("0", "1"):
        return env == "1"
    return (bm, bn) != SHORT_PROGRAM_CONFIG[:2]


def _prefetch(mma: str, bm: int) -> bool:
    return mma == "bf16" and bm <= 32


def _interpreter_steps(kv_indptr: torch.Tensor, block_n: int) -> int:
    """Under the interpreter (CPU tensors, host reads are free): tiles of the longest request,
    a trip count every split's loop fits in. Compiled: 0 (the loop bound is computed on the device)."""
    if not interpreting() or kv_indptr.numel() < 2:
        return 0
    longest = int((kv_indptr[1:] - kv_indptr[:-1]).max())
    return max(1, -(-longest // block_n))


@triton.jit
def _fnuz_probe_kernel(x_ptr, y_ptr):
    # a block of pointers (Triton 3.6 fails on the splat of an e4m3fnuz pointer, not on a scalar load)
    offs = tl.arange(0, 2)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < 1, other=0.0).to(tl.float32), mask=offs < 1)


@functools.cache
def _interpreter_takes_fnuz() -> bool:
    x = torch.zeros(1, dtype=torch.float8_e4m3fnuz)
    y = torch.empty(1, dtype=torch.float32)
    try:
        _fnuz_probe_kernel[(1,)](x, y)
    except Exception:  # Triton 3.6: "fail to convert fp8e4b8 to ir type"
        return False
    return True


def native_fnuz() -> bool:
    """Whether a kernel here takes an e4m3fnuz tensor as such: on ROCm, and in an interpreter that
    knows the type (Triton 3.8's does; 3.6's raises "fail to convert fp8e4b8 to ir type", found
    by running a one-element probe). Elsewhere the launchers pass its bytes as uint8 and the
    kernels decode them."""
    if torch.version.hip is not None:
        return True
    return interpreting() and _interpreter_takes_fnuz()


def native_e4m3fn(device: torch.device) -> bool:
    """Whether a kernel on ``device`` takes an e4m3fn tensor as such: Triton has the type on ROCm,
    on NVIDIA sm_89 and later, and in the interpreter; on an older NVIDIA GPU (Ampere: "type
    fp8e4nv not supported in this architecture") the launchers pass its bytes."""
    if device.type != "cuda" or torch.version.hip is not None:
        return True
    return compute_capability(device_index(device)) >= (8, 9)


def _as_codes(x: torch.Tensor):
    """(tensor to pass, BYTES) for an fp8 tensor: the tensor itself where the backend has its type
    (NATIVE), else a uint8 view of its codes (FN_BYTES / FNUZ_BYTES)."""
    if x.dtype == torch.float8_e4m3fn:
        return (x, NATIVE) if native_e4m3fn(x.device) else (x.view(torch.uint8), FN_BYTES)
    assert x.dtype == torch.float8_e4m3fnuz, x.dtype
    return (x, NATIVE) if native_fnuz() else (x.view(torch.uint8), FNUZ_BYTES)


def _kv_mode(kv_rows: torch.Tensor):
    """(tensor to pass, KV_BYTES, FNUZ)."""
    if kv_rows.dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        raise TypeError(f"kv_rows must be float8_e4m3fn or float8_e4m3fnuz, got {kv_rows.dtype}")
    kv, kv_bytes = _as_codes(kv_rows)
    return kv, kv_bytes, kv_rows.dtype == torch.float8_e4m3fnuz


def _launch_shape(q, kv_rows, kv_indptr, kv_indices, qlen: int, num_splits: int):
    """The launchers' own checks of the M1c arguments (both generations; the ops check them
    first, with messages): (T, H, R) of q [T, H, 576] with T = R * qlen."""
    assert q.dim() == 3 and q.shape[2] == KV_ROW and q.is_contiguous()
    assert kv_rows.dim() == 2 and kv_rows.shape[1] == KV_ROW and kv_rows.is_contiguous()
    assert kv_indptr.dtype == torch.int32 and kv_indices.dtype == torch.int32
    assert num_splits >= 1 and qlen >= 1
    T, H, _ = q.shape
    assert T % qlen == 0
    R = T // qlen
    assert kv_indptr.shape[0] == R + 1
    return T, H, R


def _tokens_a_program(num_tokens: int, num_requests: int, num_splits: int) -> int:
    """Tokens in a split of a request of average length (before ``_program_rows`` rounds the
    chunk up to whole tiles)."""
    return -(-(num_tokens // max(num_requests, 1)) // num_splits)


def _tiles_a_program(num_tokens: int, num_requests: int, num_splits: int, block_n: int) -> int:
    """BLOCK_N tiles in a split of a request of average length (``_program_rows``' chunk)."""
    return -(-_tokens_a_program(num_tokens, num_requests, num_splits) // block_n)


def _partials(S: int, T: int, H: int, device):
    """M1c's outputs, unwritten: (o_part [S, T, H, 512] bf16, lse_part [S, T, H] f32)."""
    return (torch.empty((S, T, H, KV_LORA_RANK), dtype=torch.bfloat16, device=device),
            torch.empty((S, T, H), dtype=torch.float32, device=device))


def _q_mode(q: torch.Tensor, q_scale):
    """(tensor to pass, Q_FP8, Q_BYTES) for a bf16 q, or an fp8 q with its q_scale."""
    if q.dtype == torch.bfloat16:
        assert q_scale is None, "a bf16 q takes no q_scale"
        return q, False, NATIVE
    assert q.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz), q.dtype
    assert q_scale is not None and q_scale.numel() == 1 and q_scale.dtype == torch.float32
    q_arg, q_bytes = _as_codes(q)
    return q_arg, True, q_bytes


def mla_decode_splitkv(q, kv_rows, kv_indptr, kv_indices, qlen: int, scale: float, kv_scale: float,
                       num_splits: int, seq_lens=None, dcp_rank: int = 0, dcp_world_size: int = 1,
                       zero_empty: bool = True, q_scale=None):
    """M1c. q [T, H, 576] bf16 (or fp8 with ``q_scale``, a float32 [1] device tensor), kv_rows [N, 576]
    fp8 -> (o_part [S, T, H, 512] bf16, lse_part [S, T, H] f32).

    ``seq_lens`` [R] int32 (global lengths), ``dcp_rank`` / ``dcp_world_size``: decode context
    parallel, as :func:`kimi_ops.mla_decode_splitkv` documents. ``zero_empty=False`` permits
    leaving an empty split's o unwritten (see :func:`kimi_ops.kernels.sm90.mla_decode_splitkv`); this
    kernel writes it anyway."""
    T, H, R = _launch_shape(q, kv_rows, kv_indptr, kv_indices, qlen, num_splits)
    q_arg, q_fp8, q_bytes = _q_mode(q, q_scale)
    S = int(num_splits)
    o_part, lse_part = _partials(S, T, H, q.device)
    if T == 0:
        return o_part, lse_part
    kv, kv_bytes, fnuz = _kv_mode(kv_rows)
    mma = "bf16" if kv_bytes else _mma_mode()
    bm, bn, warps, stages = _config(qlen * H, mma, _tokens_a_program(kv_indices.shape[0], R, S))
    grid = (triton.cdiv(qlen * H, bm), S, R)
    indices = kv_indices if kv_indices.numel() > 0 else kv_indptr  # never dereferenced when empty
    _split_kv_kernel[grid](
        q_arg, kv, kv_indptr, indices, seq_lens if seq_lens is not None else kv_indptr, o_part, lse_part,
        q_scale if q_fp8 else lse_part,  # never read without an fp8 q
        T, H, kv_rows.shape[0], qlen, S, dcp_rank, dcp_world_size,
        *_split_f32(float(scale) * float(kv_scale)), float(kv_scale),
        Q_FP8=q_fp8, Q_BYTES=q_bytes, MMA_FP8=(mma == "fp8"), KV_BYTES=kv_bytes, FNUZ=fnuz, INTERP=interpreting(),
        BLOCK_M=bm, BLOCK_N=bn, PREFETCH=_prefetch(mma, bm), GLOBAL_LENS=seq_lens is not None,
        INTERP_STEPS=_interpreter_steps(kv_indptr, bn), S_CHAINS=_s_chains(mma),
        F16=_f16_dots(mma, q.device), WORDS=_words(mma, bm, bn),
        num_warps=warps, num_stages=stages,
    )
    return o_part, lse_part


MERGE_TILE = 4096        # o_part elements a program loads per chunk: 8 KB of bf16
MERGE_MAX_SPLITS = 64   # splits a chunk holds at most (S > 64 loops)
MERGE_MIN_COLS = 64     # a split's row segment: 128 bytes, one full cache line
MERGE_PROGRAMS = 264    # shrink the column block until about 2 programs an SM (132 on the H200)


def _merge_config(S: int, TH: int):
    """(BLOCK_S, BLOCK_C, num_warps) for merging S splits of TH rows.

    The merge streams S * TH * 1 KB of o_part once; it is bound by how many bytes are in
    flight, not by arithmetic.  A program owns one row's BLOCK_C columns and loads a chunk of
    BLOCK_S splits as one [BLOCK_S, BLOCK_C] tile of at most MERGE_TILE elements (8 KB), all
    splits of the chunk in flight at once.  num_warps = tile / 1024 (1..4): a thread holds
    up to 32 elements, four 16-byte loads.  ptxas (sm_90a) reports 34-96 registers, no
    spills (96 for the 64 x 64 tile: 5 programs an SM, 40 KB in flight an SM, ~5 MB on 132
    SMs; the 2 KB tiles of S <= 2 fit 16-32 one-warp programs an SM), above the ~3-4 MB that
    Little's law asks of 4.3 TB/s at ~1 us of latency.  Small TH (batch 1: 12 rows) narrows
    the column block (down to 64 columns, a 128-byte line a split) so that the grid still
    spreads over the SMs: at that size the merge is one LSE read and one o_part read deep.
    """
    bs = min(triton.next_power_of_2(max(S, 1)), MERGE_MAX_SPLITS)
    bc = max(MERGE_MIN_COLS, min(KV_LORA_RANK, MERGE_TILE // bs))
    while bc > MERGE_MIN_COLS and TH * (KV_LORA_RANK // bc) < MERGE_PROGRAMS:
        bc //= 2
    warps = max(1, min(4, bs * bc // 1024))
    return bs, bc, warps


def mla_merge(o_part, lse_part):
    """M1b. o_part [S, T, H, 512] bf16, lse_part [S, T, H] f32 -> (o [T, H, 512] bf16, lse [T, H] f32)."""
    assert o_part.dim() == 4 and o_part.shape[3] == KV_LORA_RANK and o_part.is_contiguous()
    assert lse_part.shape == o_part.shape[:3] and lse_part.dtype == torch.float32 and lse_part.is_contiguous()
    S, T, H, _ = o_part.shape
    o = torch.empty((T, H, KV_LORA_RANK), dtype=torch.bfloat16, device=o_part.device)
    lse = torch.empty((T, H), dtype=torch.float32, device=o_part.device)
    TH = T * H
    if TH == 0:
        return o, lse
    bs, bc, warps = _merge_config(S, TH)
    _merge_kernel[(TH * (KV_LORA_RANK // bc),)](
        o_part, lse_part, o, lse, TH, S, BLOCK_S=bs, BLOCK_C=bc,
        INTERP_CHUNKS=triton.cdiv(S, bs) if interpreting() else 0,
        INTERP=interpreting(), num_warps=warps, num_stages=1)
    return o, lse


MAX_SPLITS = 256  # suggest_num_splits' cap (the merge loops over chunks of MERGE_MAX_SPLITS)


PROGRAMS_PER_SM = {4: 2, 8: 1}  # num_warps -> programs an SM holds (registers, shared memory)
# suggest_num_splits' cost of an SM's programs, in tiles: (a tile's time, a program's fixed
# time) with one program an SM, and with two (16 rows). Fitted on an H100, session 52 (32
# tokens, 4 warps: H12 q1 B8 / B32 / B128 8k at 1x / 2x / 3x the splits)
ONE_A_SM = (1.0, 8.0)
TWO_A_SM = {16: (1.55, 14.0)}


def suggest_num_splits(num_requests: int, qlen: int, num_heads: int, num_tokens: int,
                       num_sms: int = 132) -> int:
    """A split count from shapes only (never device data): the one whose programs finish first
    by the cost model below, no split shorter than 128 tokens on average, at most MAX_SPLITS.

    Cost model: one program an SM runs a BLOCK_N tile in one unit and has a fixed cost (its
    start, its partials and their merge) of ONE_A_SM[1]; where a configuration holds two programs
    an SM (:data:`PROGRAMS_PER_SM`) and the grid needs the second, each of the two runs a tile in
    TWO_A_SM[BLOCK_M][0] units (1.55: two 16-row programs do 1.29x the work of one) and pays
    TWO_A_SM[BLOCK_M][1]. Programs beyond the SMs' slots run in later waves. (8-warp programs:
    one an SM, a call takes waves x (tiles + 1), fitted on the H200 in session 29.) The split
    count is chosen for the configuration of many tokens; where its programs come out short
    (:data:`SMALL_PROGRAM_TOKENS`) the launcher runs them as one 64-token, 8-warp program an SM
    (:func:`_config`), at the same count (H12 B1 8k: 64 splits, 15.0 us on the H100).
    A split's chunk is ceil(n / S) rounded up to whole tiles (``_program_rows``), so a request
    may use fewer than S splits. Ties go to fewer splits."""
    if num_requests <= 0:
        return 1
    bm, bn, warps = _config(qlen * num_heads, _mma_mode())[:3]
    per_sm = PROGRAMS_PER_SM.get(warps, 1)
    base = num_requests * -(-qlen * num_heads // bm)  # programs a split
    avg = max(1, num_tokens // num_requests)
    cap = max(1, min(avg // 128, MAX_SPLITS))  # 128: H12 B1 8k q1 14.2 us at 64 splits, 22.0 at 32

    def cost(splits):
        tiles = _tiles_a_program(avg, 1, splits, bn)
        programs = base * -(-avg // (tiles * bn))
        if per_sm == 1:
            return -(-programs // num_sms) * (tiles + 1)
        rate, fixed = ONE_A_SM if programs <= num_sms else TWO_A_SM[bm]
        return -(-programs // (per_sm * num_sms)) * (tiles * rate + fixed)

    return min(range(1, cap + 1), key=lambda s: (cost(s), s))


# ----------------------------------------------------------------------------------------------
# cross-compilation registry (scripts/cross_compile.py)

def _specs():
    specs = []
    sig_common = {"indptr_ptr": "*i32", "indices_ptr": "*i32", "seq_lens_ptr": "*i32", "o_ptr": "*bf16",
                  "lse_ptr": "*fp32", "q_scale_ptr": "*fp32", "T": "i32", "H": "i32", "N": "i32", "qlen": "i32", "num_splits": "i32",
                  "dcp_rank": "i32", "dcp_world_size": "i32",
                  "c_hi": "fp32", "c_lo": "fp32", "kv_scale": "fp32"}
    # (mode, rows, a program's tokens): every configuration _config gives the launcher, 16 rows'
    # short programs (64-token tiles, 8 warps, the byte tile) among them
    variants = [("bf16", 16, None), ("bf16", 16, 0), ("bf16", 32, None), ("bf16", 64, None),
                ("fp8", 16, None), ("fp8", 32, None), ("fp8", 64, None)]
    for mma, rows, tokens in variants:
        bm, bn, warps, stages = _config(rows, mma, tokens)
        for fmt in ("fn", "fnuz", "u8fnuz", "u8fn"):
            if fmt.startswith("u8") and mma == "fp8":
                continue  # fp8 codes take bf16 dots
            kvt = {"fn": "*fp8e4nv", "fnuz": "*fp8e4b8", "u8fnuz": "*u8", "u8fn": "*u8"}[fmt]
            # u8fnuz: e4m3fnuz on NVIDIA; u8fn: e4m3fn on NVIDIA before sm_89 (native_e4m3fn)
            all_targets = {"fn": ("gfx950", "gfx942", "sm90"), "fnuz": ("gfx942",),
                           "u8fnuz": ("sm90", "sm80"), "u8fn": ("sm80",)}[fmt]
            kv_bytes = {"u8fnuz": FNUZ_BYTES, "u8fn": FN_BYTES}.get(fmt, NATIVE)
            for f16 in (False, True):  # the f16 dots are NVIDIA sm_89+'s (_f16_dots): sm90 here
                targets = tuple(t for t in all_targets if (t == "sm90") == f16)
                if not targets:
                    continue
                sig = {"q_ptr": "*bf16", "kv_ptr": kvt, **sig_common}
                words = _words(mma, bm, bn)
                cx = {"Q_FP8": False, "Q_BYTES": NATIVE, "MMA_FP8": mma == "fp8", "KV_BYTES": kv_bytes,
                      "FNUZ": "fnuz" in fmt, "INTERP": False, "BLOCK_M": bm, "BLOCK_N": bn,
                      "PREFETCH": _prefetch(mma, bm), "GLOBAL_LENS": False, "INTERP_STEPS": 0,
                      "S_CHAINS": _s_chains(mma), "F16": f16 and mma == "bf16", "WORDS": words}
                for kk in cx:
                    sig[kk] = "constexpr"
                name = f"splitkv_{mma}_{fmt}_m{bm}" + ("_short" if tokens == 0 else "")
                specs.append(dict(name=name, kernel=_split_kv_kernel, signature=sig, constexprs=cx,
                                  num_warps=warps, num_stages=stages, targets=targets))
                if fmt in ("fn", "u8fn") and mma == "bf16":
                    # the fp8 query (issue 28): e4m3fn (its codes on sm80), converted exactly in registers
                    specs.append(dict(name=f"{name}_q8", kernel=_split_kv_kernel,
                                      signature={**sig, "q_ptr": "*fp8e4nv" if fmt == "fn" else "*u8"},
                                      constexprs={**cx, "Q_FP8": True, "Q_BYTES": kv_bytes},
                                      num_warps=warps, num_stages=stages, targets=targets))
    # every (BLOCK_S, BLOCK_C, num_warps) _merge_config can return
    merge_cfgs = sorted({_merge_config(S, TH) for S in (1, 2, 4, 8, 16, 32, 64, 65)
                         for TH in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)})
    for bs, bc, warps in merge_cfgs:
        specs.append(dict(name=f"merge_s{bs}_c{bc}", kernel=_merge_kernel,
                          signature={"o_part_ptr": "*bf16", "lse_part_ptr": "*fp32", "o_ptr": "*bf16",
                                     "lse_ptr": "*fp32", "TH": "i32", "S": "i32", "BLOCK_S": "constexpr",
                                     "BLOCK_C": "constexpr", "INTERP_CHUNKS": "constexpr",
                                     "INTERP": "constexpr"},
                          constexprs={"BLOCK_S": bs, "BLOCK_C": bc, "INTERP": False, "INTERP_CHUNKS": 0},
                          num_warps=warps, num_stages=1))
    return specs


CROSS_COMPILE_SPECS = _specs()
