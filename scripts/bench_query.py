#!/usr/bin/env python3
"""Benchmark bmm_a16wfp4 and mla_query (M1a) on Kimi-K3 TP8 shapes against torch's bf16 bmm.

    python scripts/bench_query.py [--out query_table.md] [--sweep | --variants]

Shapes: 12 heads; W_UK [12, 512 out, 128 in] (x = q_nope.transpose(0, 1), read in place),
W_UV [12, 128 out, 512 in] (x = o.transpose(0, 1)); T (rows) in 1, 8, 64, 256, 512.
Peer: torch.bmm on the dequantized bf16 weights (stored [H, K, N], as vLLM keeps W_UK_T),
same activations. Timing: a CUDA graph of R back-to-back calls over R rotating input sets
(R such that the sets span >= 128 MB, several times the L2), replayed; time per call =
median replay / R. Floor = (weight bytes + activation bytes in + out) / 4.31 TB/s
(DESIGN.md's measured HBM read ceiling). The main "ours" column is the library's default path
(kimi_ops.kernels.mxfp4.use_gemv: the GEMV kernel at T = 1, and at T <= 8 when K >= 512, else
the tl.dot kernel; ``KIMI_OPS_MXFP4_GEMV=0/1`` forces either); the row's op says "(gemv)" and its
config is the GEMV's 4-tuple when the GEMV ran. With --sweep or --variants, at T <= 8
(GEMV_MAX_M) both bmm kernels are also timed forced: "dot default (BLOCK_M, BLOCK_N, BLOCK_K,
warps, stages)" (the tl.dot kernel, ``gemv=False``, at ``bmm_config``), "gemv default (BLOCK_M,
BLOCK_N, BLOCK_K, warps)" (``gemv=True`` at ``gemv_config``) and "gemv (...)" alternatives
(BLOCK_K as launched: clamped to K). --sweep also times the tl.dot kernel's swept block configs
(``gemv=False``) and mla_query's at T = 1, 64, 512.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from graph_timing import time_graph

from kimi_ops.kernels import mxfp4 as KM
from kimi_ops.kernels import query as KQ
from kimi_ops.reference import mxfp4 as ref

HBM = 4.31e12
H, D, L, P = 12, 128, 512, 64
TS = (1, 8, 64, 256, 512)


def graph_time_us(fn_per_set, nsets, replays=30):
    """Median per-call time (us) of a CUDA graph that calls fn_per_set(i) for i in range(nsets)."""
    return time_graph([lambda i=i: fn_per_set(i) for i in range(nsets)], replays)[0] * 1e6


def sweep_configs(configs, check, time_us, label=str):
    """{label(config): us, or "error: ..."}: each config checked (check raises when wrong), then timed;
    a config that does not compile or is wrong is recorded and the sweep goes on."""
    sweep = {}
    for cfg in configs:
        try:
            check(cfg)
            sweep[label(cfg)] = time_us(cfg)
        except Exception as exc:  # noqa: BLE001 (a failing config is recorded, the sweep goes on)
            sweep[label(cfg)] = f"error: {type(exc).__name__} {exc}"[:200]
    return sweep


def gemv_label(default):
    """Sweep keys of the GEMV runs: "gemv default (...)" for None, "gemv (...)" else."""
    return lambda cfg: f"gemv default {default}" if cfg is None else f"gemv {cfg}"


def gemv_sweep(t, n, k):
    """Alternative GEMV configs at T rows, N, K: BLOCK_K 128 at 4 warps (x's row tile a cheap load),
    one chunk of K = 512 at 8 warps (every load issued up front, x through shared memory), 256 at
    8 warps, BLOCK_N 8 (twice the programs), BLOCK_N 32 at 8 warps; BLOCK_K clamped to K as the
    launcher does, duplicates and the default dropped."""
    default = KM.gemv_config(t, n, k)
    bm = default[0]
    out = []
    for bn, bk, warps in ((16, 128, 4), (16, 512, 8), (16, 256, 8), (8, 128, 4), (32, 128, 8)):
        cfg = (bm, bn, min(bk, max(32, 1 << (k - 1).bit_length())), warps)
        if cfg != default and cfg not in out:
            out.append(cfg)
    return out


def nsets_for(set_bytes):
    return int(max(4, min(256, -(-(128 << 20) // set_bytes))))


def bench_bmm(kind, t, configs=None, dot_scaled=False, gemv_configs=None):
    n, k = (L, D) if kind == "W_UK" else (D, L)
    wq_bytes = H * n * k // 2 + H * n * k // 32
    act_bytes = H * t * k * 2 + H * t * n * 2
    nsets = nsets_for(wq_bytes + act_bytes)
    dev = "cuda"
    sets = []
    for i in range(nsets):
        x_src = torch.randn(t, H, k, device=dev, dtype=torch.bfloat16)
        wf = torch.randn(H, n, k, device=dev) * 0.05
        p, s = ref.mxfp4_quantize(wf)
        wt = ref.mxfp4_dequantize(p, s).transpose(1, 2).contiguous()   # [H, K, N] bf16 for torch
        sets.append((x_src.transpose(0, 1), p, s, wt))
    res = {"op": f"bmm_a16wfp4 {kind}", "T": t, "floor_us": (wq_bytes + act_bytes) / HBM * 1e6,
           "torch_floor_us": (H * n * k * 2 + act_bytes) / HBM * 1e6, "nsets": nsets}
    outs = [None] * nsets

    def ours(cfg, gemv=None):
        def f(i):
            x, p, s, _ = sets[i]
            outs[i] = KM.bmm_a16wfp4(x, p, s, config=cfg, dot_scaled=dot_scaled, gemv=gemv)
        return f

    def peer(i):
        x, _, _, wt = sets[i]
        outs[i] = torch.bmm(x, wt)

    # correctness of the timed path on one set
    x, p, s, wt = sets[0]
    y = KM.bmm_a16wfp4(x, p, s, dot_scaled=dot_scaled).double()
    r = (x.double() @ ref.mxfp4_dequantize(p, s, dtype=torch.float32).double().transpose(1, 2))
    res["rel_err"] = float((y - r).norm() / r.norm())
    res["ours_us"] = graph_time_us(ours(None), nsets)
    res["torch_us"] = graph_time_us(peer, nsets)
    default_gemv = not dot_scaled and KM.use_gemv(t, n, k)
    res["config"] = KM.gemv_config(t, n, k) if default_gemv else KM.bmm_config(t, n, k)
    if default_gemv:
        res["op"] += " (gemv)"

    def check(cfg, gemv=False):
        yc = KM.bmm_a16wfp4(x, p, s, config=cfg, dot_scaled=dot_scaled, gemv=gemv).double()
        ec = float((yc - r).norm() / r.norm())
        assert ec < 4e-3, ec

    res["sweep"] = {}
    if configs is not None and not dot_scaled and t <= KM.GEMV_MAX_M:
        # the tl.dot kernel forced at its default config (where the default may be the GEMV)
        res["sweep"].update(sweep_configs(
            [None], check, lambda cfg: graph_time_us(ours(cfg, gemv=False), nsets),
            lambda cfg: f"dot default {KM.bmm_config(t, n, k)}"))
    if configs:
        res["sweep"].update(sweep_configs(configs, check, lambda cfg: graph_time_us(ours(cfg, gemv=False), nsets)))
    if gemv_configs is not None and not dot_scaled and t <= KM.GEMV_MAX_M:
        # the dot-free GEMV kernel: its default config, then each alternative
        res["sweep"].update(sweep_configs(
            [None, *gemv_configs], lambda cfg: check(cfg, gemv=True),
            lambda cfg: graph_time_us(ours(cfg, gemv=True), nsets), gemv_label(KM.gemv_config(t, n, k))))
    if not res["sweep"]:
        del res["sweep"]
    sets.clear()   # frees the inputs (the closures above still name the list)
    return res


def bench_query(fmt, t, pad=None, configs=None):
    mx = fmt == "mxfp4"
    w_bytes = H * L * D // 2 + H * L * D // 32 if mx else H * D * L * 2
    hp = H if pad is None else pad
    act_bytes = H * t * (D + P) * 2 + hp * t * (L + P) * 2
    nsets = nsets_for(w_bytes + act_bytes)
    sets = []
    for i in range(nsets):
        qall = torch.randn(t, H, D + P, device="cuda", dtype=torch.bfloat16)
        wf = torch.randn(H, L, D, device="cuda") * 0.05
        p, s = ref.mxfp4_quantize(wf)
        wt = ref.mxfp4_dequantize(p, s).transpose(1, 2).contiguous()       # [H, D, L] bf16
        sets.append((qall[..., :D], qall[..., D:], p, s, wt))
    res = {"op": f"mla_query {fmt}" + (f" pad{pad}" if pad else ""), "T": t,
           "floor_us": (w_bytes + act_bytes) / HBM * 1e6,
           "torch_floor_us": (H * D * L * 2 + H * t * D * 2 + H * t * L * 2) / HBM * 1e6, "nsets": nsets}
    outs = [None] * nsets

    def ours(cfg):
        def f(i):
            qn, qp, p, s, wt = sets[i]
            outs[i] = (KQ.mla_query(qn, qp, p, s, pad, config=cfg) if mx
                       else KQ.mla_query(qn, qp, wt, None, pad, config=cfg))
        return f

    def peer(i):     # the bmm alone (what a torch M1a spends most of its time in)
        qn, _, _, _, wt = sets[i]
        outs[i] = torch.bmm(qn.transpose(0, 1), wt)

    qn, qp, p, s, wt = sets[0]
    got = KQ.mla_query(qn, qp, p, s, pad) if mx else KQ.mla_query(qn, qp, wt, None, pad)
    want = ref.mla_query(qn, qp, p, s, pad) if mx else ref.mla_query(qn, qp, wt, None, pad)
    r = want.double()
    res["rel_err"] = float((got.double() - r).norm() / r.norm())
    res["ours_us"] = graph_time_us(ours(None), nsets)
    res["torch_us"] = graph_time_us(peer, nsets)

    def composite(i):   # a torch M1a: the bmm, then the concatenation with q_pe (and the pad)
        qn, qp, _, _, wt = sets[i]
        ql = torch.bmm(qn.transpose(0, 1), wt).transpose(0, 1)
        q = torch.cat([ql, qp], dim=-1)
        outs[i] = q if pad is None else torch.nn.functional.pad(q, (0, 0, 0, pad - H))

    res["torch_m1a_us"] = graph_time_us(composite, nsets)
    res["config"] = KQ.query_config(t, H, L)
    if configs is not None:
        def check(cfg):
            gc = KQ.mla_query(qn, qp, p, s, pad, config=cfg) if mx else KQ.mla_query(qn, qp, wt, None, pad,
                                                                                     config=cfg)
            assert torch.equal(gc, got)

        res["sweep"] = sweep_configs(configs, check, lambda cfg: graph_time_us(ours(cfg), nsets))
    if not res.get("sweep"):
        res.pop("sweep", None)
    sets.clear()   # frees the inputs (the closures above still name the list)
    return res


BMM_SWEEP = [(16, 32, 128, 4, 1), (16, 64, 128, 4, 1), (16, 16, 512, 4, 1), (16, 32, 512, 4, 1),
             (16, 32, 256, 4, 2), (32, 32, 512, 4, 1), (64, 64, 128, 4, 3), (64, 32, 512, 4, 1),
             (128, 128, 64, 8, 3), (128, 64, 64, 4, 3), (128, 128, 128, 8, 2), (256, 128, 64, 8, 3)]
QUERY_SWEEP = [(16, 32, 4), (16, 64, 4), (32, 64, 4), (64, 64, 4), (128, 64, 4), (128, 128, 8), (256, 64, 8)]


def table(rows):
    lines = [("| op | T | ours (us) | best swept (us) | torch bf16 bmm (us) | torch M1a bmm+cat (us) | floor (us) "
              "| ours / floor | torch bmm / ours | rel err |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        sw = [v for v in r.get("sweep", {}).values() if isinstance(v, float)]
        best = f"{min(sw):.2f}" if sw else "-"
        m1a = f"{r['torch_m1a_us']:.2f}" if "torch_m1a_us" in r else "-"
        lines.append(f"| {r['op']} | {r['T']} | {r['ours_us']:.2f} | {best} | {r['torch_us']:.2f} | {m1a} | "
                     f"{r['floor_us']:.2f} | {r['ours_us'] / r['floor_us']:.1f}x | {r['torch_us'] / r['ours_us']:.2f}x | "
                     f"{r['rel_err']:.1e} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="markdown file for the table")
    ap.add_argument("--json", default=None)
    ap.add_argument("--sweep", action="store_true", help="also time alternative block configs")
    ap.add_argument("--variants", action="store_true",
                    help="at T <= 8, both bmm kernels forced (the tl.dot kernel at its default config, the "
                         "GEMV at its default and alternatives) beside the library default; no block-config sweep")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for t in TS:
        sweep_here = args.sweep and t in (1, 64, 512)
        configs_bmm = BMM_SWEEP if sweep_here else ([] if args.variants else None)
        configs_query = QUERY_SWEEP if sweep_here else ([] if args.variants else None)
        for kind in ("W_UK", "W_UV"):
            k = D if kind == "W_UK" else L
            n = L if kind == "W_UK" else D
            gemv_here = gemv_sweep(t, n, k) if (args.sweep or args.variants) and t <= KM.GEMV_MAX_M else None
            rows.append(bench_bmm(kind, t, configs_bmm, gemv_configs=gemv_here))
            print(rows[-1], flush=True)
        for fmt in ("bf16", "mxfp4"):
            rows.append(bench_query(fmt, t, None, configs_query))
            print(rows[-1], flush=True)
        rows.append(bench_query("mxfp4", t, 16))
        print(rows[-1], flush=True)
    extra = []
    for t in (64, 512):   # gfx950's MXFP8 hi+lo dot_scaled path, as it runs on sm_90 (for reference)
        r = bench_bmm("W_UK", t, dot_scaled=True)
        r["op"] += " dot_scaled(hi+lo)"
        extra.append(r)
        print(r, flush=True)
    dev = torch.cuda.get_device_name()
    import triton
    head = (f"Device: {dev}, torch {torch.__version__}, triton {triton.__version__}, "
            f"{datetime.date.today().isoformat()}. CUDA-graph replays of back-to-back calls over rotating "
            f"input sets (>= 128 MB), median; floor = bytes / 4.31 TB/s. 12 heads (Kimi-K3 TP8).")
    sweeps = ["| op | T | config -> us |", "|---|---:|---|"]
    for r in rows:
        if "sweep" in r:
            sweeps.append(f"| {r['op']} | {r['T']} | default {r['config']}: {r['ours_us']:.2f}; " + "; ".join(
                f"{k}: {v:.2f}" if isinstance(v, float) else f"{k}: {v}" for k, v in r["sweep"].items()) + " |")
    md = head + "\n\n" + table(rows) + "\n\nConfig sweep (bmm: BLOCK_M, BLOCK_N, BLOCK_K, warps, stages; " \
        "bmm gemv: BLOCK_M, BLOCK_N, BLOCK_K, warps; mla_query: BLOCK_M, BLOCK_N, warps):\n\n" + "\n".join(sweeps) + "\n\nsm_90 timing of the gfx950 path (MXFP8 hi+lo x fp4 `tl.dot_scaled`, " \
        "not used on NVIDIA):\n\n" + table(extra) + "\n"
    print(md)
    if args.out:
        with open(args.out, "w") as f:
            f.write(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "rows": rows, "extra": extra}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
