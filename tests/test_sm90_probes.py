"""The sm_90a probes in scripts/sm90_probes/ still build against csrc/sm90's headers (tile_phases.cu
calls splitkv_tm_kernel's own device functions, so a change to their signatures breaks it here
rather than on the next GPU session). Compile only, no GPU: needs nvcc; ~40 s on 2 cores."""
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, setup_module_of_repo

PROBES = os.path.join(ROOT, "scripts", "sm90_probes")


def _nvcc():
    toolkit = setup_module_of_repo().cuda_toolkit_root()
    nvcc = os.path.join(toolkit, "bin", "nvcc") if toolkit else shutil.which("nvcc")
    if not nvcc or not os.path.exists(nvcc):
        pytest.skip("needs the CUDA toolkit (nvcc)")
    return nvcc


def test_wgmma_rates_builds(tmp_path):
    r = subprocess.run([sys.executable, os.path.join(PROBES, "wgmma_rates.py"), "--no-run", "--nvcc", _nvcc(),
                        "--build", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    src = open(tmp_path / "wgmma_rates.cu").read()
    # every N's three wrappers, one wgmma each
    assert src.count("wgmma.mma_async") == 3 * 9 and os.path.exists(tmp_path / "wgmma_rates")


def test_tile_phases_builds(tmp_path):
    exe = tmp_path / "tile_phases"
    r = subprocess.run([_nvcc(), "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
                        "-I", os.path.join(ROOT, "csrc", "sm90"), "-o", str(exe),
                        os.path.join(PROBES, "tile_phases.cu")], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    # the probe's loops time the kernel's pieces: a spill would time something else
    counts = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", r.stdout + r.stderr)
    assert counts, "no ptxas report"
    assert all(c == ("0", "0", "0") for c in counts), counts
