#!/usr/bin/env python3
"""Time the decode layer's projections at small M (Kimi-K3 TP8 shapes) on the GPU: the cuda
backend's small-M kernel (csrc/sm90/gemv.cuh) for bf16 and fp8 block-scaled weights, against
cuBLAS's bf16 GEMM (``F.linear``) and the Triton fp8 kernels (what ran before it).

    python scripts/bench_gemv.py [--out DIR] [--m 1,2,4,8] [--shapes N:K,...]

``--shapes`` times other [N, K] weights instead of the layer's three (e.g. ``2112:7168,4224:7168``:
132 and 264 CTAs of 16 rows, to see what the CTA count's waves cost; perf-history.md, session 36).

Each timing: scripts/bench_fp8_gemv.py's method (one CUDA graph of 24 calls rotating over enough
weight copies that no call finds its weight in L2; median replay / 24). TB/s counts the weight's
bytes (bf16 2NK, fp8 NK + scales); floor = those bytes / 4.31 TB/s. Every kernel output is
checked against float32 (rel L2 <= 4e-3, else WRONG). Writes DIR/bench_gemv.md.
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_fp8_gemv import PEAK, SHAPES, copies_for, time_graph  # noqa: E402
from kimi_ops.kernels import fp8_gemm, sm90_gemv  # noqa: E402
from kimi_ops.reference.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--m", default="1,2,4,8")
    ap.add_argument("--shapes", default="", help="comma list of N:K (fp8 block scales of 128 x 128); "
                    "default: the layer's projections")
    args = ap.parse_args(argv)
    ms = [int(v) for v in args.m.split(",")]
    shapes = SHAPES
    if args.shapes:
        shapes = [("weight", int(n), int(k), 128) for n, k in (v.split(":") for v in args.shapes.split(","))]
    lines = ["| projection [N, K] | M | cuBLAS bf16 us | kimi_ops bf16 us (TB/s, % of floor) | bf16 speed-up | "
             "Triton fp8 us | kimi_ops fp8 us (TB/s, % of floor) | fp8 speed-up |",
             "|---|---|---|---|---|---|---|---|"]
    for name, n, k, bn in shapes:
        gen = torch.Generator(device="cuda").manual_seed(n)
        w_bf = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).to(torch.bfloat16)
        w8, s = quantize_fp8_blocks(w_bf, bn, 128)
        w8_f32 = dequantize_fp8_blocks(w8, s, bn, 128, torch.float32)
        wbs = [w_bf.clone() for _ in range(copies_for(2 * n * k))]
        w8s = [(w8.clone(), s.clone()) for _ in range(copies_for(n * k))]
        bytes16, bytes8 = 2 * n * k, n * k + 4 * s.numel()
        for m in ms:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            checks = []
            for label, y, ref in (
                    ("bf16", sm90_gemv.gemm_a16w16(x, w_bf), x.float() @ w_bf.float().T),
                    ("fp8", sm90_gemv.gemm_a16w8_block(x, w8, s, block_n=bn), x.float() @ w8_f32.T)):
                rel = float((y.float() - ref).norm() / ref.norm())
                checks.append(f"{label} rel L2 {rel:.2e}" + ("" if rel <= 4e-3 else " WRONG"))
            t_cub = time_graph([lambda w=w: F.linear(x, w) for w in wbs])
            t_b16 = time_graph([lambda w=w: sm90_gemv.gemm_a16w16(x, w) for w in wbs])
            t_tri = time_graph([lambda w=w, sc=sc: fp8_gemm.gemm_a16w8_block(x, w, sc, block_n=bn) for w, sc in w8s])
            t_f8 = time_graph([lambda w=w, sc=sc: sm90_gemv.gemm_a16w8_block(x, w, sc, block_n=bn) for w, sc in w8s])
            f16, f8 = bytes16 / PEAK * 1e6, bytes8 / PEAK * 1e6
            row = (f"| {name} [{n}, {k}] | {m} | {t_cub:.2f} | {t_b16:.2f} ({bytes16 / t_b16 / 1e6:.2f}, "
                   f"{100 * f16 / t_b16:.0f}%) | {t_cub / t_b16:.2f}x | {t_tri:.2f} | {t_f8:.2f} "
                   f"({bytes8 / t_f8 / 1e6:.2f}, {100 * f8 / t_f8:.0f}%) | {t_tri / t_f8:.2f}x |")
            lines.append(row)
            print(row, " ".join(checks), flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_gemv.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
