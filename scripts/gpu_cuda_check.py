#!/usr/bin/env python3
"""Quick GPU check of the Hopper kernels (kimi_ops._C) with diagnostics, then a short timing.

    python scripts/gpu_cuda_check.py [--no-check] [--skip-triton] [--time [--l2]] [--balance] [--rows]

1. Structured cases that say *where* a wrong kernel goes wrong: one token (lse = s exactly,
   o = kv_scale * v: a column permutation shows as such), one query row, one 16-row block.
2. Random cases against the float64 oracle (errors printed, not asserted).
3. --time: CUDA-graph replays over rotating input sets for a few shapes, cuda vs triton backend.
   With --l2 the cache pool is 40k rows (23 MB), so every KV read hits L2: the time left is the
   kernel's own (compute and latency), the gap to the normal run is what HBM adds.
   The cuda rows time the backend's mla_decode (work-list grid; S=0: its default split cap).
4. --balance: the variable-length batch and uniform ones through the cuda mla_decode, on the
   (split, request) grid, then on the work-list grid over KIMI_OPS_SM90_BALANCE_WAVES 1-3.
5. --rows: the cuda mla_decode at each CTA height (KIMI_OPS_SM90_ROWS) on 24-96-row shapes,
   DCP2's per-rank shape (24 heads over half the tokens) beside the one-GPU one.
"""
import argparse
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from graph_timing import time_graph  # noqa: E402
from test_triton_attention import SCALE, make_inputs, oracle  # noqa: E402

import kimi_ops.kernels.sm90 as hopper  # noqa: E402
import kimi_ops.kernels.attention as triton_kernels  # noqa: E402


def errors(kern, lens, qlen, H, S, gen, oob=0, kv_scale=0.5):
    q, kv, indptr, idx = make_inputs(lens, qlen, H, device="cuda", gen=gen, oob=oob, kv_scale=kv_scale)
    o, lse = kern.mla_merge(*kern.mla_decode_splitkv(q, kv, indptr, idx, qlen, SCALE, kv_scale, S))
    ro, rl = oracle(q, kv, indptr, idx, qlen, SCALE, kv_scale)
    fin = ~torch.isneginf(rl)
    pat = torch.equal(torch.isneginf(lse), ~fin)
    lerr = (lse.double()[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
    err = ((o.double() - ro).norm() / ro.norm()).item() if ro.norm() > 0 else o.double().norm().item()
    return err, lerr, pat, bool(torch.isnan(o).any())


def structured():
    g = torch.Generator().manual_seed(0)
    q, kv, indptr, idx = make_inputs([1], 1, 1, device="cuda", gen=g)
    op, lp = hopper.mla_decode_splitkv(q, kv, indptr, idx, 1, SCALE, 0.5, 1)
    ro, rl = oracle(q, kv, indptr, idx, 1, SCALE, 0.5)
    print(f"one token: lse {lp[0, 0, 0].item():.6f} ref {rl[0, 0].item():.6f}")
    v = (0.5 * kv[idx[0].long(), :512].double())
    got = op[0, 0, 0].double()
    print(f"one token: max |o - kv_scale v| = {(got - v).abs().max().item():.3e}")
    if (got - v).abs().max().item() > 1e-2:
        where = [int(((got[i] - v).abs() < 1e-6).nonzero()[0]) if ((got[i] - v).abs() < 1e-6).any() else -1
                 for i in range(24)]
        print("  o column i equals v column:", where)
    for lens, qlen, H in [([64], 1, 1), ([64], 1, 16), ([200], 1, 12), ([130], 2, 12), ([300], 1, 32)]:
        e = errors(hopper, lens, qlen, H, 1, g)
        print(f"lens {lens} qlen {qlen} H {H}: rel L2 {e[0]:.2e} |lse| {e[1]:.2e} -inf ok {e[2]} nan {e[3]}")


def random_cases(skip_triton=False):
    g = torch.Generator().manual_seed(1)
    for lens, qlen, H, S, oob in [([0, 1, 2, 7, 63, 64, 65, 300], 1, 12, 3, 0), ([1000] * 4, 2, 12, 1, 0),
                                  ([4096, 17, 2500, 0], 3, 12, 8, 2), ([16384], 8, 12, 64, 0),
                                  ([5, 1, 0, 2], 4, 12, 9, 0), ([3000], 1, 96, 4, 0), ([3000], 1, 128, 4, 0)]:
        for kern, name in ((hopper, "cuda"), (triton_kernels, "triton"))[:1 if skip_triton else 2]:
            e = errors(kern, lens, qlen, H, S, g, oob=oob)
            print(f"{name:6s} lens {str(lens)[:30]:30s} q{qlen} H{H} S{S}: rel L2 {e[0]:.2e} |lse| {e[1]:.2e} "
                  f"-inf ok {e[2]} nan {e[3]}")


def time_one(kern, H, qlen, lens, S, sets=8, reps=10, pool_rows=None, whole=False):
    """CUDA-graph replays over rotating sets. whole: the cuda backend's mla_decode (work-list grid
    unless KIMI_OPS_SM90_WORK_LIST=0; S caps the splits, None: its default); else the
    backend's mla_decode_splitkv (S splits) + mla_merge."""
    g = torch.Generator().manual_seed(2)
    R = len(lens)
    total = sum(lens)
    l2_resident = pool_rows is not None
    if pool_rows is None:
        pool_rows = max(min(total * sets, 2_000_000), total, 1)  # >= 1.1 GB: no set stays in L2
    pool = (torch.randn(pool_rows, 576, device="cuda") * 4).to(torch.float8_e4m3fn)
    indptr = torch.zeros(R + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(lens), 0)
    indptr = indptr.cuda()
    inputs = []
    for i in range(sets):
        if l2_resident:  # rows repeat: the pool is smaller than one set
            idx = torch.randint(0, pool_rows, (total,), generator=g).to(torch.int32).cuda()
        else:
            idx = torch.randperm(pool_rows, generator=g)[:total].to(torch.int32).cuda()
        q = torch.randn(R * qlen, H, 576, generator=g).to(torch.bfloat16).cuda()
        inputs.append((q, idx))

    def run(q, idx):
        if whole:
            return kern.mla_decode(q, pool, indptr, idx, qlen, SCALE, 0.05, S)
        op, lp = kern.mla_decode_splitkv(q, pool, indptr, idx, qlen, SCALE, 0.05, S)
        return kern.mla_merge(op, lp) if S > 1 else (op[0], lp[0])

    seconds, _ = time_graph([lambda q=q, idx=idx: run(q, idx) for q, idx in inputs], reps)
    us = seconds * 1e6
    tbps = total * 576 / us / 1e6
    return us, tbps


def varlen_batch():
    torch.manual_seed(0)  # bench_attention.py's variable-length batch
    return torch.distributions.LogNormal(math.log(8192), 0.8).sample((64,)).clamp(16, 65536).long().tolist()


def balance_sweep():
    """Per batch: mla_decode on the (split, request) grid (KIMI_OPS_SM90_WORK_LIST=0, suggested S,
    empty splits' o unwritten), then on the work-list grid over balance waves 1-4."""
    for label, lens in (("H12 q1 b64 varlen", varlen_batch()), ("H12 q1 b32 32k", [32768] * 32),
                        ("H12 q1 b8 8k", [8192] * 8), ("H12 q2 b32 8k", [8192] * 32)):
        qlen = 2 if "q2" in label else 1
        for work_list, waves in [("0", 1), ("1", 1), ("1", 2), ("1", 3)]:
            os.environ[hopper.WORK_LIST_ENV] = work_list
            os.environ[hopper.BALANCE_WAVES_ENV] = str(waves)
            us, tb = time_one(hopper, 12, qlen, lens, None, whole=True)
            grid = "work list " if work_list == "1" else "split grid"
            print(f"balance {label:18s} {grid} waves {waves}: {us:8.1f} us  {tb:5.2f} TB/s  "
                  f"({100 * tb / 4.31:.0f}% of HBM)")
    os.environ.pop(hopper.BALANCE_WAVES_ENV)
    os.environ.pop(hopper.WORK_LIST_ENV)


def rows_sweep():
    """The cuda mla_decode with each CTA height (KIMI_OPS_SM90_ROWS) on shapes of 24-96 rows a
    request: DCP2's per-rank shape (a rank attends 12 x W heads over 1/W of the tokens) beside
    the one-GPU shape of the same batch, and the compute-bound ones."""
    shapes = [("H12 q1 b32 32k (DCP1)", 12, 1, [32768] * 32), ("H24 q1 b32 16k (DCP2)", 24, 1, [16384] * 32),
              ("H12 q1 b8 32k (DCP1)", 12, 1, [32768] * 8), ("H24 q1 b8 16k (DCP2)", 24, 1, [16384] * 8),
              ("H96 q1 b64 4k", 96, 1, [4096] * 64), ("H12 q8 b32 8k", 12, 8, [8192] * 32)]
    for label, H, qlen, lens in shapes:
        for rows in ("", "16", "24", "32", "48", "64"):
            if rows and int(rows) > 2 * qlen * H:
                continue
            if rows:
                os.environ[hopper.ROWS_ENV] = rows
            us, tb = time_one(hopper, H, qlen, lens, None, whole=True)
            os.environ.pop(hopper.ROWS_ENV, None)
            print(f"rows {label:22s} {rows or 'default':7s} ({hopper.rows_per_cta(qlen * H) if not rows else rows}): "
                  f"{us:8.1f} us  {tb:5.2f} TB/s")


def timing(skip_triton=False, pool_rows=None, only=None):
    shapes = [("H12 q1 b8 8k", 12, 1, [8192] * 8), ("H12 q1 b32 8k", 12, 1, [8192] * 32),
              ("H12 q1 b32 32k", 12, 1, [32768] * 32), ("H12 q1 b128 8k", 12, 1, [8192] * 128),
              ("H12 q2 b32 8k", 12, 2, [8192] * 32), ("H12 q4 b32 8k", 12, 4, [8192] * 32),
              ("H12 q8 b32 8k", 12, 8, [8192] * 32), ("H12 q8 b128 8k", 12, 8, [8192] * 128),
              ("H96 q1 b64 4k", 96, 1, [4096] * 64), ("H12 q1 b1 32k", 12, 1, [32768])]
    varlen = varlen_batch()
    shapes.append(("H12 q1 b64 varlen", 12, 1, varlen))
    # issue 7's yardstick for the variable-length batch: a uniform batch of the same tokens
    shapes.append(("H12 q1 b64 same-tok", 12, 1, [sum(varlen) // 64] * 64))
    if only:
        shapes = [sh for sh in shapes if any(key in sh[0] for key in only)]
    for label, H, qlen, lens in shapes:
        for name, kern in (("cuda", hopper), ("triton", triton_kernels))[:1 if skip_triton else 2]:
            whole = kern is hopper  # the cuda backend's mla_decode: its own split cap
            S = None if whole else kern.suggest_num_splits(len(lens), qlen, H, sum(lens))
            us, tb = time_one(kern, H, qlen, lens, S, pool_rows=pool_rows, whole=whole)
            print(f"{name:6s} {label:18s} S={S or 0:3d}: {us:8.1f} us  {tb:5.2f} TB/s  "
                  f"({100 * tb / 4.31:.0f}% of HBM)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--skip-triton", action="store_true", help="check and time the cuda backend only")
    ap.add_argument("--l2", action="store_true", help="a 40k-row cache pool that stays in L2")
    ap.add_argument("--balance", action="store_true", help="sweep balance waves x splits (cuda)")
    ap.add_argument("--rows", action="store_true", help="time each CTA height on 24-96-row shapes (cuda)")
    ap.add_argument("--no-check", action="store_true", help="skip the structured and random cases")
    ap.add_argument("--shapes", default="", help="--time only the shapes whose label contains one of "
                    "these comma-separated strings (e.g. 'b32 32k,varlen')")
    args = ap.parse_args()
    if not args.no_check:
        structured()
        random_cases(args.skip_triton)
    if args.time:
        timing(args.skip_triton, 40_000 if args.l2 else None, [k for k in args.shapes.split(",") if k])
    if args.balance:
        balance_sweep()
    if args.rows:
        rows_sweep()


if __name__ == "__main__":
    main()
