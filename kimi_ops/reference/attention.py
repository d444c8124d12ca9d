"""Pure-torch reference of the attention ops (M1c split-KV decode, M1b merge, cache write).

The oracle every kernel is held to. It runs on any device in float64 (scores,
softmax and the PV sum all accumulate in float64; the outputs are rounded once,
to bf16 o and f32 LSE). It reads the host copy of ``kv_indptr`` (a device sync),
so it is not CUDA-graph safe: it is for checking, CPU serving and debugging.

Split partition (the reference's choice; kernels may choose another): request
r's n tokens are cut into ``ceil(n / num_splits)``-token contiguous chunks,
chunk s going to split s; a query row's partial in split s is its attention over
the tokens of chunk s it can see (causal bound ``n - qlen + i``).

Out-of-range indices (outside ``[0, N)``) read as all-zero rows, as in every
kernel: no backend ever reads outside the cache.
"""

import math

import torch

from ..formats import KV_LORA_RANK, fp8_max


def split_chunk(num_tokens: int, num_splits: int) -> int:
    """Tokens of each split's contiguous chunk in the reference partition."""
    return max(1, math.ceil(num_tokens / num_splits))


def gather_rows(kv_rows: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """float64 rows ``kv_rows[idx]`` [n, 576]; an index outside [0, N) gives a zero row."""
    n_rows, width = kv_rows.shape
    if n_rows == 0:
        return torch.zeros(idx.shape[0], width, dtype=torch.float64, device=kv_rows.device)
    valid = (idx >= 0) & (idx < n_rows)
    rows = kv_rows[idx.clamp(0, n_rows - 1).long()].to(torch.float64)
    return torch.where(valid[:, None], rows, torch.zeros((), dtype=torch.float64, device=rows.device))


def masked_attention(s: torch.Tensor, v: torch.Tensor, mask: torch.Tensor):
    """Softmax attention of scores ``s`` [..., n] over the tokens ``mask`` [..., n] keeps.

    Returns (o [..., dv], lse [...]) in float64; a row with no kept token gives
    o = 0, lse = -inf.
    """
    s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    finite = torch.isfinite(lse)
    p = torch.exp(s - torch.where(finite, lse, 0.0)[..., None])
    o = p @ v
    return torch.where(finite[..., None], o, 0.0), lse


def mla_decode_splitkv(q, kv_rows, kv_indptr, kv_indices, qlen, scale, kv_scale, num_splits,
                       seq_lens=None, dcp_rank=0, dcp_world_size=1, zero_empty=True, q_scale=None):
    """q [T, H, 576] bf16 (or fp8 with q_scale [1] f32), kv_rows [N, 576] fp8 -> o_part [S, T, H, 512]
    bf16, lse_part [S, T, H] f32. ``zero_empty`` is accepted for the dispatcher's common signature;
    empty splits' o is always 0."""
    o_part, lse_part = splitkv_float64(q, kv_rows, kv_indptr, kv_indices, qlen, scale, kv_scale, num_splits,
                                       seq_lens, dcp_rank, dcp_world_size, q_scale=q_scale)
    return o_part.to(torch.bfloat16), lse_part.to(torch.float32)


def splitkv_float64(q, kv_rows, kv_indptr, kv_indices, qlen, scale, kv_scale, num_splits,
                    seq_lens=None, dcp_rank=0, dcp_world_size=1, q_scale=None):
    """:func:`mla_decode_splitkv` before the output rounding: float64 (o_part, lse_part).

    fp8 query: the real query is ``q.double() * q_scale`` (the fp8 values and the float32
    scale are exact in float64, so is their product); ``q_scale=None`` means 1 (bf16 q).

    Decode context parallel: the rank's j-th token of a request is its global
    position ``j * dcp_world_size + dcp_rank``, and query position i sees the
    global positions ``<= seq_lens[r] - qlen + i`` (seq_lens: global lengths;
    None means the local lengths, as with one rank).
    """
    num_rows, num_heads, _ = q.shape
    device = q.device
    q64 = dequantized_query(q, q_scale)
    o_part = torch.zeros(num_splits, num_rows, num_heads, KV_LORA_RANK, dtype=torch.float64, device=device)
    lse_part = torch.full((num_splits, num_rows, num_heads), -math.inf, dtype=torch.float64, device=device)
    indptr = kv_indptr.tolist()
    lengths = seq_lens.tolist() if seq_lens is not None else [b - a for a, b in zip(indptr, indptr[1:])]
    for r in range(len(indptr) - 1):
        idx = kv_indices[indptr[r]:indptr[r + 1]]
        n = idx.shape[0]
        if n == 0:
            continue
        k = gather_rows(kv_rows, idx) * kv_scale                       # [n, 576]
        rows = slice(r * qlen, (r + 1) * qlen)
        s = torch.einsum("ihd,jd->ihj", q64[rows], k) * scale  # [qlen, H, n]
        pos = torch.arange(n, device=device)
        global_pos = pos * dcp_world_size + dcp_rank
        bound = lengths[r] - qlen + torch.arange(qlen, device=device)   # last visible position of row i
        visible = global_pos[None, :] <= bound[:, None]                 # [qlen, n]
        chunk = split_chunk(n, num_splits)
        for sp in range(math.ceil(n / chunk)):
            in_chunk = (pos >= sp * chunk) & (pos < (sp + 1) * chunk)
            mask = (visible & in_chunk)[:, None, :].expand_as(s)
            o_part[sp, rows], lse_part[sp, rows] = masked_attention(s, k[:, :KV_LORA_RANK], mask)
    return o_part, lse_part


def mla_merge(o_part, lse_part):
    """o_part [S, T, H, 512] bf16, lse_part [S, T, H] f32 -> o [T, H, 512] bf16, lse [T, H] f32."""
    lse_s = lse_part.to(torch.float64)
    lse = torch.logsumexp(lse_s, dim=0)
    finite = torch.isfinite(lse)
    weight = torch.exp(lse_s - torch.where(finite, lse, 0.0))[..., None]  # empty split: exp(-inf) = 0
    o = torch.where(weight > 0, weight * o_part.to(torch.float64), 0.0).sum(0)
    o = torch.where(finite[..., None], o, 0.0)
    return o.to(torch.bfloat16), lse.to(torch.float32)


def dequantized_query(q, q_scale=None):
    """The real query in float64: ``q`` (bf16) or ``q8 * q_scale`` (fp8 q, float32 q_scale of one element)."""
    q64 = q.to(torch.float64)
    if q_scale is None:
        return q64
    return q64 * q_scale.to(device=q.device, dtype=torch.float64).reshape(())


def decode_float64(q, kv_rows, kv_indptr, kv_indices, qlen, scale, kv_scale, q_scale=None):
    """Unsplit attention, unrounded: float64 (o [T, H, 512], lse [T, H]). The demo's oracle."""
    o, lse = splitkv_float64(q, kv_rows, kv_indptr, kv_indices, qlen, scale, kv_scale, 1, q_scale=q_scale)
    return o[0], lse[0]


def quantize_kv_rows(kv_c, k_pe, kv_scale, dtype):
    """The cache bytes of rows [kv_c | k_pe]: fp8(x / kv_scale) in float32 math, saturated."""
    rows = torch.cat([kv_c, k_pe], dim=-1).to(torch.float32)
    # a tensor divisor: CUDA turns division by a Python scalar into a multiply by its reciprocal
    rows = rows / torch.full((), kv_scale, dtype=torch.float32, device=rows.device)
    bound = fp8_max(dtype)
    return rows.clamp(-bound, bound).to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, one rounding back to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def mla_norm_cache_write(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_rows, slot_mapping, g=None, *,
                         eps, kv_scale, constant_w=False):
    """``(rms_norm(q_c), sigmoid(g))`` (gate ``[T, 0]`` without g), and ``rms_norm(kv_c)`` with
    k_pe written as :func:`mla_cache_write` writes them (kv_rows [N, 576], in place;
    ``constant_w``, a launch hint for the GPU kernel, changes nothing here)."""
    mla_cache_write(rms_norm(kv_c, kv_norm_weight, eps), k_pe, kv_rows, slot_mapping, kv_scale)
    gate = q_c.new_empty((q_c.shape[0], 0)) if g is None else torch.sigmoid(g)
    return rms_norm(q_c, q_norm_weight, eps), gate


def mla_norm_cache_write_q_b(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_rows, slot_mapping, q_b_weight,
                             q_b_scale_inv=None, g=None, *, eps, kv_scale, block_n=128, block_k=128,
                             constant_w=False):
    """:func:`mla_norm_cache_write`, then q_b's projection of the normed q_c (bf16 weight, or fp8
    with its block scales): ``(q [T, N] bf16, gate [T, G] bf16)``."""
    from . import fp8, linear

    q_normed, gate = mla_norm_cache_write(q_c, kv_c, k_pe, q_norm_weight, kv_norm_weight, kv_rows, slot_mapping, g,
                                          eps=eps, kv_scale=kv_scale)
    if q_b_scale_inv is None:
        return linear.gemm_a16w16(q_normed, q_b_weight), gate
    return fp8.gemm_a16w8_block(q_normed, q_b_weight, q_b_scale_inv, block_n=block_n, block_k=block_k), gate


def mla_cache_write(kv_c, k_pe, kv_rows, slot_mapping, kv_scale):
    """Write row slot_mapping[t] of kv_rows [N, 576] (in place); slots outside [0, N) are skipped."""
    valid = (slot_mapping >= 0) & (slot_mapping < kv_rows.shape[0])
    rows = quantize_kv_rows(kv_c[valid], k_pe[valid], kv_scale, kv_rows.dtype)
    kv_rows[slot_mapping[valid].long()] = rows
