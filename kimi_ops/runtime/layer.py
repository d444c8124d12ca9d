"""MLADecodeLayer: one tensor-parallel rank's MLA attention weights, in vLLM / HF names.

Weights (this rank's share, ``H = config.num_heads``)::

    fused_qkv_a_proj.weight  [q_lora + 512 + 64 (+ H*128 gate rows when merged), hidden]  bf16
    q_a_layernorm.weight     [q_lora]
    q_b_proj.weight          [H * (128 + 64), q_lora]
    kv_a_layernorm.weight    [512]
    kv_b_proj.weight         [H * (128 + v), 512]   -- split on load into W_UK / W_UV
    g_proj.weight            [H * v, hidden]        (gate configs, unless merged into fused_qkv_a_proj)
    o_proj.weight            [hidden, H * v]        (optional: config.o_proj)

``kv_b_proj`` is not kept: it is split into ``W_UK [H, 128, 512]`` (``k_nope = W_UK[h] @
kv_c``, absorbed into the query by M1a) and ``W_UV [H, v, 512]`` (``v = W_UV[h] @ kv_c``,
applied after the attention), in bf16 or in MXFP4 (``weights='mxfp4'``; via
:func:`kimi_ops.mxfp4_quantize`, in the layouts the ops take: ``W_UK`` packed along the
128 axis ``[H, 512, 64]`` + scales ``[H, 512, 4]``; ``W_UV`` ``[H, v, 256]`` + ``[H, v, 16]``
for :func:`kimi_ops.bmm_a16wfp4`).

``merge_gate=True`` (the default where there is a gate) keeps ``g_proj``'s rows at the
end of ``fused_qkv_a_proj`` (one GEMM, vLLM's ``KimiK3MergedQKVGateLinear``);
:func:`kimi_ops.runtime.mla.qkv_gate_weights` returns the two row slices.
"""

import math
import os

import torch
from torch import nn

from .. import ops
from ..formats import KV_LORA_RANK, ROPE_DIM
from . import aiter_fallback, dcp
from .config import MLAConfig

WEIGHT_FORMATS = ("bf16", "mxfp4")


class _Weight(nn.Module):
    """Holds one ``weight`` buffer, so the layer's state_dict keys are ``<name>.weight``."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight)


def _yarn_inv_freq(config: MLAConfig) -> torch.Tensor:
    """DeepSeek's rotary inverse frequencies [rope / 2] (float64), YaRN-corrected when configured."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    exps = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    freq_extra = 1.0 / (base ** exps)
    ys = config.rope_scaling
    if ys is None or ys.factor <= 1.0:
        return freq_extra
    freq_inter = 1.0 / (ys.factor * base ** exps)

    def correction_dim(rotations):
        return dim * math.log(ys.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(ys.beta_fast)), 0)
    high = min(math.ceil(correction_dim(ys.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extra_mask = 1.0 - ramp
    return freq_inter * (1 - extra_mask) + freq_extra * extra_mask


def random_hf_weights(config: MLAConfig, *, seed: int = 0, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """Seeded random weights of one rank, HF names, ``g_proj`` separate, ``kv_b_proj`` whole.

    Scales keep activations about unit size: linear weights N(0, 1/fan_in), norm weights
    1 + N(0, 0.1^2), so the softmax logits come out with a standard deviation near 1.
    """
    gen = torch.Generator().manual_seed(seed)
    c, h = config, config.num_heads

    def linear(rows, cols):
        return (torch.randn(rows, cols, generator=gen) / math.sqrt(cols)).to(dtype)

    def norm(n):
        return (1.0 + 0.1 * torch.randn(n, generator=gen)).to(dtype)

    sd = {
        "fused_qkv_a_proj.weight": linear(c.qkv_a_rows, c.hidden_size),
        "q_a_layernorm.weight": norm(c.q_lora_rank),
        "q_b_proj.weight": linear(h * c.qk_head_dim, c.q_lora_rank),
        "kv_a_layernorm.weight": norm(c.kv_lora_rank),
        "kv_b_proj.weight": linear(h * (c.qk_nope_head_dim + c.v_head_dim), c.kv_lora_rank),
    }
    if c.gate:
        sd["g_proj.weight"] = linear(c.gate_rows, c.hidden_size)
    if c.o_proj:
        sd["o_proj.weight"] = linear(c.hidden_size, c.o_proj_in)
    return sd


def _read_safetensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(os.fspath(path))


class MLADecodeLayer(nn.Module):
    """One rank's MLA attention layer for pure decode steps (see the module docstring).

    Args:
        config: :class:`MLAConfig` (default ``MLAConfig.kimi_k3(tp=8)``).
        weights: ``'bf16'`` or ``'mxfp4'``: the format of W_UK / W_UV (other weights are bf16).
        dtype: activation / weight dtype; the ops take bf16.
        device: where the weights live.
        seed: seed of the random init (``None``: leave the weights zero, to be loaded).
        merge_gate: keep g_proj's rows inside fused_qkv_a_proj (one GEMM).
        kv_scale: the fp8 cache's per-tensor scale (cache rows are ``fp8(x / kv_scale)``).
        num_splits: split-KV count for the attention (``None``: the ops' host heuristic).
        dcp_group: a ``torch.distributed`` group for decode context parallel (``None``: one
            rank). Build the step's metadata with ``dcp_world_size`` / ``dcp_rank`` of the group.
        dcp_combine: how the ranks' partials are combined (:data:`kimi_ops.runtime.dcp.COMBINES`).
        attention: ``'kimi_ops'`` (our kernels, every platform) or ``'aiter'`` (AITER's
            ``mla_decode_fwd``; ROCm with ``aiter`` importable only, never run on AMD by us).
        bf16: the seeds' query switch (issue 28). True: the bf16 query; False: the fp8 query
            (M1a's bf16 query quantized per tensor, all-gathered in fp8 under DCP: half the
            bytes); None (the default): fp8 under DCP, bf16 at DCP1 and with ``'aiter'``.
        q_scale: a static per-tensor scale of the fp8 query (``q8 = fp8(q / q_scale)``); None:
            the scale of each step's amax, computed on the device (under DCP the max over the
            ranks, one all-reduce of 4 bytes).
        query_dtype: the fp8 query's format (``torch.float8_e4m3fn``; ``float8_e4m3fnuz``
            only with an e4m3fnuz cache).
    """

    def __init__(self, config: MLAConfig | None = None, *, weights: str = "bf16", dtype=torch.bfloat16,
                 device="cpu", seed: int | None = 0, merge_gate: bool = True, kv_scale: float = 1.0 / 16,
                 num_splits: int | None = None, dcp_group=None, dcp_combine: str = "all_to_all",
                 attention: str = "kimi_ops", bf16: bool | None = None, q_scale: float | None = None,
                 query_dtype=torch.float8_e4m3fn):
        super().__init__()
        config = config or MLAConfig.kimi_k3()
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"MLADecodeLayer: weights must be one of {WEIGHT_FORMATS}, got {weights!r}")
        if dtype != torch.bfloat16:
            raise ValueError(f"MLADecodeLayer: the ops take bf16 activations; dtype must be torch.bfloat16, got {dtype}")
        self.config = config
        self.weight_format = weights
        self.dtype = dtype
        self.kv_scale = float(kv_scale)
        self.num_splits = num_splits
        self.merge_gate = bool(merge_gate and config.gate)
        self.dcp_group = dcp_group
        if dcp_combine not in dcp.COMBINES:
            raise ValueError(f"MLADecodeLayer: dcp_combine must be one of {dcp.COMBINES}, got {dcp_combine!r}")
        self.dcp_combine = dcp_combine
        if attention not in ("kimi_ops", "aiter"):
            raise ValueError(f"MLADecodeLayer: attention must be 'kimi_ops' or 'aiter', got {attention!r}")
        if attention == "aiter" and not aiter_fallback.available():
            raise ValueError("MLADecodeLayer: attention='aiter' needs a ROCm torch with aiter importable")
        self.attention = attention
        if query_dtype not in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
            raise ValueError(f"MLADecodeLayer: query_dtype must be torch.float8_e4m3fn or torch.float8_e4m3fnuz, "
                             f"got {query_dtype}")
        if bf16 is False and attention == "aiter":
            raise ValueError("MLADecodeLayer: attention='aiter' takes the bf16 query; bf16=False needs 'kimi_ops'")
        if q_scale is not None and not (math.isfinite(q_scale) and q_scale > 0):
            raise ValueError(f"MLADecodeLayer: q_scale must be None or a finite float > 0, got {q_scale}")
        self.bf16 = bf16
        self.query_dtype = query_dtype
        c, h, dev = config, config.num_heads, torch.device(device)
        self.register_buffer("q_scale", None if q_scale is None else
                             torch.full((1,), float(q_scale), dtype=torch.float32, device=dev), persistent=False)

        def zeros(*shape, dt=dtype):
            return torch.zeros(*shape, dtype=dt, device=dev)

        self.fused_qkv_a_proj = _Weight(zeros(c.qkv_a_rows + (c.gate_rows if self.merge_gate else 0), c.hidden_size))
        self.q_a_layernorm = _Weight(zeros(c.q_lora_rank))
        self.q_b_proj = _Weight(zeros(h * c.qk_head_dim, c.q_lora_rank))
        self.kv_a_layernorm = _Weight(zeros(c.kv_lora_rank))
        self.g_proj = _Weight(zeros(c.gate_rows, c.hidden_size)) if c.gate and not self.merge_gate else None
        self.o_proj = _Weight(zeros(c.hidden_size, c.o_proj_in)) if c.o_proj else None
        nope, v = c.qk_nope_head_dim, c.v_head_dim
        if weights == "bf16":
            self.register_buffer("W_UK", zeros(h, nope, KV_LORA_RANK))
            self.register_buffer("W_UV", zeros(h, v, KV_LORA_RANK))
            self.W_UK_scale = self.W_UV_scale = None
        else:
            self.register_buffer("W_UK", zeros(h, KV_LORA_RANK, nope // 2, dt=torch.uint8))
            self.register_buffer("W_UK_scale", zeros(h, KV_LORA_RANK, nope // 32, dt=torch.uint8))
            self.register_buffer("W_UV", zeros(h, v, KV_LORA_RANK // 2, dt=torch.uint8))
            self.register_buffer("W_UV_scale", zeros(h, v, KV_LORA_RANK // 32, dt=torch.uint8))
        if c.rope:
            self.register_buffer("rotary_inv_freq", _yarn_inv_freq(c).to(torch.float32).to(dev))
        else:
            self.rotary_inv_freq = None
        if seed is not None:
            self.load_weights(random_hf_weights(c, seed=seed, dtype=dtype))

    # --- properties ------------------------------------------------------------------------
    @property
    def dcp_world_size(self) -> int:
        return dcp.world_and_rank(self.dcp_group)[0]

    @property
    def query_bf16(self) -> bool:
        """Whether :func:`kimi_ops.runtime.mla.pre` makes the bf16 query (the ``bf16`` switch;
        its default: fp8 under DCP, where the all-gather halves, bf16 at DCP1 and with AITER)."""
        if self.bf16 is not None:
            return self.bf16
        return self.dcp_world_size == 1 or self.attention == "aiter"

    @property
    def device(self) -> torch.device:
        return self.q_b_proj.weight.device

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def weight_bytes(self) -> int:
        """Bytes of every weight a decode step reads (the performance floor counts them)."""
        return sum(t.numel() * t.element_size() for t in self.buffers())

    # --- weights in and out ----------------------------------------------------------------
    def load_weights(self, source, *, prefix: str = "", tp_rank: int = 0, strict: bool = True) -> "MLADecodeLayer":
        """Load HF / vLLM-named weights from a dict or a ``.safetensors`` file.

        Accepts ``fused_qkv_a_proj.weight`` (with or without the gate rows) or the unfused
        ``q_a_proj.weight`` + ``kv_a_proj_with_mqa.weight``; ``kv_b_proj.weight`` whole (split
        into W_UK / W_UV here, quantized to MXFP4 if the layer's weights are); ``g_proj``;
        ``o_proj``. Per-head weights holding all ``total_heads`` heads (an unsharded
        checkpoint) are sliced to rank ``tp_rank``'s heads. ``prefix`` (e.g.
        ``'model.layers.0.self_attn.'``) is stripped.
        """
        sd = _read_safetensors(source) if isinstance(source, (str, os.PathLike)) else source
        sd = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
        c, h = self.config, self.num_heads
        used = set()

        def take(name, required=True):
            if name in sd:
                used.add(name)
                return sd[name]
            if required:
                raise KeyError(f"MLADecodeLayer.load_weights: missing {prefix}{name}")
            return None

        def heads_rows(w, per_head, name):
            """Rank tp_rank's rows of a per-head [heads * per_head, ...] weight."""
            if w.shape[0] == c.total_heads * per_head and c.total_heads != h:
                return w[tp_rank * h * per_head:(tp_rank + 1) * h * per_head]
            if w.shape[0] != h * per_head:
                raise ValueError(f"MLADecodeLayer.load_weights: {name} has {w.shape[0]} rows, expected "
                                 f"{h} * {per_head} (this rank) or {c.total_heads} * {per_head} (all heads)")
            return w

        if "fused_qkv_a_proj.weight" in sd:
            qkv = take("fused_qkv_a_proj.weight")
        else:
            qkv = torch.cat([take("q_a_proj.weight"), take("kv_a_proj_with_mqa.weight")], 0)
        gate = None
        if c.gate:
            if qkv.shape[0] == c.qkv_a_rows + c.gate_rows:      # merged checkpoint
                qkv, gate = qkv[:c.qkv_a_rows], qkv[c.qkv_a_rows:]
            else:
                gate = heads_rows(take("g_proj.weight"), c.v_head_dim, "g_proj.weight")
        if tuple(qkv.shape) != (c.qkv_a_rows, c.hidden_size):
            raise ValueError(f"MLADecodeLayer.load_weights: fused_qkv_a_proj must be "
                             f"[{c.qkv_a_rows}, {c.hidden_size}], got {tuple(qkv.shape)}")
        if self.merge_gate:
            self.fused_qkv_a_proj.weight.copy_(torch.cat([qkv, gate], 0))
        else:
            self.fused_qkv_a_proj.weight.copy_(qkv)
            if gate is not None:
                self.g_proj.weight.copy_(gate)
        self.q_a_layernorm.weight.copy_(take("q_a_layernorm.weight"))
        self.kv_a_layernorm.weight.copy_(take("kv_a_layernorm.weight"))
        self.q_b_proj.weight.copy_(heads_rows(take("q_b_proj.weight"), c.qk_head_dim, "q_b_proj.weight"))
        nope, v = c.qk_nope_head_dim, c.v_head_dim
        kv_b = heads_rows(take("kv_b_proj.weight"), nope + v, "kv_b_proj.weight")
        kv_b = kv_b.to(device=self.device, dtype=self.dtype).view(h, nope + v, KV_LORA_RANK)
        self.set_kv_b(kv_b[:, :nope], kv_b[:, nope:])
        if self.o_proj is not None:
            o = take("o_proj.weight", required=strict)
            if o is not None:
                if o.shape[1] == c.total_heads * v and c.total_heads != h:
                    o = o[:, tp_rank * h * v:(tp_rank + 1) * h * v]
                self.o_proj.weight.copy_(o)
        if strict:
            extra = sorted(set(sd) - used)
            if extra:
                raise KeyError(f"MLADecodeLayer.load_weights: unexpected keys {extra}")
        return self

    @torch.no_grad()
    def set_kv_b(self, w_uk: torch.Tensor, w_uv: torch.Tensor) -> None:
        """Set W_UK [H, 128, 512] and W_UV [H, v, 512] from bf16 (quantized here for MXFP4)."""
        w_uk = w_uk.to(device=self.device, dtype=self.dtype)
        w_uv = w_uv.to(device=self.device, dtype=self.dtype)
        if self.weight_format == "bf16":
            self.W_UK.copy_(w_uk)
            self.W_UV.copy_(w_uv)
        else:
            packed, scale = ops.mxfp4_quantize(w_uk.transpose(1, 2).contiguous())   # [H, 512, 128] -> packed
            self.W_UK.copy_(packed)
            self.W_UK_scale.copy_(scale)
            packed, scale = ops.mxfp4_quantize(w_uv.contiguous())                    # [H, v, 512] -> packed
            self.W_UV.copy_(packed)
            self.W_UV_scale.copy_(scale)

    def dequantized_kv_b(self, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, 128, 512], W_UV [H, v, 512]) as the layer applies them, in ``dtype``."""
        if self.weight_format == "bf16":
            return self.W_UK.to(dtype), self.W_UV.to(dtype)
        w_uk = ops.mxfp4_dequantize(self.W_UK, self.W_UK_scale, dtype=dtype).transpose(1, 2)
        w_uv = ops.mxfp4_dequantize(self.W_UV, self.W_UV_scale, dtype=dtype)
        return w_uk.contiguous(), w_uv

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's weights under HF names (``g_proj`` separate, ``kv_b_proj`` whole;
        MXFP4 W_UK / W_UV come back dequantized, which reloads to the same bytes)."""
        from .mla import qkv_gate_weights
        qkv, gate = qkv_gate_weights(self)
        w_uk, w_uv = self.dequantized_kv_b(self.dtype)
        sd = {
            "fused_qkv_a_proj.weight": qkv,
            "q_a_layernorm.weight": self.q_a_layernorm.weight,
            "q_b_proj.weight": self.q_b_proj.weight,
            "kv_a_layernorm.weight": self.kv_a_layernorm.weight,
            "kv_b_proj.weight": torch.cat([w_uk, w_uv], 1).reshape(-1, KV_LORA_RANK),
        }
        if gate is not None:
            sd["g_proj.weight"] = gate
        if self.o_proj is not None:
            sd["o_proj.weight"] = self.o_proj.weight
        return {k: t.detach().contiguous().clone() for k, t in sd.items()}

    def save_safetensors(self, path) -> None:
        from safetensors.torch import save_file
        save_file({k: t.cpu() for k, t in self.hf_state_dict().items()}, os.fspath(path))

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict``, which also takes an HF-style dict (one holding
        ``kv_b_proj.weight``): that goes through :meth:`load_weights`."""
        if any(k.endswith("kv_b_proj.weight") for k in state_dict):
            self.load_weights(state_dict, strict=strict)
            return torch.nn.modules.module._IncompatibleKeys([], [])
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    # --- cache -----------------------------------------------------------------------------
    def new_kv_cache(self, num_blocks: int, block_size: int = 1, dtype=torch.float8_e4m3fn) -> torch.Tensor:
        """A zeroed latent cache ``[num_blocks, block_size, 576]`` on the layer's device."""
        return torch.zeros(num_blocks, block_size, KV_LORA_RANK + ROPE_DIM, dtype=dtype, device=self.device)

    # --- the step --------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, kv_cache: torch.Tensor | None = None, md=None) -> torch.Tensor:
        """One decode step of the attention block: ``hidden [T, hidden]`` (input_layernorm's
        output) -> ``o_proj(mla.layer(...))`` ``[T, hidden]`` (this rank's partial sum; the
        TP all-reduce is the caller's), or ``mla.layer``'s ``[T, H * v]`` without o_proj.
        ``kv_cache`` / ``md`` default to :func:`kimi_ops.runtime.mla.context`'s."""
        from . import mla
        if kv_cache is None or md is None:
            md, _, kv_cache, _ = mla.context(self)
        out = mla.layer(self, hidden, kv_cache, md)
        if self.o_proj is not None:
            out = torch.nn.functional.linear(out, self.o_proj.weight)
        return out

    def extra_repr(self) -> str:
        c = self.config
        return (f"{c.name}: heads {c.num_heads}/{c.total_heads}, hidden {c.hidden_size}, q_lora {c.q_lora_rank}, "
                f"weights {self.weight_format}, gate {c.gate} (merged {self.merge_gate}), rope {c.rope}, "
                f"o_proj {c.o_proj}, kv_scale {self.kv_scale}, query {'bf16' if self.query_bf16 else self.query_dtype}")
