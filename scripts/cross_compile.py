#!/usr/bin/env python3
"""Cross-compile every Triton kernel variant the dispatcher can launch, with no GPU.

    python scripts/cross_compile.py --target gfx950 --out build/xc
    python scripts/cross_compile.py --target sm90 --out build/xc --only splitkv_fp8_fn_m16

Each module in ``kimi_ops.kernels.CROSS_COMPILE_MODULES`` that exists and exposes
``CROSS_COMPILE_SPECS`` (see kimi_ops/kernels/__init__.py) is compiled with
``triton.compile(ASTSource(...), target=GPUTarget(...))``.  Each variant's assembly goes to
``OUT/<target>/<name>.amdgcn`` (AMD) or ``.ptx`` (NVIDIA); the matrix instructions found in it
and its registers / spills (AMD: the code object's metadata; sm90 / sm80: ptxas -v, Triton's
bundled ptxas) are printed, one line a variant, and a summary is written to
``OUT/<target>/summary.json``.
"""
from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TARGETS = {
    "gfx950": ("hip", "gfx950", 64),
    "gfx942": ("hip", "gfx942", 64),
    "sm90": ("cuda", 90, 32),
    "sm80": ("cuda", 80, 32),   # Ampere: no e4m3fn in Triton; the fp8 operands go as uint8 codes
}

# matrix instructions: AMD MFMA / WMMA, NVIDIA wgmma / mma
_MMA_RE = {
    "hip": re.compile(r"\b(v_mfma_[a-z0-9_]+|v_smfmac_[a-z0-9_]+|v_wmma_[a-z0-9_]+)"),
    "cuda": re.compile(r"\b(wgmma\.mma_async[a-z0-9_.]*|mma\.sync[a-z0-9_.]*)"),
}


def load_specs(only=None):
    import kimi_ops.kernels as K

    specs = []
    for mod_name in K.CROSS_COMPILE_MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ModuleNotFoundError as e:
            if e.name and mod_name.startswith(e.name):
                continue  # a kernels module not written yet
            raise
        for spec in getattr(mod, "CROSS_COMPILE_SPECS", ()):
            spec = dict(spec)
            spec["module"] = mod_name
            if only and not any(re.fullmatch(o, spec["name"]) for o in only):
                continue
            specs.append(spec)
    return specs


def _attrs(kernel, signature, divisible=()):
    # pointers 16-byte aligned, as torch allocations are: lets the compiler vectorize loads; and
    # the integer arguments in ``divisible`` multiples of 16, as Triton's JIT specializes an int
    # whose value is a multiple of 16 at launch (without it a masked load may not vectorize, and
    # Hopper's loop pipeliner leaves such a loop unpipelined: the sm90 compile is then not the one
    # that runs)
    attrs = {}
    for i, name in enumerate(kernel.arg_names):
        if signature.get(name, "").startswith("*") or name in divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def compile_spec(spec, target_name):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = spec["kernel"]
    sig = dict(spec["signature"])
    missing = [a for a in kernel.arg_names if a not in sig]
    if missing:
        raise ValueError(f"{spec['name']}: signature lacks {missing}")
    src = ASTSource(fn=kernel, signature={a: sig[a] for a in kernel.arg_names},
                    constexprs=spec.get("constexprs", {}),
                    attrs=_attrs(kernel, sig, spec.get("divisible_16", ())))
    target = GPUTarget(*TARGETS[target_name])
    opts = {"num_warps": spec.get("num_warps", 4), "num_stages": spec.get("num_stages", 2)}
    if target_name.startswith("gfx"):
        opts.update(spec.get("amd_options", {}))
    return triton.compile(src, target=target, options=opts)


def mma_instructions(asm: str, backend: str):
    return collections.Counter(m.group(1) for m in _MMA_RE[backend].finditer(asm))


_AMD_META = {
    "vgprs": r"\.vgpr_count:\s+(\d+)",            # arch + accumulation VGPRs (unified file)
    "agprs": r"\.agpr_count:\s+(\d+)",
    "vgpr_spills": r"\.vgpr_spill_count:\s+(\d+)",
    "sgpr_spills": r"\.sgpr_spill_count:\s+(\d+)",
    "occupancy": r"; Occupancy:\s+(\d+)",          # waves a SIMD
    "group_segment": r"\.group_segment_fixed_size:\s+(\d+)",  # static LDS bytes
    "scratch": r"; ScratchSize:\s+(\d+)",
}


def amd_resources(asm: str) -> dict:
    """The AMD backend's register / occupancy / LDS report from a kernel's .amdgcn text:
    {vgprs, agprs, vgpr_spills, sgpr_spills, occupancy, group_segment, scratch, mfma} (ints;
    a field the text lacks is absent). Triton's LDS is dynamic (``metadata.shared``), so
    ``group_segment`` is 0 for Triton kernels; the launch's LDS is ``shared``."""
    out = {}
    for k, pat in _AMD_META.items():
        m = re.search(pat, asm)
        if m:
            out[k] = int(m.group(1))
    out["mfma"] = len(_MMA_RE["hip"].findall(asm))
    return out


def _ptxas():
    """Triton's bundled ptxas (or the CUDA toolkit's), None where neither exists."""
    import shutil

    import triton

    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return bundled if os.path.isfile(bundled) else shutil.which("ptxas")


def sm90_resources(ptx: str, tmp_dir: str, arch: str = "sm_90a") -> dict:
    """ptxas -v's report of one kernel's PTX for ``arch``: {regs, spill_stores, spill_loads,
    stack} (bytes; empty where no ptxas exists). The JIT specializes more arguments than these
    generic compiles (an int equal to 1, one divisible by 16), so a launch's SASS can differ."""
    import subprocess

    ptxas = _ptxas()
    if ptxas is None:
        return {}
    path = os.path.join(tmp_dir, "ptxas_input.ptx")
    with open(path, "w") as f:
        f.write(ptx)
    r = subprocess.run([ptxas, f"-arch={arch}", "-v", path, "-o", path + ".cubin"], capture_output=True, text=True)
    m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads.*?Used (\d+) registers",
                  r.stdout + r.stderr, re.S)
    if r.returncode != 0 or m is None:
        raise RuntimeError(f"ptxas failed on a kernel's PTX: {(r.stdout + r.stderr)[-2000:]}")
    stack, stores, loads, regs = (int(g) for g in m.groups())
    return {"regs": regs, "spill_stores": stores, "spill_loads": loads, "stack": stack}


# Triton 3.6 keeps state from the first AMD arch it lowers for in a process: gfx942 compiled after
# gfx950 gets gfx950 instructions (v_cvt_scalef32_pk_bf16_fp8 for an e4m3fn -> bf16 conversion)
# and its link fails. 3.7 and 3.8 do not. Under 3.6 a second AMD arch compiles in a fresh process.
_AMD_ARCHS_COMPILED = set()


def _own_process(target_name) -> bool:
    import triton

    if TARGETS[target_name][0] != "hip":
        return False
    version = tuple(int(x) for x in re.findall(r"\d+", triton.__version__)[:2])
    return version < (3, 7) and bool(_AMD_ARCHS_COMPILED - {target_name})


def _run_in_own_process(target_name, out_dir, only, quiet):
    import subprocess

    cmd = [sys.executable, os.path.abspath(__file__), "--target", target_name, "--out", out_dir]
    for o in only or ():
        cmd += ["--only", o]
    if quiet:
        cmd.append("--quiet")
    r = subprocess.run(cmd, capture_output=quiet, text=True, check=False)
    if r.returncode != 0:
        raise RuntimeError(f"cross_compile.py --target {target_name} failed: {(r.stdout or '')[-2000:]}"
                           f"{(r.stderr or '')[-4000:]}")
    with open(os.path.join(out_dir, target_name, "summary.json")) as f:
        return json.load(f)


def run(target_name, out_dir, only=None, quiet=False):
    if _own_process(target_name):
        return _run_in_own_process(target_name, out_dir, only, quiet)
    backend = TARGETS[target_name][0]
    if backend == "hip":
        _AMD_ARCHS_COMPILED.add(target_name)
    dest = os.path.join(out_dir, target_name)
    os.makedirs(dest, exist_ok=True)
    results = []
    for spec in load_specs(only):
        if target_name not in spec.get("targets", TARGETS):
            continue
        t0 = time.time()
        ck = compile_spec(spec, target_name)
        asm_key = "amdgcn" if backend == "hip" else "ptx"
        asm = ck.asm[asm_key]
        with open(os.path.join(dest, f"{spec['name']}.{asm_key}"), "w") as f:
            f.write(asm)
        mma = mma_instructions(asm, backend)
        meta = {"name": spec["name"], "module": spec["module"], "kernel": spec["kernel"].__name__,
                "mma": dict(mma), "seconds": round(time.time() - t0, 2)}
        for k in ("n_regs", "n_spills"):
            v = getattr(ck, k, None)
            if isinstance(v, int):
                meta[k] = v
        shared = getattr(ck.metadata, "shared", None)
        if shared is not None:
            meta["shared"] = shared
        if backend == "hip":
            meta.update(amd_resources(asm))
        else:
            cc = TARGETS[target_name][1]
            meta.update(sm90_resources(asm, dest, "sm_90a" if cc == 90 else f"sm_{cc}"))
        results.append(meta)
        if not quiet:
            mma_s = ", ".join(f"{k} x{v}" for k, v in sorted(mma.items())) or "(no MMA)"
            if backend == "hip":
                res = (f"vgpr {meta.get('vgprs')} spill {meta.get('vgpr_spills')} "
                       f"waves {meta.get('occupancy')} lds {meta.get('shared')} ")
            else:
                res = f"regs {meta.get('regs')} spill {meta.get('spill_stores')} smem {meta.get('shared')} "
            print(f"[{target_name}] {spec['name']:<34} {res}{mma_s}  ({meta['seconds']}s)", flush=True)
    with open(os.path.join(dest, "summary.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True, action="append", choices=sorted(TARGETS),
                    help="repeatable")
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", action="append", help="regex on variant names (repeatable)")
    ap.add_argument("--quiet", action="store_true", help="no line a variant (summary.json only)")
    args = ap.parse_args(argv)
    os.environ.pop("TRITON_INTERPRET", None)
    for t in args.target:
        run(t, args.out, args.only, quiet=args.quiet)


if __name__ == "__main__":
    main()
