"""Pure-torch reference for fp8 e4m3 block-scaled weights and ``gemm_a16w8_block``.

Format (DeepSeek-V3's / Kimi-K2's checkpoints, HF ``quant_method: fp8``)
-----------------------------------------------------------------------
* ``w [N, K]`` ``torch.float8_e4m3fn`` beside ``w_scale_inv [ceil(N / bn), ceil(K / bk)]``
  float32 (HF name ``<proj>.weight_scale_inv``): the real weight is
  ``w[n, k] * w_scale_inv[n // bn, k // bk]`` (the name says "inverse" because the checkpoint
  stored ``fp8(w_real / s)`` with ``s`` the block's scale; multiplying by it dequantizes).
  ``(bn, bk)`` is the config's ``quantization_config.weight_block_size``, (128, 128) by default.
  The last block row / column may be partial (e.g. ``kv_a_proj_with_mqa``'s 576 rows: 4.5 blocks).
* ``gemm_a16w8_block(x, w, w_scale_inv, block_n, block_k)``: ``y = x @ dequant(w)^T`` with
  x ``[M, K]`` bf16, y ``[M, N]`` bf16, float32 accumulation (this reference: float32 matmul of
  the exactly dequantized weight, one rounding to bf16).

Quantization (:func:`quantize_fp8_blocks`, for bf16 weights loaded into an fp8 layer): each
block's scale is ``amax / 448`` (e4m3's largest finite value; 1 for an all-zero block), the
elements ``fp8(w / scale)`` rounded to nearest even and saturated to +-448.
"""

import torch

E4M3_MAX = 448.0


def expand_block_scales(w_scale_inv: torch.Tensor, n: int, k: int, block_n: int, block_k: int) -> torch.Tensor:
    """``[ceil(N / bn), ceil(K / bk)]`` block scales -> float32 ``[N, K]`` (each element its block's)."""
    s = w_scale_inv.to(torch.float32)
    return s.repeat_interleave(block_n, 0)[:n].repeat_interleave(block_k, 1)[:, :k]


def dequantize_fp8_blocks(w: torch.Tensor, w_scale_inv: torch.Tensor, block_n: int = 128, block_k: int = 128,
                          dtype=torch.float32) -> torch.Tensor:
    """``w [N, K]`` fp8 x its blocks' ``w_scale_inv`` -> ``dtype`` ``[N, K]`` (float32 math, one
    rounding; float64 math, exact, when ``dtype`` is float64)."""
    n, k = w.shape
    ct = torch.float64 if dtype == torch.float64 else torch.float32
    return (w.to(ct) * expand_block_scales(w_scale_inv, n, k, block_n, block_k).to(ct)).to(dtype)


def quantize_fp8_blocks(w: torch.Tensor, block_n: int = 128, block_k: int = 128,
                        fp8_dtype=torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [N, K]`` (any float dtype) -> (fp8 ``[N, K]``, float32 ``w_scale_inv [ceil(N/bn), ceil(K/bk)]``),
    scale = block amax / 448 (1 for an all-zero block)."""
    n, k = w.shape
    nb, kb = -(-n // block_n), -(-k // block_k)
    wf = w.to(torch.float32)
    padded = wf.new_zeros(nb * block_n, kb * block_k)
    padded[:n, :k] = wf
    amax = padded.abs().view(nb, block_n, kb, block_k).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (wf / expand_block_scales(scale, n, k, block_n, block_k)).clamp(-E4M3_MAX, E4M3_MAX).to(fp8_dtype)
    return q, scale


def gemm_a16w8_block(x: torch.Tensor, w: torch.Tensor, w_scale_inv: torch.Tensor, *, block_n: int = 128,
                     block_k: int = 128, constant_w: bool = False) -> torch.Tensor:
    """``x [M, K]`` bf16 @ ``dequant(w [N, K], w_scale_inv)^T`` -> bf16 ``[M, N]`` (float32 math;
    ``constant_w``, a launch hint for the sm_90 kernel, changes nothing here)."""
    wd = dequantize_fp8_blocks(w, w_scale_inv, block_n, block_k, torch.float32)
    return (x.to(torch.float32) @ wd.T).to(torch.bfloat16)
