"""M1a (``mla_query``): reference and Triton kernel against float64 math written here.

``q[t, h] = [q_nope[t, h] @ W_UK[h] | q_pe[t, h]]`` as bf16 ``[T, H', L + P]``; W_UK bf16
``[H, D, L]`` or MXFP4 ``[H, L, D/2]`` + scales (dequantized by test_mxfp4's spec-table oracle);
pad heads are all-zero rows. CPU (CI): the reference, and the Triton kernel under
TRITON_INTERPRET=1 in a subprocess. GPU: the issue's grid (T 1..512, H 12/16, bf16 / MXFP4,
pad None/16/128), opcheck on CUDA tensors and a CUDA-graph replay.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TESTS))
sys.path.insert(0, TESTS)

from test_mxfp4 import (
    oracle_dequantize,
    random_weights,
    rel_err,
    requires_cuda,
    run_interpreted,
)

from kimi_ops.reference import mxfp4 as ref


def make_query_inputs(t, h, *, d=128, latent=512, p=64, mxfp4=False, strided=False, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    if strided == "d":   # q_nope with stride 2 along D, and NaN in the columns it does not own
        qn2 = torch.full((t, h, 2 * d + 32), float("nan"), dtype=torch.bfloat16)
        qn2[..., 0:2 * d:2] = torch.randn(t, h, d, generator=g).to(torch.bfloat16)
        q_nope = qn2.to(device)[..., 0:2 * d:2]
        q_pe = torch.randn(t, h, p, generator=g).to(torch.bfloat16).to(device)
    elif strided == "t":   # q_nope = a [H, T, D] tensor transposed (0, 1)
        q_nope = torch.randn(h, t, d, generator=g).to(torch.bfloat16).to(device).transpose(0, 1)
        q_pe = torch.randn(t, h, p, generator=g).to(torch.bfloat16).to(device)
    elif strided:   # q_nope and q_pe as views of one [T, H, D + P] projection output, as in vLLM
        qall = torch.randn(t, h, d + p, generator=g).to(torch.bfloat16).to(device)
        q_nope, q_pe = qall[..., :d], qall[..., d:]
    else:
        q_nope = torch.randn(t, h, d, generator=g).to(torch.bfloat16).to(device)
        q_pe = torch.randn(t, h, p, generator=g).to(torch.bfloat16).to(device)
    if mxfp4:
        w_uk, w_uk_scale = ref.mxfp4_quantize(random_weights((h, latent, d), gen=g) * 0.1)
        w_uk, w_uk_scale = w_uk.to(device), w_uk_scale.to(device)
    else:
        w_uk = (torch.randn(h, d, latent, generator=g) * 0.1).to(torch.bfloat16).to(device)
        w_uk_scale = None
    return q_nope, q_pe, w_uk, w_uk_scale


def oracle_query(q_nope, q_pe, w_uk, w_uk_scale, pad_heads):
    """float64 [T, H', L + P]: the latent part in float64, q_pe as is, pad rows zero."""
    t, h, _ = q_nope.shape
    if w_uk_scale is None:
        w = w_uk.cpu().double()
    else:
        w = oracle_dequantize(w_uk, w_uk_scale).transpose(1, 2)        # [H, D, L]
    latent, p = w.shape[2], q_pe.shape[2]
    out = torch.zeros(t, h if pad_heads is None else pad_heads, latent + p, dtype=torch.float64)
    out[:, :h, :latent] = torch.einsum("thd,hdl->thl", q_nope.cpu().double(), w)
    out[:, :h, latent:] = q_pe.cpu().double()
    return out


def check_query(t, h, *, pad=None, mxfp4=False, strided=False, d=128, latent=512, p=64, impl="triton",
                device="cpu", dot_scaled=None, gemv=None, constant_w=False, seed=0):
    q_nope, q_pe, w_uk, w_uk_scale = make_query_inputs(t, h, d=d, latent=latent, p=p, mxfp4=mxfp4,
                                                       strided=strided, seed=seed, device=device)
    if impl == "triton":
        from kimi_ops.kernels import query as Q

        out = Q.mla_query(q_nope, q_pe, w_uk, w_uk_scale, pad, dot_scaled=dot_scaled, gemv=gemv,
                          constant_w=constant_w)
    else:
        out = ref.mla_query(q_nope, q_pe, w_uk, w_uk_scale, pad)
    hp = h if pad is None else pad
    assert out.shape == (t, hp, latent + p) and out.dtype == torch.bfloat16 and out.is_contiguous()
    out = out.cpu()
    want = oracle_query(q_nope, q_pe, w_uk, w_uk_scale, pad)
    err = rel_err(out[:, :h, :latent], want[:, :h, :latent])
    assert err < 4e-3, (t, h, pad, mxfp4, strided, impl, dot_scaled, gemv, constant_w, err)
    assert torch.equal(out[:, :h, latent:], q_pe.cpu()), "q_pe part must be copied bit for bit"
    if hp > h:
        assert out[:, h:].eq(0).all() and not torch.signbit(out[:, h:]).any(), "pad rows must be +0"
    return err


# ----------------------------------------------------------------------------------------------
# CPU

@pytest.mark.parametrize("mxfp4", [False, True])
@pytest.mark.parametrize("pad", [None, 16])
def test_reference_query(mxfp4, pad):
    check_query(5, 12, pad=pad, mxfp4=mxfp4, impl="reference")
    check_query(3, 2, pad=pad, mxfp4=mxfp4, strided=True, d=64, latent=96, p=32, impl="reference", seed=1)


def test_reference_query_pads_to_128():
    check_query(2, 12, pad=128, mxfp4=True, impl="reference")


def test_ops_layer_reference_query():
    import kimi_ops

    q_nope, q_pe, w_uk, w_uk_scale = make_query_inputs(4, 12, mxfp4=True)
    out = kimi_ops.mla_query(q_nope, q_pe, w_uk, w_uk_scale.view(getattr(torch, "float8_e8m0fnu", torch.uint8)),
                             pad_heads=16)
    assert torch.equal(out, ref.mla_query(q_nope, q_pe, w_uk, w_uk_scale, 16))


def test_interp_mla_query():
    run_interpreted("test_query", """
t.check_query(3, 2, pad=None, mxfp4=False, strided=True)          # bf16 W_UK, strided q views
t.check_query(17, 2, pad=4, mxfp4=True, seed=1)                   # MXFP4, row tail, pad heads
import triton
if tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 7):   # 3.6's interpreter: no dot_scaled
    t.check_query(2, 2, pad=3, mxfp4=True, dot_scaled=True, seed=2)   # gfx950's MXFP8 hi+lo dot_scaled
t.check_query(5, 3, pad=None, mxfp4=False, d=64, latent=96, p=32, seed=3)   # generic dims, L tail
t.check_query(4, 1, pad=2, mxfp4=True, d=96, latent=64, p=16, seed=4)      # D tail (not 2^k)
t.check_query(4, 1, pad=2, mxfp4=True, d=96, latent=64, p=16, strided="d", seed=4)   # stride_qnd = 2, NaN in
                                                                            # the unowned columns
t.check_query(5, 2, pad=None, mxfp4=True, strided="t", seed=8)            # q_nope.transpose(0, 1)
# the GEMV form (the default at T = 1), both weights; constant_w: the weight loaded before the wait
for mx in (False, True):
    t.check_query(1, 2, pad=3, mxfp4=mx, strided=True, seed=10)           # default: GEMV at T = 1
    t.check_query(1, 2, pad=None, mxfp4=mx, strided=True, constant_w=True, seed=11)
    t.check_query(3, 2, pad=4, mxfp4=mx, gemv=True, constant_w=True, seed=12)   # BLOCK_M 4, a row tail
    t.check_query(8, 1, pad=None, mxfp4=mx, gemv=True, strided="t", seed=13)
    t.check_query(2, 1, pad=2, mxfp4=mx, gemv=True, d=96, latent=80, p=16, strided="d", seed=14)  # D, L tails
    t.check_query(3, 2, pad=3, mxfp4=mx, gemv=False, constant_w=True, seed=15)  # the tl.dot form, W first
# the op layer, dispatched to Triton on CPU tensors
import os, kimi_ops
os.environ["KIMI_OPS_BACKEND"] = "triton"
qn, qp, w, s = t.make_query_inputs(3, 2, mxfp4=True, seed=5)
assert torch.equal(kimi_ops.mla_query(qn, qp, w, s, pad_heads=4), t.ref.mla_query(qn, qp, w, s, 4))
""")


def test_use_query_gemv(monkeypatch):
    """The GEMV form: by default at T = 1 (not on ROCm), forced by gemv= or KIMI_OPS_QUERY_GEMV=0/1
    (the argument first), never above GEMV_MAX_M rows."""
    from kimi_ops.kernels import query as Q

    monkeypatch.delenv("KIMI_OPS_QUERY_GEMV", raising=False)
    assert Q.use_query_gemv(1) == (torch.version.hip is None) and not Q.use_query_gemv(2)
    assert Q.use_query_gemv(8, True) and not Q.use_query_gemv(Q.GEMV_MAX_M + 1, True)
    monkeypatch.setenv("KIMI_OPS_QUERY_GEMV", "0")
    assert not Q.use_query_gemv(1) and Q.use_query_gemv(1, True)
    monkeypatch.setenv("KIMI_OPS_QUERY_GEMV", "1")
    assert Q.use_query_gemv(5) and not Q.use_query_gemv(5, False) and not Q.use_query_gemv(Q.GEMV_MAX_M + 1)


def test_cross_compile_specs_cover_launches():
    from kimi_ops.kernels import query as Q

    names = [s["name"] for s in Q.CROSS_COMPILE_SPECS]
    assert len(names) == len(set(names))
    for spec in Q.CROSS_COMPILE_SPECS:
        assert set(spec["signature"]) == set(Q._mla_query_kernel.arg_names)
        assert set(spec["constexprs"]) == {k for k, v in spec["signature"].items() if v == "constexpr"}
        assert not (spec["constexprs"]["DOT_SCALED"] and not spec["constexprs"]["MXFP4"])
    # each target's configs (AMD's own) on each path it takes (dot_scaled: gfx950 only)
    for amd, targets in ((False, ("sm90",)), (True, ("gfx950", "gfx942"))):
        launched = {Q.query_config(t, 12, 512, amd=amd) for t in (1, 8, 16, 32, 64, 128, 256, 512)}
        for target in targets:
            paths = ((False, False), (True, False)) + (((True, True),) if target == "gfx950" else ())
            for path in paths:
                covered = {(s["constexprs"]["BLOCK_M"], s["constexprs"]["BLOCK_N"], s["num_warps"])
                           for s in Q.CROSS_COMPILE_SPECS if target in s["targets"]
                           and (s["constexprs"]["MXFP4"], s["constexprs"]["DOT_SCALED"]) == path}
                assert launched <= covered, (target, path)
    # the GEMV form at every T it takes (default on NVIDIA at T = 1; gemv=True up to GEMV_MAX_M)
    gemv_launched = {Q.query_gemv_config(t) for t in range(1, Q.GEMV_MAX_M + 1)}
    for target in ("sm90", "gfx950", "gfx942"):
        for mxfp4 in (False, True):
            covered = {(s["constexprs"]["BLOCK_M"], s["constexprs"]["BLOCK_N"], s["num_warps"])
                       for s in Q.CROSS_COMPILE_SPECS if target in s["targets"] and s["constexprs"]["GEMV"]
                       and s["constexprs"]["MXFP4"] == mxfp4}
            assert gemv_launched <= covered, (target, mxfp4)


# ----------------------------------------------------------------------------------------------
# GPU

def _poison_allocator():
    # fill freed cache blocks with NaN so that an unwritten output element shows
    torch.empty(64 << 20, dtype=torch.bfloat16, device="cuda").fill_(float("nan"))


@requires_cuda
@pytest.mark.parametrize("t", [1, 8, 64, 256, 512])
@pytest.mark.parametrize("h", [12, 16])
@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
@pytest.mark.parametrize("pad", [None, 16, 128])
def test_gpu_query_grid(t, h, mxfp4, pad):
    _poison_allocator()
    check_query(t, h, pad=pad, mxfp4=mxfp4, strided=(t % 2 == 0), device="cuda", seed=t + h)


@requires_cuda
def test_gpu_query_dot_scaled_path():
    check_query(33, 12, pad=16, mxfp4=True, dot_scaled=True, device="cuda")


@requires_cuda
@pytest.mark.parametrize("mxfp4", [False, True], ids=["bf16", "mxfp4"])
def test_gpu_query_gemv_and_weights_first(mxfp4):
    """The GEMV form at every T it serves and the tl.dot form, each with the weight tile loaded
    before the PDL wait (constant_w) and without; a CUDA-graph replay of the layer's call."""
    _poison_allocator()
    for t in (1, 2, 5, 8):
        for gemv in (True, False):
            for constant_w in (False, True):
                check_query(t, 12, pad=16, mxfp4=mxfp4, strided=True, gemv=gemv, constant_w=constant_w,
                            device="cuda", seed=t)
    check_query(3, 2, pad=None, mxfp4=mxfp4, gemv=True, d=96, latent=80, p=16, strided="d", device="cuda")
    q_nope, q_pe, w_uk, w_uk_scale = make_query_inputs(1, 12, mxfp4=mxfp4, strided=True, device="cuda")
    import kimi_ops

    kimi_ops.mla_query(q_nope, q_pe, w_uk, w_uk_scale, constant_w=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kimi_ops.mla_query(q_nope, q_pe, w_uk, w_uk_scale, constant_w=True)
    q_nope.copy_(torch.randn_like(q_nope))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out[:, :, :512].cpu(), oracle_query(q_nope, q_pe, w_uk, w_uk_scale, None)[:, :, :512]) < 4e-3


@requires_cuda
def test_gpu_query_edges():
    # the decode path on q_nope^T(0, 1), a D tail with stride 2 (NaN in the unowned columns), D = 512
    for kw in ({"strided": "t", "seed": 8}, {"d": 96, "latent": 64, "p": 16, "strided": "d", "seed": 4},
               {"d": 512, "latent": 96, "p": 16, "seed": 7}):
        check_query(5, 3, pad=4, mxfp4=True, device="cuda", dot_scaled=False, **kw)


@requires_cuda
@pytest.mark.parametrize("mxfp4", [False, True])
def test_gpu_query_opcheck_and_graph(mxfp4):
    import kimi_ops  # noqa: F401

    q_nope, q_pe, w_uk, w_uk_scale = make_query_inputs(8, 12, mxfp4=mxfp4, device="cuda")
    torch.library.opcheck(torch.ops.kimi_ops.mla_query, (q_nope, q_pe, w_uk, w_uk_scale), {"pad_heads": 16})
    out = torch.ops.kimi_ops.mla_query(q_nope, q_pe, w_uk, w_uk_scale, pad_heads=16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.kimi_ops.mla_query(q_nope, q_pe, w_uk, w_uk_scale, pad_heads=16)
    q_nope.copy_(torch.randn_like(q_nope))
    q_pe.copy_(torch.randn_like(q_pe))
    graph.replay()
    torch.cuda.synchronize()
    want = oracle_query(q_nope, q_pe, w_uk, w_uk_scale, 16)
    assert rel_err(out.cpu(), want) < 4e-3
    assert torch.equal(out[:, :12, 512:].cpu(), q_pe.cpu())
