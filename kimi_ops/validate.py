"""Opt-in checks of device-data preconditions (they copy to the host: a sync).

The ops never read these values on the host, so a bad index cannot crash a
CUDA graph; it reads as an all-zero row instead (no backend reads outside the
cache). Call these while debugging a serving loop:

* :func:`validate_decode_inputs` before ``mla_decode`` / ``mla_decode_splitkv``:
  indptr starts at 0 and never decreases, indices in range; with
  ``check_finite=True`` also that every cache row a request lists is finite.
* :func:`validate_cache_write_inputs` before ``mla_cache_write``: no slot twice
  (duplicates are undefined: the row that lands may be a mix of several candidates'
  bytes), every slot -1 or inside the cache; with ``kv_c`` / ``k_pe`` also that the
  rows to be written are finite.

Why finite rows matter even where a query position cannot see them: a row past
a position's causal bound gets softmax weight exactly 0, but every backend forms
the PV product over the whole tile, and ``0 x NaN = NaN``. The contract is
therefore that every row a request lists (``kv_indices[kv_indptr[r]:kv_indptr[r+1]]``)
holds finite values; rows no request lists may hold anything.
"""

import torch

from .formats import KV_ROW

_CHUNK_ROWS = 1 << 16   # rows converted to float32 at a time in the finite checks


def _first_nonfinite_row(rows: torch.Tensor) -> int | None:
    """Index of the first row of ``rows [n, w]`` with a NaN / inf element, else None."""
    for start in range(0, rows.shape[0], _CHUNK_ROWS):
        bad = ~torch.isfinite(rows[start:start + _CHUNK_ROWS].float()).all(dim=1)
        if bad.any():
            return start + int(torch.nonzero(bad)[0])
    return None


def validate_decode_inputs(kv_cache: torch.Tensor, kv_indptr: torch.Tensor,
                           kv_indices: torch.Tensor, *, check_finite: bool = False) -> None:
    """Raise ValueError unless kv_indptr starts at 0, never decreases, ends within
    kv_indices, and every index it covers lies in [0, number of cache rows).

    ``check_finite=True`` also reads the rows the requests list (every one of
    ``kv_indices[:kv_indptr[-1]]``) and raises on the first holding a NaN (or inf):
    such a row poisons the output even at query positions whose causal bound hides
    it (weight 0, but 0 x NaN = NaN in the PV product on every backend).
    """
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
    if check_finite and end > 0:
        rows = kv_cache.detach().reshape(-1, KV_ROW)[used.to(kv_cache.device)]
        i = _first_nonfinite_row(rows)
        if i is not None:
            r = int(torch.searchsorted(indptr, torch.tensor(i), right=True)) - 1
            raise ValueError(
                f"kimi_ops: cache row {int(used[i])} (kv_indices[{i}], request {r}'s token {i - int(indptr[r])}) "
                f"is not finite: every row a request lists must be, even one past a query position's causal "
                f"bound (its softmax weight is 0, but 0 x NaN = NaN in the PV product)")


def validate_cache_write_inputs(kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                                kv_c: torch.Tensor | None = None, k_pe: torch.Tensor | None = None) -> None:
    """Raise ValueError if one ``mla_cache_write`` call would write a cache row twice
    (duplicate slots are undefined: a backend may land a mix of bytes of the candidate
    rows), or if a slot is neither -1 (skip) nor a row of the cache (the op skips it
    too, but it is almost surely a bug). With ``kv_c`` / ``k_pe`` given, also raise if a
    row that would be written holds a NaN or inf (it would land as NaN bytes)."""
    num_rows = kv_cache.numel() // KV_ROW
    slots = slot_mapping.detach().to("cpu", torch.int64)
    outside = (slots != -1) & ((slots < 0) | (slots >= num_rows))
    if outside.any():
        t = int(torch.nonzero(outside)[0])
        raise ValueError(f"kimi_ops: slot_mapping[{t}] = {int(slots[t])} is neither -1 (skip) nor a row of "
                         f"the cache's {num_rows} rows")
    written = slots >= 0
    values, counts = torch.unique(slots[written], return_counts=True)
    if (counts > 1).any():
        slot = int(values[counts > 1][0])
        where = torch.nonzero(slots == slot).flatten().tolist()
        raise ValueError(f"kimi_ops: slot {slot} appears {len(where)} times in slot_mapping (at {where}): "
                         f"duplicate slots in one mla_cache_write are undefined (the row may be a mix of "
                         f"the candidates' bytes)")
    for name, x in (("kv_c", kv_c), ("k_pe", k_pe)):
        if x is None:
            continue
        rows = x.detach()[written.to(x.device)]
        i = _first_nonfinite_row(rows)
        if i is not None:
            t = int(torch.nonzero(written)[i])
            raise ValueError(f"kimi_ops: {name}[{t}] (to slot {int(slots[t])}) is not finite: it would be "
                             f"written as NaN bytes into the cache")
