#!/usr/bin/env python3
"""Time an M1b merge alone on the GPU: Triton's (``kimi_ops.kernels.attention.mla_merge``) or,
with ``--backend cuda``, the Hopper kernel's (``kimi_ops.kernels.sm90.mla_merge``, needs kimi_ops._C).

    python3 scripts/bench_merge.py [--backend triton|cuda] [--calls 64] [--reps 50] [--sweep] [--json FILE]

Shapes (S splits, T*H rows, H = 12): (1, 12), (8, 12), (32, 12), (64, 12), (17, 384),
(9, 1536), (64, 1536).  Per shape: a CUDA graph of ``--calls`` merges over rotating input
sets (as many sets as fit 2 x the 50 MB L2, at most ``--calls``), replayed ``--reps`` times;
the time is the median replay / calls.  GB/s counts the o_part bytes read (S * T*H * 1 KB),
"% HBM" is that against 4.31 TB/s.  Each shape's output is checked once against a float64
merge (max error in bf16 ulps of the largest |o|).  ``--sweep`` (Triton only) also times other
block sizes / warp counts per shape (mla_merge's chooser patched), to re-tune _merge_config.
"""
import argparse
import itertools
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graph_timing import time_graph  # noqa: E402

import kimi_ops.kernels.attention as A  # noqa: E402

HBM = 4.31e12
L2_BYTES = 50 * 2**20
SHAPES = [(1, 12), (8, 12), (32, 12), (64, 12), (17, 384), (9, 1536), (64, 1536)]
H = 12
DEVICE = "cuda"  # a dry run may point this elsewhere


def make_set(S, TH, gen, dead_frac=0.1):
    o_part = torch.randn(S, TH // H, H, 512, device=DEVICE, generator=gen).to(torch.bfloat16)
    lse_part = torch.randn(S, TH // H, H, device=DEVICE, generator=gen) * 3
    dead = torch.rand(S, TH // H, H, device=DEVICE, generator=gen) < dead_frac
    dead[0] = False  # no row all empty (that would skip its reads)
    lse_part[dead] = -math.inf
    o_part[dead] = 0
    return o_part, lse_part


def reference(o_part, lse_part):
    lp = lse_part.double()
    rl = torch.logsumexp(lp, dim=0)
    w = torch.exp(lp - rl.clamp_min(-1e300)[None]).nan_to_num(0.0)
    return (w[..., None] * o_part.double()).sum(0), rl


def check(merge, inputs, ro, rl, ulp):
    """max |o - ref| in bf16 ulps of the largest |ref|, max |lse - ref|"""
    o, lse = merge(*inputs)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    return (o.double() - ro).abs().max().item() / ulp, (lse.double() - rl).abs().max().item()


def bench_shape(merge, S, TH, sets, calls, reps):
    fns = [lambda op=op, lp=lp: merge(op, lp) for op, lp in (sets[i % len(sets)] for i in range(calls))]
    t, _ = time_graph(fns, reps)
    nbytes = S * TH * 512 * 2
    return t, nbytes / t


def sweep_configs(S, TH):
    bs0, _, _ = A._merge_config(S, TH)
    out = []
    for bs, bc, warps in itertools.product(sorted({bs0, max(1, bs0 // 2)}), (64, 128, 256, 512), (1, 2, 4, 8)):
        tile = bs * bc
        if 32 * warps * 4 <= tile <= 32 * warps * 64 and tile <= 8192:
            out.append((bs, bc, warps))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=64, help="merges a graph holds")
    ap.add_argument("--reps", type=int, default=50, help="graph replays (median)")
    ap.add_argument("--backend", choices=("triton", "cuda"), default="triton")
    ap.add_argument("--sweep", action="store_true", help="Triton: also time other (BLOCK_S, BLOCK_C, warps)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_merge.py needs a GPU")
    import triton

    props = torch.cuda.get_device_properties(0)
    print(f"device {props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}", flush=True)
    if args.backend == "cuda":
        import kimi_ops.kernels.sm90 as hopper
        merge = hopper.mla_merge
    else:
        merge = A.mla_merge  # reads A._merge_config at each call: the sweep patches that
    print(f"backend {args.backend}")
    print(f"{'S':>3} {'T*H':>5} {'config (BS, BC, warps)':>24} {'us':>8} {'GB/s':>7} {'% HBM':>6}  max err (ulp)")
    rows = []
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    chooser = A._merge_config
    for S, TH in SHAPES:
        nbytes = S * TH * 512 * 2
        nsets = max(1, min(args.calls, math.ceil(2 * L2_BYTES / nbytes)))
        sets = [make_set(S, TH, gen) for _ in range(nsets)]
        ro, rl = reference(*sets[0])
        ulp = ro.abs().max().item() * 2.0 ** -8
        configs = [chooser(S, TH)] + ([c for c in sweep_configs(S, TH) if c != chooser(S, TH)]
                                      if args.sweep and args.backend == "triton" else [])
        for k, cfg in enumerate(configs):
            A._merge_config = lambda s, th, cfg=cfg: cfg
            try:
                err, lerr = check(merge, sets[0], ro, rl, ulp)
                t, bw = bench_shape(merge, S, TH, sets, max(args.calls, nsets), args.reps)
            finally:
                A._merge_config = chooser
            tag = "" if k else "  <- mla_merge's choice"
            if args.backend == "cuda":
                cfg, tag = "cuda merge_kernel", ""
            print(f"{S:>3} {TH:>5} {cfg!s:>24} {t * 1e6:8.2f} {bw / 1e9:7.0f} {100 * bw / HBM:6.1f}  "
                  f"{err:.2f} (lse {lerr:.1e}){tag}", flush=True)
            rows.append(dict(S=S, TH=TH, backend=args.backend, config=cfg, chosen=k == 0,
                             us=t * 1e6, gbps=bw / 1e9, max_err_ulp=err, lse_err=lerr, nsets=nsets))
        del sets
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
