"""``mla_v_up_proj`` (the layer's W_UV up-projection and output gate): reference and Triton
kernels against float64 math written here.

``out[t, h*v + j] = (W_UV[h] @ o[t, h])[j] * gate[t, h*v + j]`` as bf16 ``[T, H * v]``; W_UV
bf16 ``[H, v, 512]`` or MXFP4 ``[H, v, 256]`` + scales (dequantized by test_mxfp4's spec-table
oracle). CPU (CI): the reference, errors, and the Triton kernels under TRITON_INTERPRET=1 in a
subprocess (the GEMV at T <= 8 with MXFP4 and bf16 weights, the tl.dot kernel above, torch.bmm
for bf16 above). GPU: T 1..64 x both weight forms x gate or none on poisoned memory, opcheck
and a CUDA-graph replay.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TESTS))
sys.path.insert(0, TESTS)

from test_mxfp4 import oracle_dequantize, random_weights, rel_err, requires_cuda, run_interpreted

import kimi_ops
from kimi_ops.reference import mxfp4 as ref


def make_inputs(t, h, *, v=128, latent=512, mxfp4=False, gate=True, strided=False, seed=0, device="cpu"):
    """o [T, H, L] (``strided``: a [H, T, L] tensor transposed, as DCP's combine may give), W_UV
    and the gate (values in (0, 1), as a sigmoid's; ``strided``: a column slice of a wider tensor)."""
    g = torch.Generator().manual_seed(seed)
    if strided:
        o = torch.randn(h, t, latent, generator=g).to(torch.bfloat16).to(device).transpose(0, 1)
    else:
        o = torch.randn(t, h, latent, generator=g).to(torch.bfloat16).to(device)
    if mxfp4:
        w_uv, w_uv_scale = ref.mxfp4_quantize(random_weights((h, v, latent), gen=g) * 0.05)
        w_uv, w_uv_scale = w_uv.to(device), w_uv_scale.to(device)
    else:
        w_uv, w_uv_scale = (torch.randn(h, v, latent, generator=g) * 0.05).to(torch.bfloat16).to(device), None
    gt = None
    if gate:
        wide = torch.rand(t, h * v + (16 if strided else 0), generator=g).to(torch.bfloat16).to(device)
        gt = wide[:, 8:8 + h * v] if strided else wide
    return o, w_uv, w_uv_scale, gt


def oracle(o, w_uv, w_uv_scale, gate):
    """float64 [T, H * v]."""
    w = w_uv.cpu().double() if w_uv_scale is None else oracle_dequantize(w_uv, w_uv_scale)
    out = torch.einsum("thl,hvl->thv", o.cpu().double(), w).reshape(o.shape[0], -1)
    return out if gate is None else out * gate.cpu().double()


def check_up_proj(t, h, *, mxfp4=False, gate=True, strided=False, v=128, latent=512, impl="triton",
                  device="cpu", constant_w=False, seed=0):
    o, w_uv, w_uv_scale, gt = make_inputs(t, h, v=v, latent=latent, mxfp4=mxfp4, gate=gate,
                                          strided=strided, seed=seed, device=device)
    if impl == "triton":
        from kimi_ops.kernels import up_proj

        out = up_proj.v_up_proj(o, w_uv, w_uv_scale, gt, constant_w=constant_w)
    else:
        out = ref.mla_v_up_proj(o, w_uv, w_uv_scale, gt)
    assert out.shape == (t, h * v) and out.dtype == torch.bfloat16 and out.is_contiguous()
    err = rel_err(out, oracle(o, w_uv, w_uv_scale, gt))
    assert err < 4e-3, (t, h, mxfp4, gate, strided, impl, constant_w, err)
    return err


# ----------------------------------------------------------------------------------------------
# CPU

@pytest.mark.parametrize("mxfp4", [False, True])
@pytest.mark.parametrize("gate", [False, True])
def test_reference_up_proj(mxfp4, gate):
    check_up_proj(5, 12, mxfp4=mxfp4, gate=gate, impl="reference")
    check_up_proj(3, 2, mxfp4=mxfp4, gate=gate, strided=True, v=96, latent=64, impl="reference", seed=1)


def test_ops_layer_reference_up_proj():
    o, w, s, gt = make_inputs(4, 12, mxfp4=True)
    e8m0 = getattr(torch, "float8_e8m0fnu", torch.uint8)
    assert torch.equal(kimi_ops.mla_v_up_proj(o, w, s.view(e8m0), gt), ref.mla_v_up_proj(o, w, s, gt))


def test_up_proj_errors():
    o = torch.zeros(2, 3, 512, dtype=torch.bfloat16)
    w = torch.zeros(3, 128, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"w_uv must be a bf16 \[3, v, 512\] tensor"):
        kimi_ops.mla_v_up_proj(o, w[:2])
    with pytest.raises(ValueError, match=r"w_uv must be an MXFP4 uint8 \[3, v, 256\] tensor"):
        kimi_ops.mla_v_up_proj(o, torch.zeros(3, 128, 128, dtype=torch.uint8),
                               torch.zeros(3, 128, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"gate must be a bfloat16 \[2, 384\] tensor"):
        kimi_ops.mla_v_up_proj(o, w, gate=torch.zeros(2, 383, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"gate must be a tensor contiguous along its last dim"):
        kimi_ops.mla_v_up_proj(o, w, gate=torch.zeros(384, 2, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match=r"o must be a tensor contiguous along its last dim"):
        kimi_ops.mla_v_up_proj(torch.zeros(2, 3, 1024, dtype=torch.bfloat16)[..., ::2], w)
    with pytest.raises(ValueError, match=r"o must be a \[T, H, L\] bfloat16 tensor"):
        kimi_ops.mla_v_up_proj(o.float(), w)


def test_interp_up_proj():
    run_interpreted("test_up_proj", """
# the GEMV (T <= 8): MXFP4 and bf16 weights (bf16 pairs), gate or none, o transposed, gate sliced
for mxfp4 in (False, True):
    t.check_up_proj(1, 2, mxfp4=mxfp4, gate=True, seed=1)
    t.check_up_proj(3, 2, mxfp4=mxfp4, gate=False, strided=True, seed=2)
    t.check_up_proj(8, 1, mxfp4=mxfp4, gate=True, strided=True, v=48, seed=3)   # N tail of the 16-row blocks
    # constant_w: the weight tiles loaded before the wait (K = 512: two chunks of 256, K = 128: one;
    # K = 1024: four chunks, loaded after the wait as without constant_w)
    t.check_up_proj(1, 2, mxfp4=mxfp4, gate=True, constant_w=True, seed=11)
    t.check_up_proj(5, 1, mxfp4=mxfp4, gate=False, strided=True, v=48, constant_w=True, seed=12)
    t.check_up_proj(3, 1, mxfp4=mxfp4, gate=True, latent=128, v=32, constant_w=True, seed=14)
    t.check_up_proj(2, 1, mxfp4=mxfp4, gate=True, latent=1024, v=32, constant_w=True, seed=13)
# above 8 rows: the MXFP4 tl.dot kernel with the gate epilogue; bf16: torch.bmm + mul into the output
t.check_up_proj(9, 2, mxfp4=True, gate=True, strided=True, seed=4)
t.check_up_proj(9, 2, mxfp4=False, gate=True, strided=True, seed=5)
t.check_up_proj(17, 1, mxfp4=False, gate=False, seed=6)
import os, triton
if tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 7):   # 3.6's interpreter: no dot_scaled
    os.environ["KIMI_OPS_MXFP4_DOT_SCALED"] = "1"                       # gfx950's path, gated
    t.check_up_proj(3, 2, mxfp4=True, gate=True, strided=True, seed=9)
    t.check_up_proj(12, 1, mxfp4=True, gate=True, seed=10)
    del os.environ["KIMI_OPS_MXFP4_DOT_SCALED"]
# the op layer, dispatched to Triton on CPU tensors
import kimi_ops
os.environ["KIMI_OPS_BACKEND"] = "triton"
o, w, s, g = t.make_inputs(2, 2, mxfp4=True, seed=7)
got = kimi_ops.mla_v_up_proj(o, w, s, g)
assert t.rel_err(got, t.oracle(o, w, s, g)) < 4e-3
# a bf16 W_UV whose rows cannot be read as pairs (a strided view) takes torch.bmm
o, w, s, g = t.make_inputs(2, 2, v=32, seed=8)
wide = torch.zeros(2, 32, 1026, dtype=torch.bfloat16)
wide[..., 1:1025:2] = w
got = kimi_ops.mla_v_up_proj(o, wide[..., 1:1025:2], None, g)
assert t.rel_err(got, t.oracle(o, w, None, g)) < 4e-3
""")


def test_cross_compile_specs_cover_up_proj():
    from kimi_ops.kernels import mxfp4 as M

    names = [s["name"] for s in M.CROSS_COMPILE_SPECS]
    assert len(names) == len(set(names))
    for spec in M.CROSS_COMPILE_SPECS:
        assert set(spec["signature"]) == set(spec["kernel"].arg_names), spec["name"]
    # every GEMV config v_up_proj launches for Kimi-K3's W_UV (N 128, K 512), both weight forms, gated
    gemv = {(s["constexprs"]["BLOCK_M"], s["constexprs"]["W_BF16"]) for s in M.CROSS_COMPILE_SPECS
            if s["kernel"] is M._bmm_a16wfp4_gemv_kernel and s["constexprs"]["GATE"]
            and s["constexprs"]["BLOCK_K"] == 512}
    assert gemv == {(bm, w) for bm in (1, 2, 4, 8) for w in (False, True)}
    # and the gated tl.dot configs above 8 rows on each path
    for amd, targets in ((False, ("sm90",)), (True, ("gfx950", "gfx942"))):
        launched = {M.bmm_config(t, 128, 512, amd=amd)[:4] for t in (9, 16, 32, 64, 128, 512)}
        for target in targets:
            covered = {(s["constexprs"]["BLOCK_M"], s["constexprs"]["BLOCK_N"], s["constexprs"]["BLOCK_K"],
                        s["num_warps"]) for s in M.CROSS_COMPILE_SPECS
                       if s["kernel"] is M._bmm_a16wfp4_kernel and s["constexprs"]["GATE"]
                       and target in s["targets"]}
            assert launched <= covered, (target, launched - covered)


# ----------------------------------------------------------------------------------------------
# GPU

@requires_cuda
@pytest.mark.parametrize("t", [1, 2, 8, 9, 64])
@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
@pytest.mark.parametrize("gate", [False, True], ids=["nogate", "gate"])
@pytest.mark.parametrize("constant_w", [False, True], ids=["", "wfirst"])
def test_gpu_up_proj_grid(t, mxfp4, gate, constant_w):
    torch.empty(64 << 20, dtype=torch.bfloat16, device="cuda").fill_(float("nan"))   # poison freed blocks
    check_up_proj(t, 12, mxfp4=mxfp4, gate=gate, strided=(t % 2 == 0), device="cuda", constant_w=constant_w,
                  seed=t)


@requires_cuda
@pytest.mark.parametrize("mxfp4", [False, True])
def test_gpu_up_proj_opcheck_and_graph(mxfp4):
    o, w, s, g = make_inputs(4, 12, mxfp4=mxfp4, device="cuda")
    torch.library.opcheck(torch.ops.kimi_ops.mla_v_up_proj, (o, w, s, g))
    out = torch.ops.kimi_ops.mla_v_up_proj(o, w, s, g)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.kimi_ops.mla_v_up_proj(o, w, s, g)
    o.copy_(torch.randn_like(o))
    g.copy_(torch.rand_like(g))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, oracle(o, w, s, g)) < 4e-3
