"""MLA layer dimensions: :class:`MLAConfig` and its presets.

The latent cache layout fixes ``kv_lora_rank = 512`` and ``qk_rope_head_dim = 64``
(one cache row is ``[kv_c 512 | k_pe 64]`` = 576 fp8 bytes); everything else
(hidden size, q_lora rank, heads, nope / v head dims) is free, so small configs
for tests work the same way as Kimi-K3's.
"""

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from ..formats import KV_LORA_RANK, ROPE_DIM


def _yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention factor ``get_mscale(s, m) = 0.1 m ln(s) + 1`` for s > 1, else 1."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class RopeScaling:
    """DeepSeek's YaRN rope scaling (HF ``rope_scaling`` with ``type: yarn``).

    ``mscale`` and ``mscale_all_dim`` act as in transformers / vLLM (DeepSeek-V3): the
    rotary cos / sin are scaled by ``get_mscale(factor, mscale) / get_mscale(factor,
    mscale_all_dim)`` (:attr:`MLAConfig.rope_mscale`; 1 when the two are equal, as in
    DeepSeek-V3's config), and the softmax scale by ``get_mscale(factor, mscale_all_dim)^2``
    (:attr:`MLAConfig.softmax_scale`)."""
    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0


@dataclass(frozen=True)
class MLAConfig:
    """One tensor-parallel rank's share of an MLA attention layer (decode only).

    ``num_heads`` is the heads on this rank (``total_heads / tp``). ``gate``: a
    sigmoid output gate ``g_proj [num_heads * v_head_dim, hidden_size]``
    (Kimi-K3). ``rope``: rotary embedding on ``q_pe`` / ``k_pe`` at each token's
    position (DeepSeek-V3); Kimi-K3 is NoPE (the 64 "rope" channels carry
    un-rotated keys). ``o_proj``: whether the layer holds this rank's row-parallel
    ``o_proj [hidden_size, num_heads * v_head_dim]`` (its all-reduce is the
    caller's). ``quantization_config``: the HF config's ``quantization_config`` (a dict such as
    ``{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}``; kept as a tuple of
    its items, so the config stays hashable): :attr:`weight_block_size` reads the block size of
    fp8 block-scaled checkpoints from it.
    """
    name: str = "custom"
    hidden_size: int = 7168
    total_heads: int = 96
    tp: int = 8
    q_lora_rank: int = 1536
    kv_lora_rank: int = KV_LORA_RANK
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = ROPE_DIM
    v_head_dim: int = 128
    gate: bool = True
    rope: bool = False
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    o_proj: bool = True
    quantization_config: tuple | None = None
    softmax_scale_override: float | None = field(default=None, repr=False)

    def __post_init__(self):
        qc = self.quantization_config
        if isinstance(qc, Mapping):
            object.__setattr__(self, "quantization_config", tuple(sorted(
                (str(k), tuple(v) if isinstance(v, list) else v) for k, v in qc.items())))
        elif qc is not None and not isinstance(qc, tuple):
            raise ValueError(f"MLAConfig: quantization_config must be a dict (HF's), got {type(qc).__name__}")
        bn, bk = self.weight_block_size
        if bn < 1 or bk < 1:
            raise ValueError(f"MLAConfig: quantization_config.weight_block_size must be positive, got {(bn, bk)}")
        if self.kv_lora_rank != KV_LORA_RANK or self.qk_rope_head_dim != ROPE_DIM:
            raise ValueError(f"MLAConfig: the 576-byte cache row fixes kv_lora_rank = {KV_LORA_RANK} and "
                             f"qk_rope_head_dim = {ROPE_DIM}, got {self.kv_lora_rank} and {self.qk_rope_head_dim}")
        if self.tp < 1 or self.total_heads % self.tp != 0:
            raise ValueError(f"MLAConfig: total_heads ({self.total_heads}) must split evenly over tp ({self.tp})")
        for name in ("qk_nope_head_dim", "v_head_dim"):
            if getattr(self, name) % 32 != 0:
                raise ValueError(f"MLAConfig: {name} must be a multiple of 32 (MXFP4 blocks), "
                                 f"got {getattr(self, name)}")
        if self.hidden_size < 1 or self.q_lora_rank < 1:
            raise ValueError("MLAConfig: hidden_size and q_lora_rank must be positive")

    @property
    def weight_block_size(self) -> tuple[int, int]:
        """(rows, cols) of one fp8 weight block: ``quantization_config.weight_block_size`` where
        given, else (128, 128) (DeepSeek-V3's / Kimi-K2's)."""
        qc = dict(self.quantization_config or ())
        size = qc.get("weight_block_size")
        if size is None:
            return (128, 128)
        if len(size) != 2:
            raise ValueError(f"MLAConfig: quantization_config.weight_block_size must be [rows, cols], got {size}")
        return int(size[0]), int(size[1])

    # --- derived sizes ---------------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        """Heads on this rank."""
        return self.total_heads // self.tp

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def qkv_a_rows(self) -> int:
        """Rows of fused_qkv_a_proj: ``q_lora + kv_lora + rope``."""
        return self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def gate_rows(self) -> int:
        """Rows of g_proj (0 without a gate)."""
        return self.num_heads * self.v_head_dim if self.gate else 0

    @property
    def o_proj_in(self) -> int:
        """Width of o_proj's input (the layer's ``post`` output)."""
        return self.num_heads * self.v_head_dim

    @property
    def softmax_scale(self) -> float:
        """``1/sqrt(nope + rope)``, times YaRN's ``mscale^2`` where DeepSeek's rope scaling applies."""
        if self.softmax_scale_override is not None:
            return self.softmax_scale_override
        scale = 1.0 / math.sqrt(self.qk_head_dim)
        if self.rope and self.rope_scaling is not None:
            m = _yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def rope_mscale(self) -> float:
        """The factor on the rotary cos / sin (q_pe and k_pe alike): YaRN's
        ``get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)``; 1 without
        RoPE or rope scaling."""
        if not self.rope or self.rope_scaling is None:
            return 1.0
        ys = self.rope_scaling
        return _yarn_mscale(ys.factor, ys.mscale) / _yarn_mscale(ys.factor, ys.mscale_all_dim)

    def replace(self, **changes) -> "MLAConfig":
        return replace(self, **changes)

    # --- presets ---------------------------------------------------------------------------
    @classmethod
    def kimi_k3(cls, tp: int = 8) -> "MLAConfig":
        """Kimi-K3: 96 heads (12 a rank at TP8), hidden 7168, q_lora 1536, NoPE, sigmoid gate."""
        return cls(name=f"kimi_k3_tp{tp}", hidden_size=7168, total_heads=96, tp=tp, q_lora_rank=1536,
                   gate=True, rope=False)

    @classmethod
    def deepseek_v3(cls, tp: int = 8) -> "MLAConfig":
        """DeepSeek-V3 / R1: 128 heads (16 a rank at TP8), RoPE (YaRN, factor 40) on q_pe / k_pe, no gate."""
        return cls(name=f"deepseek_v3_tp{tp}", hidden_size=7168, total_heads=128, tp=tp, q_lora_rank=1536,
                   gate=False, rope=True, rope_theta=10000.0, rope_scaling=RopeScaling())

    @classmethod
    def small(cls, *, heads: int = 4, hidden_size: int = 256, q_lora_rank: int = 128, gate: bool = True,
              rope: bool = False, o_proj: bool = True) -> "MLAConfig":
        """A small config for tests (the cache dims stay 512 + 64)."""
        return cls(name="small", hidden_size=hidden_size, total_heads=heads, tp=1, q_lora_rank=q_lora_rank,
                   gate=gate, rope=rope, rope_scaling=RopeScaling() if rope else None, o_proj=o_proj)
