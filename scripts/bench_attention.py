#!/usr/bin/env python3
"""Benchmark kimi_ops' MLA decode (split-KV M1c + M1b merge) against peers on the GPU.

    python scripts/bench_attention.py --out DIR [--grid default|quick|issue27|small] [--mma fp8,bf16]
        [--backends triton,cuda] [--peers naive,flashinfer,flashinfer_bf16,flashmla_fp8,...]

Per shape: CUDA-graph replays over rotating input sets (a graph holds one call per set; the
sets' KV rows are random rows of one large pool, or with ``--layout contiguous`` (the default of
the issue27 and small grids) one run of rows per set, each request starting on a 64-row page, so
no set stays in L2), median of the replays.  Per kimi_ops backend (``KIMI_OPS_BACKEND``, read
by the dispatcher at every call; a backend that is not really served here is reported as not
run): time of
``mla_decode`` (splitkv + merge) and of ``mla_decode_splitkv`` alone, effective TB/s of KV
bytes, % of the floor (DESIGN.md: max(bytes / 4.31 TB/s, MMA work / 786 TFLOP/s), MMA work =
the real products, 2 x query rows x (576 + 512) a visible token, at the dense bf16 rate).  The
best backend also runs with an fp8 query (q quantized per tensor, the q8 / q_scale FlashMLA's
fp8 kernel gets; ``q_scale=`` of issue 28), where the installed kimi_ops takes one.  Per peer
(scripts/peers.py: naive torch; FlashInfer's BatchMLAPagedAttentionWrapper on the same fp8
cache and on its bf16 copy; FlashMLA's fp8 kernel (fp8 q) and its bf16 kernel on the bf16 copy,
in pages of 64 rows; vLLM's Triton MLA decode), measured the same way in the same process on
the same q / cache / indices (each peer's own index layout built outside timing), its output
checked once against ours (rel. L2 printed; a disagreeing peer is flagged), and "x <peer>" =
peer time / time of the best kimi_ops backend of that row.  Every output of set 0 (ours, the
fp8-query run, each peer) is also compared with a float32 reference (rel. L2 "rel_f32").  A
peer or backend that cannot import, compile or run is recorded as "did not run: <reason>".
Writes DIR/bench_attention.json, DIR/bench_attention.md (the detailed table, then the peer
table of issue 27 and the float32 errors) and DIR/bench_attention.png.  On the device run
scripts/setup_peers.sh first (it installs the carried wheels); scripts/device_bench.sh does it all.
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
BF16_RATE = 786e12
SCALE = 1.0 / math.sqrt(192.0)
KV_SCALE = 0.05


ISSUE27 = ((12, 8, 8192, 1), (12, 32, 8192, 1), (12, 128, 8192, 1), (12, 32, 32768, 1), (12, 1, 65536, 1),
           (96, 64, 4096, 1), (96, 8, 8192, 1), (12, 32, 8192, 2), (12, 32, 8192, 4), (12, 32, 8192, 8))
# where a call's fixed latency decides (issue 27's batch 1-8 target): H, batch, context, qlen
SMALL = ((12, 1, 256, 1), (12, 1, 1024, 1), (12, 1, 4096, 1), (12, 1, 8192, 1), (12, 1, 65536, 1),
         (12, 2, 8192, 1), (12, 4, 8192, 1), (12, 8, 1024, 1), (12, 8, 8192, 1), (12, 8, 8192, 2),
         (96, 1, 8192, 1), (96, 8, 8192, 1))
LISTED = {"issue27": ISSUE27, "small": SMALL}  # the grids given as shape lists (contiguous by default)
GRIDS = ("default", "quick", *LISTED)


def _label(H, batch, ctx, qlen):
    return f"H{H} B{batch} {f'{ctx // 1024}k' if ctx >= 1024 else ctx} q{qlen}"


def grid(name="default"):
    """The shapes of a named grid: ``default`` (H12 x qlen 1-8 x batch 1-128 x 1k-32k, H96, a
    variable-length batch), ``quick`` (seven of those), ``issue27`` (issue 27's table: H, batch,
    context, qlen as labelled, e.g. "H12 B8 8k q1"), ``small`` (batch 1-8 from 256 tokens to 64k,
    where a call's fixed latency decides; labelled the same way)."""
    if name not in GRIDS:
        raise ValueError(f"grid: expected one of {', '.join(GRIDS)}, got {name!r}")
    if name in LISTED:
        return [dict(H=H, qlen=qlen, lens=[ctx] * batch, label=_label(H, batch, ctx, qlen))
                for H, batch, ctx, qlen in LISTED[name]]
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
    if name == "quick":
        keep = {"H12 q1 b8 8k", "H12 q1 b32 32k", "H12 q2 b32 8k", "H12 q8 b32 8k", "H12 q4 b128 8k",
                "H96 q1 b64 4k", "H12 q1 b64 varlen~8k"}
        shapes = [s for s in shapes if s["label"] in keep]
    return shapes


def random_pool(max_tokens, set_bytes, pool_bytes, dev):
    """The fp8 cache pool the sets are drawn from: at least max_tokens rows, set_bytes and
    pool_bytes of 576-byte rows, plus 1024, in whole FlashMLA pages (a contiguous set is then its
    pool pages as they are); N(0, 2) values saturated to e4m3, the same pool every run (seed 0)."""
    page = peers.FLASHMLA_PAGE
    rows = -(-(max(max_tokens, int(set_bytes // 576), int(pool_bytes // 576)) + 1024) // page) * page
    torch.manual_seed(0)
    return (torch.randn(rows, 576, device=dev) * 2).clamp(-448, 448).to(torch.float8_e4m3fn)


def contiguous_run(pool_rows, tokens, dev):
    """int32 indices of one run of `tokens` pool rows starting on a random FlashMLA page."""
    page = peers.FLASHMLA_PAGE
    off = int(torch.randint(0, (pool_rows - tokens) // page + 1, ()).item()) * page
    return torch.arange(off, off + tokens, device=dev, dtype=torch.int32)


def rotation_sets(set_bytes, kv_bytes):
    """How many input sets a shape rotates over: enough that set_bytes of KV pass between two
    uses of one set (none stays in L2), 2 to 32."""
    return int(min(32, max(2, math.ceil(set_bytes / kv_bytes))))


def floor_of(H, qlen, lens, S):
    """DESIGN.md's floor of one call: max(bytes / HBM, MMA work / BF16_RATE). Bytes: every
    token's 576-byte row once, q, indices, S splits' partials and the outputs; MMA work: the real
    products, 2 x query rows x (576 + 512) flops a visible token (no hi + lo or padded rows)."""
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
    flops = 2 * vis * (576 + 512)
    t_mem = (kv_bytes + other) / HBM
    t_mma = flops / BF16_RATE
    return dict(kv_bytes=kv_bytes, bytes=kv_bytes + other, flops=flops, t_mem=t_mem, t_mma=t_mma,
                floor=max(t_mem, t_mma))


BACKEND_ENV = "KIMI_OPS_BACKEND"
DEVICE = "cuda"  # a test harness may point this elsewhere
PEER_TOL = 2e-2  # rel. L2 vs ours above this: the peer is reported as disagreeing
PEER_TOL_FP8Q = 1e-1  # the same for a peer that quantizes q to fp8 (FlashMLA fp8: ~3.5e-2 vs float32)
FP8Q_PEERS = ("flashmla_fp8",)


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
    ap.add_argument("--grid", default="default", choices=GRIDS, help="the shapes (see grid())")
    ap.add_argument("--quick", action="store_true", help="same as --grid quick")
    ap.add_argument("--mma", default="fp8,bf16", help="KIMI_OPS_TRITON_MMA variants of the triton backend")
    ap.add_argument("--backends", default="triton,cuda",
                    help="kimi_ops backends to measure (KIMI_OPS_BACKEND), comma list")
    ap.add_argument("--peers", default=",".join(peers.ALL), help=f"comma list of {', '.join(peers.ALL)} (or none)")
    ap.add_argument("--no-naive", action="store_true", help="drop naive from --peers")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--layout", default=None, choices=["random", "paged16", "contiguous"],
                    help="where a set's tokens live in the pool: random rows (page size 1), "
                         "random pages of 16 consecutive rows, or one contiguous run starting on a "
                         "64-row page (default: contiguous for --grid issue27 and small, else random)")
    ap.add_argument("--splits-mult", type=float, default=1.0, help="x suggest_num_splits")
    ap.add_argument("--tag", default="")
    ap.add_argument("--set-bytes", type=float, default=256e6, help="KV bytes to rotate over")
    ap.add_argument("--pool-bytes", type=float, default=0.0,
                    help="make the fp8 pool the sets are drawn from at least this large (default: "
                         "the largest shape or --set-bytes, whichever is more). A server's cache is "
                         "tens of GB; with --set-bytes 2e9 over a 1.8 GB pool one kernel ran 27%% "
                         "slower than at the defaults (docs/PERF.md)")
    return ap


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    args.backends = parse_list(args.backends, ("triton", "cuda"), "backend")
    args.peers = [] if args.peers.strip() in ("", "none") else parse_list(args.peers, peers.ALL, "peer")
    if args.no_naive and "naive" in args.peers:
        args.peers.remove("naive")
    args.mmas = [m for m in args.mma.split(",") if m]
    if args.quick:
        args.grid = "quick"
    if args.layout is None:
        args.layout = "contiguous" if args.grid in LISTED else "random"
    return args


PEER_LABELS = {"naive": "naive torch", "flashinfer": "FlashInfer fp8", "flashinfer_bf16": "FlashInfer bf16-KV",
               "flashmla_fp8": "FlashMLA fp8", "flashmla_bf16": "FlashMLA bf16-KV", "vllm_triton": "vLLM Triton"}


def peer_label(name):
    return PEER_LABELS[name]


def rel_f32(o, ref):
    """rel. L2 of an output against a float32 reference (None if there is none)."""
    return None if ref is None else peers.rel_l2(o.reshape(ref.shape), ref)


def make_peer(name, cases, nsm, shared):
    """(one closure per case, extra facts for the record) for a peer."""
    if name == "naive":
        return [peers.make_naive(c) for c in cases], {}
    if name in ("flashinfer", "flashinfer_bf16"):
        kv = torch.float8_e4m3fn if name == "flashinfer" else torch.bfloat16
        return [peers.make_flashinfer(c, shared, kv_dtype=kv) for c in cases], {}
    if name in ("flashmla_fp8", "flashmla_bf16"):
        make = peers.make_flashmla_fp8 if name == "flashmla_fp8" else peers.make_flashmla_bf16
        fns = [make(c) for c in cases]
        return fns, dict(layout=sorted({f.layout for f in fns}))
    fns = [peers.make_vllm_triton(c, nsm, shared) for c in cases]
    return fns, dict(num_splits=fns[0].num_splits)


def fp8q_unavailable(kimi_ops):
    """None if kimi_ops.mla_decode takes issue 28's ``q_scale=`` keyword, else why not."""
    import inspect
    try:
        params = inspect.signature(kimi_ops.mla_decode).parameters
    except (TypeError, ValueError) as e:
        return f"cannot read kimi_ops.mla_decode's signature ({e})"
    if "q_scale" not in params:
        return "kimi_ops.mla_decode has no q_scale keyword (the fp8 query of issue 28 is not in this build)"
    return None


def measure_fp8q(kimi_ops, cases, indptr, backend, mma, num_splits, reps, floor_s, refs, reason):
    """kimi_ops.mla_decode on the cases' fp8 queries (Case.fp8_query: q8 and q_scale, the inputs
    FlashMLA's fp8 kernel gets) with ``backend`` (and its triton mma variant): time, and set 0's
    rel. L2 against the float32 reference of the bf16 q (rel_f32) and of the fp8 q (rel_f32_same_q)."""
    res = dict(backend=backend)
    if reason is not None:
        res["status"] = f"did not run: {reason}"
        return res
    os.environ[BACKEND_ENV] = backend
    if mma is not None:
        os.environ["KIMI_OPS_TRITON_MMA"] = mma

    def call(c):
        q8, q_scale = c.fp8_query()
        return kimi_ops.mla_decode(q8, c.pool, indptr, c.idx, qlen=c.qlen, scale=c.scale, kv_scale=c.kv_scale,
                                   num_splits=num_splits, q_scale=q_scale)
    try:
        o, _ = call(cases[0])
        torch.cuda.synchronize()
        res.update(rel_f32=rel_f32(o, refs.get("bf16q")), rel_f32_same_q=rel_f32(o, refs.get("fp8q")))
        del o
        t, _ = time_graph([lambda c=c: call(c) for c in cases], reps)
        res.update(status="ran", us=t * 1e6, pct_floor=100 * floor_s / t)
    except Exception as e:  # noqa: BLE001 - report, keep going
        res["status"] = f"did not run: {short(e)}"
        torch.cuda.synchronize()
    return res


def measure_peer(name, cases, nsm, reps, ours, kv_bytes, floor_s, shared, refs=None):
    """Build the peer for each case (outside timing), check set 0 against ours and against the
    float32 references (``refs``: {"bf16q": o, "fp8q": o} of set 0), time a graph."""
    res = dict(label=peer_label(name))
    refs = refs or {}
    try:
        if name == "naive":
            cases = cases[:4]  # it materializes the gathered bf16 KV of a whole set
            reps = max(3, reps // 3)
        fns, extra = make_peer(name, cases, nsm, shared)
        res.update(extra)
        o, lse = fns[0]()
        torch.cuda.synchronize()
        res["rel_l2"] = peers.rel_l2(o.view_as(ours[0]), ours[0])
        res["lse_max_abs"] = peers.lse_max_abs(lse, ours[1])
        res["rel_f32"] = rel_f32(o, refs.get("bf16q"))
        if name in FP8Q_PEERS:
            res["rel_f32_same_q"] = rel_f32(o, refs.get("fp8q"))
        res["agrees"] = bool(res["rel_l2"] <= (PEER_TOL_FP8Q if name in FP8Q_PEERS else PEER_TOL))
        del o, lse
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
    import kimi_ops.kernels.triton_m1c as TM
    from kimi_ops import dispatch

    dev = torch.device(DEVICE)
    props = torch.cuda.get_device_properties(dev)
    nsm = props.multi_processor_count
    shapes = grid(args.grid)
    max_tok = max(sum(s["lens"]) for s in shapes)
    pool = random_pool(max_tok, args.set_bytes, args.pool_bytes, dev)
    pool_rows = pool.shape[0]
    mmas = args.mmas
    env_before = os.environ.get(BACKEND_ENV)
    mma_before = os.environ.get("KIMI_OPS_TRITON_MMA")
    backend_reason = {b: backend_unavailable(b, dev) for b in args.backends}
    fp8q_reason = fp8q_unavailable(kimi_ops)
    print("kimi_ops fp8 query: " + ("runs" if fp8q_reason is None else f"did not run: {fp8q_reason}"), flush=True)
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
        S = max(1, int(round(TM.suggest_num_splits(R, qlen, H, tok, nsm, arch=TM.arch_of(dev)) * args.splits_mult)))
        fl = floor_of(H, qlen, lens, S)
        nsets = rotation_sets(args.set_bytes, fl["kv_bytes"])
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
                idx = contiguous_run(pool_rows, tok, dev)
            q = torch.randn(R * qlen, H, 576, device=dev).to(torch.bfloat16)
            sets.append((q, idx))
        row = dict(label=sh["label"], H=H, qlen=qlen, batch=R, tokens=tok, num_splits=S, nsets=nsets,
                   floor_us=fl["floor"] * 1e6, mem_floor_us=fl["t_mem"] * 1e6, mma_floor_us=fl["t_mma"] * 1e6,
                   kv_bytes=fl["kv_bytes"], backends={}, peers={})
        cases = [peers.Case(q, pool, indptr_list, idx, qlen, SCALE, KV_SCALE) for q, idx in sets]
        want_fp8q = "flashmla_fp8" in args.peers or fp8q_reason is None
        refs = dict(bf16q=peers.reference_f32(cases[0])[0])
        if want_fp8q:
            refs["fp8q"] = peers.reference_f32(cases[0], *cases[0].fp8_query())[0]

        def dec(q, idx, S):
            return kimi_ops.mla_decode(q, pool, indptr, idx, qlen=qlen, scale=SCALE, kv_scale=KV_SCALE,
                                       num_splits=S)

        def spl(q, idx, S):
            return kimi_ops.mla_decode_splitkv(q, pool, indptr, idx, qlen=qlen, scale=SCALE,
                                               kv_scale=KV_SCALE, num_splits=S)

        outs = {}
        decode_splits = {}
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
                decode_splits[b] = Sd
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
                br["rel_f32"] = rel_f32(o, refs["bf16q"])
            except Exception as e:  # noqa: BLE001 - report, keep going
                br.clear()
                br["status"] = f"did not run: {short(e)}"
                torch.cuda.synchronize()
        ran = [b for b in args.backends if row["backends"][b].get("status") == "ran"]
        if ran:
            best_b = min(ran, key=lambda b: row["backends"][b]["us"])
            bb = row["backends"][best_b]
            row.update(best_backend=best_b, best_us=bb["us"], tbps=bb["tbps"], pct_floor=bb["pct_floor"],
                       pct_floor_splitkv=bb["pct_floor_splitkv"], best_floor_us=bb["floor_us"])
            for b in ran:
                if b != best_b:
                    row["backends"][b]["rel_l2_vs_" + best_b] = peers.rel_l2(outs[b][0], outs[best_b][0])
            row["fp8q"] = measure_fp8q(kimi_ops, cases, indptr, best_b, bb.get("mma"), decode_splits[best_b],
                                       args.reps, bb["floor_us"] * 1e-6, refs, fp8q_reason)
        for name, before in ((BACKEND_ENV, env_before), ("KIMI_OPS_TRITON_MMA", mma_before)):
            if before is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = before
        if ran and args.peers:
            ours = outs[best_b]
            shared = {}
            for name in args.peers:
                pr = measure_peer(name, cases, nsm, args.reps, ours, fl["kv_bytes"], fl["floor"], shared, refs)
                row["peers"][name] = pr
                if "us" in pr:
                    pr["x"] = pr["us"] / row["best_us"]
                    row[f"{name}_us"] = pr["us"]
                    row[f"x_{name}"] = pr["x"]
                peer_status.setdefault(name, set()).add(pr["status"].split(" (rel")[0][:200])
            del shared
            if "naive_us" in row:
                row["x_vs_naive"] = row["x_naive"]  # the name older readers use
            fm = row["peers"].get("flashmla_fp8", {})
            if "us" in fm and "us" in row.get("fp8q", {}):
                row["fp8q"]["x_flashmla_fp8"] = fm["us"] / row["fp8q"]["us"]
            bf16kv = [n for n in BF16KV_PEERS if "us" in row["peers"].get(n, {})]
            if bf16kv:
                best_peer = min(bf16kv, key=lambda n: row["peers"][n]["us"])
                row.update(best_bf16kv_peer=best_peer, x_best_bf16kv=row["peers"][best_peer]["x"])
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
        fq = row.get("fp8q", {})
        if "us" in fq:
            line += f"  fp8-q {fq['us']:8.1f}us (rel.f32 {fq['rel_f32']:.1e})"
        for name, pr in row["peers"].items():
            if "us" in pr:
                line += f"  {name} {pr['us']:8.1f}us x{pr['x']:.2f} (rel.L2 {pr['rel_l2']:.1e})"
                if not pr["agrees"]:
                    line += " DISAGREES"
            else:
                line += f"  {name}: {pr['status']}"
        print(line, flush=True)
        write_outputs(args, results, props, nsm, backend_reason, peer_status, fp8q_reason)
        del sets, outs, cases, refs
        torch.cuda.empty_cache()
    peers.clear_caches()

    md = write_outputs(args, results, props, nsm, backend_reason, peer_status, fp8q_reason)
    print("\n".join(md))
    plot(results, args, os.path.join(args.out, f"bench_attention{args.tag}.png"))


def write_outputs(args, results, props, nsm, backend_reason, peer_status, fp8q_reason):
    """Write DIR/bench_attention{tag}.json, .md (detailed table, notes, peer table, float32 errors)
    and _peers.md (the peer table alone) from the rows so far; returns the .md's lines. Called
    after every shape, so a run stopped by a time limit leaves what it measured."""
    meta = dict(layout=args.layout, splits_mult=args.splits_mult, set_bytes=args.set_bytes, pool_bytes=args.pool_bytes,
                device=props.name, sms=nsm,
                torch=torch.__version__, triton=__import__("triton").__version__, hbm=HBM, mma_rate=BF16_RATE,
                backends={b: ("ran" if r is None else f"did not run: {r}") for b, r in backend_reason.items()},
                peers={n: sorted(s) for n, s in peer_status.items()}, peer_versions=peer_versions(args.peers),
                ratio="x <peer> = peer time / time of the best kimi_ops backend of the row (best_backend)",
                peer_tolerance_rel_l2=PEER_TOL, peer_tolerance_rel_l2_fp8q=PEER_TOL_FP8Q, grid=args.grid,
                fp8q="ran" if fp8q_reason is None else f"did not run: {fp8q_reason}",
                floor="max(bytes / hbm, 2 x rows x 1088 x visible tokens / mma_rate)")
    with open(os.path.join(args.out, f"bench_attention{args.tag}.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)
    md = markdown(results, args.backends, args.mmas, args.peers)
    notes = [f"- backend {b}: {v}" for b, v in meta["backends"].items()]
    notes += [f"- peer {n}: {'; '.join(v)}" for n, v in meta["peers"].items()]
    notes.append("- x <peer> = peer time / time of the best kimi_ops backend of the row (column 'best')")
    notes.append(f"- kimi_ops fp8 query: {meta['fp8q']}")
    table = peer_table(results) + [""] + error_table(results, args.backends, args.peers) + [""] + peer_notes(meta)
    lines = md + [""] + notes + [""] + table
    with open(os.path.join(args.out, f"bench_attention{args.tag}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, f"bench_attention{args.tag}_peers.md"), "w") as f:
        f.write("\n".join(table) + "\n")
    return lines


def peer_versions(names):
    v = {}
    if "flashinfer" in names and peers._fi is not None:
        v["flashinfer"] = getattr(peers._fi, "__version__", "?")
    if peers._flashmla is not None:
        for n in ("flashmla_fp8", "flashmla_bf16"):
            if n in names:
                v[n] = f"vllm {peers.FLASHMLA_VLLM_VERSION} wheel: {', '.join(peers.FLASHMLA_LIBS)}"
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


SUMMARY_PEERS = ("flashmla_fp8", "flashmla_bf16", "flashinfer", "flashinfer_bf16", "vllm_triton")
BF16KV_PEERS = ("flashmla_bf16", "flashinfer_bf16")


def _us(entry):
    """A time cell: median us, '(disagrees)' when the check against ours failed, '-' if not run."""
    if "us" not in entry:
        return "-"
    return fmt(entry["us"]) + ("" if entry.get("agrees", True) else " (disagrees)")


def _us_err(entry):
    if "us" not in entry:
        return "-"
    err = entry.get("rel_f32")
    return fmt(entry["us"]) + ("" if err is None else f" ({err:.1e})")


def peer_table(results):
    """Issue 27's table: median us a call per implementation, the floor (with the best kimi_ops
    backend's split count in its partials' bytes), % of the floor of that backend, its ratios to FlashMLA fp8 and to the faster bf16-KV peer (peer time / ours),
    and the fp8-query pair (kimi_ops with q8 / q_scale beside FlashMLA fp8, rel. L2 vs float32)."""
    head = (["shape", "kimi_ops cuda", "kimi_ops triton"] + [PEER_LABELS[n] for n in SUMMARY_PEERS]
            + ["floor us", "% of floor (best kimi_ops)", "x FlashMLA fp8", "x best bf16-KV peer",
               "kimi_ops fp8-q us (rel err)", "FlashMLA fp8 us (rel err)"])
    md = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        cells = [r["label"], _us(r["backends"].get("cuda", {})), _us(r["backends"].get("triton", {}))]
        cells += [_us(r["peers"].get(n, {})) for n in SUMMARY_PEERS]
        cells += [fmt(r.get("best_floor_us", r["floor_us"])), fmt(r.get("pct_floor"), 0),
                  fmt(r["peers"].get("flashmla_fp8", {}).get("x"), 2)]
        cells.append(fmt(r["x_best_bf16kv"], 2) + f" ({PEER_LABELS[r['best_bf16kv_peer']]})"
                     if "x_best_bf16kv" in r else "-")
        cells += [_us_err(r.get("fp8q", {})), _us_err(r["peers"].get("flashmla_fp8", {}))]
        md.append("| " + " | ".join(cells) + " |")
    return md


def error_table(results, backends, peer_names):
    """rel. L2 of set 0's o against the float32 reference of the bf16-q problem; for the fp8-q runs
    also against the float32 reference on the same fp8 q ("same q")."""
    head = ["shape"] + [f"kimi_ops {b}" for b in backends] + ["kimi_ops fp8-q"] + [PEER_LABELS[n] for n in peer_names]
    md = ["rel. L2 of o vs float32 (set 0):", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cell(e, same_q=False):
        if e.get("rel_f32") is None:
            return "-"
        out = f"{e['rel_f32']:.1e}"
        if same_q and e.get("rel_f32_same_q") is not None:
            out += f" (same q {e['rel_f32_same_q']:.1e})"
        return out
    for r in results:
        cells = [r["label"]] + [cell(r["backends"].get(b, {})) for b in backends] + [cell(r.get("fp8q", {}), True)]
        cells += [cell(r["peers"].get(n, {}), n in FP8Q_PEERS) for n in peer_names]
        md.append("| " + " | ".join(cells) + " |")
    return md


def peer_notes(meta):
    notes = [f"- {meta['device']}, torch {meta['torch']}, triton {meta['triton']}, layout {meta['layout']}; "
             f"floor = {meta['floor']} (hbm {meta['hbm'] / 1e12:.2f} TB/s, {meta['mma_rate'] / 1e12:.0f} TFLOP/s)",
             "- x <peer> = peer us / best kimi_ops us (bf16 q); above 1: kimi_ops is faster",
             f"- kimi_ops fp8 query: {meta['fp8q']}"]
    notes += [f"- {PEER_LABELS.get(n, n)}: {'; '.join(v)}" for n, v in meta["peers"].items()]
    return notes


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
