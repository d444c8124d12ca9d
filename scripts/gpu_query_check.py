#!/usr/bin/env python3
"""One-call GPU check for the MXFP4 / M1a work (the device machine's `run`):

    python scripts/gpu_query_check.py        # logs and tables under $OUT (or ./gpu_query_out)

1. pytest tests/test_mxfp4.py tests/test_query.py (the GPU grid, opcheck, CUDA graphs, and the
   CPU tests) -> pytest_query.log
2. scripts/bench_query.py --variants (BENCH_QUERY_MODE=--sweep for the block-config sweep)
   -> bench_query.md / bench_query.json / bench_query.log
"""
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.environ.get("OUT") or os.path.join(ROOT, "gpu_query_out")
os.makedirs(OUT, exist_ok=True)
env = dict(os.environ, PYTHONUNBUFFERED="1")
env.pop("TRITON_INTERPRET", None)


def run(cmd, log, timeout):
    t0 = time.time()
    with open(os.path.join(OUT, log), "w") as f:
        try:
            r = subprocess.run(cmd, check=False, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
            rc = r.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    print(f"== {' '.join(cmd[1:4])}: rc={rc} in {time.time() - t0:.0f}s", flush=True)
    with open(os.path.join(OUT, log)) as f:
        lines = f.read().splitlines()
    return rc, lines


subprocess.run(["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw",
                "--format=csv"], check=False)
rc, lines = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "8",
                 "tests/test_mxfp4.py", "tests/test_query.py"], "pytest_query.log", 150)
print("\n".join(lines[-15:]))
# --variants: at T <= 8 both bmm kernels forced (tl.dot, GEMV + alternatives) beside the default; --sweep for block configs
rc2, lines = run([sys.executable, "scripts/bench_query.py", os.environ.get("BENCH_QUERY_MODE", "--variants"),
                  "--out", os.path.join(OUT, "bench_query.md"),
                  "--json", os.path.join(OUT, "bench_query.json")], "bench_query.log", 420)
print("\n".join(l for l in lines if l.startswith(("|", "Device")) or "Error" in l
                or "error" in l.lower()[:80])[-8000:])
sys.exit(0 if rc == 0 and rc2 == 0 else 1)
