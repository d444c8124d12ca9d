#!/usr/bin/env python3
"""Benchmark the whole Kimi-K3 TP8 MLA decode layer on the GPU (H200).

    python scripts/bench_layer.py [--out DIR] [--batches 1,8,32,64] [--context 8192] [--qlen 1]
                                  [--weights bf16,mxfp4,fp8] [--variants ...] [--budget SECONDS] [--gemms]

Weights (``--weights``, a comma list): ``bf16`` / ``mxfp4`` W_UK / W_UV with bf16 projections, or
``fp8``: fp8 block-scaled projections (kimi_ops.gemm_a16w8_block) and bf16 W_UK / W_UV. Per
weights and batch size, the decode step (pre / attend / post + o_proj; the metadata is built once,
outside) of:

* ours, graph:        MLADecodeLayer (kimi_ops ops) eager, captured in a torch.cuda.CUDAGraph
* ours, compiled+graph: the same step torch.compile'd (fullgraph) and captured
* plain, eager:       the same layer in plain PyTorch (bf16 W_UK / W_UV as dequantized from the
                      layer's, gather of the request's cache rows, fp8 -> bf16, masked softmax)
* plain, compiled:    that, torch.compile'd (fullgraph, default mode)
* plain, compiled+graph: that, captured in a CUDA graph

The plain PyTorch layer runs bf16 projections whatever ``--weights`` says (an fp8 layer's
dequantized: plain PyTorch has no bf16 x fp8-block GEMM) and the layer's W_UK / W_UV in bf16.
``--variants`` picks among the five (default all; ``--only-ours``: the first two).
``--gemms``: first, each fp8 projection GEMM alone (Kimi-K3 TP8 shapes, the batches' M) against
its floor (fp8 weight + scales + activations at 4.31 TB/s) and against bf16 ``F.linear`` of the
same shape: 24 calls in one CUDA graph (rotating over enough weight copies to exceed the 60 MB
L2), the replay's median over 24 (timing one call a replay measured the launch latency, ~10 us:
the 2026-12-03 run's GEMM table did, its layer table did not); and whether this torch's
``torch._scaled_mm`` takes 1x128 / 128x128 block scales on this device.

Timing: CUDA-graph replays alternate between two independent sets (layer weights, cache,
metadata), each larger than the 60 MB L2, so no replay finds its data in L2; median of the
replays (CUDA events around each). Floor = (weight bytes + KV bytes + activations) /
4.31 TB/s (kimi_ops.demo.step_bytes; the weights as our layer stores them).
Compiles are skipped once ``--budget`` seconds have passed (they take tens of seconds each).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kimi_ops.demo import HBM_BYTES_PER_S, step_bytes  # noqa: E402
from kimi_ops.runtime import DecodeMetadata, MLAConfig, MLADecodeLayer, allocate_blocks, mla  # noqa: E402
from kimi_ops.runtime.graph import GraphedStep, compile_step  # noqa: E402


# --- the same layer in plain PyTorch --------------------------------------------------------

class PlainInputs:
    """Padded per-request cache rows [R, L] (what a plain implementation gathers by) and lengths."""

    def __init__(self, md: DecodeMetadata, max_len: int):
        p = torch.arange(max_len, device=md.device)
        bt = md.block_table.long()
        self.rows = bt[:, p // md.block_size] * md.block_size + p % md.block_size      # [R, L]
        self.lens = md.seq_lens.long()
        self.slots = md.slot_mapping.clamp_min(0)


def plain_weights(layer):
    dense = layer.dense_weights(torch.bfloat16)
    w_uk, w_uv = layer.dequantized_kv_b(torch.bfloat16)
    return dict(qkv=dense["qkv"], gate=dense["gate"], qn=layer.q_a_layernorm.weight, kvn=layer.kv_a_layernorm.weight,
                qb=dense["q_b"], w_uk=w_uk, w_uv=w_uv, o=dense["o"])


def plain_layer(w, cfg: MLAConfig, kv_scale: float, hidden, kv_cache, pin: PlainInputs, qlen: int):
    h, nope = cfg.num_heads, cfg.qk_nope_head_dim
    qkv = F.linear(hidden, w["qkv"])
    q_c, kv_c, k_pe = qkv.split([cfg.q_lora_rank, 512, 64], -1)
    q_c = F.rms_norm(q_c.float(), (cfg.q_lora_rank,), w["qn"].float(), cfg.rms_norm_eps).to(hidden.dtype)
    kv_c = F.rms_norm(kv_c.float(), (512,), w["kvn"].float(), cfg.rms_norm_eps).to(hidden.dtype)
    q = F.linear(q_c, w["qb"]).view(-1, h, cfg.qk_head_dim)
    q_lat = torch.einsum("thd,hdl->thl", q[..., :nope], w["w_uk"])
    q_full = torch.cat([q_lat, q[..., nope:]], -1)                                    # [T, H, 576]
    flat = kv_cache.view(-1, 576)
    new = (torch.cat([kv_c, k_pe], -1).float() / kv_scale).clamp(-448, 448).to(flat.dtype)
    flat.view(torch.uint8).index_copy_(0, pin.slots, new.view(torch.uint8))
    r, L = pin.rows.shape
    kv = flat[pin.rows].to(hidden.dtype)                                             # [R, L, 576]
    s = torch.einsum("rihc,rlc->rihl", q_full.view(r, qlen, h, 576), kv).float() * (cfg.softmax_scale * kv_scale)
    pos = torch.arange(L, device=hidden.device)
    bound = pin.lens[:, None] - qlen + torch.arange(qlen, device=hidden.device)[None, :]   # [R, qlen]
    mask = pos[None, None, :] <= bound[:, :, None]
    s = s.masked_fill(~mask[:, :, None, :], float("-inf"))
    p = torch.softmax(s, -1).to(hidden.dtype)
    o = torch.einsum("rihl,rlc->rihc", p, kv[..., :512]) * kv_scale                  # [R, qlen, H, 512]
    core = torch.einsum("thl,hvl->thv", o.reshape(-1, h, 512), w["w_uv"]).reshape(hidden.shape[0], -1)
    core = core * torch.sigmoid(F.linear(hidden, w["gate"]))
    return F.linear(core, w["o"])


# --- where it runs (--dry-run: a small config, eagerly, on the CPU: the tests' check of this script) ---

DRY = {"on": False}


def _device() -> str:
    return "cpu" if DRY["on"] else "cuda"


def _config() -> MLAConfig:
    return MLAConfig.small() if DRY["on"] else MLAConfig.kimi_k3(tp=8)


def _capture(fn, layer, cache, md, hidden):
    """GraphedStep on the GPU; the eager call in a dry run."""
    if DRY["on"]:
        return lambda h=None: fn(layer, hidden if h is None else h, cache, md)
    return GraphedStep(fn, layer, cache, md, hidden)


# --- timing ---------------------------------------------------------------------------------

def time_alternating(runners, iters: int) -> float:
    """Median seconds of a replay, alternating the runners (independent input sets)."""
    for r in runners:
        r()
    if DRY["on"]:
        samples = []
        for i in range(iters):
            t0 = time.perf_counter()
            runners[i % len(runners)]()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)
    torch.cuda.synchronize()
    pairs = []
    for i in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runners[i % len(runners)]()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e-3 for s, e in pairs)


def profile(runners, log, name: str, iters: int = 20) -> None:
    """Per-kernel GPU time of the replays (torch.profiler), the top kernels. The sum leaves out
    the gaps between a graph's kernels, which the replay's time includes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            runners[i % len(runners)]()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append((t / iters, e.count // iters, e.key))
    rows.sort(reverse=True)
    log(f"    profile of {name}, per replay (kernels' sum {sum(r[0] for r in rows):.1f} us, "
        f"{sum(r[1] for r in rows)} kernels):")
    for us, count, key in rows[:24]:
        log(f"    {us:8.1f} us  x{count:<2} {key[:90]}")


_LAYERS: dict = {}


def decode_set(cfg, weights, batch, context, qlen, seed, device="cuda", block_size=64, margin=256,
               dcp_group=None, dcp_world=1, dcp_rank=0):
    """One input set of a decode step: a layer with random weights, a cache of random rows,
    the metadata of ``batch`` requests of ``context`` tokens (global positions; under DCP the
    cache holds rank ``dcp_rank``'s share, p % dcp_world == dcp_rank), a hidden state.
    Returns (layer, cache, md, hidden)."""
    key = (cfg, weights, device, seed, id(dcp_group))
    if key not in _LAYERS:          # the weights do not depend on the batch: one layer a (weights, seed)
        _LAYERS[key] = MLADecodeLayer(cfg, weights=weights, device=device, seed=seed, dcp_group=dcp_group)
    layer = _LAYERS[key]
    max_len = -(-context // dcp_world) + margin      # tokens a request on this rank
    bt, nblocks = allocate_blocks(batch, max_len, block_size, seed=seed, device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    cache = (torch.randn(nblocks, block_size, 576, device=device, generator=gen) / layer.kv_scale
             ).to(torch.float8_e4m3fn)
    md = DecodeMetadata.allocate(batch, batch * max_len, qlen=qlen, block_size=block_size,
                                 max_blocks=bt.shape[1], device=device, dcp_world_size=dcp_world,
                                 dcp_rank=dcp_rank)
    md.update_(torch.full((batch,), context, dtype=torch.int32, device=device), bt)
    hidden = torch.randn(batch * qlen, cfg.hidden_size, device=device, generator=gen).to(torch.bfloat16)
    return layer, cache, md, hidden


def make_set(cfg, weights, batch, context, qlen, seed):
    layer, cache, md, hidden = decode_set(cfg, weights, batch, context, qlen, seed, device=_device(),
                                          margin=8 if DRY["on"] else 256)
    return dict(layer=layer, cache=cache, md=md, hidden=hidden, plain_in=PlainInputs(md, context),
                plain_w=plain_weights(layer))


def ours_step(layer, hidden, kv_cache, md):
    return layer(hidden, kv_cache, md)


def bench_one(args, weights, batch, started, log, wanted=None, row=None):
    """One (weights, batch) point: the variants in ``wanted`` (None: ``--variants`` / all), into
    ``row`` (a new one if None); compiles only while ``--budget`` seconds have not passed."""
    cfg = _config()
    qlen = args.qlen
    sets = [make_set(cfg, weights, batch, args.context, qlen, seed) for seed in (0, 1)]
    layer0, md0 = sets[0]["layer"], sets[0]["md"]
    parts = step_bytes(layer0, int(md0.seq_lens.sum()), batch * qlen)
    floor = sum(parts.values()) / HBM_BYTES_PER_S
    row = row if row is not None else {}
    row.update(batch=batch, context=args.context, qlen=qlen, weights=weights,
               bytes=sum(parts.values()), weight_bytes=parts["weights"], floor_us=floor * 1e6)
    compile_ok = time.time() - started < args.budget
    compiled_ours = compile_step(ours_step)  # Inductor's PDL on, as the demo compiles the step

    compiled_plain = compile_step(plain_layer)

    variants = {
        "ours_graph": (ours_step, True, False),
        "ours_compiled_graph": (compiled_ours, True, True),
        "plain_eager": (None, False, False),
        "plain_compiled": (compiled_plain, False, True),
        "plain_compiled_graph": (compiled_plain, True, True),
    }
    if args.only_ours:
        variants = {k: v for k, v in variants.items() if k.startswith("ours")}
    if wanted is None and args.variants:
        wanted = args.variants.split(",")
    if wanted is not None:
        unknown = set(wanted) - set(variants) - {"plain_eager", "plain_compiled", "plain_compiled_graph"}
        if unknown:
            raise SystemExit(f"bench_layer: unknown --variants {sorted(unknown)}")
        variants = {k: v for k, v in variants.items() if k in wanted}
    outs = {}
    with torch.no_grad():
        for name, (fn, graphed, needs_compile) in variants.items():
            if needs_compile and not compile_ok:
                log(f"  {name}: skipped (compile budget spent)")
                continue
            t0 = time.time()
            try:
                if name.startswith("ours"):
                    runners = [_capture(fn, s["layer"], s["cache"], s["md"], s["hidden"]) for s in sets]
                else:
                    f = fn if fn is not None else plain_layer

                    def call(s=None, f=f):
                        return f(s["plain_w"], cfg, s["layer"].kv_scale, s["hidden"], s["cache"], s["plain_in"], qlen)
                    if graphed:
                        runners = [_capture(lambda l, h, c, m, s=s, call=call: call(s), s["layer"], s["cache"],
                                            s["md"], s["hidden"]) for s in sets]
                    else:
                        runners = [lambda s=s, call=call: call(s) for s in sets]
                setup = time.time() - t0
                sec = time_alternating(runners, args.iters)
                outs[name] = runners[0]().clone()
                row[f"{name}_us"] = sec * 1e6
                if args.profile and name.startswith("ours") and not DRY["on"]:
                    profile(runners, log, name)
                log(f"  {name:<22} {sec * 1e6:9.1f} us  ({100 * floor / sec:5.1f}% of floor; setup {setup:.0f}s)")
            except Exception as exc:  # noqa: BLE001 - report and go on
                log(f"  {name}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
            compile_ok = time.time() - started < args.budget
    if "ours_graph" in outs and "plain_eager" in outs and wanted is None:
        a, b = outs["ours_graph"].double(), outs["plain_eager"].double()
        row["ours_vs_plain_rel_diff"] = float((a - b).norm() / b.norm())
    return row


# --- the fp8 GEMMs alone ------------------------------------------------------------------------

FP8_GEMM_SHAPES = (("qkv_a+gate", 3648, 7168), ("q_b", 2304, 1536), ("o_proj", 7168, 1536))
"""Kimi-K3 TP8's fp8 projections: (name, N, K)."""


def _graphed(fn):
    """fn() captured in a CUDA graph (after a warm-up on a side stream); returns replay."""
    if DRY["on"]:
        return fn
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


CALLS_A_GRAPH = 24


def _weight_copies(nbytes: int) -> int:
    """Copies of a weight to rotate through so that no call finds its weight in the 60 MB L2."""
    return max(4, min(48, -(-160_000_000 // max(1, nbytes))))


def time_calls(make_call, copies: int) -> float:
    """Seconds a call: CALLS_A_GRAPH calls (cycling over ``copies`` weight copies,
    ``make_call(i)``) captured in one CUDA graph, median replay over CALLS_A_GRAPH (one graph
    launch a replay, so the launch latency is spread over the calls, not added to each)."""
    calls = [make_call(i % copies) for i in range(CALLS_A_GRAPH)]

    def run():
        for c in calls:
            c()
    return time_alternating([_graphed(run)], 3 if DRY["on"] else 30) / CALLS_A_GRAPH


def scaled_mm_probe(log) -> str:
    """Whether torch._scaled_mm runs 1x128 (activations) x 128x128 (weights) block scales here."""
    m, n, k = 16, 256, 512
    a = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.ones(m, k // 128, device="cuda")                       # BlockWise1x128, [M, K/128]
    sb = torch.ones(n // 128, k // 128, device="cuda")                # BlockWise128x128, [N/128, K/128]
    msg = ""
    # the scales as given, then M-major / K-major ("outer-dim-major", what cuBLASLt's VEC128 wants)
    for layout, (sa_, sb_) in (("row-major scales", (sa, sb.t())),
                               ("outer-dim-major scales", (sa.t().contiguous().t(), sb.t().contiguous()))):
        try:
            y = torch._scaled_mm(a, b.t(), scale_a=sa_, scale_b=sb_, out_dtype=torch.bfloat16)
            torch.cuda.synchronize()
            ref = a.float() @ b.float().t()
            msg = (f"runs with {layout} (rel err {float((y.float() - ref).norm() / ref.norm()):.1e}; "
                   f"the activations must be fp8 with 1x128 scales too)")
            break
        except Exception as exc:  # noqa: BLE001 - the answer is the message
            msg += f"{layout}: refused: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}; "
    st = getattr(F, "ScalingType", None)
    msg += (f"; torch.nn.functional.scaled_mm: {'present' if hasattr(F, 'scaled_mm') else 'absent'}"
            + (f" (ScalingType {', '.join(n for n in dir(st) if n.startswith('Block'))})" if st is not None else ""))
    log(f"torch._scaled_mm with 1x128 x 128x128 block scales on {torch.cuda.get_device_name()}: {msg}")
    return msg


def bench_gemms(batches, qlen, log):
    import kimi_ops
    from kimi_ops.kernels.fp8_gemm import gemm_config, gemv_config, use_gemv
    from kimi_ops.reference.fp8 import quantize_fp8_blocks
    from kimi_ops.device import multiprocessor_count
    rows = []
    sms = 132 if DRY["on"] else multiprocessor_count(torch.cuda.current_device())
    probe = "not run (dry run)" if DRY["on"] else scaled_mm_probe(log)
    dev = _device()
    shapes = (("small", 192, 256),) if DRY["on"] else FP8_GEMM_SHAPES
    log("| GEMM | M | config (tl.dot: BM,BN,BK,split,warps,stages; gemv: BN,BK,split,warps,depth,x_ahead) | fp8 us | "
        "floor us | % of floor | bf16 F.linear us | "
        "bf16 / fp8 |")
    log("|---|---|---|---|---|---|---|---|")
    for name, n, k in shapes:
        copies = _weight_copies(n * k)
        ws = [quantize_fp8_blocks(torch.randn(n, k, device=dev) / k ** 0.5) for _ in range(copies)]
        wb = [torch.randn(n, k, device=dev).to(torch.bfloat16) for _ in range(_weight_copies(2 * n * k))]
        for b in batches:
            m = b * qlen
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            t8 = time_calls(lambda i: (lambda w=ws[i][0], s=ws[i][1]: kimi_ops.gemm_a16w8_block(x, w, s)), len(ws))
            tb = time_calls(lambda i: (lambda w=wb[i]: F.linear(x, w)), len(wb))
            floor = (n * k + ws[0][1].numel() * 4 + 2 * m * (k + n)) / HBM_BYTES_PER_S
            gemv = use_gemv(m, n, k)
            cfg = (gemv_config if gemv else gemm_config)(m, n, k, 128, sms)
            rows.append(dict(gemm=name, m=m, n=n, k=k, config=cfg, fp8_us=t8 * 1e6, floor_us=floor * 1e6,
                             bf16_us=tb * 1e6))
            kind = "gemv" if gemv else "tl.dot"
            log(f"| {name} [{n}, {k}] | {m} | {kind} {','.join(map(str, cfg))} | {t8 * 1e6:.2f} | "
                f"{floor * 1e6:.2f} | {100 * floor / t8:.0f}% | {tb * 1e6:.2f} | {tb / t8:.2f}x |")
    rows.append(dict(scaled_mm_probe=probe))
    return rows


def sweep_gemms(configs, batches, qlen, started, deadline, log):
    """Each fp8 GEMM shape at each M under every config of ``configs`` (the tl.dot kernel's 6-tuples, as
    ``KIMI_OPS_FP8_GEMM_CONFIG``; the GEMV is not swept here: scripts/bench_fp8_gemv.py), CUDA-graph
    replays over 4 weights, while ``deadline`` (seconds
    since the start) allows. Log lines only."""
    from kimi_ops.kernels.fp8_gemm import gemm_a16w8_block as kernel
    from kimi_ops.reference.fp8 import quantize_fp8_blocks
    log("fp8 GEMM config sweep (us; BM,BN,BK,split,warps,stages):")
    for name, n, k in FP8_GEMM_SHAPES:
        ws = [quantize_fp8_blocks(torch.randn(n, k, device="cuda") / k ** 0.5) for _ in range(_weight_copies(n * k))]
        for b in batches:
            m = b * qlen
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            cells = []
            for cfg in configs:
                if time.time() - started > deadline:
                    log(f"  sweep stopped at the deadline ({deadline:.0f} s)")
                    return
                try:
                    t = time_calls(lambda i, cfg=cfg: (lambda w=ws[i][0], s=ws[i][1]:
                                                       kernel(x, w, s, config=cfg, gemv=False)), len(ws))
                    cells.append(f"{','.join(map(str, cfg))}: {t * 1e6:.2f}")
                except Exception as exc:  # noqa: BLE001
                    cells.append(f"{','.join(map(str, cfg))}: {type(exc).__name__}")
            log(f"  {name} M {m}: " + " | ".join(cells))


def write_outputs(args, rows, gemm_rows, lines, log):
    log("")
    log("| weights | batch | weight MB | floor us | ours graph | ours compiled+graph | plain eager | plain compiled "
        "| plain compiled+graph | best ours % of floor | best plain compiled / best ours |")
    log("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        def f(k):
            return f"{r[k]:.1f}" if k in r else "-"
        ours = min([r[k] for k in ("ours_graph_us", "ours_compiled_graph_us") if k in r], default=None)
        pct = f"{100 * r['floor_us'] / ours:.0f}%" if ours else "-"
        plain = min([r[k] for k in ("plain_compiled_us", "plain_compiled_graph_us") if k in r], default=None)
        ratio = f"{plain / ours:.1f}x" if ours and plain else "-"
        log(f"| {r['weights']} | {r['batch']} | {r['weight_bytes'] / 1e6:.1f} | {r['floor_us']:.1f} | "
            f"{f('ours_graph_us')} | {f('ours_compiled_graph_us')} | "
            f"{f('plain_eager_us')} | {f('plain_compiled_us')} | {f('plain_compiled_graph_us')} | {pct} | {ratio} |")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_layer.json"), "w") as fh:
        json.dump({"layer": rows, "gemms": gemm_rows}, fh, indent=1)
    with open(os.path.join(args.out, "bench_layer.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--batches", default="32,1,64,8", help="in this order (compiles stop at --budget)")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--qlen", type=int, default=1)
    ap.add_argument("--weights", default="mxfp4", help="comma list of bf16, mxfp4, fp8 (default mxfp4)")
    ap.add_argument("--variants", default="", help="comma list of ours_graph, ours_compiled_graph, plain_eager, "
                    "plain_compiled, plain_compiled_graph (default: all)")
    ap.add_argument("--then", default="", help="after the main pass, these variants (comma list) at the points "
                    "of --then-points, in that order, while --budget lasts (e.g. the compiled ones)")
    ap.add_argument("--then-points", default="", help="comma list of weights:batch (default: every point)")
    ap.add_argument("--sweep", default="", help="last, fp8 GEMM configs to time at every shape and M: "
                    "'BM,BN,BK,split,warps,stages;...' (while --sweep-deadline seconds since the start allow)")
    ap.add_argument("--sweep-deadline", type=float, default=1e9)
    ap.add_argument("--gemms", action="store_true", help="first the fp8 GEMMs alone (and the _scaled_mm probe)")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--budget", type=float, default=240.0, help="seconds after which compiles are skipped")
    ap.add_argument("--profile", action="store_true", help="per-kernel times of ours_graph and ours_compiled_graph (torch.profiler)")
    ap.add_argument("--only-ours", action="store_true", help="skip the plain PyTorch layer")
    ap.add_argument("--dry-run", action="store_true", help="a small config, eagerly, on the CPU (checks the script)")
    args = ap.parse_args(argv)
    DRY["on"] = args.dry_run
    if not args.dry_run and not torch.cuda.is_available():
        print("bench_layer: needs a CUDA GPU")
        return 1
    weights_list = [w.strip() for w in args.weights.split(",") if w.strip()]
    bad = [w for w in weights_list if w not in ("bf16", "mxfp4", "fp8")]
    if bad or not weights_list:
        print(f"bench_layer: --weights takes a comma list of bf16, mxfp4, fp8; got {args.weights!r}")
        return 2
    started = time.time()
    lines = []

    def log(msg):
        print(msg, flush=True)
        lines.append(msg)

    log(f"bench_layer: {'DRY RUN (small config, CPU, eager) ' if DRY['on'] else ''}Kimi-K3 TP8 layer, weights {','.join(weights_list)}, context {args.context}, "
        f"qlen {args.qlen}, {'CPU' if DRY['on'] else torch.cuda.get_device_name()}, torch {torch.__version__}")
    batches = [int(b) for b in args.batches.split(",")]
    gemm_rows = bench_gemms(batches, args.qlen, log) if args.gemms else []
    rows = []
    for batch in batches:
        for weights in weights_list:
            log(f"batch {batch}, {weights} weights:")
            rows.append(bench_one(args, weights, batch, started, log))
        torch.cuda.empty_cache()
    write_outputs(args, rows, gemm_rows, lines, log)
    if args.then:
        points = ([tuple(p.split(":")) for p in args.then_points.split(",") if p]
                  or [(r["weights"], str(r["batch"])) for r in rows])
        for weights, batch in points:
            if time.time() - started >= args.budget:
                log(f"--then: budget spent before {weights}:{batch}")
                break
            row = next((r for r in rows if r["weights"] == weights and r["batch"] == int(batch)), None)
            if row is None:
                row = {}
                rows.append(row)
            log(f"batch {batch}, {weights} weights (--then):")
            bench_one(args, weights, int(batch), started, log, wanted=args.then.split(","), row=row)
            torch.cuda.empty_cache()
        write_outputs(args, rows, gemm_rows, lines, log)
    if args.sweep and not DRY["on"]:
        configs = [tuple(int(v) for v in c.split(",")) for c in args.sweep.split(";") if c.strip()]
        sweep_gemms(configs, batches, args.qlen, started, args.sweep_deadline, log)
        with open(os.path.join(args.out, "bench_layer.md"), "w") as fh:
            fh.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
