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

``weights='fp8'``: the projections (``fused_qkv_a_proj`` with the gate rows, ``q_b_proj``,
``g_proj`` when separate, ``o_proj``) are held as fp8 e4m3 with float32 block scales, as
DeepSeek-V3 / Kimi-K2 checkpoints ship them (``<proj>.weight`` fp8 + ``<proj>.weight_scale_inv``
``[ceil(rows / bn), ceil(cols / bk)]``, real weight = fp8 x its block's scale; ``(bn, bk)`` is
``config.weight_block_size``), and run as :func:`kimi_ops.gemm_a16w8_block` (no dequantized copy).
Each fp8 projection's ``weight_scale_inv`` has one row per ``block_n`` rows (a module attribute):
``bn`` for ``q_b_proj`` / ``g_proj`` / ``o_proj``; for the fused ``[q_a | kv_a | gate]`` weight
the gcd of ``bn`` and its segment boundaries (Kimi-K3: 64, since kv_a's 576 rows end mid-block),
each checkpoint block's scale repeated over its 64-row halves: exact, 57 x 56 floats.
``kv_b_proj`` of an fp8 checkpoint is dequantized on load to bf16 W_UK / W_UV (they are
applied per head as [128, 512] / [v, 512] products, M1a and the W_UV bmm, whose kernels take
bf16 or MXFP4; 3.1 MB at Kimi-K3 TP8). A bf16 / mxfp4 layer given an fp8 checkpoint dequantizes
every projection to bf16 (float32 product, one rounding); an fp8 layer given bf16 weights
quantizes them per block (scale = amax / 448, :func:`kimi_ops.reference.fp8.quantize_fp8_blocks`).

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
from ..reference.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks
from . import aiter_fallback, dcp
from .config import MLAConfig

WEIGHT_FORMATS = ("bf16", "mxfp4", "fp8")


class _Weight(nn.Module):
    """Holds one ``weight`` buffer, so the layer's state_dict keys are ``<name>.weight``.
    fp8 projections also hold ``weight_scale_inv`` (float32 ``[ceil(rows / block_n),
    ceil(cols / block_k)]``) and the ints ``block_n`` / ``block_k``."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor | None = None, block_n: int = 128,
                 block_k: int = 128):
        super().__init__()
        self.register_buffer("weight", weight)
        if scale is not None:
            self.register_buffer("weight_scale_inv", scale)
            self.block_n, self.block_k = int(block_n), int(block_k)
        else:
            self.weight_scale_inv = None

    def dense(self, dtype=torch.float32) -> torch.Tensor:
        """The weight as applied, ``dtype`` (fp8 ones dequantized, float32 product)."""
        if self.weight_scale_inv is None:
            return self.weight.to(dtype)
        return dequantize_fp8_blocks(self.weight, self.weight_scale_inv, self.block_n, self.block_k, dtype)


class _Proj:
    """A projection as read from a checkpoint: a dense weight [rows, cols], or fp8 with its
    scales expanded to one row per weight row (``srow [rows, ceil(cols / bk)]``), so that row
    slices and concatenations are exact whatever the checkpoint's block grid."""

    def __init__(self, w: torch.Tensor, srow: torch.Tensor | None, bn: int, bk: int, name: str):
        self.w, self.srow, self.bn, self.bk, self.name = w, srow, bn, bk, name

    @property
    def fp8(self) -> bool:
        return self.srow is not None

    @property
    def shape(self):
        return self.w.shape

    def rows(self, r0: int, r1: int) -> "_Proj":
        return _Proj(self.w[r0:r1], None if self.srow is None else self.srow[r0:r1], self.bn, self.bk, self.name)

    def tp_rows(self, r0: int, r1: int, tp_rank: int) -> "_Proj":
        """Rows r0:r1 (a tensor-parallel rank's); an fp8 cut must fall on block boundaries."""
        if self.fp8 and (r0 % self.bn or (r1 % self.bn and r1 != self.w.shape[0])):
            raise ValueError(f"MLADecodeLayer.load_weights: tensor-parallel rank {tp_rank}'s rows {r0}:{r1} of "
                             f"{self.name} split a {self.bn}-row fp8 scale block (weight_block_size "
                             f"{self.bn} x {self.bk}): this TP size cannot keep the checkpoint's block scales")
        return self.rows(r0, r1)

    def tp_cols(self, c0: int, c1: int, tp_rank: int) -> "_Proj":
        """Columns c0:c1 (a row-parallel rank's input slice); fp8: on block boundaries."""
        if not self.fp8:
            return _Proj(self.w[:, c0:c1], None, self.bn, self.bk, self.name)
        if c0 % self.bk or (c1 % self.bk and c1 != self.w.shape[1]):
            raise ValueError(f"MLADecodeLayer.load_weights: tensor-parallel rank {tp_rank}'s columns {c0}:{c1} of "
                             f"{self.name} split a {self.bk}-column fp8 scale block (weight_block_size "
                             f"{self.bn} x {self.bk}): this TP size cannot keep the checkpoint's block scales")
        return _Proj(self.w[:, c0:c1], self.srow[:, c0 // self.bk:-(-c1 // self.bk)], self.bn, self.bk, self.name)

    def dense(self, dtype) -> torch.Tensor:
        if not self.fp8:
            return self.w.to(dtype)
        k = self.w.shape[1]
        return (self.w.to(torch.float32) * self.srow.to(torch.float32).repeat_interleave(self.bk, 1)[:, :k]).to(dtype)

    def as_fp8(self) -> "_Proj":
        """fp8 with per-row scales: as is, or quantized in (bn, bk) blocks from its first row."""
        if self.fp8:
            return self
        q, scale = quantize_fp8_blocks(self.w, self.bn, self.bk)
        return _Proj(q, scale.repeat_interleave(self.bn, 0)[:q.shape[0]], self.bn, self.bk, self.name)

    @staticmethod
    def cat(parts: list["_Proj"], fp8: bool) -> "_Proj":
        """Rows of the parts, one after another; ``fp8``: each part quantized on its own grid first
        (a dense part), else dense unless some part is fp8."""
        if len(parts) == 1:
            return parts[0]
        if not fp8 and all(not p.fp8 for p in parts):
            return _Proj(torch.cat([p.w for p in parts], 0), None, parts[0].bn, parts[0].bk, parts[0].name)
        parts = [p.as_fp8() for p in parts]
        return _Proj(torch.cat([p.w for p in parts], 0), torch.cat([p.srow for p in parts], 0),
                     parts[0].bn, parts[0].bk, " + ".join(p.name for p in parts))


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


def random_hf_weights(config: MLAConfig, *, seed: int = 0, dtype=torch.bfloat16,
                      fp8: bool = False) -> dict[str, torch.Tensor]:
    """Seeded random weights of one rank, HF names, ``g_proj`` separate, ``kv_b_proj`` whole.

    Scales keep activations about unit size: linear weights N(0, 1/fan_in), norm weights
    1 + N(0, 0.1^2), so the softmax logits come out with a standard deviation near 1.
    ``fp8=True``: the linear weights in the fp8 checkpoint format (``q_a_proj`` and
    ``kv_a_proj_with_mqa`` unfused, each ``.weight`` fp8 + ``.weight_scale_inv``, blocks of
    ``config.weight_block_size``), as DeepSeek-V3 / Kimi-K2 ship them.
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
    if fp8:
        qkv = sd.pop("fused_qkv_a_proj.weight")
        sd["q_a_proj.weight"], sd["kv_a_proj_with_mqa.weight"] = qkv[:c.q_lora_rank], qkv[c.q_lora_rank:]
        bn, bk = c.weight_block_size
        for name in [k for k in sd if k.endswith("proj.weight") or k == "kv_a_proj_with_mqa.weight"]:
            sd[name], sd[name + "_scale_inv"] = quantize_fp8_blocks(sd[name], bn, bk)
    return sd


def _read_safetensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(os.fspath(path))


class MLADecodeLayer(nn.Module):
    """One rank's MLA attention layer for pure decode steps (see the module docstring).

    Args:
        config: :class:`MLAConfig` (default ``MLAConfig.kimi_k3(tp=8)``).
        weights: ``'bf16'`` or ``'mxfp4'``: the format of W_UK / W_UV (other weights are bf16);
            ``'fp8'``: fp8 block-scaled projections, bf16 W_UK / W_UV (module docstring).
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

        bn, bk = c.weight_block_size

        def proj(rows, cols, block_n=bn):
            if weights != "fp8":
                return _Weight(zeros(rows, cols))
            scale = torch.ones(-(-rows // block_n), -(-cols // bk), dtype=torch.float32, device=dev)
            return _Weight(zeros(rows, cols, dt=torch.float8_e4m3fn), scale, block_n, bk)

        qkv_rows = c.qkv_a_rows + (c.gate_rows if self.merge_gate else 0)
        # the fused weight's scale rows: one per gcd(bn, segment boundaries) rows (module docstring)
        self.fused_qkv_a_proj = proj(qkv_rows, c.hidden_size, math.gcd(bn, c.q_lora_rank, c.qkv_a_rows, qkv_rows))
        self.q_a_layernorm = _Weight(zeros(c.q_lora_rank))
        self.q_b_proj = proj(h * c.qk_head_dim, c.q_lora_rank)
        self.kv_a_layernorm = _Weight(zeros(c.kv_lora_rank))
        self.g_proj = proj(c.gate_rows, c.hidden_size) if c.gate and not self.merge_gate else None
        self.o_proj = proj(c.hidden_size, c.o_proj_in) if c.o_proj else None
        nope, v = c.qk_nope_head_dim, c.v_head_dim
        if weights in ("bf16", "fp8"):
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
            self.load_weights(random_hf_weights(c, seed=seed, dtype=dtype, fp8=weights == "fp8"))

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

    def dense_weights(self, dtype=torch.float32) -> dict[str, torch.Tensor | None]:
        """The projections as the layer applies them, dense in ``dtype`` (fp8 ones dequantized):
        ``qkv [q_lora + 576, hidden]``, ``gate [H * v, hidden]`` (None without a gate),
        ``q_b [H * 192, q_lora]``, ``o [hidden, H * v]`` (None without o_proj)."""
        from .mla import qkv_gate_weights
        if self.weight_format != "fp8":
            qkv, gate = qkv_gate_weights(self)
            qkv, gate = qkv.to(dtype), (gate.to(dtype) if gate is not None else None)
        else:
            qkv = self.fused_qkv_a_proj.dense(dtype)
            gate = None
            if self.g_proj is not None:
                gate = self.g_proj.dense(dtype)
            elif self.merge_gate:
                qkv, gate = qkv[:self.config.qkv_a_rows], qkv[self.config.qkv_a_rows:]
        return dict(qkv=qkv, gate=gate, q_b=self.q_b_proj.dense(dtype),
                    o=self.o_proj.dense(dtype) if self.o_proj is not None else None)

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

        fp8 checkpoints: any projection may come as ``<proj>.weight`` ``float8_e4m3fn`` beside
        ``<proj>.weight_scale_inv`` float32 ``[ceil(rows / bn), ceil(cols / bk)]`` (``(bn, bk)`` =
        ``config.weight_block_size``); a tensor-parallel slice must then start and end on block
        boundaries (else ValueError). The fp8 layer keeps them as fp8 (bf16 ones are quantized);
        bf16 / mxfp4 layers dequantize them (the module docstring).
        """
        sd = _read_safetensors(source) if isinstance(source, (str, os.PathLike)) else source
        sd = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
        c, h = self.config, self.num_heads
        bn, bk = c.weight_block_size
        fp8 = self.weight_format == "fp8"
        used = set()

        def take(name, required=True):
            if name in sd:
                used.add(name)
                return sd[name]
            if required:
                raise KeyError(f"MLADecodeLayer.load_weights: missing {prefix}{name}")
            return None

        def take_proj(name, required=True) -> _Proj | None:
            w = take(f"{name}.weight", required)
            if w is None:
                return None
            scale = take(f"{name}.weight_scale_inv", required=False)
            is_fp8 = w.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
            if is_fp8 != (scale is not None):
                raise ValueError(f"MLADecodeLayer.load_weights: {prefix}{name}.weight is {w.dtype} "
                                 + ("without" if is_fp8 else "with") + f" {prefix}{name}.weight_scale_inv: an fp8 "
                                 "weight needs its float32 block scales and only an fp8 weight has them")
            if scale is None:
                return _Proj(w, None, bn, bk, name)
            if w.dtype != torch.float8_e4m3fn:
                w = w.to(torch.float32).to(torch.float8_e4m3fn)   # e4m3fnuz values are e4m3fn values
            expected = (-(-w.shape[0] // bn), -(-w.shape[1] // bk))
            if tuple(scale.shape) != expected:
                raise ValueError(f"MLADecodeLayer.load_weights: {prefix}{name}.weight_scale_inv must be "
                                 f"[ceil({w.shape[0]} / {bn}), ceil({w.shape[1]} / {bk})] = {list(expected)} "
                                 f"(weight_block_size {bn} x {bk}), got {list(scale.shape)}")
            srow = scale.to(torch.float32).repeat_interleave(bn, 0)[:w.shape[0]]
            return _Proj(w, srow, bn, bk, name)

        def heads_rows(p: _Proj, per_head):
            """Rank tp_rank's rows of a per-head [heads * per_head, ...] weight."""
            if p.shape[0] == c.total_heads * per_head and c.total_heads != h:
                return p.tp_rows(tp_rank * h * per_head, (tp_rank + 1) * h * per_head, tp_rank)
            if p.shape[0] != h * per_head:
                raise ValueError(f"MLADecodeLayer.load_weights: {p.name} has {p.shape[0]} rows, expected "
                                 f"{h} * {per_head} (this rank) or {c.total_heads} * {per_head} (all heads)")
            return p

        if "fused_qkv_a_proj.weight" in sd:
            qkv = take_proj("fused_qkv_a_proj")
        else:
            qkv = _Proj.cat([take_proj("q_a_proj"), take_proj("kv_a_proj_with_mqa")], fp8)
        gate = None
        if c.gate:
            if qkv.shape[0] == c.qkv_a_rows + c.gate_rows:      # merged checkpoint
                qkv, gate = qkv.rows(0, c.qkv_a_rows), qkv.rows(c.qkv_a_rows, qkv.shape[0])
            else:
                gate = heads_rows(take_proj("g_proj"), c.v_head_dim)
        if tuple(qkv.shape) != (c.qkv_a_rows, c.hidden_size):
            raise ValueError(f"MLADecodeLayer.load_weights: fused_qkv_a_proj must be "
                             f"[{c.qkv_a_rows}, {c.hidden_size}], got {tuple(qkv.shape)}")
        if self.merge_gate:
            self._set_proj(self.fused_qkv_a_proj, _Proj.cat([qkv, gate], fp8), "fused_qkv_a_proj")
        else:
            self._set_proj(self.fused_qkv_a_proj, qkv, "fused_qkv_a_proj")
            if gate is not None:
                self._set_proj(self.g_proj, gate, "g_proj")
        self.q_a_layernorm.weight.copy_(take("q_a_layernorm.weight"))
        self.kv_a_layernorm.weight.copy_(take("kv_a_layernorm.weight"))
        self._set_proj(self.q_b_proj, heads_rows(take_proj("q_b_proj"), c.qk_head_dim), "q_b_proj")
        nope, v = c.qk_nope_head_dim, c.v_head_dim
        kv_b = heads_rows(take_proj("kv_b_proj"), nope + v).dense(torch.float32)
        kv_b = kv_b.to(device=self.device, dtype=self.dtype).view(h, nope + v, KV_LORA_RANK)
        self.set_kv_b(kv_b[:, :nope], kv_b[:, nope:])
        if self.o_proj is not None:
            o = take_proj("o_proj", required=strict)
            if o is not None:
                if o.shape[1] == c.total_heads * v and c.total_heads != h:
                    o = o.tp_cols(tp_rank * h * v, (tp_rank + 1) * h * v, tp_rank)
                self._set_proj(self.o_proj, o, "o_proj")
        if strict:
            extra = sorted(set(sd) - used)
            if extra:
                raise KeyError(f"MLADecodeLayer.load_weights: unexpected keys {extra}")
        return self

    @torch.no_grad()
    def _set_proj(self, target: _Weight, p: _Proj, name: str) -> None:
        """Copy a checkpoint projection into one of the layer's: dense (dequantized where fp8), or
        fp8 with the target's scale grid (``target.block_n`` rows a scale row)."""
        if tuple(p.shape) != tuple(target.weight.shape):
            raise ValueError(f"MLADecodeLayer.load_weights: {name} must be {list(target.weight.shape)}, "
                             f"got {list(p.shape)}")
        if target.weight_scale_inv is None:
            target.weight.copy_(p.dense(torch.float32))
            return
        p = p.as_fp8()
        unit = target.block_n
        rows = p.srow.shape[0]
        srow = p.srow.to(torch.float32)
        pad = (-rows) % unit
        grid = torch.cat([srow, srow[-1:].expand(pad, -1)], 0).view(-1, unit, srow.shape[1])
        if not torch.equal(grid, grid[:, :1].expand_as(grid)):
            raise ValueError(f"MLADecodeLayer.load_weights: {name}'s fp8 block scales change inside a {unit}-row "
                             f"group of the layer's scale grid (its segments must start on multiples of {unit})")
        target.weight.copy_(p.w)
        target.weight_scale_inv.copy_(grid[:, 0])

    @torch.no_grad()
    def set_kv_b(self, w_uk: torch.Tensor, w_uv: torch.Tensor) -> None:
        """Set W_UK [H, 128, 512] and W_UV [H, v, 512] from bf16 (quantized here for MXFP4;
        bf16 in the bf16 and fp8 layers)."""
        w_uk = w_uk.to(device=self.device, dtype=self.dtype)
        w_uv = w_uv.to(device=self.device, dtype=self.dtype)
        if self.W_UK_scale is None:
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
        if self.W_UK_scale is None:
            return self.W_UK.to(dtype), self.W_UV.to(dtype)
        w_uk = ops.mxfp4_dequantize(self.W_UK, self.W_UK_scale, dtype=dtype).transpose(1, 2)
        w_uv = ops.mxfp4_dequantize(self.W_UV, self.W_UV_scale, dtype=dtype)
        return w_uk.contiguous(), w_uv

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's weights under HF names (``g_proj`` separate, ``kv_b_proj`` whole;
        MXFP4 W_UK / W_UV come back dequantized, which reloads to the same bytes). The fp8
        layer's projections come back in the checkpoint format (``q_a_proj``,
        ``kv_a_proj_with_mqa``, ``g_proj``, ``q_b_proj``, ``o_proj``: fp8 ``.weight`` +
        ``.weight_scale_inv`` in ``config.weight_block_size`` blocks; ``kv_b_proj`` bf16)."""
        from .mla import qkv_gate_weights
        if self.weight_format == "fp8":
            return self._hf_state_dict_fp8()
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

    def _fp8_rows(self, proj: _Weight, r0: int, r1: int, name: str) -> dict[str, torch.Tensor]:
        """Rows r0:r1 of an fp8 projection as a checkpoint's ``name.weight`` / ``.weight_scale_inv``."""
        bn, _ = self.config.weight_block_size
        n = proj.weight.shape[0]
        srow = proj.weight_scale_inv.repeat_interleave(proj.block_n, 0)[:n][r0:r1]
        blocks = srow[::bn]
        if not torch.equal(blocks.repeat_interleave(bn, 0)[:r1 - r0], srow):
            raise ValueError(f"MLADecodeLayer.hf_state_dict: {name}'s scales are not on its own {bn}-row blocks")
        return {f"{name}.weight": proj.weight[r0:r1], f"{name}.weight_scale_inv": blocks}

    def _hf_state_dict_fp8(self) -> dict[str, torch.Tensor]:
        c = self.config
        w_uk, w_uv = self.dequantized_kv_b(self.dtype)
        fused = self.fused_qkv_a_proj
        sd = {**self._fp8_rows(fused, 0, c.q_lora_rank, "q_a_proj"),
              **self._fp8_rows(fused, c.q_lora_rank, c.qkv_a_rows, "kv_a_proj_with_mqa"),
              "q_a_layernorm.weight": self.q_a_layernorm.weight,
              **self._fp8_rows(self.q_b_proj, 0, self.q_b_proj.weight.shape[0], "q_b_proj"),
              "kv_a_layernorm.weight": self.kv_a_layernorm.weight,
              "kv_b_proj.weight": torch.cat([w_uk, w_uv], 1).reshape(-1, KV_LORA_RANK)}
        if self.g_proj is not None:
            sd.update(self._fp8_rows(self.g_proj, 0, c.gate_rows, "g_proj"))
        elif self.merge_gate:
            sd.update(self._fp8_rows(fused, c.qkv_a_rows, fused.weight.shape[0], "g_proj"))
        if self.o_proj is not None:
            sd.update({"o_proj.weight": self.o_proj.weight, "o_proj.weight_scale_inv": self.o_proj.weight_scale_inv})
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
            out = mla.project(out, self.o_proj)
        return out

    def extra_repr(self) -> str:
        c = self.config
        return (f"{c.name}: heads {c.num_heads}/{c.total_heads}, hidden {c.hidden_size}, q_lora {c.q_lora_rank}, "
                f"weights {self.weight_format}, gate {c.gate} (merged {self.merge_gate}), rope {c.rope}, "
                f"o_proj {c.o_proj}, kv_scale {self.kv_scale}, query {'bf16' if self.query_bf16 else self.query_dtype}")
