"""The query side of issue 28: M1a's fp8 output (``mla_query(out_dtype=fp8)``,
``quantize_query``, ``query_scale``) and the runtime's ``bf16`` switch (``mla.pre`` /
``MLADecodeLayer``), against quantization and float64 math written here.

CPU (CI): the reference backend, and the Triton M1a kernel under TRITON_INTERPRET=1 feeding
the quantize. The whole layer with the fp8 query is held to the float64 layer of
test_runtime (un-absorbed attention) within its tolerance plus what the query's fp8 rounding
adds, measured here (:data:`FP8Q_LAYER_RTOL`). DCP's fp8 gather: tests/test_dcp.py.
"""

import pytest
import torch

import kimi_ops
from conftest import fp8_round_oracle
from kimi_ops.runtime import MLAConfig, MLADecodeLayer, mla
from test_mxfp4 import run_interpreted
from test_query import make_query_inputs, oracle_query
from test_runtime import LAYER_RTOL, SMALL, check_step, make_step, rel

FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
FP8Q_LAYER_RTOL = 3e-2
"""The layer's output with an fp8 query (per-tensor scale) against the float64 layer: the bf16
layer's 1.2e-2 (test_runtime.LAYER_RTOL) plus the query's e4m3 rounding (3 mantissa bits: a
relative error of RMS 2^-4 / sqrt(3) = 3.6e-2 an element at most, less through the softmax of
unit-scale logits). Measured on these small layers (2026-12-03): 1.1-1.4e-2 (bf16 q: 3.8-3.9e-3)."""


@pytest.fixture(autouse=True)
def _reference_backend(monkeypatch):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")


def fp8_oracle(x: torch.Tensor, scale: float, dtype=FN) -> torch.Tensor:
    """float64 values of fp8(x / scale) (float32 division; conftest's brute-force nearest code,
    ties to even, saturated), times the scale: the dequantized query."""
    y = x.float() / torch.tensor(scale, dtype=torch.float32)
    return fp8_round_oracle(y, dtype).double() * scale


# --- quantize_query / query_scale / mla_query(out_dtype) -------------------------------------------

@pytest.mark.parametrize("dtype", [FN, FNUZ])
def test_quantize_query_per_tensor(dtype):
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(7, 12, 576, generator=g) * 3).to(torch.bfloat16)
    q[0, 0, :5] = torch.tensor([0.0, -0.0, 1e-30, -1e-6, 2.0 ** -20])        # zeros, tiny values
    q8, q_scale = kimi_ops.quantize_query(q, dtype=dtype)
    fmax = torch.finfo(dtype).max
    assert q8.dtype == dtype and q8.shape == q.shape and q_scale.dtype == torch.float32 and q_scale.shape == (1,)
    assert float(q_scale) == float(q.float().abs().max() / torch.tensor(fmax)), "float32 amax / fmax"
    assert float(q8.float().abs().max()) == fmax, "the amax lands on the format's max"
    assert torch.equal(q8.double() * q_scale.double(), fp8_oracle(q.float(), float(q_scale), dtype))
    # a static scale: saturates what is above its range
    s = torch.tensor([float(q_scale) / 4])
    q8s, s_out = kimi_ops.quantize_query(q, q_scale=s, dtype=dtype)
    assert s_out is s and torch.equal(q8s.double() * s.double(), fp8_oracle(q.float(), float(s), dtype))
    assert float(q8s.float().abs().max()) == fmax
    # all zero / empty: scale 1, no NaN
    z8, zs = kimi_ops.quantize_query(torch.zeros(2, 3, 576, dtype=torch.bfloat16), dtype=dtype)
    assert float(zs) == 1.0 and (z8.float() == 0).all()
    e8, es = kimi_ops.quantize_query(torch.zeros(0, 3, 576, dtype=torch.bfloat16), dtype=dtype)
    assert e8.shape == (0, 3, 576) and float(es) == 1.0


def test_quantize_query_errors():
    q = torch.randn(2, 3, 576).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"quantize_query: dtype must be torch.float8_e4m3fn or "):
        kimi_ops.quantize_query(q, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"q_scale must be a float32 tensor of one element"):
        kimi_ops.quantize_query(q, q_scale=torch.ones(2))
    with pytest.raises(ValueError, match=r"q_scale must be a float32 tensor"):
        kimi_ops.quantize_query(q, q_scale=torch.ones(1, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"quantize_query: q_scale must be on q's device \(cpu\)"):
        kimi_ops.quantize_query(q, q_scale=torch.ones(1, device="meta"))
    q_nope, q_pe, w_uk, _ = make_query_inputs(2, 3)
    with pytest.raises(ValueError, match=r"mla_query: q_scale must be None for a bf16 output"):
        kimi_ops.mla_query(q_nope, q_pe, w_uk, q_scale=torch.ones(1))
    with pytest.raises(ValueError, match=r"mla_query: out_dtype must be torch.float8_e4m3fn"):
        kimi_ops.mla_query(q_nope, q_pe, w_uk, out_dtype=torch.float16)


@pytest.mark.parametrize("mxfp4", [False, True])
@pytest.mark.parametrize("pad", [None, 16])
def test_mla_query_fp8_out(mxfp4, pad):
    """mla_query(out_dtype=fp8) is M1a's bf16 query quantized per tensor (bit for bit), within
    the e4m3 rounding of the float64 query; pad heads stay zero."""
    q_nope, q_pe, w_uk, w_uk_scale = make_query_inputs(5, 12, mxfp4=mxfp4, seed=2)
    q16 = kimi_ops.mla_query(q_nope, q_pe, w_uk, w_uk_scale, pad_heads=pad)
    q8, q_scale = kimi_ops.mla_query(q_nope, q_pe, w_uk, w_uk_scale, pad_heads=pad, out_dtype=FN)
    want8, want_scale = kimi_ops.quantize_query(q16)
    assert torch.equal(q8.view(torch.uint8), want8.view(torch.uint8)) and torch.equal(q_scale, want_scale)
    deq = q8.double() * q_scale.double()
    exact = oracle_query(q_nope, q_pe, w_uk, w_uk_scale, pad)
    # e4m3: 3 mantissa bits (half a quantum 2^-4 relative) + the bf16 rounding before it
    assert ((deq - exact).abs() <= exact.abs() * (2.0 ** -4 + 2.0 ** -8) + float(q_scale) * 2.0 ** -9).all()
    if pad:
        assert (q8[:, 12:].float() == 0).all()


def test_interp_mla_query_fp8_out():
    # the Triton M1a kernel feeding the quantize (the triton backend's path)
    run_interpreted("test_runtime_fp8q", """
import os, kimi_ops
os.environ["KIMI_OPS_BACKEND"] = "triton"
from test_query import make_query_inputs
q_nope, q_pe, w_uk, w_uk_scale = make_query_inputs(17, 2, mxfp4=True, seed=1)
q8, s = kimi_ops.mla_query(q_nope, q_pe, w_uk, w_uk_scale, pad_heads=4, out_dtype=torch.float8_e4m3fn)
os.environ["KIMI_OPS_BACKEND"] = "reference"
r8, rs = kimi_ops.mla_query(q_nope, q_pe, w_uk, w_uk_scale, pad_heads=4, out_dtype=torch.float8_e4m3fn)
assert q8.shape == (17, 4, 576) and q8.dtype == torch.float8_e4m3fn
# the bf16 queries agree to a rounding; their quantizations to one fp8 step where they differ
assert abs(float(s) - float(rs)) <= float(rs) * 2 ** -7
d = (q8.double() * s.double() - r8.double() * rs.double()).abs()
assert (d <= r8.double().abs() * float(rs) * 2 ** -3 + float(rs) * 2 ** -8).all()
""")


# --- the runtime's bf16 switch ------------------------------------------------------------------

def test_switch_defaults():
    layer = MLADecodeLayer(MLAConfig.small())
    assert layer.bf16 is None and layer.query_bf16, "bf16 at DCP1 unless asked"
    assert not MLADecodeLayer(MLAConfig.small(), bf16=False).query_bf16
    assert "query bf16" in repr(layer)
    with pytest.raises(ValueError, match="query_dtype must be"):
        MLADecodeLayer(MLAConfig.small(), query_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q_scale must be None or a finite float > 0"):
        MLADecodeLayer(MLAConfig.small(), q_scale=0.0)
    assert "q_scale" not in MLADecodeLayer(MLAConfig.small(), q_scale=0.5).state_dict(), "not a weight"


def test_pre_fp8_is_the_bf16_query_quantized():
    layer, cache, md, hidden, _ = make_step(MLAConfig.small(), SMALL, qlen=2)
    q16, gate16 = mla.pre(layer, hidden, cache.clone(), md, bf16=True)
    q, gate = mla.pre(layer, hidden, cache.clone(), md, bf16=False)
    assert isinstance(q, mla.FP8Query) and q.shape == q16.shape and q.q8.dtype == FN
    want8, want_scale = kimi_ops.quantize_query(q16)
    assert torch.equal(q.q8.view(torch.uint8), want8.view(torch.uint8)) and torch.equal(q.q_scale, want_scale)
    assert torch.equal(gate, gate16)
    # a static scale: the layer's
    layer.q_scale = torch.tensor([0.25])
    q, _ = mla.pre(layer, hidden, cache.clone(), md, bf16=False)
    assert float(q.q_scale) == 0.25 and torch.equal(q.q8, kimi_ops.quantize_query(q16, q_scale=layer.q_scale)[0])
    # m1c_inputs carries q_scale; its partials merge to attend's result
    layer.q_scale = None
    q, _ = mla.pre(layer, hidden, cache, md, bf16=False)
    o, lse = mla.attend(layer, q, cache, md)
    m1c_in, po, plse = mla.m1c_inputs(layer, q, cache, md, num_splits=3)
    assert m1c_in["q_scale"] is q.q_scale and m1c_in["q"] is q.q8 and po.dtype == torch.bfloat16
    o2, lse2 = kimi_ops.mla_merge(*kimi_ops.mla_decode_splitkv(**m1c_in))
    assert (o2.double() - o.double()).norm() <= 4e-3 * o.double().norm()
    assert (lse2 - lse)[torch.isfinite(lse)].abs().max() <= 1e-5


@pytest.mark.parametrize("weights", ["bf16", "mxfp4"])
@pytest.mark.parametrize("static", [False, True])
def test_layer_fp8_query_against_float64(weights, static):
    """The whole step with the fp8 query against the float64 (un-absorbed) layer: within
    FP8Q_LAYER_RTOL, and the bf16 query's step on the same inputs within LAYER_RTOL."""
    kw = dict(q_scale=0.02) if static else {}
    layer, cache, md, hidden, bt = make_step(MLAConfig.small(), SMALL, qlen=2, weights=weights, bf16=False, **kw)
    cache16 = cache.clone()
    err8 = check_step(layer, cache, md, hidden, bt, SMALL, rtol=FP8Q_LAYER_RTOL)
    layer.bf16 = True
    err16 = check_step(layer, cache16, md, hidden, bt, SMALL, rtol=LAYER_RTOL)
    print(f"weights {weights}, static {static}: rel L2 vs float64: fp8 q {err8:.2e}, bf16 q {err16:.2e}")
    assert err16 < err8, "the fp8 query adds error"


def test_compiled_fp8_step_matches_eager():
    torch._dynamo.reset()
    layer, cache, md, hidden, _ = make_step(MLAConfig.small(), SMALL, qlen=1, bf16=False)
    eager_cache, compiled_cache = cache.clone(), cache.clone()
    with torch.no_grad():
        want = layer(hidden, eager_cache, md)
        got = torch.compile(lambda h, c: mla.layer(layer, h, c, md), fullgraph=True)(hidden, compiled_cache)
    got = torch.nn.functional.linear(got, layer.o_proj.weight)
    assert torch.equal(eager_cache.view(torch.uint8), compiled_cache.view(torch.uint8))
    assert rel(got, want) <= 1e-2


# --- GPU (the lead's H200 run) ------------------------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["bf16", "mxfp4"])
def test_gpu_kimi_k3_fp8_query_layer(monkeypatch, weights):
    """The Kimi-K3 layer with the fp8 query on the GPU backends (auto: cuda -> its Triton branch for
    an fp8 q) against float64, and a CUDA graph of the step replayed on new hidden states (each
    step's q_scale computed on the device from its own amax): equal to eager."""
    from kimi_ops.runtime.graph import GraphedStep, restore, snapshot

    monkeypatch.setenv("KIMI_OPS_BACKEND", "auto")
    lens = [9, 700, 1, 0, 64]
    layer, cache, md, hidden, bt = make_step(MLAConfig.kimi_k3(), lens, qlen=2, weights=weights, block_size=16,
                                             device="cuda", bf16=False)
    start = snapshot(cache, md)
    err = check_step(layer, cache, md, hidden, bt, lens, rtol=FP8Q_LAYER_RTOL)
    print(f"GPU kimi_k3 {weights}, fp8 query: relative L2 error vs float64 {err:.2e}")
    restore(start)

    def step(layer, h, cache, md):  # this step again on other hidden states (decode_step would advance md)
        return layer(h, cache, md)

    gen = torch.Generator(device="cuda").manual_seed(4)
    hiddens = [torch.randn(hidden.shape, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(3)]
    with torch.no_grad():
        eager = []
        for h in hiddens:
            saved = snapshot(cache, md)
            eager.append(step(layer, h, cache, md).clone())
            restore(saved)
            assert torch.isfinite(eager[-1]).all(), "no NaN / inf (unused cache rows hold NaN)"
        graphed = GraphedStep(step, layer, cache, md, hiddens[0])
        for h, want in zip(hiddens, eager):
            saved = snapshot(cache, md)
            got = graphed(h).clone()
            restore(saved)
            assert rel(got, want) <= 1e-3, "the replay takes each step's own scale"


def _compiled_dcp_rank(rank, world, init_file):
    import torch.distributed as dist

    from kimi_ops.runtime.layer import random_hf_weights
    from kimi_ops.runtime.metadata import allocate_blocks, build_decode_metadata

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        every = MLAConfig(name="dcp_compile", hidden_size=256, total_heads=2 * world, tp=1, q_lora_rank=128)
        layer = MLADecodeLayer(every.replace(tp=world), seed=None, dcp_group=dist.group.WORLD)
        layer.load_weights(random_hf_weights(every, seed=0), tp_rank=rank)
        assert not layer.query_bf16
        bt, nb = allocate_blocks(3, 16, 4, seed=1)
        md = build_decode_metadata(torch.tensor([3, 5, 9], dtype=torch.int32), bt, block_size=4, qlen=1,
                                   max_tokens=48, dcp_world_size=world, dcp_rank=rank)
        cache = layer.new_kv_cache(nb, 4)
        hidden = torch.randn(3, 256, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
        with torch.no_grad():
            want = mla.layer(layer, hidden, cache.clone(), md)
            got = torch.compile(lambda x, c: mla.layer(layer, x, c, md), fullgraph=True)(hidden, cache.clone())
        assert rel(got, want) <= 1e-2, rel(got, want)
    finally:
        dist.destroy_process_group()


def test_compiled_dcp_step_with_the_fp8_query(tmp_path):
    """torch.compile(fullgraph=True) takes the DCP step's fp8 query: the amax all-reduce, the fp8
    gather as bytes (gloo, 2 ranks), equal to eager to a bf16 rounding."""
    import torch.multiprocessing as mp

    # Now and then (4 runs of 27 on 2 cores, with kimi_ops._C built, before and after session 56)
    # a rank aborts early in torch.compile with "terminate called without an active exception"
    # (SIGABRT), a process-level failure, not a wrong result (a failed check raises in the rank and
    # comes back as ProcessRaisedException): such a run is tried again, twice at most.
    for attempt in range(3):
        try:
            mp.spawn(_compiled_dcp_rank, args=(2, str(tmp_path / f"init{attempt}")), nprocs=2, join=True)
            return
        except mp.ProcessExitedException as e:
            if e.signal_name != "SIGABRT" or attempt == 2:
                raise
