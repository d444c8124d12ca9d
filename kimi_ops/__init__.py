"""kimi_ops: Kimi-K3's MLA decode layer as PyTorch custom ops.

Ops (``torch.ops.kimi_ops.*``, re-exported here): :func:`mla_decode_splitkv`
(M1c), :func:`mla_merge` (M1b), :func:`mla_decode`, :func:`mla_cache_write`,
:func:`mxfp4_quantize`, :func:`mxfp4_dequantize`, :func:`bmm_a16wfp4`,
:func:`mla_query` (M1a; ``out_dtype=torch.float8_e4m3fn`` gives the fp8 query and its
scale, :func:`quantize_query` / :func:`query_scale`), :func:`gemm_a16w8_block` (fp8 block-scaled weights), :func:`gemm_a16w16` (bf16
weights), :func:`mla_norm_cache_write` (the layer's norms, cache write and gate
sigmoid), :func:`mla_norm_cache_write_q_b` (that and q_b's projection, one kernel on sm_90),
:func:`mla_v_up_proj` (W_UV and the output gate). ``KIMI_OPS_BACKEND`` picks the implementation
(:mod:`kimi_ops.dispatch`).
"""

from .ops import (
    bmm_a16wfp4,
    gemm_a16w16,
    gemm_a16w8_block,
    mla_cache_write,
    mla_decode,
    mla_decode_splitkv,
    mla_merge,
    mla_norm_cache_write,
    mla_norm_cache_write_q_b,
    mla_query,
    mla_v_up_proj,
    mxfp4_dequantize,
    mxfp4_quantize,
    quantize_query,
    query_scale,
)
from .validate import validate_cache_write_inputs, validate_decode_inputs

__version__ = "0.1.0"

__all__ = [
    "mla_decode_splitkv", "mla_merge", "mla_decode", "mla_cache_write",
    "mxfp4_quantize", "mxfp4_dequantize", "bmm_a16wfp4", "mla_query", "quantize_query", "query_scale",
    "gemm_a16w8_block", "gemm_a16w16", "mla_v_up_proj", "mla_norm_cache_write",
    "mla_norm_cache_write_q_b", "validate_decode_inputs", "validate_cache_write_inputs",
]
