#!/usr/bin/env python3
"""Time gemm_a16w8_block's GEMV and tl.dot kernels against torch's bf16 GEMM (cuBLAS), Kimi-K3 TP8 shapes.

    python scripts/bench_fp8_gemv.py --out DIR [--m 1,2,4,8,16] [--deadline SECONDS]

Each timing: one CUDA graph of ``CALLS`` calls rotating over enough weight copies (>= 4, > 2 x the
50 MB L2 in all) that no call finds its weight in L2, replayed ``REPLAYS`` times; the median replay
over CALLS. GB/s counts the weight's bytes only (fp8 N x K; bf16 2 N x K for cuBLAS); the floor is
N x K / 4.31 TB/s. Writes DIR/gemv_bench.md (the table) and DIR/gemv_bench.jsonl (every timing).
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch

from kimi_ops.kernels import fp8_gemm
from kimi_ops.reference.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks

SHAPES = (("qkv_a+gate", 3648, 7168, 64), ("q_b", 2304, 1536, 128), ("o_proj", 7168, 1536, 128))
PEAK = 4.31e12
CALLS, REPLAYS = 24, 15


def copies_for(nbytes):
    return max(4, -(-120 * 2 ** 20 // nbytes))


def time_graph(fns):
    """fns: a list of zero-argument calls; per-call us (median of the replays)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns[:2]:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(CALLS):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / CALLS)
    times.sort()
    return times[len(times) // 2]


def variants(m, n, k, block_k):
    """(label, gemv, config) in priority order: the defaults first, then GEMV configs around them."""
    out = [("dot default", False, None), ("gemv default", True, None)]
    default = fp8_gemm.gemv_config(m, n, k, block_k)
    seen = {default}

    def split_for(bn, bk, programs):
        tiles = -(-n // bn)
        return max(1, min(max(1, (-(-k // bk)) // 2), programs // tiles))

    cands = []
    for bn in ((64, 128) if m <= 8 else (32, 64)):
        for depth in (2, 3, 4):
            for ahead in (0, 1):
                cands.append((bn, 128, split_for(bn, 128, 264), 8, depth, ahead))
    bn, bk, _, warps, depth, ahead = default
    for programs in (132, 528):
        cands.append((bn, bk, split_for(bn, bk, programs), warps, depth, ahead))
    cands.append((32, 128, split_for(32, 128, 264), 8, 4, 1))
    for c in cands:
        if c not in seen:
            seen.add(c)
            out.append((f"gemv {c}", True, c))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--m", default="1,2,4,8,16")
    ap.add_argument("--deadline", type=float, default=150.0, help="stop starting new timings after this many s")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    ms = [int(v) for v in args.m.split(",")]
    jl = open(os.path.join(args.out, "gemv_bench.jsonl"), "w")
    sets, dequant = {}, {}
    for name, n, k, bn_scale in SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(n)
        w_bf = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(torch.bfloat16)
        w8, s = quantize_fp8_blocks(w_bf, bn_scale, 128)
        c8, c16 = copies_for(n * k), copies_for(2 * n * k)
        dequant[name] = dequantize_fp8_blocks(w8, s, bn_scale, 128, torch.float32)
        sets[name] = ([w8.clone() for _ in range(c8)], [s.clone() for _ in range(c8)],
                      [w_bf.clone() for _ in range(c16)], bn_scale)
    # every (shape, M)'s defaults and cuBLAS first, then the variants, so a deadline cuts variants
    plan = []
    for name, n, k, _ in SHAPES:           # every (shape, M)'s cuBLAS and defaults first
        for m in ms:
            plan.append((name, n, k, m, "cublas bf16", None, None))
            plan += [(name, n, k, m) + v for v in variants(m, n, k, 128)[:2]]
    for group in ([m for m in ms if m in (1, 8)], [m for m in ms if m in (2, 4)], [m for m in ms if m > 8]):
        for name, n, k, _ in SHAPES:       # then the variants, M = 1 and 8 before the others
            for m in group:
                plan += [(name, n, k, m) + v for v in variants(m, n, k, 128)[2:]]
    results = {}
    for name, n, k, m, label, gemv, cfg in plan:
        if time.time() - t0 > args.deadline:
            print(f"deadline: stopped before {name} M {m} {label}", flush=True)
            break
        if label != "cublas bf16" and gemv and m > fp8_gemm.GEMV_LIMIT_M:
            continue
        ws, ss, wb, bns = sets[name]
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        try:
            if label == "cublas bf16":
                fns = [lambda w=w: x @ w.T for w in wb]
                nbytes = 2 * n * k
            else:
                fns = [lambda w=w, sc=sc: fp8_gemm.gemm_a16w8_block(x, w, sc, block_n=bns, block_k=128, config=cfg,
                                                                    gemv=gemv) for w, sc in zip(ws, ss)]
                nbytes = n * k
                y = fns[0]().float()
                ref = x.float() @ dequant[name].T
                rel = float((y - ref).norm() / ref.norm())
                if not rel <= 4e-3:
                    print(f"{name} M {m} {label}: WRONG rel L2 {rel:.2e}", flush=True)
            us = time_graph(fns)
        except Exception as e:  # a config that does not compile or launch: recorded, not fatal
            print(f"{name} M {m} {label}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        tbs = nbytes / (us * 1e-6) / 1e12
        floor = n * k / PEAK * 1e6
        rec = dict(shape=name, n=n, k=k, m=m, label=label, us=us, tbs=tbs, floor_us=floor,
                   rel=None if label == "cublas bf16" else rel)
        jl.write(json.dumps(rec) + "\n")
        jl.flush()
        results[(name, m, label)] = rec
        print(f"{name:10s} M {m:2d} {label:32s} {us:8.2f} us {tbs:5.2f} TB/s {100 * floor / us:5.1f}% of floor"
              + ("" if rec["rel"] is None else f"  rel L2 {rec['rel']:.2e}"), flush=True)
    # the table: per (shape, M), the best GEMV config vs the tl.dot default and cuBLAS
    lines = ["| shape | M | GEMV default us | best GEMV us (config) | TB/s (best) | % of floor | tl.dot default us | "
             "best / tl.dot | cuBLAS bf16 us | best / cuBLAS |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, n, k, _ in SHAPES:
        for m in ms:
            g = [r for (nm, mm, lb), r in results.items() if nm == name and mm == m and lb.startswith("gemv")]
            dot = results.get((name, m, "dot default"))
            cub = results.get((name, m, "cublas bf16"))
            gd = results.get((name, m, "gemv default"))
            if not g:
                continue
            best = min(g, key=lambda r: r["us"])
            f = lambda r: f"{r['us']:.2f}" if r else "-"
            lines.append(f"| {name} N {n} K {k} | {m} | {f(gd)} | {best['us']:.2f} ({best['label']}) | "
                         f"{best['tbs']:.2f} | "
                         f"{100 * best['floor_us'] / best['us']:.0f}% | {f(dot)} | "
                         f"{(best['us'] / dot['us']) if dot else float('nan'):.2f} | {f(cub)} | "
                         f"{(best['us'] / cub['us']) if cub else float('nan'):.2f} |")
    with open(os.path.join(args.out, "gemv_bench.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
