"""AITER's MLA decode (``aiter.mla.mla_decode_fwd``) as ``attend``'s fallback on ROCm.

Used only where torch is a ROCm build and ``aiter`` imports; everywhere else our
own kernels serve every case. This glue has NOT run on AMD hardware: it is
tested against a recording fake of ``mla_decode_fwd`` (tests/test_aiter_fallback.py)
that checks the arguments it is handed, so the call matches AITER's documented
interface as vLLM uses it, nothing more.

What it does, as vLLM's ROCm MLA backend does:

* pads the heads up to a multiple of 16 (AITER's kernels want 16 / 128 heads;
  vLLM's ``get_mla_padded_q``): the pad rows are zeros and their outputs dropped;
* hands the cache as ``[N, 1, 1, 576]`` pages of one token (page size 1, so
  ``kv_last_page_lens`` is all ones), the CSR ``kv_indptr`` / ``kv_indices`` as is,
  ``qo_indptr = [0, qlen, 2 qlen, ...]`` and ``max_seqlen_q = qlen``;
* asks for the LSE (``return_lse=True``) when the caller needs it (DCP's combine)
  and returns it unpadded, [T, H] float32.

AITER's causal bound is in the rank's local positions, so under DCP it serves
qlen 1 only (where every cached token is visible); qlen > 1 with DCP raises.
"""

import importlib.util

import torch

from ..formats import KV_LORA_RANK, KV_ROW

HEAD_MULTIPLE = 16


def available() -> bool:
    """True on a ROCm torch with ``aiter`` importable."""
    return torch.version.hip is not None and importlib.util.find_spec("aiter") is not None


def padded_heads(num_heads: int) -> int:
    """Heads rounded up to a multiple of 16 (at least 16)."""
    return max(HEAD_MULTIPLE, -(-num_heads // HEAD_MULTIPLE) * HEAD_MULTIPLE)


def aiter_attend(q: torch.Tensor, kv_cache: torch.Tensor, md, *, scale: float, kv_scale: float,
                 return_lse: bool, decode_fwd=None):
    """q [T, H, 576] bf16 against the fp8 cache -> (o [T, H, 512] bf16, lse [T, H] f32 or None).

    ``md``: a :class:`kimi_ops.runtime.metadata.DecodeMetadata`. ``decode_fwd``
    defaults to ``aiter.mla.mla_decode_fwd`` (tests pass a fake).
    """
    if md.dcp_world_size > 1 and md.qlen > 1:
        raise ValueError("kimi_ops: the AITER fallback takes qlen 1 under decode context parallel "
                         f"(its causal bound is in local positions), got qlen {md.qlen}")
    if decode_fwd is None:
        from aiter.mla import mla_decode_fwd as decode_fwd
    rows, heads, _ = q.shape
    padded = padded_heads(heads)
    if padded != heads:
        q_in = q.new_zeros((rows, padded, KV_ROW))
        q_in[:, :heads] = q
    else:
        q_in = q
    o = q.new_empty((rows, padded, KV_LORA_RANK))
    device = q.device
    qo_indptr = torch.arange(md.num_requests + 1, device=device, dtype=torch.int32) * md.qlen
    last_page_lens = torch.ones(md.num_requests, device=device, dtype=torch.int32)
    kv_scale_t = torch.full((1,), kv_scale, device=device, dtype=torch.float32)
    result = decode_fwd(q_in, kv_cache.view(-1, 1, 1, KV_ROW), o, qo_indptr, md.kv_indptr, md.kv_indices,
                        last_page_lens, md.qlen, sm_scale=scale, kv_scale=kv_scale_t, return_lse=return_lse)
    lse = result[1][:, :heads].float() if return_lse else None
    return o[:, :heads], lse
