#!/usr/bin/env python3
"""Small cases of the Hopper kernels for compute-sanitizer (memcheck, racecheck, synccheck).

    compute-sanitizer --tool memcheck python3 scripts/sanitize_cuda.py
    python3 scripts/sanitize_cuda.py --tools all      # each of the three sanitizers in turn
    python3 scripts/sanitize_cuda.py --tools racecheck,synccheck [--timeout 90]
    python3 scripts/sanitize_cuda.py --tools all --cases projections   # one group of cases

Two groups (--cases, default both). attention: every CTA shape (16, 24, 32, 48, 64 rows), empty
splits, out-of-range indices, requests shorter than qlen, a causal tail inside the last tile, the
balanced split sizing, DCP bounds, empty splits that leave o unwritten (zero_empty=False),
mla_decode's work-list grid and both merges, and the fp8 query (q_scale) on every CTA shape.
projections: the layer's small-M GEMMs (csrc/sm90/gemv.cuh and gemm_fp8_rows64.cuh): fp8
block-scaled weights at 1-64 rows (one, two and four 8-token tiles; 33-64 rows split K over a
cluster, both of its forms), bf16 weights at 1-32 rows, launches with constant_w (programmatic
dependent launch), and the fused norm + cache write + q_b kernel (pre_norm.cuh) on both weight
kinds and both token-tile forms.
Prints the worst error of each group against float64 (the sanitizer's report is the point).
"""
import argparse
import os
import shutil
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

TOOLS = ("memcheck", "racecheck", "synccheck")
CASES = ("attention", "projections")


def attention_cases():
    import kimi_ops.kernels.sm90 as hopper
    from test_triton_attention import SCALE, make_inputs, oracle
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for lens, qlen, H, S, oob in [([0, 1, 70, 130], 2, 12, 3, 3), ([200, 5], 1, 16, 9, 0),
                                  ([150], 2, 16, 2, 0), ([90, 3], 3, 16, 4, 2), ([300], 1, 128, 2, 0),
                                  ([1000, 300], 1, 12, 1, 0),  # 16 tiles: the 4-stage ring wraps
                                  ([1000, 300], 3, 16, 1, 2),  # 48 rows, 8 tiles: the ring by halves wraps
                                  ([1000], 1, 96, 1, 0),  # 2 x 48 rows, 8 whole tiles
                                  ([1000], 2, 12, 1, 0),  # 24 rows, 8 tiles of bulk copies
                                  ([1000], 2, 16, 1, 0)]:  # 32 rows, 8 tiles of bulk copies
        q, kv, indptr, idx = make_inputs(lens, qlen, H, device="cuda", gen=g, oob=oob)
        o, lse = hopper.mla_merge(*hopper.mla_decode_splitkv(q, kv, indptr, idx, qlen, SCALE, 0.5, S))
        ro, _ = oracle(q, kv, indptr, idx, qlen, SCALE, 0.5)
        worst = max(worst, ((o.double() - ro).norm() / ro.norm().clamp_min(1e-30)).item())
    q, kv, indptr, idx = make_inputs([0, 1, 70, 130], 1, 12, device="cuda", gen=g)  # mla_decode's private partials
    o, _ = hopper.mla_merge(*hopper.mla_decode_splitkv(q, kv, indptr, idx, 1, SCALE, 0.5, 6, zero_empty=False))
    ro, _ = oracle(q, kv, indptr, idx, 1, SCALE, 0.5)
    worst = max(worst, ((o.double() - ro).norm() / ro.norm().clamp_min(1e-30)).item())
    for lens, qlen, H, S in [([0, 1, 70, 130], 1, 12, 6), ([0] * 33 + [500, 7], 2, 12, None),
                             ([300, 2], 1, 128, 3)]:  # mla_decode's work-list grid (a 2-step scan)
        q, kv, indptr, idx = make_inputs(lens, qlen, H, device="cuda", gen=g)
        o, _ = hopper.mla_decode(q, kv, indptr, idx, qlen, SCALE, 0.5, S)
        ro, _ = oracle(q, kv, indptr, idx, qlen, SCALE, 0.5)
        worst = max(worst, ((o.double() - ro).norm() / ro.norm().clamp_min(1e-30)).item())
    q, kv, indptr, idx = make_inputs([40, 0, 77], 2, 12, device="cuda", gen=g)
    seq_lens = torch.tensor([80, 3, 150], dtype=torch.int32, device="cuda")
    hopper.mla_decode_splitkv(q, kv, indptr, idx, 2, SCALE, 0.5, 2, seq_lens, 1, 2)
    hopper.mla_decode(q, kv, indptr, idx, 2, SCALE, 0.5, 2, seq_lens, 1, 2)
    # the fp8 query (q_scale) on every CTA height (staged as f16)
    for rows in ("16", "24", "32", "48", "64"):
        os.environ[hopper.ROWS_ENV] = rows
        for lens, qlen, H, S in [([0, 1, 70, 130], 2, 12, 3), ([300, 2], 1, 16, None)]:
            q, kv, indptr, idx = make_inputs(lens, qlen, H, device="cuda", gen=g, oob=2)
            amax = q.float().abs().max()
            q_scale = (amax / 448.0).reshape(1)
            q8 = (q.float() / q_scale).to(torch.float8_e4m3fn)
            o, _ = hopper.mla_merge(*hopper.mla_decode_splitkv(q8, kv, indptr, idx, qlen, SCALE, 0.5, S or 2,
                                                               q_scale=q_scale))
            o2, _ = hopper.mla_decode(q8, kv, indptr, idx, qlen, SCALE, 0.5, S, q_scale=q_scale)
            ro, _ = oracle(q8.double() * q_scale.double(), kv, indptr, idx, qlen, SCALE, 0.5)
            for out in (o, o2):
                worst = max(worst, ((out.double() - ro).norm() / ro.norm().clamp_min(1e-30)).item())
    del os.environ[hopper.ROWS_ENV]
    torch.cuda.synchronize()
    print(f"sanitize_cuda attention: worst rel L2 {worst:.2e}")


def projection_cases():
    import kimi_ops
    from kimi_ops.kernels import sm90_gemv
    from test_fp8_weights import gemm64, random_fp8
    from test_gemv import bound_ok
    import test_norm_cache_write_q_b as nq
    torch.manual_seed(0)
    worst = 0.0
    os.environ[sm90_gemv.ENV] = "64"   # bf16 weights past their default of 16 rows (to 32): the four-tile form too
    for n, k, bn in ((2304, 1536, 128), (1000, 4160, 16)):   # q_b's shape; a ragged N with a partial k-block
        w, s = random_fp8(n, k, bn, 128, seed=n)
        wd, sd = w.cuda(), s.cuda()
        wb = (torch.randn(n, k) / k ** 0.5).to(torch.bfloat16)
        wbd = wb.cuda()
        for m in (1, 9, 17, 33, 64):
            x = torch.randn(m, k).to(torch.bfloat16)
            xd = x.cuda()
            assert sm90_gemv.serves(xd, wd, sd, bn, 128), (m, n, k)
            ref = gemm64(x, w, s, bn, 128)
            for mt in (("1", "2") if m > 32 else ("1",)):
                os.environ["KIMI_OPS_SM90_ROWS64_MT"] = mt
                for constant_w in (False, True):
                    y = kimi_ops.gemm_a16w8_block(xd, wd, sd, block_n=bn, block_k=128, constant_w=constant_w)
                    worst = max(worst, bound_ok(y, ref))
            del os.environ["KIMI_OPS_SM90_ROWS64_MT"]
            if m <= 32:
                assert sm90_gemv.serves(xd, wbd), (m, n, k)
                ref = x.double() @ wb.double().T
                for constant_w in (False, True):
                    worst = max(worst, bound_ok(kimi_ops.gemm_a16w16(xd, wbd, constant_w=constant_w), ref))
    del os.environ[sm90_gemv.ENV]
    for fp8, t in ((False, 3), (True, 3), (True, 9), (False, 16)):
        inputs, w, s, w64 = nq.gpu_case(t, fp8, gcols=1536 if t % 2 else 0, seed=t)
        assert nq.fused_serves(inputs, w, s), (fp8, t)
        q, _ = nq.call(inputs, w, s, constant_w=True)
        nq.check_q(q, inputs, w64)
    torch.cuda.synchronize()
    print(f"sanitize_cuda projections: worst max err / bound {worst:.2f} (<= 1 passes)")
    if worst > 1.0:
        sys.exit("sanitize_cuda projections: a GEMM outside its bound")


def under_sanitizers(tools, timeout, groups):
    """This script's cases under ``compute-sanitizer --tool T`` for each tool (its exit status 1
    where it reports an error); prints the last lines of each run. Returns 0 if every run passed."""
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        sys.exit("sanitize_cuda.py: compute-sanitizer not found on PATH")
    failed = []
    for tool in tools:
        cmd = [exe, "--tool", tool, "--error-exitcode", "1", sys.executable, os.path.abspath(__file__),
               "--cases", ",".join(groups)]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            rc, text = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired:
            rc, text = "timeout", ""
        for line in text.strip().splitlines()[-3:]:
            print(f"{tool}: {line}")
        print(f"{tool}: rc={rc}")
        if rc != 0:
            failed.append(tool)
    return 1 if failed else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tools", default="", help="run the cases under these compute-sanitizer tools "
                    "(comma-separated, or 'all': " + ", ".join(TOOLS) + "); without it the cases run "
                    "once in this process (for a compute-sanitizer you start yourself)")
    ap.add_argument("--timeout", type=int, default=90, help="seconds a sanitizer run may take (with --tools)")
    ap.add_argument("--cases", default=",".join(CASES), help="which groups of cases (comma-separated: "
                    + ", ".join(CASES) + "; default both)")
    args = ap.parse_args(argv)
    groups = tuple(c for c in args.cases.split(",") if c)
    unknown = [c for c in groups if c not in CASES]
    if unknown or not groups:
        ap.error(f"unknown case group(s) {unknown}: choose from {', '.join(CASES)}")
    if not args.tools:
        if "attention" in groups:
            attention_cases()
        if "projections" in groups:
            projection_cases()
        return 0
    tools = TOOLS if args.tools == "all" else tuple(t for t in args.tools.split(",") if t)
    bad = [t for t in tools if t not in TOOLS]
    if bad:
        ap.error(f"unknown tool(s) {bad}: choose from {', '.join(TOOLS)} or 'all'")
    return under_sanitizers(tools, args.timeout, groups)


if __name__ == "__main__":
    sys.exit(main())
