"""``python -m kimi_ops demo``: a Kimi-K3 TP8 decode-attention step on every backend
that can run here, each checked against the float64 reference."""

import argparse
import os
import statistics
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


def run_demo(args) -> int:
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
            call = lambda: ops.mla_decode(*work.decode_args(), num_splits=splits, **work.decode_kwargs())  # noqa: E731
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=4, help="decode requests (default 4)")
    parser.add_argument("--context", type=int, default=300, help="about this many cached tokens a request")
    parser.add_argument("--qlen", type=int, default=1, help="query positions a request (1..8)")
    parser.add_argument("--heads", type=int, default=12, help="query heads (Kimi-K3 TP8: 12)")
    parser.add_argument("--splits", type=int, default=None, help="num_splits (default: the host heuristic)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when present)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls a backend (median)")
    parser.add_argument("--seed", type=int, default=0)
