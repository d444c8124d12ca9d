"""scripts/bench_layer.py's dry run (a small config, eagerly, on the CPU): every weights format,
the --then pass and the fp8 GEMM table come out, so the device run does not find a broken script."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_layer_dry_run(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "bench_layer.py"), "--dry-run", "--weights", "bf16,mxfp4,fp8",
           "--batches", "1,2", "--context", "24", "--iters", "1", "--variants", "ours_graph,plain_eager", "--gemms",
           "--then", "plain_compiled", "--then-points", "fp8:2", "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": ROOT, "KIMI_OPS_BACKEND": "reference", "KIMI_OPS_NO_EXTENSION": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.load(open(tmp_path / "bench_layer.json"))
    points = {(row["weights"], row["batch"]): row for row in data["layer"]}
    assert set(points) == {(w, b) for w in ("bf16", "mxfp4", "fp8") for b in (1, 2)}
    assert all(row["ours_graph_us"] > 0 and row["plain_eager_us"] > 0 for row in points.values())
    assert "plain_compiled_us" in points[("fp8", 2)] and "plain_compiled_us" not in points[("fp8", 1)]
    assert points[("fp8", 1)]["weight_bytes"] < 0.8 * points[("bf16", 1)]["weight_bytes"]
    assert [g["m"] for g in data["gemms"] if "m" in g] == [1, 2]
    assert "| fp8 | 2 |" in open(tmp_path / "bench_layer.md").read()
