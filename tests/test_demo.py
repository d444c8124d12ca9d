"""The README's main command runs, checks itself and prints its table."""

import os
import subprocess
import sys


def run_demo(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kimi_ops", "demo", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


def test_demo_default_workload_passes():
    result = run_demo()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "12 heads" in result.stdout and "PASS" in result.stdout and "FAIL" not in result.stdout


def test_demo_runs_triton_under_the_interpreter():
    result = run_demo("--batch", "2", "--context", "40", "--qlen", "2", "--repeats", "1",
                      env={"TRITON_INTERPRET": "1", "KIMI_OPS_BACKEND": "auto"})
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split()[0] for line in result.stdout.splitlines() if line.endswith("PASS")]
    assert rows == ["triton", "reference"], result.stdout
