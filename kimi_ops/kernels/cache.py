"""Triton KV-cache write (``mla_cache_write``) and the software fp8 encoder / decoder the kernels
share (``fp8_bits`` / ``fp8_value``: no fp8 type, so they run on any GPU and in the interpreter).

The fp8 encode is done with integer / exact float arithmetic (``fp8_bits``), not the
hardware or interpreter conversion: it rounds to nearest even, handles subnormals,
saturates to the format's finite max and gives the same bytes as torch's
``(x.float() / kv_scale).clamp(-fmax, fmax).to(fp8_dtype)`` on every backend
(the Triton interpreter's own fp32 -> fp8 cast does not round to nearest even, and
the NVIDIA backend has no e4m3fnuz type).  The store goes through a uint8 view of
the cache, so e4m3fn and e4m3fnuz caches are written by the same kernel anywhere.
"""
import torch
import triton
import triton.language as tl

from ..formats import KV_LORA_RANK, KV_ROW, ROPE_DIM
from .pdl import pdl_args, wait_prior_grid

FP8_FN = torch.float8_e4m3fn
FP8_FNUZ = torch.float8_e4m3fnuz


@triton.jit
def fp8_bits(x, FNUZ: tl.constexpr):
    """f32 -> E4M3 code (int32 in [0, 255]): RNE, subnormals, saturated to the finite max.

    e4m3fn: bias 7, max 448 (0x7e), -0 kept (0x80), NaN -> 0x7f | sign.
    e4m3fnuz: bias 8, max 240 (0x7f), no -0 (a zero result is 0x00), NaN -> 0x80.
    """
    if FNUZ:
        BIAS: tl.constexpr = 8
        FMAX: tl.constexpr = 240.0
    else:
        BIAS: tl.constexpr = 7
        FMAX: tl.constexpr = 448.0
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = tl.abs(x)
    a = tl.minimum(a, FMAX)
    abits = a.to(tl.int32, bitcast=True)
    e = ((abits >> 23) & 0xFF) - 127
    # quantum of the fp8 grid at a: 2^(max(e, 1 - BIAS) - 3); adding C = quantum * 2^23
    # rounds a to that grid, to nearest even, in f32 (exact: the sum stays below 2^24 quanta)
    qe = tl.maximum(e, 1 - BIAS) - 3
    c = ((qe + 23 + 127) << 23).to(tl.float32, bitcast=True)
    r = (a + c) - c
    r = tl.minimum(r, FMAX)
    rbits = r.to(tl.int32, bitcast=True)
    re = ((rbits >> 23) & 0xFF) - 127
    is_norm = re >= 1 - BIAS
    code_norm = ((re + BIAS) << 3) | ((rbits >> 20) & 7)
    # subnormal: r = m * 2^(1 - BIAS - 3), m in 0..7 (exact)
    code_sub = (r * (2.0**(BIAS + 2))).to(tl.int32)
    code = tl.where(is_norm, code_norm, code_sub)
    if FNUZ:
        code = tl.where(code == 0, 0, code | (sign << 7))
        code = tl.where(x != x, 0x80, code)
    else:
        code = code | (sign << 7)
        code = tl.where(x != x, 0x7F | (sign << 7), code)
    return code


@triton.jit
def fp8_value(code, FNUZ: tl.constexpr):
    """E4M3 code (uint8 / int, [0, 255]) -> f32, exact, by integer arithmetic: for a GPU without
    the fp8 type (NVIDIA before sm_89, e4m3fnuz on NVIDIA) and the kernels' byte paths.

    e4m3fn: bias 7, 0x7f / 0xff NaN, 0x80 -0. e4m3fnuz: bias 8, 0x80 NaN, no -0, no inf.
    """
    if FNUZ:
        BIAS: tl.constexpr = 8
    else:
        BIAS: tl.constexpr = 7
    c = code.to(tl.int32) & 0xFF
    e = (c >> 3) & 0xF
    m = c & 7
    normal = (((e + (127 - BIAS)) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    mag = tl.where(e > 0, normal, m.to(tl.float32) * (2.0**(-BIAS - 2)))  # subnormal: m * 2^(1 - BIAS - 3)
    # the sign as a bit (a negation may be 0 - x, which gives +0 for e4m3fn's 0x80)
    x = (mag.to(tl.int32, bitcast=True) | ((c >> 7) << 31)).to(tl.float32, bitcast=True)
    if FNUZ:
        return tl.where(c == 0x80, float("nan"), x)
    return tl.where((c & 0x7F) == 0x7F, float("nan"), x)


@triton.jit
def store_kv_row(row_ptr, c, pe, kv_scale, ok, FNUZ: tl.constexpr, DC: tl.constexpr, DP: tl.constexpr):
    """One cache row at row_ptr (uint8 [DC + DP]) where ``ok``: ``fp8(cat(c, pe) / kv_scale)``, c
    float32 [DC] and pe float32 [DP] (the division correctly rounded, then :func:`fp8_bits`)."""
    tl.store(row_ptr + tl.arange(0, DC), fp8_bits(tl.math.div_rn(c, kv_scale), FNUZ).to(tl.uint8), mask=ok)
    tl.store(row_ptr + DC + tl.arange(0, DP), fp8_bits(tl.math.div_rn(pe, kv_scale), FNUZ).to(tl.uint8), mask=ok)


@triton.jit
def _cache_write_kernel(
    kvc_ptr, kpe_ptr, kv_ptr, slot_ptr,
    N, kv_scale,
    stride_c, stride_pe,
    FNUZ: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_PE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_prior_grid(PDL)
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    ok = (slot >= 0) & (slot < N)
    offs_c = tl.arange(0, BLOCK_C)
    offs_p = tl.arange(0, BLOCK_PE)
    t64 = t.to(tl.int64)
    xc = tl.load(kvc_ptr + t64 * stride_c + offs_c).to(tl.float32)
    xp = tl.load(kpe_ptr + t64 * stride_pe + offs_p).to(tl.float32)
    store_kv_row(kv_ptr + slot * 576, xc, xp, kv_scale, ok, FNUZ, BLOCK_C, BLOCK_PE)


def mla_cache_write(kv_c, k_pe, kv_rows, slot_mapping, kv_scale: float) -> None:
    """Write row ``slot_mapping[t]`` of ``kv_rows [N, 576]`` (fp8) with
    ``fp8(cat(kv_c[t], k_pe[t]) / kv_scale)``; slots outside [0, N) (-1 included) are skipped."""
    assert kv_rows.dim() == 2 and kv_rows.shape[1] == KV_ROW and kv_rows.is_contiguous()
    assert kv_rows.dtype in (FP8_FN, FP8_FNUZ), kv_rows.dtype
    T = kv_c.shape[0]
    assert kv_c.shape == (T, KV_LORA_RANK) and k_pe.shape == (T, ROPE_DIM) and slot_mapping.shape == (T,)
    assert kv_c.stride(1) == 1 and k_pe.stride(1) == 1
    if T == 0:
        return
    N = kv_rows.shape[0]
    _cache_write_kernel[(T,)](
        kv_c, k_pe, kv_rows.view(torch.uint8), slot_mapping,
        N, float(kv_scale),
        kv_c.stride(0), k_pe.stride(0),
        FNUZ=kv_rows.dtype == FP8_FNUZ,
        BLOCK_C=KV_LORA_RANK, BLOCK_PE=ROPE_DIM, **pdl_args(kv_rows.device),
        num_warps=4,
    )


def _specs():
    specs = []
    for xdt in ("bf16", "fp16", "fp32"):
        for sdt in ("i32", "i64"):
            for fnuz in (False, True):
                specs.append(dict(
                    name=f"cache_write_{xdt}_{sdt}_{'fnuz' if fnuz else 'fn'}",
                    kernel=_cache_write_kernel,
                    signature={"kvc_ptr": f"*{xdt}", "kpe_ptr": f"*{xdt}", "kv_ptr": "*u8",
                               "slot_ptr": f"*{sdt}", "N": "i32", "kv_scale": "fp32",
                               "stride_c": "i32", "stride_pe": "i32",
                               "FNUZ": "constexpr", "BLOCK_C": "constexpr", "BLOCK_PE": "constexpr",
                               "PDL": "constexpr"},
                    # sm_90 launches PDL=True (kimi_ops.kernels.pdl: two instructions more)
                    constexprs={"FNUZ": fnuz, "BLOCK_C": KV_LORA_RANK, "BLOCK_PE": ROPE_DIM, "PDL": False},
                    num_warps=4, num_stages=1,
                ))
    return specs


CROSS_COMPILE_SPECS = _specs()
