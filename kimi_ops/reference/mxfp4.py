"""Pure-torch reference for the OCP MXFP4 format, ``bmm_a16wfp4`` and M1a (``mla_query``).

Device-agnostic and vectorized (no Python loop over elements); the oracle for the
Triton kernels and the CPU backend of the ops.

Format (OCP Microscaling Formats v1.0, MXFP4; AITER's / vLLM's layout)
------------------------------------------------------------------------
* Elements are FP4 E2M1: a sign bit (bit 3), two exponent bits, one mantissa bit.
  Codes 0..7 are ``0, 0.5, 1, 1.5, 2, 3, 4, 6``; codes 8..15 are their negatives
  (code 8 is -0). Two elements per byte, element ``2i`` in the low nibble,
  ``2i + 1`` in the high nibble.
* One E8M0 scale per 32 consecutive elements of the last dim: a biased exponent
  byte ``s`` meaning ``2^(s - 127)``; ``s = 0xFF`` is NaN.
* ``w [..., N, K]`` -> ``w_packed [..., N, K/2]`` uint8, ``w_scale [..., N, K/32]``
  uint8 (``torch.float8_e8m0fnu`` scales are accepted and viewed as uint8).

Quantization rule (the OCP MX conversion)
-----------------------------------------
* ``e = floor(log2(amax)) - 2`` over the block's absolute maximum, clamped to
  the E8M0 range ``[-127, 127]`` (with float32-representable inputs only the
  lower clamp can bind: blocks whose amax is below ``2^-125``).
* Elements ``x / 2^e`` are rounded to the nearest E2M1 value, ties to even
  (``0.25 -> 0``, ``0.75 -> 1``, ``1.25 -> 1``, ``1.75 -> 2``, ``2.5 -> 2``,
  ``3.5 -> 4``, ``5 -> 4``), and saturated to +-6. The sign is kept, so a
  negative value that rounds to zero is stored as -0 (code 8).
* **All-zero block**: scale byte 0 (``e = -127``, the clamp) and zero codes
  (code 8 for -0.0 inputs). Any scale would do; 0 is what the clamp gives.
* **NaN / inf input** (documented, not an error): a block holding any NaN or
  +-inf gets the NaN scale ``0xFF`` and all-zero element codes, as the OCP spec
  prescribes for the scale; it dequantizes to NaN in all 32 elements, and a
  product with it is NaN. No host sync, so it is CUDA-graph and
  ``torch.compile`` safe.
* ``dequantize(quantize(w))`` is exact in bfloat16 and float32 and is a fixed
  point: quantizing it again gives the same bytes (each block's largest code
  is 4 or 6 unless the scale is clamped, so its scale is found again).
"""

import torch

from ..formats import MXFP4_BLOCK

E8M0_BIAS = 127
E8M0_NAN = 0xFF

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""Value of each E2M1 code 0..15 (bit 3 is the sign)."""

# Rounding thresholds on |x| / 2^e between consecutive magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6,
# and whether the tie goes up (the upper neighbour has the even mantissa bit).
_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True),
               (2.5, False), (3.5, True), (5.0, False))


def _pow2_f32(exponent: torch.Tensor) -> torch.Tensor:
    """Exact float32 2^exponent for integer exponent in [-126, 127] (built from bits)."""
    return ((exponent.to(torch.int32) + 127) << 23).view(torch.float32)


def _e8m0_to_f32(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 byte -> float32 2^(s - 127) exactly (s = 0 is the subnormal 2^-127), 0xFF -> NaN."""
    s = scale.view(torch.uint8).to(torch.int32)
    normal = (s.clamp(min=1) << 23).view(torch.float32)
    value = torch.where(s == 0, torch.full_like(normal, 2.0 ** -127), normal)
    return torch.where(s == E8M0_NAN, torch.full_like(value, float("nan")), value)


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MXFP4 quantization along the last dim (rules in the module docstring).

    Args:
        w: ``[..., K]`` bf16, fp16 or fp32, ``K % 32 == 0``.

    Returns:
        ``(w_packed [..., K/2] uint8, w_scale [..., K/32] uint8)``.
    """
    k = w.shape[-1]
    if k % MXFP4_BLOCK != 0:
        raise ValueError(f"mxfp4_quantize: last dim must be a multiple of {MXFP4_BLOCK}, got {k}")
    if w.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"mxfp4_quantize: w must be bf16/f16/f32, got {w.dtype}")
    lead = w.shape[:-1]
    x = w.to(torch.float32).reshape(*lead, k // MXFP4_BLOCK, MXFP4_BLOCK)
    bad = (~torch.isfinite(x)).any(dim=-1)                      # NaN / inf blocks
    amax = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x)).amax(dim=-1)
    # floor(log2(amax)) exactly: amax = m * 2^ex with m in [0.5, 1) -> ex - 1 (frexp is exact).
    _, ex = torch.frexp(amax)
    e = torch.where(amax > 0, ex.to(torch.int32) - 1 - 2, torch.full_like(ex, -127, dtype=torch.int32))
    e = e.clamp(-127, 127)
    # x / 2^e = x * 2^-e, exact (2^-e is a normal float32 for e in [-127, 125]).
    v = x.abs() * _pow2_f32(-e).unsqueeze(-1)
    mag = torch.zeros_like(v, dtype=torch.uint8)
    for t, tie_up in _THRESHOLDS:                                # 7 comparisons, vectorized
        mag += (v >= t) if tie_up else (v > t)
    codes = mag | (torch.signbit(x).to(torch.uint8) << 3)
    codes = torch.where(bad.unsqueeze(-1), torch.zeros_like(codes), codes)
    scale = torch.where(bad, torch.full_like(e, E8M0_NAN), e + E8M0_BIAS).to(torch.uint8)
    codes = codes.reshape(*lead, k)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), scale.contiguous()


def mxfp4_dequantize(w_packed: torch.Tensor, w_scale: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """MXFP4 -> ``dtype`` ``[..., K]``: computed exactly in float32, then cast once.

    Exact for bf16 and float32 outputs wherever the value fits float32: scale bytes
    253 / 254 (never made by :func:`mxfp4_quantize`, whose largest is 252) times a large
    code give +-inf. fp16 output is a plain cast of the exact value (inf / 0 outside fp16's
    range). Scale 0xFF gives NaN.
    """
    packed = w_packed.view(torch.uint8)
    lead, half = packed.shape[:-1], packed.shape[-1]
    k = half * 2
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*lead, k)
    values = lut[codes.long()].reshape(*lead, k // MXFP4_BLOCK, MXFP4_BLOCK)
    scale = _e8m0_to_f32(w_scale).reshape(*lead, k // MXFP4_BLOCK, 1)
    return (values * scale).reshape(*lead, k).to(dtype)


def bmm_a16wfp4(x: torch.Tensor, w_packed: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """``y[b] = x[b] @ dequant(w)[b]^T``: x ``[B, M, K]`` bf16 (any strides), w in MXFP4
    (``w_packed [B, N, K/2]``, ``w_scale [B, N, K/32]``) -> y ``[B, M, N]`` bf16.

    float32 math on the exactly dequantized weights, one rounding to bf16.
    """
    w = mxfp4_dequantize(w_packed, w_scale, dtype=torch.float32)
    return torch.bmm(x.to(torch.float32), w.transpose(1, 2)).to(torch.bfloat16)


def mla_v_up_proj(o: torch.Tensor, w_uv: torch.Tensor, w_uv_scale: torch.Tensor | None = None,
                  gate: torch.Tensor | None = None, *, constant_w: bool = False) -> torch.Tensor:
    """The layer's W_UV up-projection and gate: ``out[t, h*v + j] = (W_UV[h] @ o[t, h])[j] *
    gate[t, h*v + j]`` as bf16 ``[T, H * v]``; o ``[T, H, L]`` bf16, ``w_uv`` bf16 ``[H, v, L]`` or
    MXFP4 (uint8 ``[H, v, L/2]`` + ``w_uv_scale [H, v, L/32]``), gate ``[T, H * v]`` or None.
    float32 math on the exactly dequantized weights, the gate on the float32 product, one rounding
    (``constant_w``, a launch hint for the GPU kernel, changes nothing here)."""
    if w_uv_scale is None:
        w = w_uv.to(torch.float32)
    else:
        w = mxfp4_dequantize(w_uv, w_uv_scale, dtype=torch.float32)
    core = torch.einsum("thl,hvl->thv", o.to(torch.float32), w).reshape(o.shape[0], -1)
    if gate is not None:
        core = core * gate.to(torch.float32)
    return core.to(torch.bfloat16)


def mla_query(q_nope: torch.Tensor, q_pe: torch.Tensor, w_uk: torch.Tensor,
              w_uk_scale: torch.Tensor | None = None, pad_heads: int | None = None,
              *, constant_w: bool = False) -> torch.Tensor:
    """M1a: ``q[t, h] = [q_nope[t, h] @ W_UK[h] | q_pe[t, h]]`` as bf16 ``[T, H', L + P]``.

    Args:
        q_nope: ``[T, H, D]`` bf16 (D = 128 for Kimi-K3 / DeepSeek); any strides.
        q_pe: ``[T, H, P]`` bf16 (P = 64); any strides.
        w_uk: bf16 ``[H, D, L]`` (L = 512), or MXFP4 packed along D: uint8
            ``[H, L, D/2]`` with ``w_uk_scale [H, L, D/32]`` (then W_UK[h] = dequant(w_uk)[h]^T).
        pad_heads: None (H' = H) or H' >= H; **pad heads' rows are all zeros**
            (latent and rope parts).
        constant_w: a launch hint for the GPU kernel (:func:`kimi_ops.mla_query`); no effect here.

    Returns:
        q ``[T, H', L + P]`` bf16, contiguous: float32 math, one rounding to bf16;
        the q_pe part is copied bit for bit.
    """
    t, h, _ = q_nope.shape
    if w_uk_scale is None:
        w = w_uk.to(torch.float32)                                   # [H, D, L]
    else:
        w = mxfp4_dequantize(w_uk, w_uk_scale, dtype=torch.float32).transpose(1, 2)  # [H, D, L]
    latent = w.shape[2]
    rope = q_pe.shape[2]
    heads = h if pad_heads is None else pad_heads
    out = torch.zeros((t, heads, latent + rope), dtype=torch.bfloat16, device=q_nope.device)
    q_lat = torch.bmm(q_nope.to(torch.float32).transpose(0, 1), w)   # [H, T, L]
    out[:, :h, :latent] = q_lat.transpose(0, 1).to(torch.bfloat16)
    out[:, :h, latent:] = q_pe
    return out


__all__ = ["mxfp4_quantize", "mxfp4_dequantize", "bmm_a16wfp4", "mla_query",
           "E2M1_VALUES", "MXFP4_BLOCK"]
