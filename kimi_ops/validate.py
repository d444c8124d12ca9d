"""Opt-in checks of device-data preconditions (they copy to the host: a sync).

The ops never read these values on the host, so a bad index cannot crash a
CUDA graph; it reads as an all-zero row instead (no backend reads outside the
cache). Call :func:`validate_decode_inputs` while debugging a serving loop.
"""

import torch

from .formats import KV_ROW


def validate_decode_inputs(kv_cache: torch.Tensor, kv_indptr: torch.Tensor,
                           kv_indices: torch.Tensor) -> None:
    """Raise ValueError unless kv_indptr starts at 0, never decreases, ends within
    kv_indices, and every index it covers lies in [0, number of cache rows)."""
    indptr = kv_indptr.detach().to("cpu", torch.int64)
    num_rows = kv_cache.numel() // KV_ROW
    if indptr.numel() == 0 or indptr[0] != 0:
        raise ValueError(f"kimi_ops: kv_indptr must start at 0, got {indptr[:1].tolist()}")
    steps = indptr[1:] - indptr[:-1]
    if (steps < 0).any():
        r = int(torch.nonzero(steps < 0)[0])
        raise ValueError(f"kimi_ops: kv_indptr must not decrease, but kv_indptr[{r + 1}] = "
                         f"{int(indptr[r + 1])} < kv_indptr[{r}] = {int(indptr[r])}")
    end = int(indptr[-1])
    if end > kv_indices.numel():
        raise ValueError(f"kimi_ops: kv_indptr[-1] = {end} exceeds len(kv_indices) = {kv_indices.numel()}")
    used = kv_indices[:end].detach().to("cpu", torch.int64)
    bad = (used < 0) | (used >= num_rows)
    if bad.any():
        i = int(torch.nonzero(bad)[0])
        raise ValueError(f"kimi_ops: kv_indices[{i}] = {int(used[i])} is outside the cache's "
                         f"{num_rows} rows")
