"""Decode context parallel (DCP) over ``torch.distributed``: the query gather and the LSE combine.

With W ranks, a request's token at global position p lives on rank ``p % W``
(vLLM's interleave of 1; :mod:`kimi_ops.runtime.metadata` builds each rank's
shard). A decode step then runs, on every rank:

1. :func:`query_all_gather`: each rank's query for its H heads [T, H, 576] is
   gathered along heads into [T, W * H, 576] (gathered head ``rank * H + h``). An fp8
   query (the default under DCP, issue 28) goes as its bytes, 576 a row and head instead
   of bf16's 1152, under one scale: :func:`global_amax` (an all-reduce of one float32)
   makes the per-tensor scale every rank's, or the layer's static scale needs none;
2. the attention of all W * H heads against this rank's shard, with causal bounds
   in global positions (``kimi_ops.mla_decode(..., seq_lens=global lengths,
   dcp_rank=rank, dcp_world_size=W)``): partials o [T, W * H, 512] bf16 and
   lse [T, W * H] f32;
3. :func:`combine`: each rank gets the W partials of its own H heads and merges
   them by LSE, giving (o [T, H, 512] bf16, lse [T, H] f32).

Two combines, both exact up to the bf16 partials:

* ``"all_to_all"`` (the default): one all-to-all of the partials (bf16 o and f32
  lse, 1028 bytes a row and head), then :func:`kimi_ops.mla_merge`;
* ``"gather_reduce_scatter"``: an all-gather of the LSEs (small), each rank scales
  its own partials by ``exp(lse_rank - lse)`` in float32, and a reduce-scatter
  sums them onto the heads' owners (2048 bytes a row and head in float32).

The all-to-all moves half the bytes and has one collective on the critical path
of the o tensor; it is the default (the H200 comparison lives in docs/PERF.md).
Runs on any backend torch.distributed has: NCCL on GPUs, gloo on CPU.
"""

import torch
import torch.distributed as dist

from .. import ops

COMBINES = ("all_to_all", "gather_reduce_scatter")

# torch 2.13 renamed the tensor collectives (the old names warn there); 2.11-2.12 have the old ones
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def world_and_rank(group) -> tuple[int, int]:
    """(W, rank) of ``group``; (1, 0) when group is None."""
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def query_all_gather(q: torch.Tensor, group) -> torch.Tensor:
    """[T, H, D] on each rank -> [T, W * H, D], gathered head ``rank * H + h``."""
    world, _ = world_and_rank(group)
    if world == 1:
        return q
    rows, heads, dim = q.shape
    gathered = q.new_empty((world * rows, heads, dim))       # rank w's query at rows w * T ..
    _all_gather(gathered, q.contiguous(), group=group)
    return gathered.view(world, rows, heads, dim).transpose(0, 1).reshape(rows, world * heads, dim)


def query_all_gather_fp8(q8: torch.Tensor, q_scale: torch.Tensor, group):
    """The fp8 query's all-gather: q8 [T, H, 576] fp8 on each rank (one ``q_scale`` shared by
    the ranks: :func:`global_amax`, or a static scale) -> (q8 [T, W * H, 576], q_scale). The
    bytes go as uint8 (a collective need not know the float8 types: gloo does not), half
    the bytes of the bf16 gather."""
    world, _ = world_and_rank(group)
    if world == 1:
        return q8, q_scale
    return query_all_gather(q8.view(torch.uint8), group).view(q8.dtype), q_scale


def global_amax(amax: torch.Tensor, group) -> torch.Tensor:
    """The max over the ranks of each rank's float32 [1] amax (an all-reduce of 4 bytes), so
    every rank quantizes its heads of the query with the same per-tensor scale."""
    world, _ = world_and_rank(group)
    if world == 1:
        return amax
    amax = amax.clone()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax


def query_gather_bytes(rows: int, heads: int, world: int, *, fp8: bool, static_scale: bool = False) -> dict:
    """Bytes one rank sends and receives in a step's query gather (payload only): the all-gather
    of ``rows x heads x 576`` elements (bf16: 2 bytes each, fp8: 1), plus, for an fp8 query with
    a per-tensor scale from the amax, the all-reduce of one float32 (4 bytes)."""
    per_rank = rows * heads * 576 * (1 if fp8 else 2)
    scale = 4 if fp8 and not static_scale and world > 1 else 0
    return dict(send=per_rank + scale, recv=(world - 1) * per_rank + (world - 1) * scale if world > 1 else 0,
                gathered=world * per_rank)


def _by_owner(x: torch.Tensor, world: int) -> torch.Tensor:
    """[T, W * H, ...] -> [W, T, H, ...] contiguous: slab w holds the heads rank w owns."""
    rows, all_heads = x.shape[:2]
    return x.reshape(rows, world, all_heads // world, *x.shape[2:]).transpose(0, 1).contiguous()


def combine(o: torch.Tensor, lse: torch.Tensor, group, method: str = "all_to_all"):
    """This rank's partials over all W * H heads -> its own heads' merged (o [T, H, 512] bf16,
    lse [T, H] f32). ``method``: one of :data:`COMBINES`."""
    if method not in COMBINES:
        raise ValueError(f"kimi_ops.runtime.dcp.combine: method must be one of {COMBINES}, got {method!r}")
    world, rank = world_and_rank(group)
    if world == 1:
        return o, lse
    if method == "all_to_all":
        return _combine_all_to_all(o, lse, group, world)
    return _combine_gather_reduce_scatter(o, lse, group, world, rank)


def _combine_all_to_all(o, lse, group, world):
    send_o, send_lse = _by_owner(o, world), _by_owner(lse, world)
    recv_o, recv_lse = torch.empty_like(send_o), torch.empty_like(send_lse)
    dist.all_to_all_single(recv_o, send_o, group=group)      # recv[w]: rank w's partial of my heads
    dist.all_to_all_single(recv_lse, send_lse, group=group)
    return ops.mla_merge(recv_o, recv_lse)


def _combine_gather_reduce_scatter(o, lse, group, world, rank):
    every_lse = lse.new_empty((world * lse.shape[0], lse.shape[1]))
    _all_gather(every_lse, lse.contiguous(), group=group)
    total = torch.logsumexp(every_lse.view(world, *lse.shape), dim=0)  # [T, W * H]
    finite = torch.isfinite(total)
    weight = torch.where(finite, torch.exp(lse - torch.where(finite, total, 0.0)), 0.0)
    scaled = torch.where(weight[..., None] > 0, o.float() * weight[..., None], 0.0)
    by_owner = _by_owner(scaled, world)                                # [W, T, H, 512]
    mine = scaled.new_empty(by_owner.shape[1:])
    _reduce_scatter(mine, by_owner.flatten(0, 1), group=group)
    heads = lse.shape[1] // world
    return mine.to(torch.bfloat16), total[:, rank * heads:(rank + 1) * heads].contiguous()
