"""Triton M1a (``mla_query``): the absorbed bf16 query, in one launch.

``q[t, h] = [q_nope[t, h] @ W_UK[h] | q_pe[t, h]]`` as bf16 ``[T, H', L + P]`` (Kimi-K3 /
DeepSeek: D = 128, L = 512, P = 64), with ``W_UK`` either bf16 ``[H, D, L]`` or MXFP4 packed
along D (``w_uk [H, L, D/2]`` uint8 + ``w_uk_scale [H, L, D/32]`` E8M0, W_UK[h] = dequant^T).

Grid ``(cdiv(T, BLOCK_M), cdiv(L, BLOCK_N), H')``: a program takes BLOCK_M token rows of one
head and BLOCK_N latent columns, reads its q_nope tile (any strides) and weight tile, decodes
an MXFP4 tile to bf16 in registers (exactly, as :mod:`kimi_ops.kernels.mxfp4`), runs one
``tl.dot`` over the whole D (f32 accumulation) and stores bf16; or, at T <= 8 (the GEMV form,
:func:`use_query_gemv`), sums the products over D by broadcast FMAs in float32 with no MMA
(an MXFP4 tile decoded to even / odd halves, bmm_a16wfp4's GEMV). The programs of latent block 0
also copy the rows' q_pe into columns ``L .. L + P``. **Pad heads** (``H <= h < H'``) are
written as all zeros (latent and rope parts), by the same launch. D, L and P are generic (any
D with D % 32 == 0 for MXFP4; any L, P), the block sizes are powers of two with masks.

The fp8 query (issue 28, ``kimi_ops.mla_query(..., out_dtype=torch.float8_e4m3fn)``) is this
kernel's bf16 output quantized by :func:`kimi_ops.ops.quantize_query` (torch ops: amax, one
division, the cast; Inductor fuses them in a compiled step). It is not fused into this kernel:
the default per-tensor scale needs the amax of the whole output before the first element can
be stored (a second pass, or a grid-wide barrier), and the bf16 query is 2 x T x H x 576 bytes
(T x H = 384 at batch 32: 442 KB), read back once.
"""
import torch
import triton
import triton.language as tl

from . import interpreting, mxfp4_paths
from .pdl import pdl_args, wait_prior_grid, weights_first
from .mxfp4 import (
    GEMV_MAX_M,
    _dot_mxfp4_scaled,
    _dot_operand,
    _gemv_x_tile,
    _load_mxfp4_even_odd,
    _mxfp4_decode,
    _to_bf16,
    forced_gemv,
    gemv_x_pairs,
    use_dot_scaled,
)


@triton.jit
def _mla_query_kernel(
    qn_ptr, qp_ptr, w_ptr, s_ptr, o_ptr,
    T, H, D, L, P,
    stride_qnt, stride_qnh, stride_qnd,
    stride_qpt, stride_qph, stride_qpd,
    stride_wh, stride_w1, stride_w2,          # bf16: [H, D, L] strides; MXFP4: [H, L, D/2]
    stride_sh, stride_sl, stride_sd,          # MXFP4 scales [H, L, D/32] (unused for bf16)
    stride_ot, stride_oh, stride_oc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    MXFP4: tl.constexpr, DOT_SCALED: tl.constexpr, INTERP: tl.constexpr, PDL: tl.constexpr = False,
    GEMV: tl.constexpr = False, X_PAIRS: tl.constexpr = False, W_FIRST: tl.constexpr = False,
):
    if not W_FIRST:
        wait_prior_grid(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    h = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < T
    mask_n = offs_n < L
    o_rows = o_ptr + offs_m[:, None].to(tl.int64) * stride_ot + h.to(tl.int64) * stride_oh
    offs_p = tl.arange(0, BLOCK_P)
    mask_p = mask_m[:, None] & (offs_p[None, :] < P)
    # the weight tile (a pad head, h >= H, loads nothing); with W_FIRST before the PDL wait
    has_w = h < H
    w_head = tl.minimum(h, H - 1).to(tl.int64)
    w_base = w_ptr + w_head * stride_wh
    s_base = s_ptr + w_head * stride_sh
    if GEMV:
        if MXFP4:   # [1, BN, BD/2] even / odd D elements, decoded
            kp = tl.arange(0, BLOCK_D // 2)[None, None, :]
            n3 = offs_n[None, :, None]
            we, wo = _load_mxfp4_even_odd(w_base + n3 * stride_w1, s_base + n3 * stride_sl, kp,
                                          (n3 < L) & (kp < D // 2) & has_w, stride_w2, stride_sd)
        else:       # [1, BD, BN]
            d3 = tl.arange(0, BLOCK_D)[None, :, None]
            n3 = offs_n[None, None, :]
            w = tl.load(w_base + d3 * stride_w1 + n3 * stride_w2, mask=(d3 < D) & (n3 < L) & has_w,
                        other=0.0).to(tl.float32)
    else:
        offs_d = tl.arange(0, BLOCK_D)
        if MXFP4:
            offs_dp = tl.arange(0, BLOCK_D // 2)
            offs_ds = tl.arange(0, BLOCK_D // 32)
            wp = tl.load(w_base + offs_n[:, None] * stride_w1 + offs_dp[None, :] * stride_w2,
                         mask=mask_n[:, None] & (offs_dp[None, :] < D // 2) & has_w, other=0)
            ws = tl.load(s_base + offs_n[:, None] * stride_sl + offs_ds[None, :] * stride_sd,
                         mask=mask_n[:, None] & (offs_ds[None, :] < D // 32) & has_w, other=0)
            if not DOT_SCALED:
                w = tl.trans(_dot_operand(_mxfp4_decode(wp, ws, BLOCK_N, BLOCK_D), INTERP))   # [D, N]
        else:
            w = _dot_operand(tl.load(w_base + offs_d[:, None] * stride_w1 + offs_n[None, :] * stride_w2,
                                     mask=(offs_d[:, None] < D) & mask_n[None, :] & has_w, other=0.0), INTERP)
    if W_FIRST:
        wait_prior_grid(PDL)
    if h < H:
        qn_rows = qn_ptr + (pid_m * BLOCK_M).to(tl.int64) * stride_qnt + h.to(tl.int64) * stride_qnh
        if GEMV:    # every row of the program against the tile by broadcast FMAs, reduced over D
            m3 = tl.arange(0, BLOCK_M)[:, None, None]
            if MXFP4:
                xe, xo = _gemv_x_tile(qn_rows, kp, kp < D // 2, m3, T - pid_m * BLOCK_M, stride_qnt, stride_qnd,
                                      BLOCK_M, BLOCK_D, X_PAIRS)
                acc = tl.sum(xe * we + xo * wo, axis=2)
            else:
                x = tl.zeros((BLOCK_M, BLOCK_D, 1), dtype=tl.float32)
                for mi in tl.static_range(BLOCK_M):
                    row = tl.load(qn_rows + mi * stride_qnt + d3 * stride_qnd,
                                  mask=(d3 < D) & (pid_m * BLOCK_M + mi < T), other=0.0)
                    x = tl.where(m3 == mi, row.to(tl.float32), x)
                acc = tl.sum(x * w, axis=1)
        else:
            qn = tl.load(qn_rows + tl.arange(0, BLOCK_M)[:, None] * stride_qnt + offs_d[None, :] * stride_qnd,
                         mask=mask_m[:, None] & (offs_d[None, :] < D), other=0.0)
            if MXFP4 and DOT_SCALED:
                acc = _dot_mxfp4_scaled(qn, wp, ws, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), BLOCK_M, BLOCK_D)
            else:
                acc = tl.dot(_dot_operand(qn, INTERP), w)
        tl.store(o_rows + offs_n[None, :] * stride_oc, _to_bf16(acc, INTERP),
                 mask=mask_m[:, None] & mask_n[None, :])
        if pid_n == 0:
            pe = tl.load(qp_ptr + offs_m[:, None].to(tl.int64) * stride_qpt + h.to(tl.int64) * stride_qph
                         + offs_p[None, :] * stride_qpd, mask=mask_p, other=0.0)
            tl.store(o_rows + (L + offs_p[None, :]) * stride_oc, pe, mask=mask_p)
    else:
        zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.bfloat16)
        tl.store(o_rows + offs_n[None, :] * stride_oc, zero, mask=mask_m[:, None] & mask_n[None, :])
        if pid_n == 0:
            tl.store(o_rows + (L + offs_p[None, :]) * stride_oc,
                     tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.bfloat16), mask=mask_p)


def query_config(t: int, heads: int, latent: int, amd: bool = False) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the tl.dot form from shapes alone; ``amd``: for gfx950 /
    gfx942 (the launcher: a ROCm build), where 32- and 64-row tiles take 8 warps (the MXFP4 decode
    path at 4 took 292-439 VGPRs + AGPRs, 1 wave a SIMD, on gfx950 with Triton 3.6;
    scripts/cross_compile.py)."""
    bm = 16 if t <= 16 else 32 if t <= 32 else 64
    bn = 64 if t <= 64 else 128
    bn = min(bn, max(16, triton.next_power_of_2(latent)))
    warps = 8 if bm * bn >= 64 * 128 or (amd and bm >= 32) else 4
    return bm, bn, warps


def query_gemv_config(t: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the GEMV form: every row in one program (BLOCK_M = T's
    power of two), 16 latent columns a program (Kimi-K3 TP8: 32 x 12 heads = 384 programs), 4
    warps: bmm_a16wfp4's GEMV config for W_UK (:func:`kimi_ops.kernels.mxfp4.gemv_config`, N 512,
    K 128), measured there at T = 1 (2.58 us against the tl.dot kernel's 3.55)."""
    return triton.next_power_of_2(max(1, t)), 16, 4


def use_query_gemv(t: int, gemv: bool | None = None) -> bool:
    """Whether M1a runs its GEMV form (no tl.dot; the form's docstring in :func:`mla_query`):
    never above ``GEMV_MAX_M`` rows or on the dot_scaled path; else ``gemv`` when given, else
    ``KIMI_OPS_QUERY_GEMV=1`` / ``0``, else at T = 1 on NVIDIA and the interpreter (W_UK in
    bmm_a16wfp4's GEMV: 2.58 us against 3.55 on the H200 at T = 1, MXFP4; at T = 8 the tl.dot
    kernel was faster, 3.61 against 5.09: :func:`kimi_ops.kernels.mxfp4.gemv_wins`)."""
    forced = forced_gemv(t, gemv, "KIMI_OPS_QUERY_GEMV")
    return t == 1 and torch.version.hip is None if forced is None else forced


def mla_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor,
              w_uk_scale: torch.Tensor | None = None, pad_heads: int | None = None,
              *, constant_w: bool = False, config: tuple[int, int, int] | None = None,
              dot_scaled: bool | None = None, gemv: bool | None = None) -> torch.Tensor:
    """M1a in one launch -> q ``[T, H', L + P]`` bf16 contiguous (inputs validated by the op
    layer; any strides). Pad heads (``pad_heads > H``) are all-zero rows.

    Two forms of the product, one kernel: the tl.dot form (a [BLOCK_M, D] x [D, BLOCK_N] MMA, an
    MXFP4 tile decoded to bf16 first, or ``tl.dot_scaled`` on gfx950) and, at T <= 8, the GEMV form
    (:func:`use_query_gemv`; ``gemv`` forces it on / off): each latent column's sum over D by
    broadcast FMAs in float32 (an MXFP4 tile decoded to even / odd halves, as bmm_a16wfp4's GEMV
    kernel does), no MMA operand layouts. ``constant_w``: nothing queued before on the stream
    writes W_UK (a model's weight): with PDL the kernel loads (and decodes) its weight tile before
    it waits for the previous kernel. ``config`` overrides the host's (BLOCK_M, BLOCK_N, num_warps)
    of the form that runs and ``dot_scaled`` the MXFP4 product's form (default
    :func:`kimi_ops.kernels.mxfp4.use_dot_scaled`: ``tl.dot_scaled`` on gfx950) (benchmarks,
    tests)."""
    t, h, d = q_nope.shape
    p = q_pe.shape[2]
    mxfp4 = w_uk_scale is not None
    latent = w_uk.shape[1] if mxfp4 else w_uk.shape[2]
    heads = h if pad_heads is None else pad_heads
    out = torch.empty((t, heads, latent + p), dtype=torch.bfloat16, device=q_nope.device)
    if out.numel() == 0:
        return out
    ds = mxfp4 and (use_dot_scaled(q_nope.device) if dot_scaled is None else dot_scaled)
    as_gemv = not ds and use_query_gemv(t, gemv)
    if as_gemv:
        bm, bn, warps = config or query_gemv_config(t)
        if bm < t or bm & (bm - 1):
            raise ValueError(f"mla_query's GEMV form: BLOCK_M must be a power of two >= T = {t}, got {bm}")
    else:
        bm, bn, warps = config or query_config(t, h, latent, amd=torch.version.hip is not None)
    if mxfp4:
        scale = w_uk_scale.view(torch.uint8)
        s_strides = scale.stride()
    else:
        scale = w_uk                                # placeholder pointer, never read
        s_strides = (0, 0, 0)
    pdl = pdl_args(q_nope.device)
    grid = (triton.cdiv(t, bm), triton.cdiv(latent, bn), heads)
    _mla_query_kernel[grid](
        q_nope, q_pe, w_uk, scale, out,
        t, h, d, latent, p,
        *q_nope.stride(), *q_pe.stride(), *w_uk.stride(), *s_strides, *out.stride(),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=max(32, triton.next_power_of_2(d)),
        BLOCK_P=max(16, triton.next_power_of_2(p)), MXFP4=mxfp4,
        DOT_SCALED=ds, INTERP=interpreting(), **pdl, GEMV=as_gemv,
        X_PAIRS=as_gemv and mxfp4 and gemv_x_pairs(q_nope.transpose(0, 1)),
        W_FIRST=weights_first(constant_w, pdl),
        num_warps=warps, num_stages=1,
    )
    return out


# ----------------------------------------------------------------------------------------------
# cross-compilation registry (scripts/cross_compile.py; format in kimi_ops/kernels/__init__.py)

def _specs():
    specs = []
    seen = set()
    for mxfp4 in (False, True):
        sig = {"qn_ptr": "*bf16", "qp_ptr": "*bf16", "w_ptr": "*u8" if mxfp4 else "*bf16",
               "s_ptr": "*u8" if mxfp4 else "*bf16", "o_ptr": "*bf16",
               "T": "i32", "H": "i32", "D": "i32", "L": "i32", "P": "i32"}
        for name in ("qnt", "qnh", "qnd", "qpt", "qph", "qpd", "wh", "w1", "w2", "sh", "sl", "sd",
                     "ot", "oh", "oc"):
            sig[f"stride_{name}"] = "i32"
        for kk in ("BLOCK_M", "BLOCK_N", "BLOCK_D", "BLOCK_P", "MXFP4", "DOT_SCALED", "INTERP", "PDL",
                   "GEMV", "X_PAIRS", "W_FIRST"):
            sig[kk] = "constexpr"
        paths = mxfp4_paths("mxfp4_decode", "mxfp4_dotscaled") if mxfp4 else mxfp4_paths("bf16", None)
        for t in (1, 32, 64, 512):
            for ds, kind, amd, targets in paths:
                bm, bn, warps = query_config(t, 12, 512, amd=amd)
                if (kind, bm, bn, warps, amd) in seen:
                    continue
                seen.add((kind, bm, bn, warps, amd))
                specs.append({
                    "name": f"mla_query_{kind}_m{bm}n{bn}w{warps}" + ("_amd" if amd and not ds else ""),
                    "kernel": _mla_query_kernel, "signature": dict(sig),
                    "constexprs": {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": 128, "BLOCK_P": 64,
                                   "MXFP4": mxfp4, "DOT_SCALED": ds, "INTERP": False,
                                   "PDL": False,  # sm_90 launches PDL=True: kimi_ops.kernels.pdl
                                   "GEMV": False, "X_PAIRS": False, "W_FIRST": False},
                    "num_warps": warps, "num_stages": 1, "targets": targets})
        # the GEMV form at T = 1 .. GEMV_MAX_M (BLOCK_M 1, 2, 4, 8; q_nope's D pairs as uint32 for
        # MXFP4, as the layer's q_b output gives them); the default on NVIDIA at T = 1 only
        for bm in (1, 2, 4, 8):
            _, bn, warps = query_gemv_config(bm)
            specs.append({
                "name": f"mla_query_gemv_{'mxfp4' if mxfp4 else 'bf16'}_m{bm}n{bn}w{warps}",
                "kernel": _mla_query_kernel, "signature": dict(sig),
                "constexprs": {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": 128, "BLOCK_P": 64,
                               "MXFP4": mxfp4, "DOT_SCALED": False, "INTERP": False, "PDL": False,
                               "GEMV": True, "X_PAIRS": mxfp4, "W_FIRST": False},
                "num_warps": warps, "num_stages": 1, "targets": ("gfx950", "gfx942", "sm90")})
        # the decode layer's launches on sm_90 as they run: PDL, the weight tile before the wait
        # (constant_w; tests/test_cross_compile.py checks the order of the loads in the PTX): the
        # GEMV form at T = 1, the tl.dot form at T = 8
        for t in (1, 8):
            gemv = t == 1
            bm, bn, warps = query_gemv_config(t) if gemv else query_config(t, 12, 512)
            specs.append({
                "name": f"mla_query_{'gemv_' if gemv else ''}{'mxfp4' if mxfp4 else 'bf16'}_m{bm}n{bn}w{warps}_pdl_wfirst",
                "kernel": _mla_query_kernel, "signature": dict(sig),
                "constexprs": {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": 128, "BLOCK_P": 64,
                               "MXFP4": mxfp4, "DOT_SCALED": False, "INTERP": False, "PDL": True,
                               "GEMV": gemv, "X_PAIRS": gemv and mxfp4, "W_FIRST": True},
                "num_warps": warps, "num_stages": 1, "targets": ("sm90",)})
    return specs


CROSS_COMPILE_SPECS = _specs()
