"""The gather roofline: the read bandwidth a kernel that does nothing but gather the cache's
576-byte rows attains, against the same rows read in order.

M1c's floor (scripts/bench_attention.py) divides the KV bytes by 4.31 TB/s, DESIGN.md's measured
HBM read rate (a sequential read). A decode batch reads its rows through a page-size-1 index:
random 576-byte rows of a large pool. This script times a Triton kernel that loads every indexed row (as 144 int32) and
folds it into one xor checksum a program, so the only traffic is the rows (plus 4 bytes of index a
row), for three index patterns over the same pool:
  random      a random permutation of the pool (bench_attention's default layout)
  sequential  rows 0..n-1 in order
  pages64     random 64-row pages, in order inside a page (a paged cache's layout)
Each is swept over block shapes and pipelining depths and the best is reported. The checksum is
compared against torch's, so a config that skipped rows would fail rather than look fast.

    python3 scripts/bench_gather.py [--tokens 1048576] [--pool 2000000] [--reps 20]

Timing: CUDA-graph replays (scripts/graph_timing.py), median; the pool (1.15 GB by default) is
far larger than the 50 MB L2, a call's rows (604 MB by default) too, and the graph cycles through
--sets index sets (different random permutations, for the random patterns).
"""
import argparse
import itertools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from graph_timing import time_graph  # noqa: E402

ROW_WORDS = tl.constexpr(144)  # a 576-byte cache row as int32


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _gather_checksum(kv, idx, out, n, ROWS: tl.constexpr, ITERS: tl.constexpr, STAGES: tl.constexpr):
    """out[pid] = xor of every int32 word of rows idx[pid*ROWS*ITERS, (pid+1)*ROWS*ITERS) (< n)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, 128)
    tail = 128 + tl.arange(0, 16)
    acc = tl.zeros([ROWS, 128], tl.int32)
    acc_tail = tl.zeros([ROWS, 16], tl.int32)
    for i in tl.range(0, ITERS, num_stages=STAGES):
        t = (pid * ITERS + i) * ROWS + tl.arange(0, ROWS)
        valid = t < n
        row = tl.load(idx + t, mask=valid, other=0).to(tl.int64) * ROW_WORDS
        acc ^= tl.load(kv + row[:, None] + cols[None, :], mask=valid[:, None], other=0)
        acc_tail ^= tl.load(kv + row[:, None] + tail[None, :], mask=valid[:, None], other=0)
    word = tl.reduce(tl.reduce(acc, 1, _xor), 0, _xor) ^ tl.reduce(tl.reduce(acc_tail, 1, _xor), 0, _xor)
    tl.store(out + pid, word)


def gather_checksum(kv_words, idx, rows, iters, stages, warps):
    n = idx.numel()
    out = torch.empty(triton.cdiv(n, rows * iters), dtype=torch.int32, device=idx.device)
    _gather_checksum[(out.numel(),)](kv_words, idx, out, n, ROWS=rows, ITERS=iters, STAGES=stages, num_warps=warps)
    return out


def xor_all(words):
    """The xor of every element of an int32 tensor (torch has no xor reduction: fold halves)."""
    x = words.flatten()
    while x.numel() > 1:
        if x.numel() % 2:
            x = torch.cat([x, x.new_zeros(1)])
        x = x[: x.numel() // 2] ^ x[x.numel() // 2:]
    return int(x[0]) if x.numel() else 0


def expected_checksum(kv_words, idx):
    """The xor of every word of the indexed rows, from torch."""
    total = 0
    for part in idx.split(1 << 18):
        total ^= xor_all(kv_words[part.long()])
    return total


def index_sets(pattern, n, pool, sets, gen):
    """`sets` int32 index vectors of n distinct rows of [0, pool) (the module docstring's patterns)."""
    if pattern == "sequential":
        return [torch.arange(n, dtype=torch.int32)] * sets
    if pattern == "random":
        return [torch.randperm(pool, generator=gen)[:n].to(torch.int32) for _ in range(sets)]
    page = 64
    out = []
    for _ in range(sets):
        pages = torch.randperm(pool // page, generator=gen)[: -(-n // page)]
        out.append((pages[:, None] * page + torch.arange(page)).flatten()[:n].to(torch.int32))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1 << 20, help="rows gathered a call (b32 32k: 1048576)")
    ap.add_argument("--pool", type=int, default=2_000_000, help="cache rows (576 bytes each)")
    ap.add_argument("--sets", type=int, default=4, help="rotating index sets")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    if not 0 < args.tokens <= args.pool - args.pool % 64:
        sys.exit("--tokens must be in [1, pool rounded down to 64-row pages]")
    if not torch.cuda.is_available():
        sys.exit("bench_gather.py needs a CUDA GPU")
    gen = torch.Generator().manual_seed(0)
    kv = torch.randint(-128, 128, (args.pool, 576), dtype=torch.int8, device="cuda")
    kv_words = kv.view(torch.int32)
    configs = list(itertools.product((32, 64), (16,), (2, 3, 4), (4, 8)))  # rows, iters, stages, warps
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          f"{args.tokens} rows of 576 B a call from a pool of {args.pool}")
    for pattern in ("random", "pages64", "sequential"):
        idx_sets = [i.cuda() for i in index_sets(pattern, args.tokens, args.pool, args.sets, gen)]
        want = expected_checksum(kv_words, idx_sets[0])
        best = None
        for rows, iters, stages, warps in configs:
            got = xor_all(gather_checksum(kv_words, idx_sets[0], rows, iters, stages, warps))
            if got != want:
                sys.exit(f"{pattern} {rows, iters, stages, warps}: checksum {got} != {want}")
            seconds, _ = time_graph([lambda i=i: gather_checksum(kv_words, i, rows, iters, stages, warps)
                                     for i in idx_sets], args.reps)
            if best is None or seconds < best[0]:
                best = (seconds, (rows, iters, stages, warps))
        seconds, cfg = best
        tbps = args.tokens * 576 / seconds / 1e12
        print(f"{pattern:10s} {seconds * 1e6:8.1f} us  {tbps:.2f} TB/s of rows  "
              f"({100 * tbps / 4.31:.0f}% of 4.31)  best (rows, iters, stages, warps) = {cfg}")


if __name__ == "__main__":
    main()
