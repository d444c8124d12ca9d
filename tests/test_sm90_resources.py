"""The Hopper kernels' registers and spills, read from ptxas without a GPU (as
tests/test_cross_compile.py reads the AMD code objects): csrc/sm90/mla_decode_sm90.cu and
gemv_sm90.cu are compiled to cubins with setup.py's nvcc flags plus ``-Xptxas -v``, and every
kernel instance must spill nothing (a spill in the K loop costs local-memory traffic on every tile)
and fit its launch bound's registers. Known exceptions: the 16-row kernel's 3-stage ring (not a
default, only ``KIMI_OPS_SM90_STAGES=3``) spills 24 bytes; the 33-64-row fp8 GEMM's 8-token-tile
form at 16 weight rows a warp, 8 (KNOWN_SPILLS). Needs nvcc and a CUDA build of torch;
~80 s on 2 cores.
"""
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest
import torch
from conftest import ROOT, setup_module_of_repo

SOURCE = os.path.join(ROOT, "csrc", "sm90", "mla_decode_sm90.cu")
GEMV_SOURCE = os.path.join(ROOT, "csrc", "sm90", "gemv_sm90.cu")

# instance (demangled, namespaces dropped) -> the spill bytes (stores, loads) it is allowed
KNOWN_SPILLS = {
    "splitkv_kernel<3, false>(SplitKVParams)": (24, 120),
    "splitkv_kernel<3, true>(SplitKVParams)": (24, 120),
    "gemm_fp8_rows64_kernel<1, 3, 8>(Rows64Params)": (8, 8),
}
# registers a thread may use: the launch bounds (2 CTAs of 256 threads a SM for the 16-row kernel,
# whose consumers then take 232 with setmaxnreg; 1 CTA of 256 for the token-major one)
MAX_REGS = {"splitkv_kernel": 128, "splitkv_tm_kernel": 255, "merge_rows_kernel": 255, "merge_kernel": 255}

_ENTRY = re.compile(r"Compiling entry function '(\S+)' for 'sm_90a'\n.*?Function properties for \S+\n\s+(\d+) bytes "
                    r"stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads\n.*?Used (\d+) registers",
                    re.S)


def _ptxas_report(tmp_path, source=SOURCE):
    setup = setup_module_of_repo()
    toolkit = setup.cuda_toolkit_root()
    if not torch.version.cuda or toolkit is None:
        pytest.skip("needs a CUDA build of torch and the CUDA toolkit (nvcc)")
    if shutil.which("c++filt") is None:
        pytest.skip("needs c++filt (binutils) to name the kernels")
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

    includes = include_paths() + [os.path.join(toolkit, "include"), sysconfig.get_paths()["include"]]
    cmd = [os.path.join(toolkit, "bin", "nvcc"), "-cubin", "-o", str(tmp_path / "sm90.cubin"), source,
           *setup.NVCC_FLAGS, "-Xptxas", "-v", "-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C",
           *COMMON_NVCC_FLAGS, *[f"-I{p}" for p in includes]]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    entries = _ENTRY.findall(r.stdout + r.stderr)
    names = subprocess.run(["c++filt"], input="\n".join(e[0] for e in entries), capture_output=True,
                           text=True, check=True).stdout.splitlines()
    report = {}
    for name, (_, stack, stores, loads, regs) in zip(names, entries):
        name = name.replace("(anonymous namespace)::", "").replace("kimi_ops::sm90::", "").removeprefix("void ")
        report[name] = dict(stack=int(stack), spill_stores=int(stores), spill_loads=int(loads), regs=int(regs))
    return report


def _print(report):
    for name, r in sorted(report.items()):
        print(f"{name}: {r['regs']} registers, spills {r['spill_stores']} / {r['spill_loads']} bytes", file=sys.stderr)


def test_sm90_kernels_do_not_spill(tmp_path):
    report = _ptxas_report(tmp_path)
    _print(report)
    kinds = {name.split("<")[0].split("(")[0] for name in report}
    assert kinds == set(MAX_REGS), f"kernels compiled: {sorted(kinds)}"
    # every instance the launchers can pick: 3 ring depths x 2 queries (16 rows), 5 token-major
    # shapes (24, 32, 48, 64 x 2 and 3 stages) x 2 queries, the 24- and 32-row ones' bulk loads
    # and the 48-row one's halves x 2 queries, 2 merge_rows rounds, merge_kernel
    assert len(report) == 25, sorted(report)
    assert sum("TmLoad)1" in n for n in report) == 4, sorted(report)  # kBulk
    assert sum("TmLoad)2" in n for n in report) == 2, sorted(report)  # kCpAsyncHalves
    spilled = {n: (r["spill_stores"], r["spill_loads"]) for n, r in report.items()
               if (r["spill_stores"], r["spill_loads"]) != KNOWN_SPILLS.get(n, (0, 0))}
    assert not spilled, f"spills (bytes stored, loaded) other than the known ones: {spilled}"
    over = {n: r["regs"] for n, r in report.items() if r["regs"] > MAX_REGS[n.split("<")[0].split("(")[0]]}
    assert not over, f"registers above the launch bound: {over}"


def test_gemv_kernel_does_not_spill(tmp_path):
    """gemv_sm90.cu's kernels. csrc/sm90/gemv.cuh's sixteen instances: the twelve plain ones (bf16 /
    fp8 weight, 4 / 8 warps, one / two / four 8-token tiles for 1-8 / 9-16 / 17-32 rows) and the
    four fused with the layer's norms (kNorm: 4 warps, either weight, one / two tiles): no spill;
    the plain ones at most 128 registers, so two CTAs of 8 warps share a SM (Kimi-K3's fused qkv_a
    launches 228 CTAs on 132 SMs: at one CTA a SM that would be two waves), the fused ones within
    their launch bound of two 128-thread CTAs a SM (255). csrc/sm90/gemm_fp8_rows64.cuh's four (6 / 8
    token tiles for 33-48 / 49-64 rows; 16 weight rows a warp, two CTAs a SM, or 32, one): at most
    128 / 255 registers, no spill but the known one of 16 rows a warp at 8 tiles (8 bytes stored,
    8 loaded with nvcc 13.0 since session 58's copy addresses; 24 / 24 in session 57, 40 / 36
    before, 76 / 60 in the build measured in session 56)."""
    report = _ptxas_report(tmp_path, GEMV_SOURCE)
    _print(report)
    gemv = {n for n in report if n.startswith("gemv_kernel<")}
    rows64 = {n for n in report if n.startswith("gemm_fp8_rows64_kernel<")}
    assert len(gemv) == 16 and len(rows64) == 4 and len(report) == 20, sorted(report)
    fused = {n for n in report if n.endswith(", true>(GemvParams)")}
    assert len(fused) == 4 and all(n.startswith("gemv_kernel<4,") for n in fused), sorted(fused)
    spilled = {n: (r["spill_stores"], r["spill_loads"]) for n, r in report.items()
               if (r["spill_stores"], r["spill_loads"]) != KNOWN_SPILLS.get(n, (0, 0))}
    assert not spilled, f"spills (bytes stored, loaded) other than the known one: {spilled}"
    bound = {n: 255 if n in fused or n.startswith("gemm_fp8_rows64_kernel<2,") else 128 for n in report}
    over = {n: r["regs"] for n, r in report.items() if r["regs"] > bound[n]}
    assert not over, f"registers above the launch bound: {over}"
