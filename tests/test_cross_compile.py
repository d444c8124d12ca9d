"""scripts/cross_compile.py: the Triton kernels compile for gfx950, gfx942 and sm90 with no GPU,
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
