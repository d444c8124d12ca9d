#!/usr/bin/env python3
"""Benchmark the Triton MLA decode (split-KV M1c + M1b merge) on the GPU.

    python scripts/bench_attention.py --out DIR [--quick] [--mma fp8,bf16] [--no-naive]

Per shape: CUDA-graph replays over rotating input sets (a graph holds one call per set; the
sets' KV rows are random rows of one large pool, so no set stays in L2), median of the
replays.  Reports time of mla_decode (splitkv + merge) and of splitkv alone, effective TB/s
of KV bytes, % of the floor (DESIGN.md: max(bytes / 4.31 TB/s, MMA work / 1415 TFLOP/s),
MMA work = the seeds' fp8 hi + lo scheme: 2 x 2 x rows x visible tokens x (576 + 512)),
and the ratio to each peer measured in the same process (naive torch: gather + dequantize
to bf16 + matmul + softmax + matmul).  Writes DIR/bench_attention.json,
DIR/bench_attention.md and DIR/bench_attention.png.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

HBM = 4.31e12
FP8_RATE = 1415e12
BF16_RATE = 786e12
SCALE = 1.0 / math.sqrt(192.0)
KV_SCALE = 0.05


def grid(quick=False):
    shapes = []
    for qlen in (1, 2, 4, 8):
        for batch in (1, 8, 32, 128):
            for ctx in (1024, 8192, 32768):
                shapes.append(dict(H=12, qlen=qlen, lens=[ctx] * batch, label=f"H12 q{qlen} b{batch} {ctx // 1024}k"))
    for batch in (8, 64):
        shapes.append(dict(H=96, qlen=1, lens=[4096] * batch, label=f"H96 q1 b{batch} 4k"))
    torch.manual_seed(0)  # the same variable-length batch in every run
    lens = torch.distributions.LogNormal(math.log(8192), 0.8).sample((64,)).clamp(16, 65536).long().tolist()
    shapes.append(dict(H=12, qlen=1, lens=lens, label="H12 q1 b64 varlen~8k"))
    if quick:
        keep = {"H12 q1 b8 8k", "H12 q1 b32 32k", "H12 q2 b32 8k", "H12 q8 b32 8k", "H12 q4 b128 8k",
                "H96 q1 b64 4k", "H12 q1 b64 varlen~8k"}
        shapes = [s for s in shapes if s["label"] in keep]
    return shapes


def floor_of(H, qlen, lens, S):
    R = len(lens)
    T = R * qlen
    rows = T * H
    kv_bytes = sum(lens) * 576
    vis = 0
    for n in lens:
        for i in range(qlen):
            vis += max(0, min(n, n - qlen + i + 1))
    vis *= H
    other = rows * 576 * 2 + sum(lens) * 4 + (R + 1) * 4 + 2 * S * rows * (512 * 2 + 4) + rows * (512 * 2 + 4)
    flops = 2 * 2 * vis * (576 + 512)
    t_mem = (kv_bytes + other) / HBM
    t_mma = flops / FP8_RATE
    return dict(kv_bytes=kv_bytes, bytes=kv_bytes + other, flops=flops, t_mem=t_mem, t_mma=t_mma,
                floor=max(t_mem, t_mma))


def time_graph(fns, reps):
    """fns: one closure a set; a graph of all of them; median replay time / len(fns)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3 / len(fns))
    del g
    return statistics.median(ts), ts


def naive_decode(q, pool, indptr_list, idx, qlen, H, kv_scale):
    """Peer: gather + dequantize to bf16, padded batch matmul, masked softmax, matmul."""
    R = len(indptr_list) - 1
    lens = [indptr_list[r + 1] - indptr_list[r] for r in range(R)]
    L = max(lens)
    dev = q.device
    if all(n == L for n in lens):
        gidx = idx[: R * L].view(R, L).long()
    else:
        gidx = torch.zeros(R, L, dtype=torch.long, device=dev)
        for r in range(R):
            gidx[r, : lens[r]] = idx[indptr_list[r]: indptr_list[r + 1]].long()
    lens_t = torch.tensor(lens, device=dev)

    def f():
        k = pool[gidx].to(torch.bfloat16) * kv_scale                      # [R, L, 576]
        qq = q.view(R, qlen * H, 576)
        s = torch.matmul(qq, k.transpose(1, 2)).float() * SCALE            # [R, qlen*H, L]
        pos = torch.arange(qlen, device=dev).repeat_interleave(H)
        lim = lens_t[:, None] - qlen + pos[None, :] + 1                   # [R, qlen*H]
        s = s.masked_fill(torch.arange(L, device=dev)[None, None, :] >= lim[:, :, None], -math.inf)
        lse = torch.logsumexp(s, -1)
        p = torch.softmax(s, -1).nan_to_num(0.0).to(torch.bfloat16)
        o = torch.matmul(p, k[..., :512])
        return o, lse

    return f


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--mma", default="fp8,bf16")
    ap.add_argument("--no-naive", action="store_true")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--layout", default="random", choices=["random", "paged16", "contiguous"],
                    help="where a set's tokens live in the pool: random rows (page size 1), "
                         "random pages of 16 consecutive rows, or one contiguous run")
    ap.add_argument("--splits-mult", type=float, default=1.0, help="x suggest_num_splits")
    ap.add_argument("--tag", default="")
    ap.add_argument("--set-bytes", type=float, default=256e6, help="KV bytes to rotate over")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    import kimi_ops.kernels.attention as A

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    nsm = props.multi_processor_count
    shapes = grid(args.quick)
    max_tok = max(sum(s["lens"]) for s in shapes)
    pool_rows = max(max_tok, int(args.set_bytes // 576)) + 1024
    torch.manual_seed(0)
    pool = (torch.randn(pool_rows, 576, device=dev) * 2).clamp(-448, 448).to(torch.float8_e4m3fn)
    mmas = args.mma.split(",")
    results = []
    print(f"device {props.name}, {nsm} SMs, pool {pool_rows} rows ({pool_rows * 576 / 1e9:.2f} GB), "
          f"torch {torch.__version__}, triton {__import__('triton').__version__}", flush=True)
    for sh in shapes:
        H, qlen, lens = sh["H"], sh["qlen"], sh["lens"]
        R = len(lens)
        tok = sum(lens)
        S = max(1, int(round(A.suggest_num_splits(R, qlen, H, tok, nsm) * args.splits_mult)))
        fl = floor_of(H, qlen, lens, S)
        nsets = int(min(32, max(2, math.ceil(args.set_bytes / fl["kv_bytes"]))))
        indptr_list = [0]
        for n in lens:
            indptr_list.append(indptr_list[-1] + n)
        indptr = torch.tensor(indptr_list, dtype=torch.int32, device=dev)
        sets = []
        for _ in range(nsets):
            if args.layout == "random":
                idx = torch.randperm(pool_rows, device=dev)[:tok].to(torch.int32)
            elif args.layout == "paged16":
                nb = -(-tok // 16)
                blocks = torch.randperm(pool_rows // 16, device=dev)[:nb]
                idx = (blocks[:, None] * 16 + torch.arange(16, device=dev)).flatten()[:tok].to(torch.int32)
            else:
                off = int(torch.randint(0, pool_rows - tok + 1, ()).item())
                idx = torch.arange(off, off + tok, device=dev, dtype=torch.int32)
            q = torch.randn(R * qlen, H, 576, device=dev).to(torch.bfloat16)
            sets.append((q, idx))
        row = dict(label=sh["label"], H=H, qlen=qlen, batch=R, tokens=tok, num_splits=S, nsets=nsets,
                   floor_us=fl["floor"] * 1e6, mem_floor_us=fl["t_mem"] * 1e6, mma_floor_us=fl["t_mma"] * 1e6,
                   kv_bytes=fl["kv_bytes"])
        for mma in mmas:
            os.environ["KIMI_OPS_TRITON_MMA"] = mma

            def dec(q=None, idx=None):
                op, lp = A.mla_decode_splitkv(q, pool, indptr, idx, qlen, SCALE, KV_SCALE, S)
                return A.mla_merge(op, lp)

            def spl(q=None, idx=None):
                return A.mla_decode_splitkv(q, pool, indptr, idx, qlen, SCALE, KV_SCALE, S)

            t_dec, _ = time_graph([lambda q=q, idx=idx: dec(q, idx) for q, idx in sets], args.reps)
            t_spl, _ = time_graph([lambda q=q, idx=idx: spl(q, idx) for q, idx in sets], args.reps)
            row[f"{mma}_us"] = t_dec * 1e6
            row[f"{mma}_splitkv_us"] = t_spl * 1e6
        best = min(mmas, key=lambda m: row[f"{m}_us"])
        t = row[f"{best}_us"] * 1e-6
        row["best"] = best
        row["tbps"] = fl["kv_bytes"] / t / 1e12
        row["pct_floor"] = 100 * fl["floor"] / t
        row["pct_floor_splitkv"] = 100 * fl["floor"] / (row[f"{best}_splitkv_us"] * 1e-6)
        if not args.no_naive:
            try:
                nsets_n = min(nsets, 4)
                fns = [naive_decode(q, pool, indptr_list, idx, qlen, H, KV_SCALE) for q, idx in sets[:nsets_n]]
                t_n, _ = time_graph(fns, max(3, args.reps // 3))
                row["naive_us"] = t_n * 1e6
                row["x_vs_naive"] = t_n / t
            except torch.OutOfMemoryError:
                row["naive_us"] = None
                torch.cuda.empty_cache()
        results.append(row)
        print(f"{row['label']:<24} S={S:<3} floor {row['floor_us']:8.1f}us  "
              + "  ".join(f"{m} {row[m + '_us']:8.1f}us (splitkv {row[m + '_splitkv_us']:7.1f})" for m in mmas)
              + f"  {row['tbps']:.2f} TB/s  {row['pct_floor']:5.1f}% floor"
              + (f"  naive {row['naive_us']:9.1f}us x{row['x_vs_naive']:.1f}" if row.get("naive_us") else ""),
              flush=True)
        del sets
        torch.cuda.empty_cache()

    meta = dict(layout=args.layout, splits_mult=args.splits_mult, device=props.name, sms=nsm, torch=torch.__version__, triton=__import__("triton").__version__,
                hbm=HBM, fp8_rate=FP8_RATE, peers=["naive torch"] if not args.no_naive else [])
    with open(os.path.join(args.out, f"bench_attention{args.tag}.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    md = ["| shape | splits | floor us | " + " | ".join(f"{m} us" for m in mmas)
          + " | splitkv us | TB/s (KV) | % floor | % floor (splitkv only) | naive us | x naive |",
          "|" + "---|" * (9 + len(mmas))]
    for r in results:
        md.append(f"| {r['label']} | {r['num_splits']} | {r['floor_us']:.1f} | "
                  + " | ".join(f"{r[m + '_us']:.1f}" for m in mmas)
                  + f" | {r[r['best'] + '_splitkv_us']:.1f} | {r['tbps']:.2f} | {r['pct_floor']:.0f} | "
                  f"{r['pct_floor_splitkv']:.0f} | "
                  + (f"{r['naive_us']:.0f} | {r['x_vs_naive']:.1f} |" if r.get("naive_us") else "- | - |"))
    with open(os.path.join(args.out, f"bench_attention{args.tag}.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    print("\n".join(md))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(12, 4))
        ax.bar(range(len(results)), [r["pct_floor"] for r in results])
        ax.set_xticks(range(len(results)))
        ax.set_xticklabels([r["label"] for r in results], rotation=90, fontsize=6)
        ax.set_ylabel("% of floor")
        ax.axhline(70, color="r", lw=0.5)
        ax.axhline(50, color="orange", lw=0.5)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, f"bench_attention{args.tag}.png"), dpi=120)
    except Exception as e:  # plotting is optional
        print("plot failed:", e)


if __name__ == "__main__":
    main()
