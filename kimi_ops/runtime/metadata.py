"""Decode metadata: the page-size-1 CSR the attention kernels read, built on the device.

A request's tokens live in a paged cache: token ``p`` of request ``r`` is flat
cache row ``block_table[r, p // block_size] * block_size + p % block_size``
(a slot list is the same with ``block_size = 1``). :func:`build_decode_metadata`
turns sequence lengths and a block table into

* ``kv_indptr [R + 1]`` int32 and ``kv_indices [max_tokens]`` int32: request r's
  rows, in order, are ``kv_indices[kv_indptr[r]:kv_indptr[r + 1]]``;
* ``slot_mapping [R * qlen]`` int64: the cache row each query row's token is
  written to this step (``-1``: skip);
* ``positions [R * qlen]`` int64: each query row's token position (RoPE).

with torch ops only: fixed shapes (``R`` requests, an index buffer of fixed
capacity ``max_tokens``), no host sync, no data-dependent shapes. So the build
runs inside a captured CUDA graph or a ``torch.compile``'d step, and
:meth:`DecodeMetadata.update_` / :meth:`DecodeMetadata.advance_` rewrite the
same buffers in place between replays.

Conventions (vLLM's): ``seq_lens[r]`` counts request r's tokens *including* this
step's ``qlen`` new ones; query row ``r * qlen + i`` is the token at position
``seq_lens[r] - qlen + i``. A request with ``seq_lens[r] < qlen`` (a padding
request at 0, say) has its missing rows' slots at ``-1``; they see no token
(o = 0, lse = -inf). ``kv_indptr`` is clamped to the capacity, so an
over-long batch never makes the kernels read past ``kv_indices`` (it loses its
tail tokens instead; keep ``sum(seq_lens) <= max_tokens``).

Decode context parallel (issue 6's hook): with ``dcp_world_size = W > 1`` the
metadata is rank ``dcp_rank``'s shard: a request's token at global position p
lives on rank ``p % W`` as the rank's local token ``k = p // W`` (vLLM's
interleave of 1), the block table addresses local tokens, ``kv_indptr`` /
``kv_indices`` list the rank's local tokens and ``slot_mapping`` is ``-1`` for
rows other ranks own; ``seq_lens`` stays global (the causal bound is in global
positions, which the kernels learn in issue 6).
"""

from dataclasses import dataclass

import torch


@dataclass
class DecodeMetadata:
    """One decode step's metadata (fixed-capacity device buffers; see the module docstring)."""
    kv_indptr: torch.Tensor      # [R + 1] int32
    kv_indices: torch.Tensor     # [max_tokens] int32 (the tail past kv_indptr[-1] is 0 and unread)
    seq_lens: torch.Tensor       # [R] int32, global lengths including this step's tokens
    slot_mapping: torch.Tensor   # [R * qlen] int64, -1 skips
    positions: torch.Tensor      # [R * qlen] int64
    block_table: torch.Tensor    # [R, max_blocks] int32 (block ids of local tokens)
    qlen: int
    block_size: int
    dcp_world_size: int = 1
    dcp_rank: int = 0

    @property
    def num_requests(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_rows(self) -> int:
        """Query rows T = R * qlen."""
        return self.slot_mapping.shape[0]

    @property
    def max_tokens(self) -> int:
        """Capacity of the index buffer."""
        return self.kv_indices.shape[0]

    @property
    def device(self) -> torch.device:
        return self.seq_lens.device

    @classmethod
    def allocate(cls, num_requests: int, max_tokens: int, *, qlen: int = 1, block_size: int = 1,
                 max_blocks: int | None = None, device="cpu", dcp_world_size: int = 1,
                 dcp_rank: int = 0) -> "DecodeMetadata":
        """Empty buffers (all requests at length 0) for ``num_requests`` requests and
        ``max_tokens`` cached tokens; fill them with :meth:`update_`."""
        if max_blocks is None:
            max_blocks = -(-max_tokens // block_size)
        md = cls(
            kv_indptr=torch.zeros(num_requests + 1, dtype=torch.int32, device=device),
            kv_indices=torch.zeros(max_tokens, dtype=torch.int32, device=device),
            seq_lens=torch.zeros(num_requests, dtype=torch.int32, device=device),
            slot_mapping=torch.full((num_requests * qlen,), -1, dtype=torch.int64, device=device),
            positions=torch.zeros(num_requests * qlen, dtype=torch.int64, device=device),
            block_table=torch.zeros(num_requests, max_blocks, dtype=torch.int32, device=device),
            qlen=qlen, block_size=block_size, dcp_world_size=dcp_world_size, dcp_rank=dcp_rank)
        _check(md)
        return md

    def update_(self, seq_lens: torch.Tensor | None = None,
                block_table: torch.Tensor | None = None) -> "DecodeMetadata":
        """Copy new ``seq_lens`` / ``block_table`` (if given) into this metadata's buffers and
        rebuild the derived buffers in place (device ops only; graph-safe)."""
        if seq_lens is not None:
            self.seq_lens.copy_(seq_lens)
        if block_table is not None:
            self.block_table.copy_(block_table)
        _build_into(self)
        return self

    def advance_(self, num_new: int | None = None) -> "DecodeMetadata":
        """The next decode step: every request grows by ``num_new`` (default qlen) tokens
        and the buffers are rebuilt in place. Padding requests (length 0) stay at 0."""
        step = self.qlen if num_new is None else num_new
        self.seq_lens.add_(torch.where(self.seq_lens > 0, step, 0).to(self.seq_lens.dtype))
        _build_into(self)
        return self

    def clone(self) -> "DecodeMetadata":
        return DecodeMetadata(self.kv_indptr.clone(), self.kv_indices.clone(), self.seq_lens.clone(),
                              self.slot_mapping.clone(), self.positions.clone(), self.block_table.clone(),
                              self.qlen, self.block_size, self.dcp_world_size, self.dcp_rank)


def _check(md: DecodeMetadata) -> None:
    if md.qlen < 1 or md.block_size < 1:
        raise ValueError(f"DecodeMetadata: qlen and block_size must be >= 1, got {md.qlen}, {md.block_size}")
    if not 0 <= md.dcp_rank < md.dcp_world_size:
        raise ValueError(f"DecodeMetadata: dcp_rank must be in [0, {md.dcp_world_size}), got {md.dcp_rank}")
    if md.block_table.dim() != 2 or md.block_table.shape[0] != md.seq_lens.shape[0]:
        raise ValueError(f"DecodeMetadata: block_table must be [R, max_blocks] with R = {md.seq_lens.shape[0]}, "
                         f"got {tuple(md.block_table.shape)}")


def cache_rows(block_table: torch.Tensor, request, k: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat cache row of request ``request``'s local token ``k`` (int64; tensors broadcast):
    ``block_table[request, k // block_size] * block_size + k % block_size``, the block index
    clamped to the table. int64 ``k`` makes the result int64 whatever the table's dtype."""
    blk = torch.div(k, block_size, rounding_mode="floor").clamp(0, block_table.shape[1] - 1)
    return block_table[request, blk] * block_size + k.remainder(block_size)


def _derive(seq_lens, block_table, *, block_size: int, qlen: int, max_tokens: int,
            dcp_world_size: int = 1, dcp_rank: int = 0):
    """(kv_indptr, kv_indices, slot_mapping, positions) from lengths and a block table: torch ops
    with fixed output shapes, no host sync."""
    device = seq_lens.device
    num_requests, max_blocks = block_table.shape
    world, rank = dcp_world_size, dcp_rank
    n = seq_lens.to(torch.int64)
    local = torch.div(n - rank + (world - 1), world, rounding_mode="floor").clamp_min(0)  # tokens on this rank
    ends = local.cumsum(0).clamp_max(max_tokens)
    indptr = torch.cat([ends.new_zeros(1), ends])
    table = block_table.to(torch.int64)

    def rows_of(req, k):
        return cache_rows(table, req, k, block_size)

    if num_requests > 0:
        j = torch.arange(max_tokens, device=device)
        req = torch.searchsorted(ends, j, right=True)                  # request owning index slot j
        inside = req < num_requests
        req_c = req.clamp_max(num_requests - 1)
        k = (j - indptr[req_c]).clamp_min(0)
        indices = torch.where(inside, rows_of(req_c, k), 0)
    else:
        indices = torch.zeros(max_tokens, dtype=torch.int64, device=device)

    t = torch.arange(num_requests * qlen, device=device)
    req_q = torch.div(t, qlen, rounding_mode="floor")                   # query row t is request t // qlen's
    pos = n[req_q] - qlen + t.remainder(qlen)                           # ... token at this position
    mine = (pos >= 0) & (pos.remainder(world) == rank)
    k_new = torch.div(pos.clamp_min(0), world, rounding_mode="floor")
    slots = torch.where(mine, rows_of(req_q, k_new), -1)
    return indptr.to(torch.int32), indices.to(torch.int32), slots, pos.clamp_min(0)


def _build_into(md: DecodeMetadata) -> None:
    indptr, indices, slots, pos = _derive(md.seq_lens, md.block_table, block_size=md.block_size, qlen=md.qlen,
                                          max_tokens=md.max_tokens, dcp_world_size=md.dcp_world_size,
                                          dcp_rank=md.dcp_rank)
    md.kv_indptr.copy_(indptr)
    md.kv_indices.copy_(indices)
    md.slot_mapping.copy_(slots)
    md.positions.copy_(pos)


def build_decode_metadata(seq_lens: torch.Tensor, block_table: torch.Tensor, *, block_size: int, qlen: int = 1,
                          max_tokens: int, dcp_world_size: int = 1, dcp_rank: int = 0) -> DecodeMetadata:
    """New :class:`DecodeMetadata` from device ``seq_lens [R]`` and ``block_table [R, max_blocks]``
    (int32/int64), with an index buffer of ``max_tokens`` rows."""
    md = DecodeMetadata.allocate(seq_lens.shape[0], max_tokens, qlen=qlen, block_size=block_size,
                                 max_blocks=block_table.shape[1], device=seq_lens.device,
                                 dcp_world_size=dcp_world_size, dcp_rank=dcp_rank)
    return md.update_(seq_lens, block_table)


def build_from_slots(seq_lens: torch.Tensor, slots: torch.Tensor, *, qlen: int = 1, max_tokens: int,
                     dcp_world_size: int = 1, dcp_rank: int = 0) -> DecodeMetadata:
    """Metadata from a slot list ``slots [R, max_len]`` (request r's local token k at flat row
    ``slots[r, k]``): a block table of block size 1."""
    return build_decode_metadata(seq_lens, slots, block_size=1, qlen=qlen, max_tokens=max_tokens,
                                 dcp_world_size=dcp_world_size, dcp_rank=dcp_rank)


def allocate_blocks(num_requests: int, max_len: int, block_size: int, *, shuffle: bool = True, seed: int = 0,
                    device="cpu") -> tuple[torch.Tensor, int]:
    """A host-side block allocator for demos and tests: every request gets its own
    ``ceil(max_len / block_size)`` blocks (randomly permuted over the cache when ``shuffle``).
    Returns ``(block_table [R, max_blocks] int32, num_blocks)``."""
    max_blocks = max(1, -(-max_len // block_size))
    num_blocks = num_requests * max_blocks
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)) if shuffle \
        else torch.arange(num_blocks)
    return ids.view(num_requests, max_blocks).to(torch.int32).to(device), num_blocks
