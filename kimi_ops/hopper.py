"""Host side of the Hopper (sm_90a) kernels in ``kimi_ops._C`` (``csrc/mla_decode_sm90.cu``).

The ``cuda`` backend of :mod:`kimi_ops.dispatch`: ``mla_decode_splitkv`` (M1c) and
``mla_merge`` (M1b) as CUDA C++ kernels, registered as the private ops
``torch.ops.kimi_ops._mla_decode_splitkv_sm90`` / ``_mla_merge_sm90`` (CUDA key). The
public ops call these functions after their own host checks.

Numerics: the fp8 cache bytes become f16 exactly in registers; the bf16 query is scaled per
row by 2^k into [2^14, 2^15) and held as f16 (exact); S and O accumulate in f32 on
``mma.sync`` f16 tensor-core MMAs; P is rounded to f16. See the .cu file's header for the
tiling and the byte layouts.

An ``e4m3fnuz`` cache (gfx942's format) has no kernel here: it runs the Triton kernel.
"""
import math
import os

import torch

LOG2E = 1.4426950408889634
STAGES_ENV = "KIMI_OPS_SM90_STAGES"  # K-ring depth override (2..4; 32-row CTAs: 2..3), for tuning


def _ops():
    import kimi_ops._C  # noqa: F401  (registers the private ops)
    return torch.ops.kimi_ops


def rows_per_cta(rows_per_request: int) -> int:
    """Query rows one CTA takes: 16, 32 or 64 (4, 8 or 16 warps; an MMA's M is 16).

    Cost model: the padded rows computed plus half a 16-row tile for each CTA of a request (each
    re-reads the request's KV, from L2 after the first); ties go to the bigger CTA."""
    def cost(rows):
        ctas = -(-rows_per_request // rows)
        return ctas * rows + 8 * ctas
    return min((64, 32, 16), key=cost)


DEFAULT_STAGES = {16: 2, 32: 3, 64: 3}
MAX_STAGES = {16: 4, 32: 3, 64: 3}
CTAS_PER_SM = {(16, 2): 2}  # by shared memory (97 KB); every other (rows, stages) takes 135-199 KB: 1


def ring_stages(rows: int) -> int:
    """Shared-memory stages of 64 tokens (37 KB each) in the CTA's K ring."""
    env = os.environ.get(STAGES_ENV)
    if env:
        stages = int(env)
        if not 2 <= stages <= MAX_STAGES[rows]:
            raise ValueError(f"{STAGES_ENV} must be 2..{MAX_STAGES[rows]} for {rows}-row CTAs, got {stages}")
        return stages
    return DEFAULT_STAGES[rows]


def mla_decode_splitkv(q, kv_rows, kv_indptr, kv_indices, qlen: int, scale: float, kv_scale: float,
                       num_splits: int, seq_lens=None, dcp_rank: int = 0, dcp_world_size: int = 1):
    """M1c. q [T, H, 576] bf16, kv_rows [N, 576] fp8 -> (o_part [S, T, H, 512] bf16, lse_part [S, T, H] f32).

    A request of n tokens is cut into ``num_splits`` chunks of ``ceil(n / S)`` tokens rounded up
    to 64 (later splits may be empty: o = 0, lse = -inf)."""
    if kv_rows.dtype != torch.float8_e4m3fn:
        from .kernels.attention import mla_decode_splitkv as triton_splitkv
        return triton_splitkv(q, kv_rows, kv_indptr, kv_indices, qlen, scale, kv_scale, num_splits,
                              seq_lens, dcp_rank, dcp_world_size)
    rows = rows_per_cta(qlen * q.shape[1])
    return _ops()._mla_decode_splitkv_sm90(
        q, kv_rows, kv_indptr, kv_indices, seq_lens, qlen, float(scale) * float(kv_scale) * LOG2E,
        float(kv_scale), num_splits, dcp_rank, dcp_world_size, rows, ring_stages(rows))


def mla_merge(o_part, lse_part):
    """M1b. o_part [S, T, H, 512] bf16, lse_part [S, T, H] f32 -> (o [T, H, 512] bf16, lse [T, H] f32)."""
    return _ops()._mla_merge_sm90(o_part, lse_part)


def suggest_num_splits(num_requests: int, qlen: int, num_heads: int, num_tokens: int,
                       num_sms: int = 132) -> int:
    """A split count from shapes only (never device data).

    The CTAs (requests x row groups x splits) run in waves over the device's CTA slots; a
    split count is good when its last wave is nearly full. Take the smallest count whose waves
    are at least 90% full, else the fullest; at most one split per 128 tokens of an average
    request and at most 128."""
    if num_requests <= 0:
        return 1
    rows = rows_per_cta(qlen * num_heads)
    slots = num_sms * CTAS_PER_SM.get((rows, ring_stages(rows)), 1)
    ctas = num_requests * -(-qlen * num_heads // rows)
    cap = int(max(1, min((num_tokens // num_requests) // 128, 128)))

    def fullness(splits):
        total = ctas * splits
        return total / (-(-total // slots) * slots)

    for splits in range(1, cap + 1):
        if fullness(splits) >= 0.9:
            return splits
    return max(range(1, cap + 1), key=lambda splits: (fullness(splits), -splits))
