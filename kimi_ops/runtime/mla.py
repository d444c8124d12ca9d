"""An MLA layer's decode step, split where the seeds' mono kernels split it.

* :func:`pre`: the qkv_a GEMM (g_proj merged in or beside it; bf16, or fp8 block-scaled
  through :func:`project`); the q / kv RMSNorms, this step's KV rows into the fp8 cache and the
  output gate ``sigmoid(g_proj)`` and q_b in one op (:func:`kimi_ops.mla_norm_cache_write_q_b`:
  one kernel on sm_90 at decode batches); RoPE where the config has it, W_UK absorbed into the
  query (M1a, :func:`kimi_ops.mla_query`).
* :func:`attend`: the attention over the latent cache (M1c + M1b, :func:`kimi_ops.mla_decode`;
  AITER's ``mla_decode_fwd`` where the layer asks for it on ROCm, :mod:`.aiter_fallback`).
* :func:`post`: the W_UV up-projection (MXFP4 or bf16) times the gate, one op
  (:func:`kimi_ops.mla_v_up_proj`): o_proj's input ``[T, H * v]`` bf16.

``layer(module, hidden, kv_cache, md) = post(attend(pre(...)))``. Pure decode only
(every query row a decode row). Every function is torch ops and kimi_ops custom ops
with fixed shapes and no host sync, so the whole step compiles with
``torch.compile(fullgraph=True)`` and replays in a CUDA graph.

Decode context parallel (:mod:`.dcp`, the layer's ``dcp_group``): :func:`pre` ends with
the query all-gather over heads (H -> W * H), :func:`attend` computes this rank's
partial over its shard with causal bounds in global positions, and :func:`post`
starts with the LSE combine back to the rank's H heads (the seeds'
``dcp_manager.query_gather`` / ``combine``).
"""

import contextlib
from typing import NamedTuple

import torch

from .. import ops
from ..formats import KV_LORA_RANK, ROPE_DIM
from . import aiter_fallback, dcp

# --- the query -----------------------------------------------------------------------------

class FP8Query(NamedTuple):
    """The fp8 query :func:`pre` returns with ``bf16=False``: ``q8 [T, H (W * H under DCP), 576]``
    fp8 and its per-tensor ``q_scale`` (float32 [1], on the device): real q = q8 x q_scale."""
    q8: torch.Tensor
    q_scale: torch.Tensor

    @property
    def shape(self):
        return self.q8.shape


def quantize_step_query(layer, q: torch.Tensor):
    """M1a's bf16 query [T, H, 576] -> FP8Query in the layer's ``query_dtype``: the layer's
    static scale (``layer.q_scale``) or the per-tensor amax scale, the amax taken over every
    DCP rank (:func:`kimi_ops.runtime.dcp.global_amax`: one all-reduce of 4 bytes) so that the
    gathered query has one scale."""
    dtype = layer.query_dtype
    q_scale = layer.q_scale
    if q_scale is None:
        q_scale = ops.query_scale(q, dtype=dtype, amax=dcp.global_amax(ops.query_amax(q), layer.dcp_group))
    return FP8Query(*ops.quantize_query(q, q_scale=q_scale, dtype=dtype))


# --- the step's context (the seeds' get_attention_context, without vLLM) ---------------------

_CONTEXT: list[tuple] = []


@contextlib.contextmanager
def step_context(md, kv_caches):
    """Make ``md`` and the layers' caches the current step's: ``kv_caches`` is one cache
    tensor (every layer's) or a dict ``{layer: cache}``. :func:`context` reads them."""
    _CONTEXT.append((md, kv_caches))
    try:
        yield
    finally:
        _CONTEXT.pop()


def context(layer):
    """``(metadata, attention layer, kv_cache, slot_mapping)`` of the current step
    (set by :func:`step_context`)."""
    if not _CONTEXT:
        raise RuntimeError("kimi_ops.runtime.mla.context: no step context; use mla.step_context(md, kv_caches) "
                           "or pass kv_cache and md explicitly")
    md, caches = _CONTEXT[-1]
    kv_cache = caches[layer] if isinstance(caches, dict) else caches
    return md, layer, kv_cache, md.slot_mapping


# --- weights ----------------------------------------------------------------------------------

def qkv_gate_weights(layer):
    """fused_qkv_a's ``[q_lora + 576, hidden]`` and g_proj's ``[H * v, hidden]`` weights: row
    slices of one ``[q_a | kv_a | gate]`` weight where the gate is merged in; the gate
    ``None`` without one."""
    w = layer.fused_qkv_a_proj.weight
    if layer.g_proj is not None:
        return w, layer.g_proj.weight
    if not layer.merge_gate:
        return w, None
    n = layer.config.qkv_a_rows
    return w[:n], w[n:]


def fp8_scale_args(proj) -> tuple[torch.Tensor | None, dict]:
    """A projection's fp8 block scales and their block sizes: ``(proj.weight_scale_inv,
    dict(block_n=, block_k=))``, or ``(None, {})`` for a bf16 weight."""
    scale = getattr(proj, "weight_scale_inv", None)
    return scale, (dict(block_n=proj.block_n, block_k=proj.block_k) if scale is not None else {})


def project(x: torch.Tensor, proj) -> torch.Tensor:
    """``x [T, in] @ W^T`` for one of the layer's projections: :func:`kimi_ops.gemm_a16w16` on a
    bf16 weight, or :func:`kimi_ops.gemm_a16w8_block` on an fp8 block-scaled one
    (``proj.weight_scale_inv``); the weights are constants (``constant_w``)."""
    scale, blocks = fp8_scale_args(proj)
    if scale is None:
        return ops.gemm_a16w16(x, proj.weight, constant_w=True)
    return ops.gemm_a16w8_block(x, proj.weight, scale, constant_w=True, **blocks)


# --- pieces -----------------------------------------------------------------------------------

def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
               mscale: float = 1.0) -> torch.Tensor:
    """DeepSeek's rotary (interleaved pairs ``(2i, 2i+1)``, vLLM's ``is_neox_style=False``) of
    ``x [T, ..., 64]`` at ``positions [T]``, cos / sin times ``mscale`` (YaRN's
    ``config.rope_mscale``); float32 math, one rounding."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]           # [T, 32]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (freqs.shape[1],)
    cos, sin = freqs.cos().view(shape), freqs.sin().view(shape)
    if mscale != 1.0:
        cos, sin = cos * mscale, sin * mscale
    xf = x.float()
    x0, x1 = xf[..., 0::2], xf[..., 1::2]
    out = torch.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], dim=-1)
    return out.flatten(-2).to(x.dtype)


def pre(layer, hidden: torch.Tensor, kv_cache: torch.Tensor, md, bf16: bool | None = None):
    """``hidden``: input_layernorm's output ``[T, hidden]`` bf16. Writes this step's KV rows
    (slots ``md.slot_mapping``) into ``kv_cache`` and returns ``(q, gate)``: M1a's query and
    ``gate = sigmoid(g_proj(hidden)) [T, H * v]`` bf16 (``None`` without a gate).

    ``bf16`` (the seeds' switch; None: the layer's ``query_bf16``, which defaults to fp8 under
    DCP and bf16 at DCP1): True gives the bf16 query ``q [T, H, 576]``; False the fp8 query
    :class:`FP8Query` ``(q8, q_scale)`` (:func:`quantize_step_query`). Under DCP the query
    is all-gathered over heads (``[T, W * H, 576]``), an fp8 one as its bytes."""
    c = layer.config
    nope, rope = c.qk_nope_head_dim, c.qk_rope_head_dim
    qkv = project(hidden, layer.fused_qkv_a_proj)        # [T, q_lora + 576 (+ gate)]
    if layer.g_proj is not None:
        g = project(hidden, layer.g_proj)
    elif layer.merge_gate:
        qkv, g = qkv.split([c.qkv_a_rows, c.gate_rows], -1)
    else:
        g = None
    if md.dcp_world_size != layer.dcp_world_size:
        raise ValueError(f"kimi_ops.runtime.mla.pre: the metadata is built for DCP world size "
                         f"{md.dcp_world_size}, the layer's group has {layer.dcp_world_size} ranks")
    q_c, kv_c, k_pe = qkv.split([c.q_lora_rank, KV_LORA_RANK, ROPE_DIM], -1)
    if c.rope:
        k_pe = apply_rope(k_pe, md.positions, layer.rotary_inv_freq, c.rope_mscale)
    # the q / kv RMSNorms, this step's KV rows into the cache, sigmoid(g) and q_b: one kernel on sm_90
    q_b = layer.q_b_proj
    scale, blocks = fp8_scale_args(q_b)
    q, gate = ops.mla_norm_cache_write_q_b(q_c, kv_c, k_pe, layer.q_a_layernorm.weight, layer.kv_a_layernorm.weight,
                                           kv_cache, md.slot_mapping, q_b.weight, scale, g, eps=c.rms_norm_eps,
                                           kv_scale=layer.kv_scale, constant_w=True, **blocks)
    q = q.view(-1, layer.num_heads, nope + rope)
    q_nope, q_pe = q.split([nope, rope], -1)
    if c.rope:
        q_pe = apply_rope(q_pe, md.positions, layer.rotary_inv_freq, c.rope_mscale)
    bf16 = layer.query_bf16 if bf16 is None else bf16
    q = ops.mla_query(q_nope, q_pe, layer.W_UK, layer.W_UK_scale, constant_w=True)
    if bf16:
        q = dcp.query_all_gather(q, layer.dcp_group)       # DCP: [T, H, 576] -> [T, W * H, 576]
    else:
        q = quantize_step_query(layer, q)
        q = FP8Query(*dcp.query_all_gather_fp8(q.q8, q.q_scale, layer.dcp_group))
    return q, (gate if g is not None else None)


def attend(layer, q, kv_cache: torch.Tensor, md):
    """The attention (M1c + M1b) of the query ``q [T, H, 576]`` (bf16, or :class:`FP8Query`) over the cache:
    ``(o [T, H, 512] bf16, lse [T, H] f32)``, softmax scale ``config.softmax_scale``,
    ``kv_scale`` the layer's. Under DCP, ``q`` holds every rank's heads and the result
    is this rank's partial over its shard of the tokens (causal bounds in global
    positions: ``md.seq_lens`` are global). ``layer.attention == "aiter"`` routes to
    AITER's kernel (ROCm)."""
    q, q_scale = (q.q8, q.q_scale) if isinstance(q, FP8Query) else (q, None)
    if layer.attention == "aiter":
        if q_scale is not None:
            raise ValueError("kimi_ops.runtime.mla.attend: attention='aiter' takes the bf16 query (pre(bf16=True))")
        return aiter_fallback.aiter_attend(q, kv_cache, md, scale=layer.config.softmax_scale,
                                           kv_scale=layer.kv_scale, return_lse=md.dcp_world_size > 1)
    return ops.mla_decode(q, kv_cache, md.kv_indptr, md.kv_indices, qlen=md.qlen,
                          scale=layer.config.softmax_scale, kv_scale=layer.kv_scale, num_splits=layer.num_splits,
                          q_scale=q_scale, seq_lens=md.seq_lens, dcp_rank=md.dcp_rank, dcp_world_size=md.dcp_world_size,
                          constant_kv=True)  # pre's last kernel (M1a / the fp8 query's) writes q only


def m1c_inputs(layer, q, kv_cache: torch.Tensor, md, num_splits: int | None = None):
    """M1c's inputs for M1a's query ``q [T, H, 576]`` (bf16, or :class:`FP8Query`: then
    ``q_scale`` is among them) and buffers of its partials:
    ``(m1c_in, o_part [splits, T, H, 512] bf16, lse_part [splits, T, H] f32)``;
    ``kimi_ops.mla_decode_splitkv(**m1c_in)`` computes the partials, ``kimi_ops.mla_merge``
    merges them (M1b)."""
    from .. import dispatch
    q, q_scale = (q.q8, q.q_scale) if isinstance(q, FP8Query) else (q, None)
    splits = num_splits or layer.num_splits or dispatch.default_num_splits(
        md.num_requests, q.shape[0], q.shape[1], md.max_tokens, q.device)
    m1c_in = dict(q=q, kv_cache=kv_cache.view(-1, kv_cache.shape[-1]), kv_indptr=md.kv_indptr,
                  kv_indices=md.kv_indices, qlen=md.qlen, scale=layer.config.softmax_scale,
                  kv_scale=layer.kv_scale, num_splits=splits)
    if q_scale is not None:
        m1c_in["q_scale"] = q_scale
    po = torch.empty((splits, q.shape[0], q.shape[1], KV_LORA_RANK), dtype=torch.bfloat16, device=q.device)
    plse = torch.empty((splits, q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device)
    return m1c_in, po, plse


def post(layer, o: torch.Tensor, lse: torch.Tensor, md, gate: torch.Tensor | None):
    """o_proj's input ``[T, H * v]`` bf16: W_UV applied to each head's latent output, times the
    gate (:func:`kimi_ops.mla_v_up_proj`: one kernel, the gate on the float32 product)."""
    latent, _ = dcp.combine(o, lse, layer.dcp_group, layer.dcp_combine)  # DCP: W * H -> H heads
    return ops.mla_v_up_proj(latent, layer.W_UV, layer.W_UV_scale, gate, constant_w=True)


def layer(module, hidden: torch.Tensor, kv_cache: torch.Tensor, md) -> torch.Tensor:
    """One decode step: ``post(attend(pre(...)))``, o_proj's input ``[T, H * v]``."""
    q, gate = pre(module, hidden, kv_cache, md)
    o, lse = attend(module, q, kv_cache, md)
    return post(module, o, lse, md, gate)
