"""Triton ``mla_v_up_proj``: the layer's W_UV up-projection and output gate in one launch.

``out[t, h * v + j] = (W_UV[h] @ o[t, h])[j] * gate[t, h * v + j]`` -> bf16 ``[T, H * v]``
(o_proj's input), f32 accumulation and one rounding (the seeds' post rounds the product to bf16
before the gate multiply: here the gate multiplies the f32 sum). ``o [T, H, 512]`` bf16 (the
merged latent, any strides with 512 contiguous); ``W_UV`` bf16 ``[H, v, 512]`` or MXFP4
``w_uv [H, v, 256]`` uint8 + ``w_uv_scale [H, v, 16]`` E8M0 (:mod:`kimi_ops.reference.mxfp4`);
``gate [T, H * v]`` bf16 or None.

The kernels are :mod:`kimi_ops.kernels.mxfp4`'s, writing straight into ``[T, H * v]`` through
strided views (batch = head), the gate in their epilogue: an MXFP4 W_UV runs as
:func:`kimi_ops.kernels.mxfp4.bmm_a16wfp4` picks (the dot-free GEMV at small T, else the tl.dot
kernel); a bf16 one the GEMV where :func:`kimi_ops.kernels.mxfp4.use_gemv` takes it (T <= 8 on
NVIDIA, rows contiguous and 4-byte aligned: its weights read as bf16 pairs), else ``torch.bmm``
and one ``torch.mul`` into the output. What the fusion saves in a compiled step: the gate
multiply (an Inductor kernel reading the bmm's output and writing ``[T, H * v]``) and, for a bf16
W_UV, the bmm's transpose copy.
"""
import torch

from .mxfp4 import bmm_a16wfp4, gemv_x_pairs, launch_gemv, use_gemv


def v_up_proj(o: torch.Tensor, w_uv: torch.Tensor, w_uv_scale: torch.Tensor | None = None,
              gate: torch.Tensor | None = None, *, constant_w: bool = False) -> torch.Tensor:
    """-> ``[T, H * v]`` bf16 (inputs validated by the op layer). ``constant_w``: the GEMV kernel
    loads W_UV before its PDL wait (:func:`kimi_ops.kernels.mxfp4.launch_gemv`)."""
    t, h, _ = o.shape
    v = w_uv.shape[1]
    out = torch.empty((t, h * v), dtype=torch.bfloat16, device=o.device)
    if out.numel() == 0:
        return out
    x = o.transpose(0, 1)                                  # [H, T, 512], a view
    y = out.view(t, h, v).transpose(0, 1)                  # [H, T, v], a view of out
    g = None if gate is None else gate.view(t, h, v).transpose(0, 1)
    if w_uv_scale is not None:
        bmm_a16wfp4(x, w_uv, w_uv_scale, out=y, gate=g, constant_w=constant_w)
    elif use_gemv(t, v, w_uv.shape[2]) and gemv_x_pairs(w_uv):
        launch_gemv(x, w_uv, None, y, g, constant_w=constant_w)
    else:
        core = torch.bmm(x, w_uv.transpose(1, 2))          # [H, T, v]
        if g is None:
            y.copy_(core)
        else:
            torch.mul(core, g, out=y)
    return out
