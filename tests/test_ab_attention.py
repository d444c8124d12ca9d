"""scripts/ab_attention.py on the CPU: the shape labels, and a dry run (the triton backend in the
interpreter, the graph timing stubbed; bf16 and fp8 query) that must call a switch that changes
nothing bit-equal and leave the environment as it found it."""
import os
import subprocess
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts")
sys.path.insert(0, SCRIPTS)

import ab_attention as ab  # noqa: E402


def test_shape_labels():
    assert ab.parse_shape("H96 B8 8k q1") == (96, 8, 8192, 1)
    assert ab.parse_shape(" H4 B2 96 q2 ") == (4, 2, 96, 2)
    for bad in ("H96 B8 8k", "96 B8 8k q1", "H12 B32 8K q2"):
        with pytest.raises(ValueError, match="shape"):
            ab.parse_shape(bad)
    assert [ab.parse_shape(s)[0] for s in ab.DEFAULT_SHAPES.split(";")] == [12, 12, 12, 12, 96, 96]


DRY_RUN = r"""
import os, sys
sys.path.insert(0, os.environ["SCRIPTS"])
import ab_attention as ab
ab.DEVICE = "cpu"
ab.time_graph = lambda fns, reps: ([f() for f in fns], (1e-5, [1e-5]))[1]
os.environ["KIMI_OPS_AB_DRY"] = "before"
ab.main(["--env", "KIMI_OPS_AB_DRY", "--values", "a,-,b", "--shapes", "H4 B2 96 q2", "--backend", "triton",
         "--rounds", "2", "--reps", "1", "--set-bytes", "300000", *sys.argv[1:]])
print("restored:", os.environ.get("KIMI_OPS_AB_DRY"))
"""


@pytest.mark.parametrize("extra", [[], ["--fp8-query"]], ids=["bf16q", "fp8q"])
def test_dry_run_on_cpu(extra):
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", SCRIPTS=SCRIPTS)
    r = subprocess.run([sys.executable, "-c", DRY_RUN, *extra], env=env, capture_output=True, text=True, timeout=600,
                       check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("H4 B2 96 q2")]
    assert len(line) == 1 and "bit-equal" in line[0] and "not bit-equal" not in line[0], r.stdout
    assert "a: 10.00 us" in line[0] and "-: 10.00 us" in line[0] and "b: 10.00 us [10.00-10.00] +0.0%" in line[0]
    assert "restored: before" in r.stdout
    assert ("; fp8 query" in r.stdout) == bool(extra), r.stdout


def test_save_is_seeded(tmp_path):
    """--save: two runs (two processes, as two builds would be) save the same o and lse of set 0
    for each shape, bit for bit: the inputs are seeded, so a difference is the kernels'."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", SCRIPTS=SCRIPTS)
    files = [tmp_path / f"run{i}.pt" for i in (1, 2)]
    for f in files:
        r = subprocess.run([sys.executable, "-c", DRY_RUN, "--save", str(f)], env=env, capture_output=True, text=True,
                           timeout=600, check=False)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-4000:]
    import torch
    a, b = (torch.load(f) for f in files)
    assert list(a) == ["H4 B2 96 q2"] and a.keys() == b.keys()
    o, lse = a["H4 B2 96 q2"]
    assert o.shape == (2 * 2, 4, 512) and lse.shape == (2 * 2, 4) and torch.isfinite(o).all()
    assert torch.equal(o, b["H4 B2 96 q2"][0]) and torch.equal(lse, b["H4 B2 96 q2"][1])
