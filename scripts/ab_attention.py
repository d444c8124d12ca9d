#!/usr/bin/env python3
"""In-process A/B of kimi_ops' mla_decode under an environment switch (a maintainers' tool).

    python3 scripts/ab_attention.py --env KIMI_OPS_SM90_TM_LOAD --values cp,bulk
        [--shapes "H96 B8 8k q1;H12 B32 8k q4"] [--rounds 3] [--reps 20] [--set-bytes 2e9] [--pool-bytes 0]
        [--fp8-query]

The launchers read their switches (KIMI_OPS_SM90_*, KIMI_OPS_PDL, ...) at every launch, so one
process can time each value of one: per shape, input sets of contiguous requests on 64-row pages
of one fp8 pool, rotating over --set-bytes of KV so that no set stays in L2; then, round by round,
each value in turn: a CUDA graph of one mla_decode call a set (graph_timing.py), --reps replays,
their median. Prints, per shape, each value's median over the rounds with the rounds' range, and
whether its o and lse on set 0 are bit-equal to the first value's (a switch meant to leave the
numbers alone must say "bit-equal"). The value "-" unsets the variable (first in the list, write
--values=-,bulk: argparse takes a bare "-,bulk" for an option). --fp8-query: each set's
bf16 q quantized per tensor to e4m3fn (kimi_ops.quantize_query, amax scale), mla_decode given
q8 and q_scale= (the fp8-query kernels; the same random q as without it).
The pool and the rotation matter outside the tile loop: in session 44 one kernel ran 27% slower
with --set-bytes 2e9 over a 1.8 GB pool than at bench_attention.py's 256 MB over 0.6 GB.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_attention import KV_SCALE, SCALE, contiguous_run, random_pool, rotation_sets  # noqa: E402
from graph_timing import time_graph  # noqa: E402

DEVICE = "cuda"
DEFAULT_SHAPES = "H12 B8 8k q1;H12 B32 8k q2;H12 B32 8k q4;H12 B32 8k q8;H96 B64 4k q1;H96 B8 8k q1"
SHAPE_RE = re.compile(r"^H(\d+) B(\d+) (\d+)(k?) q(\d+)$")


def parse_shape(label):
    """'H96 B8 8k q1' -> (heads, batch, context tokens, qlen); the context in tokens or k (1024)."""
    m = SHAPE_RE.match(label.strip())
    if m is None:
        raise ValueError(f"shape: expected 'H<heads> B<batch> <context>[k] q<qlen>', got {label!r}")
    h, b, ctx, k, q = m.groups()
    return int(h), int(b), int(ctx) * (1024 if k else 1), int(q)


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--env", required=True, help="the environment variable to switch")
    ap.add_argument("--values", required=True, help="comma list of its values ('-': unset); the first is the base")
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="';' list of 'H<heads> B<batch> <ctx>[k] q<qlen>'")
    ap.add_argument("--backend", default="cuda", help="KIMI_OPS_BACKEND for every call")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--set-bytes", type=float, default=2e9, help="KV bytes to rotate over")
    ap.add_argument("--pool-bytes", type=float, default=0.0, help="the fp8 pool at least this large")
    ap.add_argument("--save", default="", help="torch.save each shape's first-value o, lse on set 0 here "
                    "(inputs are seeded: two builds' files compare bit for bit)")
    ap.add_argument("--fp8-query", action="store_true",
                    help="q quantized per tensor to e4m3fn (kimi_ops.quantize_query), passed with q_scale=")
    return ap


def set_env(name, value):
    if value == "-":
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def main(argv=None):
    args = build_parser().parse_args(argv)
    values = args.values.split(",")
    shapes = [(label.strip(), *parse_shape(label)) for label in args.shapes.split(";") if label.strip()]
    import kimi_ops

    dev = torch.device(DEVICE)
    os.environ["KIMI_OPS_BACKEND"] = args.backend
    pool = random_pool(max(b * ctx for _, _, b, ctx, _ in shapes), args.set_bytes, args.pool_bytes, dev)
    pool_rows = pool.shape[0]
    before = os.environ.get(args.env)
    print(f"{args.env} in {values}; backend {args.backend}; pool {pool_rows} rows ({pool_rows * 576 / 1e9:.2f} GB)"
          f"{'; fp8 query' if args.fp8_query else ''}", flush=True)
    saved = {}
    try:
        for label, H, B, ctx, qlen in shapes:
            tok = B * ctx
            indptr = torch.arange(0, tok + 1, ctx, dtype=torch.int32, device=dev)
            nsets = rotation_sets(args.set_bytes, tok * 576)
            sets = []
            for _ in range(nsets):
                idx = contiguous_run(pool_rows, tok, dev)
                q = torch.randn(B * qlen, H, 576, device=dev).to(torch.bfloat16)
                q, q_scale = kimi_ops.quantize_query(q) if args.fp8_query else (q, None)
                sets.append((q, q_scale, idx))

            def call(q, q_scale, idx):
                return kimi_ops.mla_decode(q, pool, indptr, idx, qlen=qlen, scale=SCALE, kv_scale=KV_SCALE,
                                           q_scale=q_scale)

            same = {}
            base = None
            for v in values:
                set_env(args.env, v)
                o, lse = call(*sets[0])
                if base is None:
                    base = (o.clone(), lse.clone())
                    saved[label] = (o.cpu(), lse.cpu())
                same[v] = torch.equal(o, base[0]) and torch.equal(lse, base[1])
            times = {v: [] for v in values}
            for _ in range(args.rounds):
                for v in values:
                    set_env(args.env, v)
                    t, _ = time_graph([lambda s=s: call(*s) for s in sets], args.reps)
                    times[v].append(t * 1e6)
            cells = []
            for v in values:
                med = statistics.median(times[v])
                rel = "" if v == values[0] else f" {100 * (med / statistics.median(times[values[0]]) - 1):+.1f}%"
                cells.append(f"{v}: {med:.2f} us [{min(times[v]):.2f}-{max(times[v]):.2f}]{rel}"
                             f"{'' if same[v] else ' OUTPUT DIFFERS'}")
            equal = "bit-equal" if all(same.values()) else "not bit-equal"
            print(f"{label} ({nsets} sets, {equal}): " + "; ".join(cells), flush=True)
    finally:
        set_env(args.env, "-" if before is None else before)
        if args.save:
            torch.save(saved, args.save)


if __name__ == "__main__":
    main()
