"""A float64 computation of a whole decode step of an :class:`MLADecodeLayer` (the demo's check).

Plain float64 matmuls on the weights the layer applies (MXFP4 and fp8 ones dequantized exactly),
the absorbed attention over the fp8 cache as it stands after the step (the layer's own
rows for this step included), explicit softmax. Host-side and slow: for checking only.
(The tests hold the layer to an oracle of their own, written in the un-absorbed form.)
"""

import torch

from ..formats import KV_LORA_RANK, KV_ROW


@torch.no_grad()
def layer_float64(layer, hidden: torch.Tensor, kv_cache_after: torch.Tensor, md) -> torch.Tensor:
    """float64 ``[T, hidden]`` (``[T, H * v]`` without o_proj) of the step ``layer(hidden, kv_cache, md)``."""
    c, h = layer.config, layer.num_heads
    x = hidden.detach().cpu().double()
    dense = {k: (w.cpu().double() if w is not None else None) for k, w in layer.dense_weights(torch.float64).items()}
    w_qkv, w_gate = dense["qkv"], dense["gate"]
    w_uk, w_uv = (w.cpu().double() for w in layer.dequantized_kv_b(torch.float32))
    qkv = x @ w_qkv.T

    def rms(v, g):
        return v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps) * g.cpu().double()

    q_c = rms(qkv[:, :c.q_lora_rank], layer.q_a_layernorm.weight)
    q = (q_c @ dense["q_b"].T).view(-1, h, c.qk_head_dim)
    q_nope, q_pe = q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
    if c.rope:
        pos = md.positions.cpu().double()[:, None] * layer.rotary_inv_freq.cpu().double()[None, :]
        cos, sin = pos.cos()[:, None] * c.rope_mscale, pos.sin()[:, None] * c.rope_mscale
        x0, x1 = q_pe[..., 0::2], q_pe[..., 1::2]
        q_pe = torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], -1).flatten(-2)
    q_lat = torch.einsum("thd,hdl->thl", q_nope, w_uk)                 # [T, H, 512]
    rows = kv_cache_after.detach().cpu().reshape(-1, KV_ROW).double() * layer.kv_scale
    indptr, indices = md.kv_indptr.cpu().tolist(), md.kv_indices.cpu().long()
    seq_lens = md.seq_lens.cpu().tolist()
    qlen = md.qlen
    out = torch.zeros(x.shape[0], h, KV_LORA_RANK, dtype=torch.float64)
    for r in range(len(indptr) - 1):
        kv = rows[indices[indptr[r]:indptr[r + 1]]]
        for i in range(qlen):
            visible = seq_lens[r] - qlen + i + 1
            if visible <= 0:
                continue
            t = r * qlen + i
            k = kv[:visible]
            s = (q_lat[t] @ k[:, :KV_LORA_RANK].T + q_pe[t] @ k[:, KV_LORA_RANK:].T) * c.softmax_scale
            p = torch.exp(s - s.max(-1, keepdim=True).values)
            out[t] = (p / p.sum(-1, keepdim=True)) @ k[:, :KV_LORA_RANK]
    core = torch.einsum("thl,hvl->thv", out, w_uv).reshape(x.shape[0], -1)
    if w_gate is not None:
        core = core * torch.sigmoid(x @ w_gate.T)
    if layer.o_proj is not None:
        core = core @ dense["o"].T
    return core


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (NaN anywhere gives inf)."""
    out = out.detach().cpu().double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))
