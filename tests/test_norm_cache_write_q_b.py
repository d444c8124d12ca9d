"""``mla_norm_cache_write_q_b`` (the layer's norms, cache write and gate, then q_b's projection):
against float64 math written here and against the two ops it replaces.

q against float64 ``(rms_norm(q_c) * q_norm_weight) @ W^T`` within one bf16 rounding of the
projection's input (2^-9 of sum |x_k w_k|) plus bf16's rounding of the result, and within 3e-3 in
relative L2 (what the two roundings give: 2.35e-3 for the reference at Kimi-K3's q_b); the cache
rows and the gate as tests/test_norm_cache_write.py checks them (within one fp8 step / bf16
rounding of float64, unwritten rows unchanged byte for byte). CPU (CI): the reference is the two
ops bit for bit (bf16 and fp8 weights), errors, opcheck, and the Triton backend under
TRITON_INTERPRET=1. GPU (sm_90): the fused kernel (gemv.cuh's kNorm form and pre_norm.cuh) at both
token-tile forms (1-8, 9-16 tokens), both weight kinds, the gate on and off, int32 / int64 slots
with -1 and out-of-range ones, q_c / kv_c / k_pe / g as column slices of one qkv tensor; the cache
bytes and gate against the unfused op's; constant_w (PDL) bit for bit against a plain launch; a
CUDA-graph replay; the calls it does not take (17-32 tokens, an f32 norm weight) through the two
ops.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TESTS))
sys.path.insert(0, TESTS)

from conftest import requires_sm90
from test_fp8_weights import fp8_dense64, random_fp8
from test_mxfp4 import run_interpreted
from test_norm_cache_write import EPS, check_rows, make_inputs, oracle

import kimi_ops

KV_SCALE = 0.05


def make_weight(n, k, fp8, seed, device="cpu"):
    """q_b's weight: bf16 [n, k], or fp8 e4m3fn with 128 x 128 block scales; and its float64 copy."""
    if fp8:
        w, s = random_fp8(n, k, 128, 128, seed)
        return w.to(device), s.to(device), fp8_dense64(w, s, 128, 128)
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16)
    return w.to(device), None, w.double()


def call(inputs, w, s, **kw):
    q_c, kv_c, k_pe, g, qw, kvw, cache, slots = inputs
    return kimi_ops.mla_norm_cache_write_q_b(q_c, kv_c, k_pe, qw, kvw, cache, slots, w, s, g, eps=EPS,
                                             kv_scale=KV_SCALE, **kw)


def check_q(q, inputs, w64):
    """q within the bound of float64 (rms_norm(q_c) * weight) @ W^T (module docstring)."""
    q_c, kv_c, k_pe, g, qw, kvw, _, _ = inputs
    x64, _, _ = oracle(q_c, kv_c, k_pe, g, qw, kvw, KV_SCALE)
    want, mag = x64 @ w64.T, x64.abs() @ w64.abs().T
    assert q.dtype == torch.bfloat16 and q.shape == want.shape
    err = (q.cpu().double() - want).abs()
    bound = 2.0 ** -8 * want.abs() + 2.0 ** -9 * mag + 1e-30
    assert (err <= bound).all(), f"max err / bound {(err / bound).max().item():.2f}"
    # and as a whole: the two bf16 roundings give ~2.4e-3 (a lost norm weight of 1 +- 0.1: ~0.1)
    rel = (err.norm() / want.norm()).item()
    assert rel <= 3e-3, f"rel L2 {rel:.2e}"


def check_cache_and_gate(inputs, before, gate):
    """The rows written within one fp8 step of float64, the others unchanged; the gate within bf16's rounding."""
    q_c, kv_c, k_pe, g, qw, kvw, cache, slots = inputs
    _, want_g, want_rows = oracle(q_c, kv_c, k_pe, g, qw, kvw, KV_SCALE)
    check_rows(cache, slots, want_rows, before)
    if g is None:
        assert gate.shape == (q_c.shape[0], 0)
    else:
        assert gate.shape == g.shape and (gate.cpu().double() - want_g).abs().max() <= 2 ** -8


# ----------------------------------------------------------------------------------------------
# CPU

@pytest.mark.parametrize("fp8", [False, True])
def test_reference_is_the_two_ops(fp8):
    inputs = make_inputs(5, q=256, gcols=96)
    w, s, w64 = make_weight(320, 256, fp8, seed=1)
    before = inputs[6].view(-1, 576).clone()
    q, gate = call(inputs, w, s)
    check_q(q, inputs, w64)
    check_cache_and_gate(inputs, before, gate)
    q_c, kv_c, k_pe, g, qw, kvw, cache, slots = make_inputs(5, q=256, gcols=96)
    qn, gate2 = kimi_ops.mla_norm_cache_write(q_c, kv_c, k_pe, qw, kvw, cache, slots, g, eps=EPS, kv_scale=KV_SCALE)
    q2 = kimi_ops.gemm_a16w16(qn, w) if s is None else kimi_ops.gemm_a16w8_block(qn, w, s)
    assert torch.equal(q, q2) and torch.equal(gate, gate2)
    assert torch.equal(cache.view(torch.uint8), inputs[6].view(torch.uint8))


def test_errors():
    inputs = make_inputs(3, q=256, gcols=0)
    w, s, _ = make_weight(64, 256, True, seed=2)
    wb, _, _ = make_weight(64, 256, False, seed=2)
    with pytest.raises(ValueError, match=r"mla_norm_cache_write_q_b: x is \[M, 256\] but w is \[N, 128\]"):
        call(inputs, wb[:, :128].contiguous(), None)
    with pytest.raises(ValueError, match=r"mla_norm_cache_write_q_b: w must be a bf16 \[N, K\] tensor"):
        call(inputs, w, None)
    with pytest.raises(ValueError, match=r"mla_norm_cache_write_q_b: w_scale_inv must be float32"):
        call(inputs, w, s[:, :1])
    with pytest.raises(ValueError, match=r"mla_norm_cache_write_q_b: kv_c must be a \[3, 512\]"):
        q_c, kv_c, k_pe, g, qw, kvw, cache, slots = inputs
        call((q_c, kv_c[:, :500], k_pe, g, qw, kvw, cache, slots), wb, None)
    with pytest.raises(ValueError, match=r"mla_norm_cache_write_q_b: kv_scale"):
        kimi_ops.mla_norm_cache_write_q_b(*inputs[:2], inputs[2], inputs[4], inputs[5], inputs[6], inputs[7], wb,
                                          eps=EPS, kv_scale=0.0)


@pytest.mark.parametrize("fp8", [False, True])
def test_opcheck(fp8):
    from test_opcheck import opcheck_and_mutations

    q_c, kv_c, k_pe, g, qw, kvw, cache, slots = make_inputs(4, q=256, gcols=64, paged=True)
    w, s, _ = make_weight(128, 256, fp8, seed=3)
    args = (q_c, kv_c, k_pe, qw, kvw, cache, slots, w, s, g)
    opcheck_and_mutations("mla_norm_cache_write_q_b", args, dict(eps=EPS, kv_scale=0.5), mutated={5})


def test_interp_norm_cache_write_q_b():
    run_interpreted("test_norm_cache_write_q_b", """
import os, kimi_ops
os.environ["KIMI_OPS_BACKEND"] = "triton"     # the Triton norm kernel, then the projection's reference
for fp8, gcols in ((False, 40), (True, 0)):
    inputs = t.make_inputs(5, q=256, gcols=gcols, seed=7)
    w, s, w64 = t.make_weight(96, 256, fp8, seed=8)
    before = inputs[6].view(-1, 576).clone()
    q, gate = t.call(inputs, w, s)
    t.check_q(q, inputs, w64)
    t.check_cache_and_gate(inputs, before, gate)
""")


# ----------------------------------------------------------------------------------------------
# GPU (sm_90: the fused kernel)

def gpu_case(t, fp8, *, gcols=1536, slots_dtype=torch.int64, seed=0, n=2304, k=1536):
    inputs = make_inputs(t, q=k, gcols=gcols, num_rows=256, slots_dtype=slots_dtype, seed=seed, device="cuda")
    w, s, w64 = make_weight(n, k, fp8, seed=seed + 100, device="cuda")
    return inputs, w, s, w64


def fused_serves(inputs, w, s):
    from kimi_ops.kernels import sm90_gemv

    q_c, kv_c, k_pe, g, qw, kvw, cache, _ = inputs
    return sm90_gemv.norm_q_b_serves(q_c, kv_c, k_pe, g, qw, kvw, cache.view(-1, 576), w, s)


@requires_sm90
@pytest.mark.parametrize("fp8,t", [(False, 1), (False, 8), (False, 13), (False, 16),
                                   (True, 1), (True, 3), (True, 8), (True, 9), (True, 16)])
def test_gpu_fused(fp8, t, monkeypatch):
    inputs, w, s, w64 = gpu_case(t, fp8, gcols=1536 if t % 2 else 0, slots_dtype=torch.int32 if t % 3 else torch.int64,
                                 seed=t)
    assert fused_serves(inputs, w, s), "the fused kernel should take this call"
    before = inputs[6].view(-1, 576).cpu().clone()
    q, gate = call(inputs, w, s, constant_w=True)
    torch.cuda.synchronize()
    check_q(q, inputs, w64)
    check_cache_and_gate(inputs, before, gate)
    # the unfused op's cache bytes and gate: the same values (the kv norm's float32 sum in another
    # order may move a code by one step in rare elements)
    fused_cache = inputs[6].view(torch.uint8).cpu().clone()
    monkeypatch.setenv("KIMI_OPS_SM90_NORM_Q_B", "0")
    assert not fused_serves(inputs, w, s)
    q2, gate2 = call(inputs, w, s)
    monkeypatch.delenv("KIMI_OPS_SM90_NORM_Q_B")
    check_q(q2, inputs, w64)
    diff = (inputs[6].view(torch.uint8).cpu().int() - fused_cache.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3, (diff.max(), (diff > 0).sum())
    assert gate.shape == gate2.shape and (gate.numel() == 0 or (gate.float() - gate2.float()).abs().max() <= 2 ** -9)
    # each within ~2.4e-3 of float64 (check_q), the two roundings independent: ~3.3e-3 apart
    rel = ((q.double() - q2.double()).norm() / q2.double().norm()).item()
    print(f"fused vs two ops, fp8 {fp8}, T {t}: rel L2 of q {rel:.2e}")
    assert rel < 5e-3
    # a plain launch (no PDL): bit for bit
    q3, gate3 = call(inputs, w, s, constant_w=False)
    assert torch.equal(q3, q) and torch.equal(gate3, gate)


@requires_sm90
def test_gpu_graph_replay():
    inputs, w, s, w64 = gpu_case(4, True, seed=11)
    q_c, kv_c, k_pe, g, qw, kvw, cache, slots = inputs
    q0, gate0 = call(inputs, w, s, constant_w=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, gate = call(inputs, w, s, constant_w=True)
    fresh = make_inputs(4, q=1536, gcols=1536, num_rows=256, seed=12, device="cuda")
    for dst, src in zip((q_c, kv_c, k_pe, g), fresh[:4]):
        dst.copy_(src)
    slots.copy_(fresh[7])
    before = cache.view(-1, 576).cpu().clone()
    graph.replay()
    torch.cuda.synchronize()
    check_q(q, inputs, w64)
    check_cache_and_gate(inputs, before, gate)
    assert not torch.equal(q, q0)


@requires_sm90
def test_gpu_calls_it_does_not_take():
    """Above 16 tokens (the fused kernel's limit; a bf16 weight's projection kernel's too) and with an
    f32 norm weight the two ops run; the results hold the same bounds."""
    for t, fp8, f32_norm in ((20, False, False), (24, True, False), (32, True, False), (4, True, True)):
        inputs, w, s, w64 = gpu_case(t, fp8, seed=t + 40)
        if f32_norm:
            inputs = inputs[:4] + (inputs[4].float(),) + inputs[5:]
        assert not fused_serves(inputs, w, s)
        before = inputs[6].view(-1, 576).cpu().clone()
        q, gate = call(inputs, w, s, constant_w=True)
        check_q(q, inputs, w64)
        check_cache_and_gate(inputs, before, gate)


@requires_sm90
def test_gpu_private_op_checks():
    inputs, w, s, _ = gpu_case(2, True, seed=50)
    q_c, kv_c, k_pe, g, qw, kvw, cache, slots = inputs
    op = torch.ops.kimi_ops._norm_q_b_sm90
    rows = cache.view(-1, 576)
    with pytest.raises(RuntimeError, match="q_norm_weight must be a contiguous, 16-byte aligned bf16"):
        op(q_c, kv_c, k_pe, qw.float(), kvw, rows, slots, w, s, g, 128, EPS, KV_SCALE, False)
    with pytest.raises(RuntimeError, match="kv_cache must be a contiguous float8_e4m3fn"):
        op(q_c, kv_c, k_pe, qw, kvw, rows.view(torch.uint8), slots, w, s, g, 128, EPS, KV_SCALE, False)
    with pytest.raises(RuntimeError, match="the fused q_b takes at most 16 tokens"):
        big = gpu_case(17, True, seed=51)[0]
        op(big[0], big[1], big[2], qw, kvw, big[6].view(-1, 576), big[7], w, s, big[3], 128, EPS, KV_SCALE, False)
    with pytest.raises(RuntimeError, match="the fused q_b needs K >= 4 k-blocks"):
        op(q_c[:, :256], kv_c, k_pe, qw[:256], kvw, rows, slots, w[:, :256].contiguous(), s[:, :2].contiguous(), g,
           128, EPS, KV_SCALE, False)
