"""``python -m kimi_ops demo --dcp N``: the Kimi-K3 layer under decode context parallel.

Spawns N ranks (NCCL, one GPU each, when N GPUs are present; else gloo on the CPU).
Rank r holds TP rank r's 12 heads and the tokens at positions p with p % N == r; the
replicated weights (fused_qkv_a, the norms) are the same on every rank. Every step,
each rank runs the layer with the DCP group (query all-gather 12 -> 12 N heads, its
shard's partial, LSE combine) and, beside it, the same weights as one rank over the
whole cache; the two outputs must agree. Steps run eagerly (no graph capture across
ranks here); rank 0 times them.
"""

import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

REPLICATED = ("fused_qkv_a_proj.weight", "q_a_layernorm.weight", "kv_a_layernorm.weight")
DCP_RTOL = 1e-2   # rank vs one-process layer (the partials' extra bf16 roundings; tests/test_dcp.py)
DCP_RTOL_FP8Q = 5e-2
"""The same with the DCP layer's default fp8 query (issue 28) against the one-rank bf16 query:
what quantizing the query adds to the Kimi-K3 layer (2.7e-2 measured, README Numerics) plus
the partials' roundings; a wrong shard or scale is off by O(1)."""


def rank_weights(config, rank: int, seed: int):
    """TP rank ``rank``'s random weights; the replicated ones drawn from one seed for all ranks."""
    from .runtime import random_hf_weights
    weights = random_hf_weights(config, seed=seed + 1 + rank)
    shared = random_hf_weights(config, seed=seed)
    weights.update({name: shared[name] for name in REPLICATED})
    return weights


def history_slots(block_table, lengths, block_size, world=1, rank=0):
    """(request, positions, cache slots) of every history token on ``rank``: position p is
    the rank's local token ``p // world`` (:func:`kimi_ops.runtime.metadata.cache_rows`)."""
    from .runtime.metadata import cache_rows
    rows = []
    for r, n in enumerate(lengths):
        p = torch.arange(rank, n, world, device=block_table.device)
        rows.append((r, p.cpu(), cache_rows(block_table, r, p // world, block_size)))
    return rows


def _rank_main(rank, world, init_file, use_nccl, opts, results):
    from .runtime import DecodeMetadata, MLAConfig, MLADecodeLayer, allocate_blocks
    from .ops import mla_cache_write

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = torch.device("cuda", rank) if use_nccl else torch.device("cpu")
    if use_nccl:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_nccl else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world, device_id=device if use_nccl else None)
    try:
        batch, context, qlen, steps, block = (opts[k] for k in ("batch", "context", "qlen", "steps", "block"))
        config = MLAConfig.kimi_k3(tp=8)
        weights = rank_weights(config, rank, opts["seed"])
        sharded = MLADecodeLayer(config, weights=opts["weights"], device=device, seed=None,
                                 dcp_group=dist.group.WORLD).load_weights(weights)
        whole = MLADecodeLayer(config, weights=opts["weights"], device=device, seed=None).load_weights(weights)
        lengths = [max(1, context + (i * 97) % 211 - 105) for i in range(batch)]
        max_len = max(lengths) + steps * qlen
        block_table, num_blocks = allocate_blocks(batch, max_len, block, seed=opts["seed"], device=device)
        mds, caches = {}, {}
        for name, (w, r) in {"rank": (world, rank), "whole": (1, 0)}.items():
            mds[name] = DecodeMetadata.allocate(batch, batch * max_len, qlen=qlen, block_size=block,
                                                max_blocks=block_table.shape[1], device=device,
                                                dcp_world_size=w, dcp_rank=r)
            caches[name] = sharded.new_kv_cache(num_blocks, block)
        gen = torch.Generator().manual_seed(opts["seed"])          # the same history on every rank
        history = torch.randn(batch, max(lengths), 576, generator=gen).to(torch.bfloat16)
        for name, (w, r) in {"rank": (world, rank), "whole": (1, 0)}.items():
            for req, pos, slots in history_slots(block_table, lengths, block, w, r):
                rows = history[req, pos].to(device)
                mla_cache_write(rows[:, :512], rows[:, 512:], caches[name], slots, sharded.kv_scale)
        seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device) + qlen
        for md in mds.values():
            md.update_(seq_lens, block_table)
        errors, seconds = [], []
        with torch.no_grad():
            for _ in range(steps):
                hidden = torch.randn(batch * qlen, config.hidden_size, generator=gen).to(torch.bfloat16).to(device)
                if use_nccl:
                    torch.cuda.synchronize(device)
                dist.barrier()
                start = time.perf_counter()
                out = sharded(hidden, caches["rank"], mds["rank"])
                if use_nccl:
                    torch.cuda.synchronize(device)
                seconds.append(time.perf_counter() - start)
                ref = whole(hidden, caches["whole"], mds["whole"])
                errors.append(float((out.double() - ref.double()).norm() / ref.double().norm()))
                for md in mds.values():
                    md.advance_()
        gathered = [None] * world if rank == 0 else None
        dist.gather_object((rank, max(errors), statistics.median(seconds), sharded.query_bf16), gathered, dst=0)
        if rank == 0:
            results.put(gathered)
    finally:
        dist.destroy_process_group()


def dcp_options(args) -> dict:
    """The run's settings from the flags: those left out take the ``--dcp`` defaults of
    :data:`kimi_ops.demo.MODE_DEFAULTS` (what --help states)."""
    from .demo import apply_defaults
    apply_defaults(args, "dcp")
    return dict(batch=args.batch, context=args.context, qlen=args.qlen, steps=args.steps,
                block=args.block_size, weights=args.weights, seed=args.seed)


def run_dcp_demo(args) -> int:
    world = args.dcp
    use_nccl = args.device != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() >= world
    opts = dcp_options(args)
    print(f"kimi_ops demo --dcp {world}: Kimi-K3 TP8 layer, {world} ranks over "
          f"{'NCCL (one GPU each)' if use_nccl else 'gloo (CPU)'}, batch {opts['batch']} x qlen {opts['qlen']}, "
          f"context ~{opts['context']}, {opts['steps']} eager steps, block size {opts['block']}, "
          f"{opts['weights']} W_UK/W_UV")
    results = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(world, os.path.join(tmp, "init"), use_nccl, opts, results), nprocs=world)
    failed = False
    print(f"{'rank':>4} {'max rel L2 vs one rank':>24} {'step (eager)':>14}  check")
    bf16q = True
    for rank, err, sec, bf16q in sorted(results.get()):
        ok = err <= (DCP_RTOL if bf16q else DCP_RTOL_FP8Q)
        failed |= not ok
        print(f"{rank:>4} {err:>24.2e} {sec * 1e3:>11.2f} ms  {'PASS' if ok else 'FAIL'}")
    query = "bf16 query" if bf16q else "fp8 query (the DCP default; the one rank: bf16)"
    print(f"tolerance: rel L2 <= {DCP_RTOL if bf16q else DCP_RTOL_FP8Q:g} against the same weights as one rank "
          f"over the whole cache; {query}")
    return 1 if failed else 0
