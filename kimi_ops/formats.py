"""Byte layouts and number formats shared by every backend.

Latent KV cache row (576 bytes, one fp8 byte a channel)::

    byte 0 ........ 511 | 512 ...... 575
         kv_c (latent)  | k_pe (rope part)

stored as ``fp8(x / kv_scale)``, saturated to the format's largest finite value
(448 for ``float8_e4m3fn``, 240 for ``float8_e4m3fnuz``, the gfx942 format).
"""

import torch

KV_LORA_RANK = 512
"""Latent channels of a cache row; also the width of V and of the attention output."""
ROPE_DIM = 64
"""Rope channels of a cache row (Kimi-K3 is NoPE: they hold un-rotated keys)."""
KV_ROW = KV_LORA_RANK + ROPE_DIM
"""Channels (= fp8 bytes) of one cache row and of one query head."""

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
"""Cache dtypes: OCP e4m3fn (NVIDIA, gfx950) and e4m3fnuz (gfx942)."""


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 dtype, the cache's or the query's (the saturation bound)."""
    return float(torch.finfo(dtype).max)


MXFP4_BLOCK = 32
"""MXFP4: elements (along the last dim) that share one E8M0 scale."""
