"""The seeds' runtime module, standing alone: one MLA layer's decode step from kimi_ops' ops.

* :class:`MLAConfig` — dims (``MLAConfig.kimi_k3(tp=8)``, ``MLAConfig.deepseek_v3(tp=8)``).
* :class:`MLADecodeLayer` — one rank's weights (vLLM / HF names, bf16 or MXFP4 W_UK / W_UV).
* :class:`DecodeMetadata` — the kernels' CSR + slots, built on the device with fixed capacities.
* :mod:`kimi_ops.runtime.mla` — ``pre`` / ``attend`` / ``post`` / ``layer`` and friends.
"""

from . import mla
from .config import MLAConfig, RopeScaling
from .layer import MLADecodeLayer, random_hf_weights
from .metadata import DecodeMetadata, allocate_blocks, build_decode_metadata, build_from_slots

__all__ = ["MLAConfig", "RopeScaling", "MLADecodeLayer", "random_hf_weights", "DecodeMetadata",
           "build_decode_metadata", "build_from_slots", "allocate_blocks", "mla"]
