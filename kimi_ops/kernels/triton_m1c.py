"""Triton M1c, second generation: token-major split-KV MLA decode, the Triton M1c of AMD GPUs.

``mla_decode_splitkv``: one program per (row block, split, request), as the first generation
(:mod:`kimi_ops.kernels.attention`), but the products run token-major:

    S^T [BLOCK_N, BLOCK_M] = K [BLOCK_N, 576] . Q^T [576, BLOCK_M]      (tokens are the MMA's M)
    O^T [512, BLOCK_M]    += V^T [512, BLOCK_N] . P^T [BLOCK_N, BLOCK_M] (V = K[:, :512])

so a block of 16 query rows (12 heads fit one) is the MMA's N and are never padded to the
64 rows of a wgmma's M; the tokens of a tile (64 on sm_90, 32 on AMD) fill M.  The gathered
K tile is loaded once, converted to bf16 once (exact: E4M3 is a subset of bf16) and is the
operand of both products (Triton stages it through shared memory / LDS for the second,
transposed, read).  A request's ``qlen * H`` rows are cut into row blocks of BLOCK_M; the
row blocks of one (split, request) are adjacent in the grid, so the split's KV chunk comes
from HBM once and from L2 for the other blocks.

Where it runs (:func:`kernel_for`, ``KIMI_OPS_TRITON_KERNEL``): on AMD (gfx950 / gfx942) and in
the interpreter. On NVIDIA the launcher keeps the first generation: on the H200 (2026-12-03,
Triton 3.6) this kernel measured 105.5 us at H12 B8 8k q1 and 381.6 us at H12 B32 8k q1
against the first generation's 60.5 / 210.5 us in the session's baseline (ptxas: 255 registers and an 832-byte stack
at 16 rows x 64 tokens, 4 warps).

Registers (AMD): O^T is ``DV * BLOCK_M * 4`` bytes a program.  With 16 rows a program and
``vsplit`` 2 (two programs a row block, each computing all of S and half of O^T, the K tile
read by both from L2) and the next tile's fp8 bytes (and the indices of the one after) loaded
into registers while a tile computes (``prefetch``; Triton's own 2-stage pipelining of the
gathered tile took 40 VGPRs more on gfx950 and, with fp8 dots, 317 + 61 AGPRs), gfx950
(32-token tiles, 4 waves) needs 214 VGPRs (164 with an fp8 q's fp8 dots) and gfx942 (16-token
tiles, 8 waves) 176-198 (142), no spills, 2-3 waves a SIMD (scripts/cross_compile.py; every
one-program-a-row-block configuration of 16-64 tokens x 2-8 waves, and 32-row blocks, spilled
or dropped to 1 wave).  Triton's LDS is dynamic
(``metadata.shared``: 16384 / 8192 bytes), so the code object's group segment reads 0.  The
configuration of each architecture is one table, :data:`CONFIGS`, read by the launcher and by
the cross-compile specs alike.

Numerics: bf16 x bf16 dots with f32 accumulation (but S of an fp8 q on AMD, below).  The seeds'
fp8 hi + lo scheme is not taken on AMD: the AMD material found (the ROCm blog "Matrix Core
Programming on AMD CDNA3 and CDNA4 architecture", rocm.blogs.amd.com/software-tools-optimization/
matrix-cores-cdna) says the MFMA's output matrix is stored in FP32 "to minimize accuracy loss
during accumulation" but states nothing about how the fp8 products are summed inside an
instruction (alignment, truncation), and sm_90's fp8 MMA is known to keep ~14 bits there; the
first generation's fp8 variant failed the lse contract on sm_90 for that reason.  S is the sum
of independent partial products (256 + 256 + 64 channels with vsplit 2) added in f32, since a
matrix unit's chained accumulation may truncate.  The softmax keeps its running max in raw dot
units (``d = q . k``), ``p = 2^((d - m) * c * log2 e)``, and the row's lse ``m * c + ln l`` is
formed at the end with ``c = scale * kv_scale [* q_scale]`` carried as a hi + lo pair and the
product's rounding error recovered by an FMA.

fp8 query (issue 28): ``q`` float8_e4m3fn (or e4m3fnuz with an e4m3fnuz cache) with a float32
1-element ``q_scale`` tensor; ``q_scale`` joins ``c``: ``s = scale * kv_scale * q_scale * (q8 .
k8)``.  Where the target's fp8 MFMA takes the pair's format (``Config.fp8_qk``: gfx950 e4m3fn,
16x16x128 f8f6f4; gfx942 e4m3fnuz, 16x16x32 fp8) S^T is fp8 x fp8 dots on the bytes as loaded:
no conversion of q, of the rope channels or of the other program's half, and half the MMA
cycles of S (P V^T stays bf16).  That product is the seeds' own (their M1c runs K's fp8 bytes
against Q's fp8 hi and lo on the same f8f6f4 MFMA for a bf16-level result); here it has never
run on an AMD GPU: ``KIMI_OPS_TRITON_FP8_DOTS=0`` returns to bf16 dots, converting q exactly.
Elsewhere (NVIDIA, the e4m3fn cache on gfx942, bytes decoded in the kernel) q is converted to
bf16 in the kernel, exactly.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..device import is_sm90
from . import interpreting
from .attention import (FNUZ_BYTES, NATIVE, _as_codes, _fp8_to16, _interpreter_steps, _kv_mode, _launch_shape,
                        _partials, _program_rows, _row_inv, _row_lse, _score_scale, _split_f32, _to_bf16)
from .attention import mla_merge  # noqa: F401  (the M1b of this backend: one merge for both generations)

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _tile_indices(indices_ptr, start, tok, hi):
    """The cache rows of tokens ``tok`` of the split ending at ``hi`` (-1 past it)."""
    return tl.load(indices_ptr + start + tok, mask=tok < hi, other=-1)


@triton.jit
def _load_tile(kv_ptr, idx, N, offs_c, offs_x, offs_p, VSPLIT: tl.constexpr):
    """The fp8 bytes of cache rows ``idx``: (channels offs_c, the other half offs_x (VSPLIT 2;
    else offs_c's again, unused), rope); an index outside [0, N) (a token past the split: -1)
    reads zeros."""
    D: tl.constexpr = 576
    idx = idx.to(tl.int64)
    ld_ok = ((idx >= 0) & (idx < N))[:, None]
    krow = (kv_ptr + idx * D)[:, None]
    kc = tl.load(krow + offs_c[None, :], mask=ld_ok, other=0.0)
    kp = tl.load(krow + 512 + offs_p[None, :], mask=ld_ok, other=0.0)
    if VSPLIT == 2:
        kx = tl.load(krow + offs_x[None, :], mask=ld_ok, other=0.0)
    else:
        kx = kc
    return kc, kp, kx


@triton.jit
def _splitkv_tm_kernel(
    q_ptr, q_scale_ptr, kv_ptr, indptr_ptr, indices_ptr, seq_lens_ptr, o_ptr, lse_ptr,
    T, H, N, qlen, num_splits, dcp_rank, dcp_world_size,
    c_hi, c_lo,  # scale * kv_scale as hi + lo f32 (c_hi + c_lo = the f64 product to ~2^-48)
    kv_scale,
    HAS_QSCALE: tl.constexpr,   # q is fp8 and q_scale_ptr holds its float32 scale
    Q_BYTES: tl.constexpr,      # 0: q as its type; 1 / 2: e4m3fn / e4m3fnuz codes (decoded in the kernel)
    FP8_QK: tl.constexpr,       # S^T = K Q^T as fp8 x fp8 dots (an fp8 q of the cache's fp8 type)
    KV_BYTES: tl.constexpr,     # 0: the cache as its type; 1 / 2: e4m3fn / e4m3fnuz codes (decoded)
    INTERP: tl.constexpr,
    BLOCK_M: tl.constexpr,      # query rows a program (the MMA's N)
    BLOCK_N: tl.constexpr,      # tokens a tile (the MMA's M)
    GLOBAL_LENS: tl.constexpr,
    INTERP_STEPS: tl.constexpr,
    VSPLIT: tl.constexpr,       # programs sharing a row block's 512 output channels (1 or 2)
    PREFETCH: tl.constexpr,     # the next tile's bytes are loaded while this one computes
):
    DC: tl.constexpr = 512
    DV: tl.constexpr = 512 // VSPLIT
    DP: tl.constexpr = 64
    D: tl.constexpr = 576
    pid_m = tl.program_id(0) // VSPLIT
    pid_v = tl.program_id(0) % VSPLIT   # this program's channels: [pid_v * DV, pid_v * DV + DV)
    pid_s = tl.program_id(1)
    pid_r = tl.program_id(2)

    start, flat_row, row_ok, lim, lo, hi = _program_rows(
        indptr_ptr, seq_lens_ptr, pid_m, pid_s, pid_r, H, qlen, num_splits, dcp_rank, dcp_world_size,
        BLOCK_M, BLOCK_N, GLOBAL_LENS)

    if INTERP:
        DT16: tl.constexpr = tl.float32  # the interpreter multiplies bf16 as integers
    else:
        DT16: tl.constexpr = tl.bfloat16

    offs_c = pid_v * DV + tl.arange(0, DV)      # the output channels (also V's)
    offs_x = (1 - pid_v) * DV + tl.arange(0, DV)  # VSPLIT 2: the other half (S only)
    offs_p = tl.arange(0, DP)
    offs_n = tl.arange(0, BLOCK_N)
    # Q^T [576, BLOCK_M], loaded once (bf16, or fp8 converted exactly)
    q_rows = q_ptr + flat_row[None, :] * D
    qcT = tl.load(q_rows + offs_c[:, None], mask=row_ok[None, :], other=0.0)
    qpT = tl.load(q_rows + DC + offs_p[:, None], mask=row_ok[None, :], other=0.0)
    if not FP8_QK:
        qcT = _fp8_to16(qcT, Q_BYTES, DT16)
        qpT = _fp8_to16(qpT, Q_BYTES, DT16)
    if VSPLIT == 2:
        qxT = tl.load(q_rows + offs_x[:, None], mask=row_ok[None, :], other=0.0)
        if not FP8_QK:
            qxT = _fp8_to16(qxT, Q_BYTES, DT16)

    # |c| = |scale * kv_scale [* q_scale]| as hi + lo, its sign; the scores' base-2 factor
    ch, cl, sgn = _score_scale(c_hi, c_lo, q_scale_ptr, HAS_QSCALE)
    rs = ch * 1.4426950408889634

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")  # running max of d = q . k
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    accT = tl.zeros([DV, BLOCK_M], dtype=tl.float32)

    if PREFETCH:
        # the next tile's fp8 bytes, and the indices of the one after, in flight (registers)
        # while this one computes
        k8_nx, kp_nx, kx_nx = _load_tile(kv_ptr, _tile_indices(indices_ptr, start, lo + offs_n, hi), N,
                                         offs_c, offs_x, offs_p, VSPLIT)
        idx_nx = _tile_indices(indices_ptr, start, lo + BLOCK_N + offs_n, hi)
    for step in range(0, INTERP_STEPS if INTERP_STEPS > 0 else tl.cdiv(hi - lo, BLOCK_N)):
        tok = lo + step * BLOCK_N + offs_n
        tok_ok = tok < hi
        if PREFETCH:
            k8, kp, kx = k8_nx, kp_nx, kx_nx
            k8_nx, kp_nx, kx_nx = _load_tile(kv_ptr, idx_nx, N, offs_c, offs_x, offs_p, VSPLIT)
            idx_nx = _tile_indices(indices_ptr, start, tok + 2 * BLOCK_N, hi)
        else:
            k8, kp, kx = _load_tile(kv_ptr, _tile_indices(indices_ptr, start, tok, hi), N, offs_c, offs_x,
                                    offs_p, VSPLIT)
        kc = _fp8_to16(k8, KV_BYTES, DT16)   # V^T's operand (and K's, unless FP8_QK)
        if not FP8_QK:
            k8 = kc
            kp = _fp8_to16(kp, KV_BYTES, DT16)
        # S^T in raw dot units [BLOCK_N, BLOCK_M], as independent partial products added in
        # f32 (RNE): an MMA's chained accumulation truncates its running sum, so one long
        # chain's error grows with |s| (the lse of large scores); short chains bound it
        d = tl.dot(k8, qcT)
        if VSPLIT == 2:
            if not FP8_QK:
                kx = _fp8_to16(kx, KV_BYTES, DT16)
            dx = tl.dot(kx, qxT)
            dp = tl.dot(kp, qpT)
            # the same sum in both programs, channels [0, 256) + ([256, 512) + rope): each one's
            # o half is then normalized by the same l, and the lse they store is the same bits
            # (summed own-half-first, the two differed in the last bit and raced: H200, m1c)
            d = tl.where(pid_v == 0, d + (dx + dp), dx + (d + dp))
        else:
            d = d + tl.dot(kp, qpT)
        vis = tok_ok[:, None] & (tok[:, None] < lim[None, :])
        d = tl.where(vis, d * sgn, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(d, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        # (a zero scale: -inf * 0 would be NaN, so masked scores and an empty start are selected)
        alpha = tl.where(m_i == float("-inf"), 0.0, tl.exp2((m_i - m_safe) * rs))
        p = tl.where(vis, tl.exp2((d - m_safe[None, :]) * rs), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        accT = accT * alpha[None, :]
        accT = tl.dot(tl.trans(kc), p.to(DT16), accT)    # O^T += V^T P^T
        m_i = m_new

    oT = accT * _row_inv(l_i, kv_scale)[None, :]
    lse = _row_lse(m_i, l_i, ch, cl)  # m * c + ln l, the product's rounding error added back
    out_row = (pid_s.to(tl.int64) * T) * H + flat_row
    tl.store(o_ptr + out_row[None, :] * DC + offs_c[:, None], _to_bf16(oT, INTERP), mask=row_ok[None, :])
    tl.store(lse_ptr + out_row, lse, mask=row_ok & (pid_v == 0))  # VSPLIT 2: one program stores it


# ----------------------------------------------------------------------------------------------
# the per-architecture table (launcher and cross-compile alike)

class Config(NamedTuple):
    max_rows: int      # the entry serves requests of up to this many qlen * H rows (the last: any)
    block_m: int       # rows a program (a row block)
    block_n: int       # tokens a tile
    num_warps: int
    num_stages: int
    vsplit: int = 1    # programs sharing a row block's 512 output channels (each does all of S)
    amd_options: tuple = ()  # extra AMD compile options, (name, value) pairs
    prefetch: bool = False  # the next tile's fp8 bytes loaded (into registers) during this one
    fp8_qk: tuple = ()  # cache formats ("fn", "fnuz") whose fp8 q of the same type takes fp8 dots for S


# arch -> entries by max_rows (ascending; the last entry takes every larger row count: more
# row blocks).  Chosen from the cross-compiled code objects (scripts/cross_compile.py): no
# VGPR / register spill, at least 2 waves a SIMD on AMD.
CONFIGS: dict[str, tuple[Config, ...]] = {
    # sm_90: a program does all of S and half of O (vsplit 2), 32-token tiles, 8 warps: ptxas
    # (scripts/cross_compile.py, 2026-12-03) 170-174 registers, 0 spills on the e4m3fn cache, where
    # the earlier (16 rows, 64 tokens, 4 warps, vsplit 1) spilled ~1 KB; timed on the H200 2.8-8x
    # slower than the first generation, which NVIDIA runs by default (KIMI_OPS_TRITON_KERNEL). No
    # fp8 dots: sm_90's fp8 MMA missed the lse contract (the first generation's fp8 variant)
    "sm90": (Config(1 << 30, 16, 32, 8, 2, vsplit=2),),
    "nvidia": (Config(1 << 30, 16, 64, 4, 2),),  # Ampere / Ada / Blackwell: mma.sync, same tiles
    # gfx950: a program does all of S and half of O (vsplit 2), the next tile in registers: 214
    # VGPRs (bf16 dots; 254 with Triton's 2-stage pipelining instead), 164 with the fp8 q's
    # 16x16x128 f8f6f4 dots (3 waves); 0 spills
    "gfx950": (Config(1 << 30, 16, 32, 4, 1, vsplit=2, prefetch=True, fp8_qk=("fn",)),),
    # gfx942: the same with 16-token tiles and 8 waves: 176-198 VGPRs, 2 waves (every
    # one-program-a-row-block config of 16-64 tokens x 2-8 waves spills or runs 1 wave); an
    # e4m3fnuz q against the e4m3fnuz cache takes 16x16x32 fp8 dots (142 VGPRs, 3 waves); gfx942's
    # MFMA has no e4m3fn, where Triton would widen to f16 dots (236 VGPRs): bf16 dots there
    "gfx942": (Config(1 << 30, 16, 16, 8, 1, vsplit=2, prefetch=True, fp8_qk=("fnuz",)),),
    # the interpreter: both program shapes (vsplit 1 and 2), with and without the prefetch and
    # the fp8 dots
    "interp": (Config(16, 16, 16, 4, 1),
               Config(1 << 30, 16, 32, 4, 1, vsplit=2, prefetch=True, fp8_qk=("fn", "fnuz"))),
}


def arch_of(device: torch.device) -> str:
    """The CONFIGS key of ``device``: ``interp`` (CPU tensors, the interpreter), ``gfx950`` /
    ``gfx942`` (ROCm; other AMD chips take gfx942's), ``sm90`` or ``nvidia``."""
    if device.type != "cuda" or interpreting():
        return "interp"
    try:
        if torch.version.hip is not None:
            name = getattr(torch.cuda.get_device_properties(device), "gcnArchName", "")
            return "gfx950" if name.startswith("gfx950") else "gfx942"
        return "sm90" if is_sm90(device) else "nvidia"
    except (RuntimeError, AssertionError):  # no such device here (shape-only callers)
        return "gfx942" if torch.version.hip is not None else "nvidia"


KERNEL_ENV = "KIMI_OPS_TRITON_KERNEL"


def kernel_for(arch: str) -> str:
    """Which Triton M1c the launcher runs on ``arch``: ``"m1c"`` (this module) or ``"first"``
    (:mod:`kimi_ops.kernels.attention`, the row-major first generation).

    ``KIMI_OPS_TRITON_KERNEL`` = ``auto`` (default) | ``m1c`` | ``first``. auto: the first
    generation on NVIDIA GPUs (sm_90 and the rest: on the H200 it ran 1.7-6x faster than this
    kernel, 2026-12-03, docs/PERF.md), this kernel on AMD (gfx950 / gfx942: the first
    generation spills there, this one does not) and in the interpreter."""
    choice = os.environ.get(KERNEL_ENV, "auto").strip().lower() or "auto"
    if choice not in ("auto", "m1c", "first"):
        raise ValueError(f"{KERNEL_ENV} must be auto, m1c or first, got {choice!r}")
    if choice != "auto":
        return choice
    return "first" if arch in ("sm90", "nvidia") else "m1c"


def pick_config(arch: str, rows_per_req: int) -> Config:
    for cfg in CONFIGS[arch]:
        if rows_per_req <= cfg.max_rows:
            return cfg
    return CONFIGS[arch][-1]


FP8_DOTS_ENV = "KIMI_OPS_TRITON_FP8_DOTS"
_FORMAT = {torch.float8_e4m3fn: "fn", torch.float8_e4m3fnuz: "fnuz"}


def takes_fp8_dots(cfg: Config, q_dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether an fp8 q of ``q_dtype`` against a cache of ``kv_dtype`` runs S^T = K Q^T as fp8 x
    fp8 dots under ``cfg``: q of the cache's own fp8 type, a format the target's fp8 MMA takes
    (``cfg.fp8_qk``), and ``KIMI_OPS_TRITON_FP8_DOTS`` not ``0`` (read at each launch)."""
    if os.environ.get(FP8_DOTS_ENV, "1").strip() == "0":
        return False
    return q_dtype == kv_dtype and _FORMAT.get(q_dtype) in cfg.fp8_qk


def _q_mode(q: torch.Tensor, q_scale, kv_dtype):
    """(tensor to pass, HAS_QSCALE, Q_BYTES) after checking the q / q_scale pair."""
    if q.dtype == torch.bfloat16:
        if q_scale is not None:
            raise ValueError("mla_decode_splitkv: q_scale is only for an fp8 q; q is bfloat16")
        return q, False, NATIVE
    if q.dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        raise TypeError(f"mla_decode_splitkv: q must be bfloat16 or float8_e4m3fn, got {q.dtype}")
    if q_scale is None:
        raise ValueError("mla_decode_splitkv: an fp8 q needs q_scale (a float32 1-element tensor)")
    if q_scale.dtype != torch.float32 or q_scale.numel() != 1 or q_scale.device != q.device:
        raise ValueError("mla_decode_splitkv: q_scale must be a float32 1-element tensor on q's device")
    if q.dtype == torch.float8_e4m3fnuz and kv_dtype != torch.float8_e4m3fnuz:
        raise TypeError("mla_decode_splitkv: an e4m3fnuz q needs an e4m3fnuz cache")
    q_arg, q_bytes = _as_codes(q)
    return q_arg, True, q_bytes


def mla_decode_splitkv(q, kv_rows, kv_indptr, kv_indices, qlen: int, scale: float, kv_scale: float,
                       num_splits: int, seq_lens=None, dcp_rank: int = 0, dcp_world_size: int = 1,
                       zero_empty: bool = True, q_scale=None):
    """M1c. q [T, H, 576] bf16 (or fp8 with ``q_scale``), kv_rows [N, 576] fp8 ->
    (o_part [S, T, H, 512] bf16, lse_part [S, T, H] f32).

    Same contract as :func:`kimi_ops.kernels.attention.mla_decode_splitkv` (``seq_lens`` /
    ``dcp_rank`` / ``dcp_world_size``: decode context parallel; every split is written, so
    ``zero_empty`` is moot); ``q_scale``: float32 [1] on q's device, required with an fp8 q."""
    T, H, R = _launch_shape(q, kv_rows, kv_indptr, kv_indices, qlen, num_splits)
    if kernel_for(arch_of(q.device)) == "first":
        from .attention import mla_decode_splitkv as first_generation
        return first_generation(q, kv_rows, kv_indptr, kv_indices, qlen, scale, kv_scale, num_splits,
                                seq_lens=seq_lens, dcp_rank=dcp_rank, dcp_world_size=dcp_world_size,
                                zero_empty=zero_empty, q_scale=q_scale)
    qq, has_qs, q_bytes = _q_mode(q, q_scale, kv_rows.dtype)
    S = int(num_splits)
    o_part, lse_part = _partials(S, T, H, q.device)
    if T == 0:
        return o_part, lse_part
    kv, kv_bytes, _ = _kv_mode(kv_rows)
    cfg = pick_config(arch_of(q.device), qlen * H)
    fp8_qk = has_qs and not kv_bytes and not q_bytes and takes_fp8_dots(cfg, q.dtype, kv_rows.dtype)
    grid = (triton.cdiv(qlen * H, cfg.block_m) * cfg.vsplit, S, R)
    indices = kv_indices if kv_indices.numel() > 0 else kv_indptr  # never dereferenced when empty
    c_hi, c_lo = _split_f32(float(scale) * float(kv_scale))
    _splitkv_tm_kernel[grid](
        qq, q_scale if has_qs else kv_indptr, kv, kv_indptr, indices,
        seq_lens if seq_lens is not None else kv_indptr, o_part, lse_part,
        T, H, kv_rows.shape[0], qlen, S, dcp_rank, dcp_world_size,
        c_hi, c_lo, float(kv_scale),
        HAS_QSCALE=has_qs, Q_BYTES=q_bytes, FP8_QK=fp8_qk, KV_BYTES=kv_bytes, INTERP=interpreting(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GLOBAL_LENS=seq_lens is not None,
        INTERP_STEPS=_interpreter_steps(kv_indptr, cfg.block_n), VSPLIT=cfg.vsplit, PREFETCH=cfg.prefetch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **dict(cfg.amd_options),
    )
    return o_part, lse_part


def suggest_num_splits(num_requests: int, qlen: int, num_heads: int, num_tokens: int,
                       num_sms: int = 132, arch: str = "sm90") -> int:
    """A split count from shapes only. Where the first generation runs (NVIDIA): its rule
    (:func:`kimi_ops.kernels.attention.suggest_num_splits`, fitted on the H200). Here (AMD, no
    measurement yet): about four programs a multiprocessor, no split shorter than 256 tokens on
    average, at most 64."""
    if num_requests <= 0:
        return 1
    if kernel_for(arch) == "first":
        from .attention import suggest_num_splits as first_generation
        return first_generation(num_requests, qlen, num_heads, num_tokens, num_sms)
    bm = pick_config(arch, qlen * num_heads).block_m
    base = num_requests * -(-qlen * num_heads // bm)
    want = max(1, -(-4 * num_sms // base))
    cap = max(1, max(1, num_tokens // num_requests) // 256)
    return int(max(1, min(want, cap, 64)))


# ----------------------------------------------------------------------------------------------
# cross-compilation registry: exactly the configurations CONFIGS lets the launcher pick

CROSS_TARGETS = ("gfx950", "gfx942", "sm90")


def _specs():
    specs = []
    common = {"q_scale_ptr": "*fp32", "indptr_ptr": "*i32", "indices_ptr": "*i32",
              "seq_lens_ptr": "*i32", "o_ptr": "*bf16", "lse_ptr": "*fp32", "T": "i32", "H": "i32",
              "N": "i32", "qlen": "i32", "num_splits": "i32", "dcp_rank": "i32",
              "dcp_world_size": "i32", "c_hi": "fp32", "c_lo": "fp32", "kv_scale": "fp32"}
    for arch in CROSS_TARGETS:
        # the cache formats each target serves natively (gfx942: e4m3fnuz and e4m3fn)
        fmts = {"gfx950": ("fn",), "gfx942": ("fn", "fnuz"), "sm90": ("fn", "u8fnuz")}[arch]
        for cfg in sorted(set(c._replace(max_rows=0) for c in CONFIGS[arch])):
            for fmt in fmts:
                for qk in ("bf16", "fp8"):
                    kvt = {"fn": "*fp8e4nv", "fnuz": "*fp8e4b8", "u8fnuz": "*u8"}[fmt]
                    qt = "*bf16" if qk == "bf16" else {"fn": "*fp8e4nv", "fnuz": "*fp8e4b8",
                                                       "u8fnuz": "*u8"}[fmt]
                    cx = {"HAS_QSCALE": qk == "fp8",
                          "Q_BYTES": FNUZ_BYTES if qk == "fp8" and fmt == "u8fnuz" else NATIVE,
                          "FP8_QK": qk == "fp8" and fmt in cfg.fp8_qk,
                          "KV_BYTES": FNUZ_BYTES if fmt == "u8fnuz" else NATIVE, "INTERP": False,
                          "BLOCK_M": cfg.block_m,
                          "BLOCK_N": cfg.block_n, "GLOBAL_LENS": False, "INTERP_STEPS": 0,
                          "VSPLIT": cfg.vsplit, "PREFETCH": cfg.prefetch}
                    sig = {"q_ptr": qt, "kv_ptr": kvt, **common, **{k: "constexpr" for k in cx}}
                    specs.append(dict(name=f"tm_{arch}_q{qk}_{fmt}_m{cfg.block_m}_n{cfg.block_n}"
                                           f"_v{cfg.vsplit}",
                                      kernel=_splitkv_tm_kernel, signature=sig, constexprs=cx,
                                      num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                                      amd_options=dict(cfg.amd_options), targets=(arch,),
                                      divisible_16=("H", "N")))
    return specs


CROSS_COMPILE_SPECS = _specs()
