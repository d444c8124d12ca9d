"""``python -m kimi_ops demo``: the Kimi-K3 TP8 MLA decode layer, N steps, checked.

The default job (:func:`run_layer_demo`): a Kimi-K3 TP8 layer (12 heads, hidden 7168) with
random weights decodes a batch of requests for ``--steps`` steps (on a GPU: the step
``torch.compile``'d and captured in a CUDA graph; on the CPU: eager), checked against a
float64 computation of the whole layer at the first and last steps, printing per-step
latency, tokens/s, effective bandwidth and % of the H200 floor.

``--attention-only`` (:func:`run_attention_demo`): the decode attention alone on every
backend that can run here, each checked against the float64 reference (the earlier demo).
"""

import argparse
import functools
import os
import statistics
import sys
import time

import torch

from . import dispatch, ops
from .reference.attention import decode_float64
from .workloads import decode_workload

RTOL, LSE_ATOL = 4e-3, 1e-3   # DESIGN.md's accuracy contract


def backends_here(device: torch.device) -> list[str]:
    """Backends that can serve mla_decode on ``device`` (the best first)."""
    found = []
    for name in ("cuda", "triton"):
        if name in dispatch.IMPLEMENTATIONS["mla_decode_splitkv"] and \
                dispatch.unavailable_reason(name, device) is None:
            found.append(name)
    return found + ["reference"]


# cycles of a GPU spin queued before a timed replay (~0.1 ms): the CPU queues the replay behind its
# start event meanwhile, so the events time the GPU's work and not the CPU's launch of it (~10 us
# a replay when timed from an idle GPU), as scripts/bench_layer.py's replays do
LAUNCH_COVER_CYCLES = 200_000


def timed_on_gpu(fn, events: list):
    """``fn()`` between two CUDA events (appended to ``events``) behind a spin; returns its result."""
    torch.cuda._sleep(LAUNCH_COVER_CYCLES)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    events.append((start, end))
    return out


def time_call(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` after one warm-up."""
    fn()
    samples = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def errors(o, lse, o_ref, lse_ref):
    """(relative L2 error of o, max |lse error| over finite rows, -inf pattern exact)."""
    o, lse = o.double().cpu(), lse.double().cpu()
    rel = float((o - o_ref).norm() / o_ref.norm().clamp_min(1e-30))
    empty = torch.isinf(lse_ref)
    pattern = bool(torch.equal(torch.isinf(lse) & (lse < 0), empty)) and not torch.isnan(o).any()
    finite = ~empty
    lse_err = float((lse - lse_ref)[finite].abs().max()) if finite.any() else 0.0
    return rel, lse_err, pattern


def run_attention_demo(args) -> int:
    apply_defaults(args, "attention")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    lengths = [max(0, args.context + (i * 97) % 211 - 105) for i in range(args.batch)]
    work = decode_workload(lengths, heads=args.heads, qlen=args.qlen, device=device, seed=args.seed)
    o_ref, lse_ref = decode_float64(work.q.cpu(), work.kv_cache.cpu(), work.kv_indptr.cpu(),
                                    work.kv_indices.cpu(), work.qlen, work.scale, work.kv_scale)
    print(f"kimi_ops demo: mla_decode, {args.batch} requests x qlen {args.qlen}, {args.heads} heads, "
          f"{work.num_tokens} cached tokens (lengths {min(lengths)}..{max(lengths)}), fp8 cache, on {device}")
    header = f"{'backend':<10} {'splits':>6} {'time':>11} {'rel L2 err(o)':>14} {'max|dLSE|':>10}  check"
    print(header)
    print("-" * len(header))
    failed = False
    previous = os.environ.get(dispatch.ENV_VAR)
    try:
        for backend in backends_here(device):
            os.environ[dispatch.ENV_VAR] = backend
            splits = args.splits or dispatch.default_num_splits(
                args.batch, work.q.shape[0], args.heads, work.num_tokens, device)
            call = functools.partial(ops.mla_decode, *work.decode_args(), num_splits=splits, **work.decode_kwargs())
            o, lse = call()
            rel, lse_err, pattern = errors(o, lse, o_ref, lse_ref)
            ok = rel <= RTOL and lse_err <= LSE_ATOL and pattern
            failed |= not ok
            seconds = time_call(call, device, args.repeats)
            print(f"{backend:<10} {splits:>6} {seconds * 1e6:>9.1f}us {rel:>14.2e} {lse_err:>10.2e}  "
                  f"{'PASS' if ok else 'FAIL'}")
    finally:
        if previous is None:
            os.environ.pop(dispatch.ENV_VAR, None)
        else:
            os.environ[dispatch.ENV_VAR] = previous
    print(f"tolerances: rel L2 <= {RTOL:g}, |dLSE| <= {LSE_ATOL:g}, -inf exactly where the reference has it")
    return 1 if failed else 0


# --- the whole layer ---------------------------------------------------------------------------

HBM_BYTES_PER_S = 4.31e12    # the H200's measured HBM read bandwidth (DESIGN.md)
LAYER_RTOL = 1.2e-2          # the layer's output vs float64 (derivation: tests/test_runtime.py)


def step_bytes(layer, num_tokens: int, num_rows: int) -> dict[str, int]:
    """Bytes one decode step must move at least: every weight once, every visible token's
    576-byte cache row and 4-byte index once, and the activations between the kernels
    (hidden in, output, q_a/kv_a/gate, the query and the attention output written and read)."""
    c = layer.config
    h = c.num_heads
    out_width = c.hidden_size if layer.o_proj is not None else c.o_proj_in
    act = 2 * num_rows * (c.hidden_size + out_width)                               # hidden in, out
    act += 2 * 2 * num_rows * (c.qkv_a_rows + c.gate_rows + h * c.qk_head_dim)     # qkv_a(+gate), q_b
    act += 2 * 2 * num_rows * h * (576 + 512 + c.v_head_dim)                       # q, o, W_UV out
    return {"weights": layer.weight_bytes(), "kv": num_tokens * (576 + 4), "activations": act}


WEIGHTS_DESCRIPTION = {
    "bf16": "bf16 W_UK/W_UV",
    "mxfp4": "mxfp4 W_UK/W_UV",
    "fp8": "fp8 projections (128x128 block scales, gemm_a16w8_block), bf16 W_UK/W_UV",
}


def attention_bytes(layer, num_tokens: int, num_rows: int) -> int:
    """The part of :func:`step_bytes` the attention moves: the visible tokens' cache rows and
    indices, the query read and its output written (o bf16, lse float32)."""
    h = layer.config.num_heads
    return num_tokens * (576 + 4) + num_rows * h * (576 * 2 + 512 * 2 + 4)


def time_attention(layer, cache, md, hidden, device: torch.device, repeats: int = 20) -> float:
    """Median seconds of the step's attention alone (``mla.attend`` on the query ``mla.pre``
    makes of ``hidden``; a copy of the cache), a CUDA graph replay on the GPU, eager on the CPU."""
    from .runtime import mla
    from .runtime.graph import GraphedStep
    cache = cache.clone()
    with torch.no_grad():
        q, _ = mla.pre(layer, hidden, cache, md)
        if device.type != "cuda":
            return time_call(lambda: mla.attend(layer, q, cache, md), device, max(1, repeats // 4))
        graphed = GraphedStep(lambda layer, _hidden, cache, md: mla.attend(layer, q, cache, md),
                              layer, cache, md, hidden)
        samples = []
        for _ in range(repeats):
            timed_on_gpu(graphed, samples)
        torch.cuda.synchronize(device)
    return statistics.median(s.elapsed_time(e) * 1e-3 for s, e in samples)


def step_table(step_s: float, attn_s: float, total_bytes: int, attn_bytes: int) -> list[str]:
    """The demo's table: the step, its attention and the rest, each with its time, its floor
    (bytes / 4.31 TB/s), % of that floor and its share of the step's time."""
    rows = [("step", step_s, total_bytes), ("attention", attn_s, attn_bytes),
            ("rest", max(step_s - attn_s, 0.0), total_bytes - attn_bytes)]
    lines = [f"{'part':<10} {'time':>10} {'floor':>10} {'% of floor':>11} {'share of step':>14}"]
    lines.append("-" * len(lines[0]))
    for name, sec, nbytes in rows:
        floor = nbytes / HBM_BYTES_PER_S
        pct = f"{100 * floor / sec:.0f}%" if sec > 0 else "-"
        lines.append(f"{name:<10} {_fmt(sec):>10} {_fmt(floor):>10} {pct:>11} {100 * sec / step_s:>13.0f}%")
    return lines


def _fmt(seconds: float) -> str:
    if seconds < 1e-6:
        return f"{seconds * 1e6:.3f} us"
    return f"{seconds * 1e6:.1f} us" if seconds < 1e-2 else f"{seconds * 1e3:.1f} ms"


def _progress(iterable, total: int, enabled: bool):
    if not enabled:
        return iterable
    try:
        from tqdm import tqdm
        return tqdm(iterable, total=total, desc="decode", unit="step", file=sys.stderr, leave=False)
    except ImportError:
        def simple():
            for i, x in enumerate(iterable):
                done = (i + 1) * 30 // total
                print(f"\rdecode [{'#' * done}{'.' * (30 - done)}] {i + 1}/{total}", end="", file=sys.stderr)
                yield x
            print(file=sys.stderr)
        return simple()


def run_layer_demo(args) -> int:
    from .runtime import DecodeMetadata, MLAConfig, MLADecodeLayer, allocate_blocks
    from .runtime.graph import GraphedStep, compile_step, decode_step
    from .runtime.reference import layer_float64, relative_error

    apply_defaults(args, "layer")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    batch, context, qlen, steps = args.batch, args.context, args.qlen, args.steps
    torch.manual_seed(args.seed)
    config = MLAConfig.kimi_k3(tp=8)
    layer = MLADecodeLayer(config, weights=args.weights, device=device, seed=args.seed)
    lengths = [max(1, context + (i * 97) % 211 - 105) for i in range(batch)]
    max_len = max(lengths) + steps * qlen
    block_table, num_blocks = allocate_blocks(batch, max_len, args.block_size, seed=args.seed, device=device)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    cache = (torch.randn(num_blocks, args.block_size, 576, device=device, generator=gen) / layer.kv_scale
             ).to(torch.float8_e4m3fn)
    md = DecodeMetadata.allocate(batch, sum(lengths) + batch * steps * qlen, qlen=qlen, block_size=args.block_size,
                                 max_blocks=block_table.shape[1], device=device)
    md.update_(torch.tensor(lengths, dtype=torch.int32, device=device), block_table)
    hiddens = [torch.randn(batch * qlen, config.hidden_size, device=device, generator=gen).to(torch.bfloat16)
               for _ in range(min(steps, 8))]

    graphed = device.type == "cuda" and not args.eager
    how = "eager"
    with torch.no_grad():
        if graphed:
            fn = decode_step if args.no_compile else compile_step(decode_step)
            how = ("eager" if args.no_compile else "torch.compile'd") + " + CUDA graph"
            print(f"capturing the decode step ({how}) ...", flush=True)
            runner = GraphedStep(fn, layer, cache, md, hiddens[0])
        else:
            def runner(hidden):
                return decode_step(layer, hidden, cache, md)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"kimi_ops demo: Kimi-K3 TP8 MLA decode layer ({config.num_heads} heads of {config.total_heads}, "
              f"hidden {config.hidden_size}, q_lora {config.q_lora_rank}, NoPE, sigmoid gate, o_proj), "
              f"{WEIGHTS_DESCRIPTION[args.weights]}, fp8 cache, on {device} ({name})")
        print(f"batch {batch} x qlen {qlen}, context {min(lengths)}..{max(lengths)} tokens "
              f"(+{steps * qlen} over the run), block size {args.block_size}, {steps} steps, {how}, "
              f"backend {dispatch.backend_for('mla_decode_splitkv', device)}")
        check_at = sorted({0, steps - 1} | set(range(0, steps, args.check_every or steps)))
        checks, seconds, tokens = [], [], []
        events = []
        for i in _progress(range(steps), steps, not args.no_progress):
            hidden = hiddens[i % len(hiddens)]
            if device.type == "cuda":
                out = timed_on_gpu(lambda: runner(hidden), events)
            else:
                t0 = time.perf_counter()
                out = runner(hidden)
                seconds.append(time.perf_counter() - t0)
            tokens.append(md.seq_lens.sum())    # a device scalar: no sync in the loop
            if i in check_at:
                ref = layer_float64(layer, hidden, cache, md)
                checks.append((i, relative_error(out, ref)))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            seconds = [s.elapsed_time(e) * 1e-3 for s, e in events]
    tokens = torch.stack(tokens).tolist()
    med = statistics.median(seconds)
    mean_tokens = sum(tokens) / len(tokens)
    parts = step_bytes(layer, int(mean_tokens), batch * qlen)
    total = sum(parts.values())
    floor = total / HBM_BYTES_PER_S
    print(f"step latency: median {_fmt(med)} (mean {_fmt(statistics.mean(seconds))}, "
          f"min {_fmt(min(seconds))}, over {steps} steps)")
    print(f"tokens/s: {batch * qlen / med:,.0f}")
    print(f"bytes/step: {total / 1e6:.1f} MB (weights {parts['weights'] / 1e6:.1f}, KV {parts['kv'] / 1e6:.1f}, "
          f"activations {parts['activations'] / 1e6:.2f}); effective {total / med / 1e12:.3f} TB/s; "
          f"H200 floor {floor * 1e6:.1f} us at 4.31 TB/s -> {100 * floor / med:.2g}% of floor"
          + ("" if device.type == "cuda" else " (the floor is the H200's; this ran on the CPU)"))
    attn_s = time_attention(layer, cache, md, hiddens[0], device)
    attn_bytes = attention_bytes(layer, int(mean_tokens), batch * qlen)
    print(f"where the step's time goes (attention: mla.attend alone, {'a CUDA graph' if device.type == 'cuda' else 'eager'}; "
          f"rest = step - attention: the projections, norms, M1a, cache write, W_UV, gate):")
    for line in step_table(med, attn_s, total, attn_bytes):
        print("  " + line)
    failed = False
    for i, err in checks:
        ok = err <= LAYER_RTOL
        failed |= not ok
        print(f"check step {i:>4}: rel L2 error vs float64 {err:.2e}  {'PASS' if ok else 'FAIL'}")
    print(f"tolerance: rel L2 <= {LAYER_RTOL:g} (bf16 activations between the GEMMs; see tests/test_runtime.py)")
    return 1 if failed else 0


def run_demo(args) -> int:
    """``python -m kimi_ops demo``: the layer job, or the attention table with ``--attention-only``."""
    if args.attention_only:
        return run_attention_demo(args)
    if args.dcp > 1:
        from .demo_dcp import run_dcp_demo
        return run_dcp_demo(args)
    return run_layer_demo(args)


# --- flags -------------------------------------------------------------------------------------

MAX_QLEN = 8
MODE_DEFAULTS = {
    "layer": {"batch": 8, "context": 512, "steps": 32},
    "attention": {"batch": 4, "context": 300, "steps": 32},   # --attention-only (steps unused)
    "dcp": {"batch": 4, "context": 256, "steps": 8},          # --dcp N > 1
}
"""Each job's defaults for the flags left out; --help is written from this table."""


def mode(args) -> str:
    """Which job the flags ask for: ``layer``, ``attention`` or ``dcp``."""
    return "attention" if args.attention_only else "dcp" if args.dcp > 1 else "layer"


def apply_defaults(args, job: str | None = None) -> None:
    """Fill the flags left out (None) with ``job``'s defaults (:data:`MODE_DEFAULTS`)."""
    for name, value in MODE_DEFAULTS[job or mode(args)].items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def _defaults_help(name: str) -> str:
    d = {job: MODE_DEFAULTS[job][name] for job in MODE_DEFAULTS}
    return f"default {d['layer']}; --attention-only: {d['attention']}; --dcp: {d['dcp']}"


def int_in_range(low: int, high: int | None = None):
    """An argparse type: an int in [low, high] (no upper bound without ``high``)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"{low}..{high}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value
    parse.__name__ = "int"
    return parse


def device_flag(text: str) -> str:
    """An argparse type: ``cpu``, ``cuda`` or ``cuda:N`` (availability is checked after parsing)."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    return text


def check_arguments(parser: argparse.ArgumentParser, args) -> None:
    """What the types cannot see: the GPU the flags ask for exists, the flags fit together.
    Calls ``parser.error`` (one line on stderr after the usage, exit 2)."""
    if args.attention_only and args.dcp > 1:
        parser.error("argument --dcp: --attention-only runs one process; leave out --dcp or --attention-only")
    if args.device is None:
        return
    device = torch.device(args.device)
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        parser.error(f"argument --device: {args.device} was asked for but no CUDA GPU is visible here "
                     f"(torch.cuda.is_available() is False); use --device cpu")
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        parser.error(f"argument --device: {args.device} does not exist, this machine has {count} GPU(s)")
    if args.dcp > count:
        parser.error(f"argument --dcp: {args.dcp} ranks on --device cuda need {args.dcp} GPUs, found {count} "
                     f"(leave out --device to run on gloo on the CPU)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    positive = int_in_range(1)
    parser.add_argument("--batch", type=positive, default=None, help=f"decode requests ({_defaults_help('batch')})")
    parser.add_argument("--context", type=positive, default=None,
                        help=f"about this many cached tokens a request ({_defaults_help('context')})")
    parser.add_argument("--qlen", type=int_in_range(1, MAX_QLEN), default=1,
                        help=f"query positions a request a step, 1..{MAX_QLEN} (default 1)")
    parser.add_argument("--steps", type=positive, default=None,
                        help=f"decode steps (default {MODE_DEFAULTS['layer']['steps']}; "
                             f"--dcp: {MODE_DEFAULTS['dcp']['steps']})")
    parser.add_argument("--weights", choices=("bf16", "mxfp4", "fp8"), default="mxfp4",
                        help="W_UK / W_UV format (bf16, mxfp4), or fp8: fp8 block-scaled projections")
    parser.add_argument("--block-size", type=positive, default=16, help="KV cache block size (default 16)")
    parser.add_argument("--device", type=device_flag, default=None,
                        help="cpu, cuda or cuda:N (default: cuda when a GPU is present)")
    parser.add_argument("--eager", action="store_true", help="GPU: run eagerly, no CUDA graph")
    parser.add_argument("--no-compile", action="store_true", help="GPU: capture the eager step (no torch.compile)")
    parser.add_argument("--check-every", type=positive, default=None, help="also check every N steps")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dcp", type=positive, default=1,
                        help="decode context parallel over N ranks (NCCL with N GPUs, else gloo on the CPU), "
                             "checked against one rank")
    attention = parser.add_argument_group("attention only (the earlier demo)")
    attention.add_argument("--attention-only", action="store_true",
                           help="just the decode attention on every backend here (the earlier table)")
    attention.add_argument("--heads", type=int_in_range(1, 128), default=12,
                           help="query heads, 1..128 (Kimi-K3 TP8: 12)")
    attention.add_argument("--splits", type=int_in_range(1, 65535), default=None,
                           help="num_splits, 1..65535 (default: the host heuristic)")
    attention.add_argument("--repeats", type=positive, default=5, help="timed calls a backend (median, default 5)")
