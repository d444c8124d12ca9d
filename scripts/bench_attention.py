#!/usr/bin/env python3
"""Benchmark kimi_ops' MLA decode (split-KV M1c + M1b merge) against peers on the GPU.

    python scripts/bench_attention.py --out DIR [--quick] [--mma fp8,bf16]
        [--backends triton,cuda] [--peers naive,flashinfer,vllm_triton]

Per shape: CUDA-graph replays over rotating input sets (a graph holds one call per set; the
sets' KV rows are random rows of one large pool, so no set stays in L2), median of the
replays.  Per kimi_ops backend (``KIMI_OPS_BACKEND``, read by the dispatcher at every call;
a backend that is not really served here is reported as not run): time of ``mla_decode``
(splitkv + merge) and of ``mla_decode_splitkv`` alone, effective TB/s of KV bytes, % of the
floor (DESIGN.md: max(bytes / 4.31 TB/s, MMA work / 1415 TFLOP/s), MMA work = the seeds'
fp8 hi + lo scheme: 2 x 2 x rows x visible tokens x (576 + 512)).  Per peer
(scripts/peers.py: naive torch, FlashInfer's BatchMLAPagedAttentionWrapper on the same fp8
cache, vLLM's Triton MLA decode), measured the same way in the same process on the same q /
cache / indices (each peer's own index layout built outside timing), its output checked once
against ours (rel. L2 printed; a disagreeing peer is flagged), and "x <peer>" = peer time /
time of the best kimi_ops backend of that row.  A peer or backend that cannot import,
compile or run is recorded as "did not run: <reason>".  Writes DIR/bench_attention.json,
DIR/bench_attention.md and DIR/bench_attention.png.  On the device run
scripts/setup_peers.sh first (it installs the carried wheels).
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

import peers  # noqa: E402  (scripts/peers.py)
from graph_timing import time_graph  # noqa: E402

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


BACKEND_ENV = "KIMI_OPS_BACKEND"
DEVICE = "cuda"  # a test harness may point this elsewhere
PEER_TOL = 2e-2  # rel. L2 vs ours above this: the peer is reported as disagreeing


def backend_unavailable(backend, dev):
    """None if KIMI_OPS_BACKEND=backend really serves mla_decode_splitkv here, else why not."""
    from kimi_ops import dispatch
    os.environ[BACKEND_ENV] = backend
    try:
        served = dispatch.backend_for("mla_decode_splitkv", dev)
    except Exception as e:  # noqa: BLE001 - the dispatcher's own reason
        return f"{type(e).__name__}: {e}"
    if served != backend:
        return f"{BACKEND_ENV}={backend} is served by {served} (no {backend} mla_decode_splitkv here)"
    return None


def short(e, n=300):
    msg = f"{type(e).__name__}: {e}".replace("\n", " ")
    return msg if len(msg) <= n else msg[: n - 3] + "..."


def parse_list(text, allowed, what):
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in allowed]
    if bad:
        raise SystemExit(f"unknown {what}: {', '.join(bad)} (known: {', '.join(allowed)})")
    return items


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--mma", default="fp8,bf16", help="KIMI_OPS_TRITON_MMA variants of the triton backend")
    ap.add_argument("--backends", default="triton,cuda",
                    help="kimi_ops backends to measure (KIMI_OPS_BACKEND), comma list")
    ap.add_argument("--peers", default=",".join(peers.ALL), help=f"comma list of {', '.join(peers.ALL)} (or none)")
    ap.add_argument("--no-naive", action="store_true", help="drop naive from --peers")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--layout", default="random", choices=["random", "paged16", "contiguous"],
                    help="where a set's tokens live in the pool: random rows (page size 1), "
                         "random pages of 16 consecutive rows, or one contiguous run")
    ap.add_argument("--splits-mult", type=float, default=1.0, help="x suggest_num_splits")
    ap.add_argument("--tag", default="")
    ap.add_argument("--set-bytes", type=float, default=256e6, help="KV bytes to rotate over")
    return ap


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    args.backends = parse_list(args.backends, ("triton", "cuda"), "backend")
    args.peers = [] if args.peers.strip() in ("", "none") else parse_list(args.peers, peers.ALL, "peer")
    if args.no_naive and "naive" in args.peers:
        args.peers.remove("naive")
    args.mmas = [m for m in args.mma.split(",") if m]
    return args


def peer_label(name):
    return {"naive": "naive torch", "flashinfer": "flashinfer (fp8 cache)", "vllm_triton": "vllm triton"}[name]


def measure_peer(name, cases, nsm, reps, ours, kv_bytes, floor_s, shared):
    """Build the peer for each case (outside timing), check set 0 against ours, time a graph."""
    res = dict(label=peer_label(name))
    try:
        if name == "naive":
            cases = cases[:4]  # it materializes the gathered bf16 KV of a whole set
            fns = [peers.make_naive(c) for c in cases]
            reps = max(3, reps // 3)
        elif name == "flashinfer":
            fns = [peers.make_flashinfer(c, shared) for c in cases]
        else:
            fns = [peers.make_vllm_triton(c, nsm, shared) for c in cases]
            res["num_splits"] = fns[0].num_splits
        o, lse = fns[0]()
        torch.cuda.synchronize()
        res["rel_l2"] = peers.rel_l2(o.view_as(ours[0]), ours[0])
        res["lse_max_abs"] = peers.lse_max_abs(lse, ours[1])
        res["agrees"] = bool(res["rel_l2"] <= PEER_TOL)
        t, _ = time_graph(fns, reps)
        res["us"] = t * 1e6
        res["tbps"] = kv_bytes / t / 1e12
        res["pct_floor"] = 100 * floor_s / t
        res["status"] = "ran" if res["agrees"] else f"ran, DISAGREES with ours (rel. L2 {res['rel_l2']:.2e})"
    except peers.PeerUnavailable as e:
        res["status"] = f"did not run: {e}"
    except torch.OutOfMemoryError as e:
        res["status"] = f"did not run: out of memory ({short(e, 120)})"
    except Exception as e:  # noqa: BLE001 - a peer must never stop the benchmark
        res["status"] = f"did not run: {short(e)}"
    if "us" not in res:
        try:
            torch.cuda.synchronize()
        except Exception:  # noqa: BLE001
            pass
        torch.cuda.empty_cache()
    return res


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)

    import kimi_ops
    import kimi_ops.kernels.attention as A
    from kimi_ops import dispatch

    dev = torch.device(DEVICE)
    props = torch.cuda.get_device_properties(dev)
    nsm = props.multi_processor_count
    shapes = grid(args.quick)
    max_tok = max(sum(s["lens"]) for s in shapes)
    pool_rows = max(max_tok, int(args.set_bytes // 576)) + 1024
    torch.manual_seed(0)
    pool = (torch.randn(pool_rows, 576, device=dev) * 2).clamp(-448, 448).to(torch.float8_e4m3fn)
    mmas = args.mmas
    env_before = os.environ.get(BACKEND_ENV)
    backend_reason = {b: backend_unavailable(b, dev) for b in args.backends}
    for b, r in backend_reason.items():
        print(f"backend {b}: " + ("runs" if r is None else f"did not run: {r}"), flush=True)
    results = []
    peer_status = {}
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
                   kv_bytes=fl["kv_bytes"], backends={}, peers={})

        def dec(q, idx, S):
            return kimi_ops.mla_decode(q, pool, indptr, idx, qlen=qlen, scale=SCALE, kv_scale=KV_SCALE,
                                       num_splits=S)

        def spl(q, idx, S):
            return kimi_ops.mla_decode_splitkv(q, pool, indptr, idx, qlen=qlen, scale=SCALE,
                                               kv_scale=KV_SCALE, num_splits=S)

        outs = {}
        for b in args.backends:
            br = row["backends"][b] = {}
            if backend_reason[b] is not None:
                br["status"] = f"did not run: {backend_reason[b]}"
                continue
            os.environ[BACKEND_ENV] = b
            try:
                # each backend's own split heuristic (the one mla_decode uses when num_splits is None)
                Sb = S if b == "triton" else max(1, int(round(
                    dispatch.default_num_splits(R, R * qlen, H, tok, dev) * args.splits_mult)))
                flb = fl if Sb == S else floor_of(H, qlen, lens, Sb)
                br["num_splits"] = Sb
                # the cuda mla_decode runs a work-list grid whose split cap is its own default
                Sd = None if b == "cuda" else Sb
                variants = mmas if b == "triton" else [None]
                for mma in variants:
                    if mma is not None:
                        os.environ["KIMI_OPS_TRITON_MMA"] = mma
                    t_dec, _ = time_graph([lambda q=q, idx=idx: dec(q, idx, Sd) for q, idx in sets], args.reps)
                    t_spl, _ = time_graph([lambda q=q, idx=idx: spl(q, idx, Sb) for q, idx in sets], args.reps)
                    key = b if mma is None else mma
                    row[f"{key}_us"] = t_dec * 1e6
                    row[f"{key}_splitkv_us"] = t_spl * 1e6
                best_v = min(variants, key=lambda m: row[f"{b if m is None else m}_us"])
                key = b if best_v is None else best_v
                if best_v is not None:
                    os.environ["KIMI_OPS_TRITON_MMA"] = best_v
                    br["mma"] = best_v
                    row["best"] = best_v  # the triton mma variant (kept for older readers)
                t = row[f"{key}_us"] * 1e-6
                br.update(status="ran", us=t * 1e6, splitkv_us=row[f"{key}_splitkv_us"], floor_us=flb["floor"] * 1e6,
                          tbps=flb["kv_bytes"] / t / 1e12, pct_floor=100 * flb["floor"] / t,
                          pct_floor_splitkv=100 * flb["floor"] / (row[f"{key}_splitkv_us"] * 1e-6))
                o, lse = dec(*sets[0], Sd)
                torch.cuda.synchronize()
                outs[b] = (o.clone(), lse.clone())
            except Exception as e:  # noqa: BLE001 - report, keep going
                br.clear()
                br["status"] = f"did not run: {short(e)}"
                torch.cuda.synchronize()
        ran = [b for b in args.backends if row["backends"][b].get("status") == "ran"]
        if ran:
            best_b = min(ran, key=lambda b: row["backends"][b]["us"])
            bb = row["backends"][best_b]
            row.update(best_backend=best_b, best_us=bb["us"], tbps=bb["tbps"], pct_floor=bb["pct_floor"],
                       pct_floor_splitkv=bb["pct_floor_splitkv"])
            for b in ran:
                if b != best_b:
                    row["backends"][b]["rel_l2_vs_" + best_b] = peers.rel_l2(outs[b][0], outs[best_b][0])
        if env_before is None:
            os.environ.pop(BACKEND_ENV, None)
        else:
            os.environ[BACKEND_ENV] = env_before
        if ran and args.peers:
            ours = outs[best_b]
            cases = [peers.Case(q, pool, indptr_list, idx, qlen, SCALE, KV_SCALE) for q, idx in sets]
            shared = {}
            for name in args.peers:
                pr = measure_peer(name, cases, nsm, args.reps, ours, fl["kv_bytes"], fl["floor"], shared)
                row["peers"][name] = pr
                if "us" in pr:
                    pr["x"] = pr["us"] / row["best_us"]
                    row[f"{name}_us"] = pr["us"]
                    row[f"x_{name}"] = pr["x"]
                peer_status.setdefault(name, set()).add(pr["status"].split(" (rel")[0][:200])
            del shared, cases
            if "naive_us" in row:
                row["x_vs_naive"] = row["x_naive"]  # the name older readers use
        results.append(row)
        line = f"{row['label']:<24} S={S:<3} floor {row['floor_us']:8.1f}us"
        for b in args.backends:
            br = row["backends"][b]
            if br.get("status") == "ran":
                extra = f" [{br['mma']}]" if "mma" in br else ""
                line += (f"  {b}{extra} S={br['num_splits']} {br['us']:8.1f}us (splitkv {br['splitkv_us']:7.1f}) "
                         f"{br['tbps']:.2f} TB/s {br['pct_floor']:5.1f}% floor")
            else:
                line += f"  {b}: not run"
        for name, pr in row["peers"].items():
            if "us" in pr:
                line += f"  {name} {pr['us']:8.1f}us x{pr['x']:.2f} (rel.L2 {pr['rel_l2']:.1e})"
                if not pr["agrees"]:
                    line += " DISAGREES"
            else:
                line += f"  {name}: {pr['status']}"
        print(line, flush=True)
        del sets, outs
        torch.cuda.empty_cache()

    meta = dict(layout=args.layout, splits_mult=args.splits_mult, device=props.name, sms=nsm,
                torch=torch.__version__, triton=__import__("triton").__version__, hbm=HBM, fp8_rate=FP8_RATE,
                backends={b: ("ran" if r is None else f"did not run: {r}") for b, r in backend_reason.items()},
                peers={n: sorted(s) for n, s in peer_status.items()}, peer_versions=peer_versions(args.peers),
                ratio="x <peer> = peer time / time of the best kimi_ops backend of the row (best_backend)",
                peer_tolerance_rel_l2=PEER_TOL)
    with open(os.path.join(args.out, f"bench_attention{args.tag}.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    md = markdown(results, args.backends, mmas, args.peers)
    notes = [f"- backend {b}: {v}" for b, v in meta["backends"].items()]
    notes += [f"- peer {n}: {'; '.join(v)}" for n, v in meta["peers"].items()]
    notes.append("- x <peer> = peer time / time of the best kimi_ops backend of the row (column 'best')")
    with open(os.path.join(args.out, f"bench_attention{args.tag}.md"), "w") as f:
        f.write("\n".join(md + [""] + notes) + "\n")
    print("\n".join(md + [""] + notes))
    plot(results, args, os.path.join(args.out, f"bench_attention{args.tag}.png"))


def peer_versions(names):
    v = {}
    if "flashinfer" in names and peers._fi is not None:
        v["flashinfer"] = getattr(peers._fi, "__version__", "?")
    if "vllm_triton" in names and peers._vllm_mod is not None:
        v["vllm_triton"] = os.path.relpath(peers.VLLM_FILE, peers.REPO)
    return v


def fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def markdown(results, backends, mmas, peer_names):
    head = ["shape", "splits", "floor us"]
    for b in backends:
        if b == "triton":
            head += [f"triton {m} us" for m in mmas]
        else:
            head += [f"{b} splits", f"{b} us"]
        head += [f"{b} splitkv us", f"{b} TB/s (KV)", f"{b} % floor"]
    head.append("best")
    for n in peer_names:
        head += [f"{peer_label(n)} us", f"x {peer_label(n)}"]
    md = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r["label"], str(r["num_splits"]), fmt(r["floor_us"])]
        for b in backends:
            br = r["backends"].get(b, {})
            ran = br.get("status") == "ran"
            if b == "triton":
                cells += [fmt(r.get(f"{m}_us")) if ran else "-" for m in mmas]
            else:
                cells += [str(br.get("num_splits", "-")), fmt(br.get("us"))]
            cells += [fmt(br.get("splitkv_us")), fmt(br.get("tbps"), 2), fmt(br.get("pct_floor"), 0)]
        cells.append(r.get("best_backend", "-") + (f" ({r['backends']['triton']['mma']})"
                     if r.get("best_backend") == "triton" else ""))
        for n in peer_names:
            pr = r["peers"].get(n, {})
            cells.append(fmt(pr.get("us")) + ("" if pr.get("agrees", True) else " (disagrees)"))
            cells.append(fmt(pr.get("x"), 2))
        md.append("| " + " | ".join(cells) + " |")
    return md


def plot(results, args, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(12, 4))
        xs = range(len(results))
        width = 0.8 / max(1, len(args.backends))
        for i, b in enumerate(args.backends):
            ys = [r["backends"].get(b, {}).get("pct_floor", 0) for r in results]
            ax.bar([x + i * width for x in xs], ys, width, label=b)
        ax.set_xticks(list(xs))
        ax.set_xticklabels([r["label"] for r in results], rotation=90, fontsize=6)
        ax.set_ylabel("% of floor")
        ax.axhline(70, color="r", lw=0.5)
        ax.axhline(50, color="orange", lw=0.5)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    except Exception as e:  # plotting is optional
        print("plot failed:", e)


if __name__ == "__main__":
    main()
