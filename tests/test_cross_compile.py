"""scripts/cross_compile.py: the Triton kernels compile for gfx950, gfx942, sm90 and sm80 with no GPU,
and use the fp8 matrix instructions of each target (a representative set, to stay fast)."""
from __future__ import annotations

import os
import sys

import pytest
import triton

needs_fnuz_triton = pytest.mark.skipif(
    tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7),
    reason="Triton 3.6 cannot lower e4m3fnuz: no interpreter type for it, and gfx942's "
           "float32 -> fp8e4m3fnuz conversion asserts; the fnuz path needs Triton >= 3.7")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, ROOT)

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                                reason="compiles real kernels")


def _run(target, only, tmp_path):
    import cross_compile

    res = cross_compile.run(target, str(tmp_path), only=only, quiet=True)
    assert res, f"no variant matched {only} for {target}"
    for r in res:
        ext = "amdgcn" if target.startswith("gfx") else "ptx"
        assert (tmp_path / target / f"{r['name']}.{ext}").stat().st_size > 0
    return {r["name"]: r for r in res}


def test_gfx950_f8f6f4(tmp_path):
    res = _run("gfx950", ["splitkv_fp8_fn_m64", "merge_s64_c64", "cache_write_bf16_i64_fn"], tmp_path)
    mma = res["splitkv_fp8_fn_m64"]["mma"]
    assert any(k.startswith("v_mfma_") and "f8f6f4" in k for k in mma), mma


@needs_fnuz_triton
def test_gfx942_fp8_mfma(tmp_path):
    res = _run("gfx942", ["splitkv_fp8_fnuz_m64", "cache_write_bf16_i64_fnuz"], tmp_path)
    mma = res["splitkv_fp8_fnuz_m64"]["mma"]
    assert any(k.startswith("v_mfma_") and ("fp8" in k or "f8" in k) for k in mma), mma


def test_sm90_wgmma_e4m3(tmp_path):
    res = _run("sm90", ["splitkv_fp8_fn_m64", "splitkv_bf16_fn_m16"], tmp_path)
    mma = res["splitkv_fp8_fn_m64"]["mma"]
    assert any(k.startswith("wgmma") and "e4m3.e4m3" in k for k in mma), mma
    assert res["splitkv_bf16_fn_m16"]["mma"], "the bf16 variant has no MMA"


def test_sm80_compiles_without_e4m3fn(tmp_path):
    """NVIDIA before sm_89 (Ampere): Triton has no e4m3fn type there ("type fp8e4nv not supported
    in this architecture"), so the attention kernels take the cache and an fp8 q, and the fp8
    projections their weight, as uint8 codes decoded by integer arithmetic. Every sm80 variant of
    those modules compiles (ptxas for sm_80) with bf16 mma.sync and no fp8 MMA."""
    res = _run("sm80", [r"splitkv_.*", r"gemm_a16w8_block_.*", r"gemv_a16w8_block_.*",
                        r"cache_write_bf16_i32_fn"], tmp_path)
    split = [n for n in res if n.startswith("splitkv_")]
    assert {"splitkv_bf16_u8fn_m16", "splitkv_bf16_u8fn_m16_q8", "splitkv_bf16_u8fn_m64"} <= set(split), split
    for name, r in res.items():
        assert all("e4m3" not in k for k in r["mma"]), (name, r["mma"])
        if name.startswith(("splitkv_", "gemm_a16w8_block_m")):
            assert r["mma"] and all(".bf16.bf16." in k for k in r["mma"]), (name, r["mma"])


# ----------------------------------------------------------------------------------------------
# issue 29 item 2: static quality of every AMD variant the launcher can pick

def _launcher_specs(target):
    """Names of the specs the launchers can launch on ``target``: every Triton kernel of the decode
    layer on AMD, i.e. every module's specs for the target (the token-major M1c of every CONFIGS
    entry, both q types, each cache format; every merge shape; the cache write; M1a; the MXFP4
    and fp8 projections with the configs each picks on AMD), but the first-generation split
    kernels, which AMD does not run (KIMI_OPS_TRITON_KERNEL=first: they spill there)."""
    import importlib

    import kimi_ops.kernels as K
    import kimi_ops.kernels.attention as A

    names = []
    for mod_name in K.CROSS_COMPILE_MODULES:
        for s in importlib.import_module(mod_name).CROSS_COMPILE_SPECS:
            if target in s.get("targets", (target,)) and s["kernel"] is not A._split_kv_kernel:
                names.append(s["name"])
    return names


def test_launcher_configs_are_the_specs():
    # one table: each config the launcher picks on an architecture (any row count) is a spec
    import kimi_ops.kernels.triton_m1c as M

    for arch in M.CROSS_TARGETS:
        cx = {(s["constexprs"]["BLOCK_M"], s["constexprs"]["BLOCK_N"], s["constexprs"]["VSPLIT"],
               s["num_warps"], s["num_stages"])
              for s in M.CROSS_COMPILE_SPECS if arch in s["targets"]}
        for rows in (1, 3, 12, 16, 17, 24, 32, 33, 48, 64, 96, 128, 768, 1024):
            c = M.pick_config(arch, rows)
            assert (c.block_m, c.block_n, c.vsplit, c.num_warps, c.num_stages) in cx, (arch, rows, c)


def test_specs_specialize_as_the_launch_does():
    # an integer argument a spec calls divisible_16 is compiled as Triton's JIT specializes a
    # multiple of 16 at launch (tt.divisibility 16), and each such argument is one at the shapes
    import cross_compile as cc
    import kimi_ops.kernels.fp8_gemm as G

    spec = next(s for s in G.CROSS_COMPILE_SPECS if s["name"].startswith("gemm_a16w8_block_m"))
    attrs = cc._attrs(spec["kernel"], spec["signature"], spec["divisible_16"])
    names = spec["kernel"].arg_names
    assert {names[i] for (i,) in attrs} == {n for n in names if spec["signature"][n].startswith("*")} | set(
        G.DIVISIBLE_16)
    for n, k in G.KIMI_K3_SHAPES:   # N, K; block_n = block_k = 128; contiguous rows: strides K
        assert n % 16 == 0 and k % 16 == 0


@pytest.mark.parametrize("target", ["gfx950", pytest.param("gfx942", marks=needs_fnuz_triton)])
def test_amd_no_spills(target, tmp_path):
    """Every Triton variant the launchers can pick on ``target`` (_launcher_specs): 0 VGPR spills
    and at least 2 waves a SIMD, read from the code object's metadata, and the attention and
    merge kernels no SGPR spill either (the GEMMs' address arithmetic spills scalars into VGPR
    lanes: no memory, no wave lost); the attention variants use the bf16 MFMA (P V^T), and an fp8
    q of the cache's type (gfx950: e4m3fn, gfx942: e4m3fnuz) the target's fp8 MFMA for S, a bf16
    q never."""
    import re

    res = _run(target, [re.escape(n) for n in _launcher_specs(target)], tmp_path)
    attention = ("tm_", "merge_")
    bad = {n: {k: r.get(k) for k in ("vgprs", "vgpr_spills", "sgpr_spills", "occupancy")}
           for n, r in res.items()
           if r.get("vgpr_spills", 1) != 0 or r.get("occupancy", 0) < 2
           or (n.startswith(attention) and r.get("sgpr_spills", 0) != 0)}
    assert not bad, f"{target}: variants that spill or run under 2 waves a SIMD: {bad}"
    fp8_mfma = {"gfx950": "f8f6f4", "gfx942": "fp8_fp8"}[target]
    fp8_q = {"gfx950": "_qfp8_fn_", "gfx942": "_qfp8_fnuz_"}[target]
    for n, r in res.items():
        if n.startswith("tm_"):
            assert any("bf16" in k for k in r["mma"]), (n, r["mma"])
            assert any(fp8_mfma in k for k in r["mma"]) == (fp8_q in n), (n, r["mma"])
    assert len(res) == len(_launcher_specs(target))


def test_sm90_second_generation_no_spills(tmp_path):
    """The second-generation kernel's sm_90 config (what KIMI_OPS_TRITON_KERNEL=m1c runs on the
    H200): ptxas -v reports no spill on the e4m3fn cache, bf16 and fp8 query. (The e4m3fnuz
    cache on NVIDIA, decoded from its bytes, spills at every config tried: not asserted.)"""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import cross_compile

    if cross_compile._ptxas() is None:
        pytest.skip("no ptxas (Triton's bundled one or the CUDA toolkit's)")
    res = _run("sm90", [r"tm_sm90_q(bf16|fp8)_fn_.*"], tmp_path)
    assert len(res) == 2, sorted(res)
    for name, r in res.items():
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, (name, r)
        assert r["regs"] <= 255


def test_sm90_weights_before_the_pdl_wait(tmp_path):
    """The decode layer's W_UK, W_UV and norm kernels as they launch on sm_90 (PDL, ``constant_w``:
    W_FIRST, the ``*_pdl_wfirst`` specs): loads of their weights come before ``griddepcontrol.wait``
    in the PTX (with W_FIRST off the wait is the first statement: none would), the activation's
    after it."""
    import re

    res = _run("sm90", [r".*_pdl_wfirst"], tmp_path)
    assert len(res) == 9, sorted(res)
    for name in res:
        ptx = (tmp_path / "sm90" / f"{name}.ptx").read_text()
        waits = [m.start() for m in re.finditer(r"griddepcontrol\.wait", ptx)]
        assert len(waits) == 1, (name, len(waits))
        loads = [m.start() for m in re.finditer(r"\bld\.global", ptx)]
        before = sum(p < waits[0] for p in loads)
        assert before >= 1 and len(loads) > before, (name, before, len(loads))


def test_gfx942_after_gfx950_in_one_process(tmp_path):
    """gfx942 compiled after gfx950 in one process is gfx942 code. Triton 3.6 carried gfx950's
    lowering into it (an e4m3fn -> bf16 conversion became v_cvt_scalef32_pk_bf16_fp8 and the link
    failed), so under 3.6 cross_compile.run compiles a second AMD arch in its own process."""
    only = ["splitkv_bf16_fn_m16_q8"]
    first = _run("gfx950", only, tmp_path / "a")["splitkv_bf16_fn_m16_q8"]["mma"]
    second = _run("gfx942", only, tmp_path / "b")["splitkv_bf16_fn_m16_q8"]["mma"]
    assert any("16x16x32_bf16" in k for k in first), first   # gfx950's MFMA
    assert second and all("16x16x16_bf16" in k for k in second), second


def test_own_process_rule(monkeypatch):
    """Which cross-compiles run in a fresh process: a second AMD arch under Triton < 3.7 only."""
    import cross_compile

    monkeypatch.setattr(cross_compile, "_AMD_ARCHS_COMPILED", {"gfx950"})
    for version, expected in (("3.6.0", {"gfx942": True, "gfx950": False, "sm90": False}),
                              ("3.8.0", {"gfx942": False, "gfx950": False, "sm90": False})):
        monkeypatch.setattr(triton, "__version__", version)
        assert {t: cross_compile._own_process(t) for t in expected} == expected, version
