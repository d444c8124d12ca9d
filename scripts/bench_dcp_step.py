#!/usr/bin/env python3
"""The whole Kimi-K3 decode step under DCP W (NCCL, CUDA graphs) against DCP1 at the same context.

    python scripts/bench_dcp_step.py --world W [--batches 1,8,32] [--context 32768] [--weights mxfp4]
    python scripts/bench_dcp_step.py --world 2 --cpu --batches 2 --context 64    (gloo smoke run)

Rank r holds TP rank r's 12 heads and the tokens at positions p % W == r of every request
(``--context`` tokens a request, global positions), as ``kimi_ops demo --dcp`` does. Per batch:
the layer's step (pre / attend / post with the DCP query all-gather and LSE combine inside) on
two independent input sets (layer, cache, metadata, hidden), both captured in one CUDA graph on
every rank and replayed with a ``dist.barrier`` before each replay; median per step. Then rank 0
alone times the same step with the whole cache on one GPU (DCP1: every token of every request)
the same way. Rank 0 prints a markdown table: batch, context, DCP1 us, DCP W us, DCP1 / DCP W.

``--query`` picks the DCP layer's query (issue 28): ``default`` (the layer's: fp8 under DCP, its
all-gather half the bytes), ``bf16`` or ``fp8``; DCP1 always runs its default (bf16). Run it
twice (``--query bf16`` / ``--query fp8``) to time what the fp8 gather saves; until the csrc
kernels take an fp8 q, the cuda backend runs an fp8 query's attention on Triton.

``--cpu`` runs the same code path on gloo with eager steps (no graphs): a check that the script
works, its times mean nothing. Keep NCCL_NVLS_ENABLE=0 (and the device README's other
multicast-off variables) on the GPU machine.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)

from bench_layer import decode_set  # noqa: E402

from kimi_ops.runtime import MLAConfig  # noqa: E402


def time_steps(sets, reps, barrier, use_graph):
    """Median seconds of one step over the sets (graph: one CUDA graph of all of them)."""
    fns = [lambda s=s: s[0](s[3], s[1], s[2]) for s in sets]
    if use_graph:
        from graph_timing import time_graph
        return time_graph(fns, reps, before_replay=barrier)[0]
    samples = []
    for _ in range(reps):
        if barrier is not None:
            barrier()
        start = time.perf_counter()
        for f in fns:
            f()
        samples.append((time.perf_counter() - start) / len(fns))
    return statistics.median(samples)


def _rank_main(rank, world, init_file, opts, results):
    use_gpu = not opts["cpu"]
    device = torch.device("cuda", rank) if use_gpu else torch.device("cpu")
    if use_gpu:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if use_gpu else "gloo", init_method=f"file://{init_file}",
                            rank=rank, world_size=world, device_id=device if use_gpu else None)
    config = MLAConfig.kimi_k3(tp=8)
    rows = []
    try:
        with torch.no_grad():
            for batch in opts["batches"]:
                args = (config, opts["weights"], batch, opts["context"], opts["qlen"])
                sets = [decode_set(*args, seed + 16 * rank, device, dcp_group=dist.group.WORLD, dcp_world=world,
                                   dcp_rank=rank) for seed in (0, 1)]
                for s in sets:
                    s[0].bf16 = {"default": None, "bf16": True, "fp8": False}[opts["query"]]
                dcp_s = time_steps(sets, opts["reps"], dist.barrier, use_gpu)
                del sets
                one_s = None
                if rank == 0:
                    sets = [decode_set(*args, seed, device) for seed in (0, 1)]
                    one_s = time_steps(sets, opts["reps"], None, use_gpu)
                    del sets
                if use_gpu:
                    torch.cuda.empty_cache()
                dist.barrier()
                rows.append((batch, one_s, dcp_s))
        if rank == 0:
            results.put(rows)
    finally:
        dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=None, help="ranks (default: every GPU)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=32768, help="tokens a request (global)")
    ap.add_argument("--qlen", type=int, default=1)
    ap.add_argument("--weights", choices=("bf16", "mxfp4"), default="mxfp4")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--cpu", action="store_true", help="gloo on the CPU, eager: a smoke run")
    ap.add_argument("--query", choices=("default", "bf16", "fp8"), default="default",
                    help="the DCP layer's query (default: the layer's, fp8 under DCP)")
    args = ap.parse_args(argv)
    world = args.world or (torch.cuda.device_count() if not args.cpu else 2)
    if not args.cpu and (not torch.cuda.is_available() or torch.cuda.device_count() < world or world < 2):
        print(f"bench_dcp_step: needs {world} >= 2 GPUs (or --cpu)")
        return 1
    opts = dict(batches=[int(b) for b in args.batches.split(",")], context=args.context, qlen=args.qlen,
                weights=args.weights, reps=args.reps, cpu=args.cpu, query=args.query)
    results = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(world, os.path.join(tmp, "init"), opts, results), nprocs=world)
    rows = results.get()
    how = "gloo, eager (smoke run: times mean nothing)" if args.cpu else "NCCL, CUDA graphs"
    print(f"bench_dcp_step: Kimi-K3 TP8 layer, {args.weights} W_UK/W_UV, qlen {args.qlen}, "
          f"DCP {world} over {how}, DCP query {'fp8' if args.query != 'bf16' else 'bf16'} (DCP1: bf16)")
    print(f"| batch | context | DCP1 us | DCP{world} us | DCP1 / DCP{world} |")
    print("|---|---|---|---|---|")
    for batch, one_s, dcp_s in rows:
        print(f"| {batch} | {args.context} | {one_s * 1e6:.1f} | {dcp_s * 1e6:.1f} | {one_s / dcp_s:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
