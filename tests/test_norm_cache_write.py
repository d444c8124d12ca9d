"""``mla_norm_cache_write`` (the layer's q / kv RMSNorms, cache write and gate sigmoid in one op):
the reference and the Triton kernel against float64 math written here.

q_c_normed and gate against float64 within bf16's rounding; the cache rows decoded from fp8
against float64 ``cat(rms_norm(kv_c), k_pe) / kv_scale`` within one fp8 step; every row whose
slot is not written (poisoned, -1, out of range) unchanged byte for byte. CPU (CI): the
reference, errors, opcheck, and the Triton kernel under TRITON_INTERPRET=1 in a subprocess.
GPU: both cache formats, slots int32 / int64, a paged cache, opcheck and a CUDA-graph replay.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TESTS))
sys.path.insert(0, TESTS)

from test_mxfp4 import requires_cuda, run_interpreted

import kimi_ops
from kimi_ops.reference import attention as ref

EPS = 1e-6


def make_inputs(t, *, q=1536, gcols=256, num_rows=64, cache_dtype=torch.float8_e4m3fn, slots_dtype=torch.int64,
                paged=False, seed=0, device="cpu"):
    """q_c / kv_c / k_pe / g as column slices of one [T, q + 576 + G] tensor (the qkv_a GEMM's
    output), norm weights, a poisoned cache (random bytes) and slots: distinct rows, then -1 and
    one past the cache's end for the last two tokens when t >= 3."""
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, q + 576 + gcols, generator=gen) * 3).to(torch.bfloat16).to(device)
    q_c, kv_c, k_pe, g = qkv.split([q, 512, 64, gcols], -1)
    qw = (1 + 0.1 * torch.randn(q, generator=gen)).to(torch.bfloat16).to(device)
    kvw = (1 + 0.1 * torch.randn(512, generator=gen)).to(torch.bfloat16).to(device)
    cache = torch.randint(0, 256, (num_rows, 576), generator=gen, dtype=torch.uint8)
    cache[(cache & 0x7F) == 0x7F] = 0                      # no NaN codes in the poison (compared below)
    cache = cache.view(cache_dtype).to(device)
    slots = torch.randperm(num_rows, generator=gen)[:t].to(slots_dtype)
    if t >= 3:
        slots[-2], slots[-1] = -1, num_rows
    if paged:
        cache = cache.view(num_rows // 8, 8, 576)
    return q_c, kv_c, k_pe, (g if gcols else None), qw, kvw, cache, slots.to(device)


def oracle(q_c, kv_c, k_pe, g, qw, kvw, kv_scale):
    """float64 (q_c_normed, gate or None, rows [T, 576] / kv_scale)."""
    def norm(x, w):
        x = x.cpu().double()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w.cpu().double()
    rows = torch.cat([norm(kv_c, kvw), k_pe.cpu().double()], -1) / kv_scale
    return norm(q_c, qw), (None if g is None else torch.sigmoid(g.cpu().double())), rows


def check(t, *, impl="triton", kv_scale=0.05, constant_w=False, **kw):
    q_c, kv_c, k_pe, g, qw, kvw, cache, slots = make_inputs(t, **kw)
    before = cache.view(-1, 576).cpu().clone()
    if impl == "triton":
        from kimi_ops.kernels import pre_norm

        qn, gate = pre_norm.mla_norm_cache_write(q_c, kv_c, k_pe, qw, kvw, cache.view(-1, 576), slots, g,
                                                 eps=EPS, kv_scale=kv_scale, constant_w=constant_w)
    else:
        qn, gate = kimi_ops.mla_norm_cache_write(q_c, kv_c, k_pe, qw, kvw, cache, slots, g, eps=EPS,
                                                 kv_scale=kv_scale, constant_w=constant_w)
    want_q, want_g, want_rows = oracle(q_c, kv_c, k_pe, g, qw, kvw, kv_scale)
    assert qn.shape == q_c.shape and qn.dtype == torch.bfloat16 and qn.is_contiguous()
    assert (qn.cpu().double() - want_q).abs().max() <= 2 ** -8 * want_q.abs().max()
    if g is None:
        assert gate.shape == (t, 0)
    else:
        assert gate.shape == g.shape and gate.dtype == torch.bfloat16
        assert (gate.cpu().double() - want_g).abs().max() <= 2 ** -8
    return qn, gate, check_rows(cache, slots, want_rows, before)


def check_rows(cache, slots, want_rows, before):
    """Each token's cache row within one fp8 step of float64 ``want_rows`` (rows / kv_scale), every
    row no slot names unchanged from ``before`` byte for byte; -> the cache's rows on the CPU."""
    after = cache.view(-1, 576).cpu()
    written = torch.zeros(after.shape[0], dtype=torch.bool)
    fmax = torch.finfo(cache.dtype).max
    for i, s in enumerate(slots.cpu().tolist()):
        if 0 <= s < after.shape[0]:
            written[s] = True
            got = after[s].double()
            want = want_rows[i].clamp(-fmax, fmax)
            # one fp8 step: 2^-3 relative for normals (2^-4 rounding, plus the bf16 kv_c's), the
            # subnormal step absolute
            tol = torch.maximum(want.abs() * 2 ** -3, torch.full_like(want, 2.0 ** -9))
            assert ((got - want).abs() <= tol).all(), (i, s, (got - want).abs().max())
    assert torch.equal(after[~written].view(torch.uint8), before[~written].view(torch.uint8)), "unwritten rows changed"
    return after


# ----------------------------------------------------------------------------------------------
# CPU

@pytest.mark.parametrize("gcols", [0, 256])
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_reference(gcols, cache_dtype):
    check(5, impl="reference", gcols=gcols, cache_dtype=cache_dtype)
    check(1, impl="reference", gcols=gcols, cache_dtype=cache_dtype, paged=True, slots_dtype=torch.int32, seed=1)


def test_reference_is_the_unfused_step():
    """The op's bytes and outputs are those of the unfused step it replaces (runtime.mla.pre
    before: two rms_norm, mla_cache_write of the normed kv_c, torch.sigmoid)."""
    q_c, kv_c, k_pe, g, qw, kvw, cache, slots = make_inputs(6)
    cache2 = cache.clone()
    qn, gate = kimi_ops.mla_norm_cache_write(q_c, kv_c, k_pe, qw, kvw, cache, slots, g, eps=EPS, kv_scale=0.1)
    kimi_ops.mla_cache_write(ref.rms_norm(kv_c, kvw, EPS), k_pe, cache2, slots, 0.1)
    assert torch.equal(cache.view(torch.uint8), cache2.view(torch.uint8))
    assert torch.equal(qn, ref.rms_norm(q_c, qw, EPS)) and torch.equal(gate, torch.sigmoid(g))


def test_errors():
    q_c, kv_c, k_pe, g, qw, kvw, cache, slots = make_inputs(3)
    call = kimi_ops.mla_norm_cache_write
    with pytest.raises(ValueError, match=r"kv_c must be a \[3, 512\] bfloat16 tensor"):
        call(q_c, kv_c[:, :500], k_pe, qw, kvw, cache, slots, g, eps=EPS, kv_scale=1.0)
    with pytest.raises(ValueError, match=r"g must be a \[3, G\] bfloat16 tensor"):
        call(q_c, kv_c, k_pe, qw, kvw, cache, slots, g[:2], eps=EPS, kv_scale=1.0)
    with pytest.raises(ValueError, match=r"q_norm_weight must be a contiguous \[1536\]"):
        call(q_c, kv_c, k_pe, qw[:100], kvw, cache, slots, g, eps=EPS, kv_scale=1.0)
    with pytest.raises(ValueError, match=r"q_c must be a tensor contiguous along its last dim"):
        call(q_c[:, ::2], kv_c, k_pe, qw[:768], kvw, cache, slots, g, eps=EPS, kv_scale=1.0)
    with pytest.raises(ValueError, match=r"eps must be a finite float >= 0"):
        call(q_c, kv_c, k_pe, qw, kvw, cache, slots, g, eps=float("nan"), kv_scale=1.0)
    with pytest.raises(ValueError, match=r"kv_scale"):
        call(q_c, kv_c, k_pe, qw, kvw, cache, slots, g, eps=EPS, kv_scale=0.0)
    with pytest.raises(ValueError, match=r"q_c must be a \[T, Q\] bfloat16 tensor"):
        call(q_c.float(), kv_c, k_pe, qw, kvw, cache, slots, g, eps=EPS, kv_scale=1.0)


@pytest.mark.parametrize("gate", [False, True])
def test_opcheck(gate):
    from test_opcheck import opcheck_and_mutations

    q_c, kv_c, k_pe, g, qw, kvw, cache, slots = make_inputs(4, gcols=128 if gate else 0, paged=True)
    args = (q_c, kv_c, k_pe, qw, kvw, cache, slots, g)
    opcheck_and_mutations("mla_norm_cache_write", args, dict(eps=EPS, kv_scale=0.5), mutated={5})


def test_interp_norm_cache_write():
    run_interpreted("test_norm_cache_write", """
for dt in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
    t.check(5, cache_dtype=dt, seed=1)                                   # -1 and out-of-range slots
t.check(1, gcols=0, slots_dtype=torch.int32, seed=2)                     # no gate: grid (T, 2)
t.check(3, q=96, gcols=40, kv_scale=3.0, seed=3)                         # Q and G not powers of two
t.check(3, q=96, gcols=40, constant_w=True, seed=5)                      # the norm weights before the wait
t.check(2, gcols=0, constant_w=True, seed=6)
# the op layer, dispatched to Triton on CPU tensors, a paged cache: the reference's outputs
import os, kimi_ops
os.environ["KIMI_OPS_BACKEND"] = "triton"
qc, kvc, kpe, g, qw, kvw, cache, slots = t.make_inputs(4, paged=True, seed=4)
qn, gate = kimi_ops.mla_norm_cache_write(qc, kvc, kpe, qw, kvw, cache, slots, g, eps=t.EPS, kv_scale=0.25)
os.environ["KIMI_OPS_BACKEND"] = "reference"
qc2, kvc2, kpe2, g2, qw2, kvw2, cache2, slots2 = t.make_inputs(4, paged=True, seed=4)
qn2, gate2 = kimi_ops.mla_norm_cache_write(qc2, kvc2, kpe2, qw2, kvw2, cache2, slots2, g2, eps=t.EPS, kv_scale=0.25)
# the same up to a last-bit difference in a few elements (float32 sums in another order)
assert (qn.double() - qn2.double()).abs().max() <= 2 ** -7 * qn2.double().abs().max()
assert (cache.view(torch.uint8).int() - cache2.view(torch.uint8).int()).abs().max() <= 1
assert torch.equal(gate, gate2)
""")


def test_cross_compile_specs():
    from kimi_ops.kernels import pre_norm

    for spec in pre_norm.CROSS_COMPILE_SPECS:
        assert set(spec["signature"]) == set(pre_norm._norm_cache_write_kernel.arg_names)
    assert {s["signature"]["slot_ptr"] for s in pre_norm.CROSS_COMPILE_SPECS} == {"*i32", "*i64"}


# ----------------------------------------------------------------------------------------------
# GPU

@requires_cuda
@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
@pytest.mark.parametrize("slots_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("t", [1, 8, 64])
def test_gpu(cache_dtype, slots_dtype, t):
    check(t, cache_dtype=cache_dtype, slots_dtype=slots_dtype, num_rows=128, paged=(t == 8), device="cuda", seed=t)
    check(t, cache_dtype=cache_dtype, slots_dtype=slots_dtype, num_rows=128, device="cuda", constant_w=True,
          seed=t + 1)


@requires_cuda
def test_gpu_opcheck_and_graph():
    q_c, kv_c, k_pe, g, qw, kvw, cache, slots = make_inputs(8, device="cuda")
    args = (q_c, kv_c, k_pe, qw, kvw, cache, slots, g)
    torch.library.opcheck(torch.ops.kimi_ops.mla_norm_cache_write.default, args, dict(eps=EPS, kv_scale=0.5),
                          test_utils=("test_autograd_registration", "test_faketensor"))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qn, gate = kimi_ops.mla_norm_cache_write(*args, eps=EPS, kv_scale=0.5)
    q_c.copy_(torch.randn_like(q_c))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.allclose(qn.float(), ref.rms_norm(q_c, qw, EPS).float(), rtol=2 ** -7, atol=0)
