"""DCP combine latency over NCCL: all-to-all + merge against all-gather + reduce-scatter.

    torchrun --nproc-per-node W scripts/bench_dcp.py        (or: python scripts/bench_dcp.py --world W)

Each rank holds partials o [T, W * 12, 512] bf16 and lse [T, W * 12] f32 (random, finite)
and combines them to its own 12 heads; every method runs inside a CUDA graph of 20 calls,
replayed 20 times, median per call. Rank 0 prints a markdown table.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graph_timing import time_graph  # noqa: E402

from kimi_ops.runtime import dcp  # noqa: E402

HEADS = 12


def time_method(method, o, lse, group, calls=20, replays=20):
    """Microseconds a combine: ``calls`` combines in one CUDA graph, median of ``replays``
    replays, every rank entering each replay together."""
    fns = [lambda: dcp.combine(o, lse, group, method)] * calls
    return time_graph(fns, replays, before_replay=dist.barrier)[0] * 1e6


def worker(rank, world, rows_list):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29561")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    lines = []
    for rows in rows_list:
        o = torch.randn(rows, world * HEADS, 512, device="cuda").to(torch.bfloat16)
        lse = torch.randn(rows, world * HEADS, device="cuda")
        times = {m: time_method(m, o, lse, group) for m in dcp.COMBINES}
        lines.append(f"| {world} | {rows} | " + " | ".join(f"{times[m]:.1f}" for m in dcp.COMBINES) + " |")
    if rank == 0:
        print("| W | T | " + " | ".join(f"{m} us" for m in dcp.COMBINES) + " |")
        print("|---|---|" + "---|" * len(dcp.COMBINES))
        print("\n".join(lines))
    dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=torch.cuda.device_count())
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args.rows)
    else:
        mp.spawn(worker, args=(args.world, args.rows), nprocs=args.world)


if __name__ == "__main__":
    main()
