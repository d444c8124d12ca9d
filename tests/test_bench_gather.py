"""The gather rooflines' scripts on the CPU: scripts/bench_gather.py's checksum kernel under
TRITON_INTERPRET=1 (it must read exactly the indexed rows, so a config that skipped or repeated
rows could not report a bandwidth), and scripts/bench_bulk_gather.cu compiled by nvcc for sm_90a
(it runs only on a Hopper GPU; this keeps it building against csrc/sm90/copy.cuh)."""
import os
import shutil
import subprocess
import sys

import pytest

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts")

BODY = """
import torch
import bench_gather as b
g = torch.Generator().manual_seed(0)
words = torch.randint(-128, 128, (700, 576), dtype=torch.int8, generator=g).view(torch.int32)
for pattern in ("random", "pages64", "sequential"):
    idx = b.index_sets(pattern, 300, 700, 1, g)[0]
    assert idx.unique().numel() == 300 and int(idx.min()) >= 0 and int(idx.max()) < 700, pattern
    want = b.expected_checksum(words, idx)
    for rows, iters in ((32, 4), (16, 8)):  # 300 rows: the last program's block is partly masked
        got = b.xor_all(b.gather_checksum(words, idx, rows, iters, 2, 4))
        assert got == want, (pattern, rows, iters, got, want)
    assert b.expected_checksum(words, idx[:-1]) != want  # one row fewer changes the checksum
    # the checksum is the xor of the indexed rows' words
    assert want == b.xor_all(words[idx.long()])
print("OK")
"""


def test_gather_checksum_interpreted():
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=SCRIPTS)
    r = subprocess.run([sys.executable, "-c", BODY], env=env, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def _nvcc():
    home = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    path = os.path.join(home, "bin", "nvcc")
    return path if os.path.exists(path) else shutil.which("nvcc")


@pytest.mark.skipif(_nvcc() is None, reason="nvcc not found")
def test_bulk_gather_compiles(tmp_path):
    src = os.path.join(SCRIPTS, "bench_bulk_gather.cu")
    cmd = [_nvcc(), "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", src, "-o", str(tmp_path / "bbg")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert (tmp_path / "bbg").exists()
