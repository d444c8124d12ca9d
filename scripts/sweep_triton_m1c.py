#!/usr/bin/env python3
"""Sweep the Triton M1c kernels' launch configurations on the GPU (issue 29's H200 numbers).

    python scripts/sweep_triton_m1c.py [--shapes "H12 B32 8k q1,H96 B8 8k q1"] [--reps 10]
        [--first "32,8,3,0,1;32,8,3,1,1"] [--m1c "16,32,8,2,2"] [--splits 1,2]

For each shape (issue 27's labels, ``H<heads> B<batch> <ctx>k q<qlen>``: contiguous requests, as
scripts/bench_attention.py lays them) and each variant, ``kimi_ops.mla_decode`` on the triton
backend is timed from CUDA-graph replays over rotating input sets (scripts/graph_timing.py,
median), and its output is checked against the float32 reference of the first set
(scripts/peers.py's reference_f32: rel. L2 of o, max |dlse|; a variant over 4e-3 / 1e-3 is
flagged WRONG); % of floor is scripts/bench_attention.py's floor (PERF.md's). Variants:

* ``--first``: the first generation (kimi_ops/kernels/attention.py) with ``_config`` /
  ``_prefetch`` / ``S_CHAINS`` replaced: ``BLOCK_N,num_warps,num_stages,PREFETCH,S_CHAINS[,BLOCK_M]``
  (without BLOCK_M, the launcher's); ``default`` is the launcher's own choice.
* ``--m1c``: the second generation (kimi_ops/kernels/triton_m1c.py) with the sm_90 table replaced
  by one entry ``BLOCK_M,BLOCK_N,num_warps,num_stages,VSPLIT[,PREFETCH]`` (PREFETCH 1: the next
  tile's bytes loaded into registers during this one, as AMD's entries do).
* ``--splits``: multipliers of the launcher's split count (``suggest_num_splits``).

Prints one line a (shape, variant, split multiplier) and a table of the best per shape; writes
``--out``/sweep_triton_m1c.json. An experiment driver: the launcher's defaults change only after
a sweep says so (docs/PERF.md).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import peers  # noqa: E402  (scripts/peers.py: the float32 reference)
from bench_attention import KV_SCALE, SCALE, floor_of  # noqa: E402  (PERF.md's floor and inputs)
from graph_timing import time_graph  # noqa: E402

DEFAULT_SHAPES = "H12 B8 8k q1,H12 B32 8k q1,H12 B32 8k q4,H96 B8 8k q1"


def parse_shape(label):
    h, b, ctx, q = label.split()
    return dict(label=label, H=int(h[1:]), batch=int(b[1:]), ctx=int(ctx[:-1]) * 1024, qlen=int(q[1:]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--first", default="default", help="';'-separated BLOCK_N,warps,stages,PREFETCH,S_CHAINS[,BLOCK_M] or default")
    ap.add_argument("--m1c", default="", help="';'-separated BLOCK_M,BLOCK_N,warps,stages,VSPLIT[,PREFETCH]")
    ap.add_argument("--splits", default="1", help="comma list of split-count multipliers")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--set-bytes", type=float, default=600e6, help="rotate input sets until this many KV bytes")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args(argv)
    os.environ["KIMI_OPS_BACKEND"] = "triton"
    import kimi_ops
    import kimi_ops.kernels.attention as A
    import kimi_ops.kernels.triton_m1c as TM

    dev = torch.device("cuda")
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    shapes = [parse_shape(s.strip()) for s in args.shapes.split(",") if s.strip()]
    variants = [("first", v.strip()) for v in args.first.split(";") if v.strip()]
    variants += [("m1c", v.strip()) for v in args.m1c.split(";") if v.strip()]
    mults = [float(x) for x in args.splits.split(",")]
    orig_config, orig_prefetch = A._config, A._prefetch
    orig_sm90 = TM.CONFIGS["sm90"]
    max_tok = max(s["batch"] * s["ctx"] for s in shapes)
    pool_rows = max_tok + int(args.set_bytes // 576) + 4096
    torch.manual_seed(0)
    pool = (torch.randn(pool_rows, 576, device=dev) * 2).clamp(-448, 448).to(torch.float8_e4m3fn)
    results = []
    for sh in shapes:
        H, qlen, R, ctx = sh["H"], sh["qlen"], sh["batch"], sh["ctx"]
        lens = [ctx] * R
        tok = R * ctx
        kv_bytes = tok * 576
        nsets = int(min(16, max(2, math.ceil(args.set_bytes / kv_bytes))))
        indptr_list = [i * ctx for i in range(R + 1)]
        indptr = torch.tensor(indptr_list, dtype=torch.int32, device=dev)
        sets = []
        for _ in range(nsets):
            off = int(torch.randint(0, (pool_rows - tok) // 64 + 1, ()).item()) * 64
            idx = torch.arange(off, off + tok, device=dev, dtype=torch.int32)
            sets.append((torch.randn(R * qlen, H, 576, device=dev).to(torch.bfloat16), idx))
        q0, idx0 = sets[0]
        ref_o, ref_lse = peers.reference_f32(peers.Case(q0, pool, indptr_list, idx0, qlen, SCALE, KV_SCALE))
        for kind, spec in variants:
            os.environ[TM.KERNEL_ENV] = kind
            A._config, A._prefetch = orig_config, orig_prefetch
            TM.CONFIGS["sm90"] = orig_sm90
            base_splits = TM.suggest_num_splits(R, qlen, H, tok, nsm, arch=TM.arch_of(dev))  # this kernel's
            os.environ.pop(A.S_CHAINS_ENV, None)
            if kind == "first" and spec != "default":
                bn, w, st, pf, sc, *bm = (int(x) for x in spec.split(","))
                A._config = lambda rows, mma, tokens=None, bn=bn, w=w, st=st, bm=bm: (
                    bm[0] if bm else orig_config(rows, mma)[0], bn, w, st)
                A._prefetch = lambda mma, bm, pf=pf: bool(pf)
                os.environ[A.S_CHAINS_ENV] = str(sc)
            elif kind == "m1c":
                bm, bn, w, st, vs, *pf = (int(x) for x in spec.split(","))
                TM.CONFIGS["sm90"] = (TM.Config(1 << 30, bm, bn, w, st, vsplit=vs, prefetch=bool(pf and pf[0])),)
            for mult in mults:
                S = max(1, int(round(base_splits * mult)))
                fl = floor_of(H, qlen, lens, S)["floor"] * 1e6
                rec = dict(shape=sh["label"], kernel=kind, config=spec, splits=S, floor_us=fl)
                try:
                    def call(q, idx, S=S):
                        return kimi_ops.mla_decode(q, pool, indptr, idx, qlen=qlen, scale=SCALE,
                                                   kv_scale=KV_SCALE, num_splits=S)
                    o, lse = call(*sets[0])
                    torch.cuda.synchronize()
                    rel = float((o.float() - ref_o).norm() / ref_o.norm())
                    dl = float((lse - ref_lse).abs().max())
                    t, _ = time_graph([lambda q=q, idx=idx: call(q, idx) for q, idx in sets], args.reps)
                    us = t * 1e6
                    rec.update(us=us, tbps=kv_bytes / t / 1e12, pct_floor=100 * fl / us, rel_l2=rel, dlse=dl,
                               ok=rel <= 4e-3 and dl <= 1e-3)
                    print(f"{sh['label']:<16} {kind:<5} {spec:<16} S={S:<3} {us:8.1f} us {rec['tbps']:5.2f} TB/s "
                          f"{rec['pct_floor']:5.1f}% floor  rel {rel:.2e} dlse {dl:.1e}"
                          + ("" if rec["ok"] else "  WRONG"), flush=True)
                except Exception as e:  # noqa: BLE001 - a variant that fails to compile or run is recorded
                    rec["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                    print(f"{sh['label']:<16} {kind:<5} {spec:<16} S={S:<3} failed: {rec['error']}", flush=True)
                    torch.cuda.synchronize()
                results.append(rec)
    A._config, A._prefetch = orig_config, orig_prefetch
    TM.CONFIGS["sm90"] = orig_sm90
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep_triton_m1c.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\nbest per shape (correct variants):")
    for sh in shapes:
        ok = [r for r in results if r["shape"] == sh["label"] and r.get("ok")]
        if ok:
            b = min(ok, key=lambda r: r["us"])
            print(f"{sh['label']:<16} {b['kernel']} {b['config']} S={b['splits']}: {b['us']:.1f} us, "
                  f"{b['pct_floor']:.1f}% of floor ({b['floor_us']:.1f} us)")


if __name__ == "__main__":
    main()
