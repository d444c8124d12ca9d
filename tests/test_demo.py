"""The README's main command runs the whole Kimi-K3 layer, checks itself and prints its
numbers; ``--attention-only`` keeps the attention table."""

import os
import subprocess
import sys


def run_demo(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kimi_ops", "demo", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=600)


def test_demo_layer_job_passes():
    result = run_demo("--steps", "6", "--batch", "3", "--context", "200", "--qlen", "2", "--device", "cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "Kimi-K3 TP8 MLA decode layer (12 heads of 96, hidden 7168" in out, out
    for needle in ("step latency:", "tokens/s:", "effective", "% of floor", "check step    0", "check step    5"):
        assert needle in out, (needle, out)
    assert "PASS" in out and "FAIL" not in out


def test_demo_layer_bf16_weights_and_bad_flags():
    result = run_demo("--steps", "2", "--batch", "1", "--context", "50", "--weights", "bf16", "--device", "cpu",
                      "--no-progress")
    assert result.returncode == 0 and "bf16 W_UK/W_UV" in result.stdout, result.stdout + result.stderr
    assert run_demo("--steps", "0", "--device", "cpu").returncode == 2


def test_demo_attention_only_default_workload_passes():
    result = run_demo("--attention-only")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "12 heads" in result.stdout and "PASS" in result.stdout and "FAIL" not in result.stdout


def test_demo_attention_only_runs_triton_under_the_interpreter():
    result = run_demo("--attention-only", "--batch", "2", "--context", "40", "--qlen", "2", "--repeats", "1",
                      "--device", "cpu", env={"TRITON_INTERPRET": "1", "KIMI_OPS_BACKEND": "auto"})
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line.split()[0] for line in result.stdout.splitlines() if line.endswith("PASS")]
    assert rows == ["triton", "reference"], result.stdout


def test_demo_dcp_two_ranks_on_gloo():
    result = run_demo("--dcp", "2", "--batch", "2", "--context", "40", "--steps", "2", "--device", "cpu")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gloo" in result.stdout and result.stdout.count("PASS") == 2, result.stdout
