"""The fp8 query (issue 28): q in float8 with ``q_scale``, real q = q8 x q_scale.

Contract (README, Numerics): against float64 on the same fp8 q, q_scale and fp8 cache, rel L2
of o <= 4e-3, |lse - ref| <= 4e-3, -inf exactly where the reference has it. The oracles are
conftest's / test_triton_attention's brute-force loops (independent of kimi_ops.reference), fed
the fp8 query dequantized in float64.

CPU (CI): the reference through the public ops (every path: splits, DCP bounds, block caches,
empty requests, every error), and the Triton kernel under TRITON_INTERPRET=1 in a subprocess
(poisoned outputs, e4m3fn / e4m3fnuz queries and caches, the e4m3fnuz byte path of NVIDIA).
GPU (skipped without one): the grid on the triton and cuda backends, and a CUDA graph replayed
with a new q_scale written in place.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

import kimi_ops
from conftest import (assert_attention_close, dcp_shard, make_decode_case, oracle_decode,
                      quantize_per_tensor, run_interpreted)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP8Q_RTOL = 4e-3       # the fp8-query contract: rel L2 of o
FP8Q_LSE_ATOL = 4e-3   # |lse - ref|
FN, FNUZ = torch.float8_e4m3fn, torch.float8_e4m3fnuz
# (cache dtype, q dtype): e4m3fn q with either cache, e4m3fnuz q only with an e4m3fnuz cache
PAIRS = [(FN, FN), (FNUZ, FN), (FNUZ, FNUZ)]


def fp8_case(lengths, *, q_dtype=FN, kv_dtype=FN, heads=12, qlen=1, seed=0, block_size=None,
             device="cpu", q_gain=1.0):
    """A DecodeCase whose q is fp8 (per-tensor scale from the amax) and its q_scale."""
    case = make_decode_case(lengths, heads=heads, qlen=qlen, block_size=block_size, dtype=kv_dtype,
                            seed=seed, device=device)
    q8, q_scale = quantize_per_tensor(case.q.float() * q_gain, q_dtype)
    case.q = q8
    return case, q_scale


# --- the reference (CPU) ------------------------------------------------------------------------

@pytest.fixture
def reference(monkeypatch):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")


@pytest.mark.parametrize("kv_dtype,q_dtype", PAIRS, ids=lambda d: str(d).split("_")[-1])
@pytest.mark.parametrize("lengths,qlen,heads,block", [
    ([5, 0, 17, 40], 1, 12, None),
    ([9, 2, 1], 3, 16, 8),        # n < qlen, a paged cache
    ([0, 0], 2, 4, None),         # nothing visible
    ([130], 8, 1, None),
])
def test_reference_matches_oracle(reference, kv_dtype, q_dtype, lengths, qlen, heads, block):
    case, q_scale = fp8_case(lengths, q_dtype=q_dtype, kv_dtype=kv_dtype, heads=heads, qlen=qlen,
                             block_size=block, seed=len(lengths) * 10 + qlen)
    o_ref, lse_ref = oracle_decode(case, q_scale)
    o, lse = kimi_ops.mla_decode(*case.args, q_scale=q_scale, **case.kwargs)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    # the reference is float64 with one rounding: tighter than the contract
    assert_attention_close(o, lse, o_ref, lse_ref, rtol=4e-3, lse_atol=1e-5)
    for splits in (1, 3):
        o_part, lse_part = kimi_ops.mla_decode_splitkv(*case.args, num_splits=splits, q_scale=q_scale,
                                                       **case.kwargs)
        assert o_part.shape == (splits, *case.q.shape[:2], 512) and o_part.dtype == torch.bfloat16
        o, lse = kimi_ops.mla_merge(o_part, lse_part)
        assert_attention_close(o, lse, o_ref, lse_ref, rtol=FP8Q_RTOL, lse_atol=1e-5)


def test_reference_q_scale_is_the_scale(reference):
    """A power-of-two q_scale gives bit for bit the bf16 query q8 * q_scale (exact in bf16);
    another scale moves the result as q8 * q_scale does (vs the oracle)."""
    case, _ = fp8_case([33, 7], heads=12, qlen=2, seed=3)
    q8 = case.q
    for s in (2.0 ** -6, 2.0 ** 3):
        q_scale = torch.tensor([s], dtype=torch.float32)
        o8, lse8 = kimi_ops.mla_decode(*case.args, num_splits=2, q_scale=q_scale, **case.kwargs)
        q16 = (q8.float() * s).to(torch.bfloat16)
        o16, lse16 = kimi_ops.mla_decode(q16, *case.args[1:], num_splits=2, **case.kwargs)
        assert torch.equal(o8, o16) and torch.equal(lse8, lse16)
    q_scale = torch.tensor([0.0123], dtype=torch.float32)
    o, lse = kimi_ops.mla_decode(*case.args, q_scale=q_scale, **case.kwargs)
    assert_attention_close(o, lse, *oracle_decode(case, q_scale), rtol=4e-3, lse_atol=1e-5)
    o1, lse1 = kimi_ops.mla_decode(*case.args, q_scale=torch.ones(1), **case.kwargs)
    assert not torch.allclose(lse1, lse), "q_scale must change the scores"


def test_reference_dcp_shards_merge_to_the_whole(reference):
    """DCP with an fp8 query: each rank's shard with global bounds, merged, is the whole."""
    case, q_scale = fp8_case([40, 3, 0, 17], heads=8, qlen=2, seed=5)
    o_ref, lse_ref = oracle_decode(case, q_scale)
    world = 3
    seq_lens = torch.tensor(case.lengths, dtype=torch.int32)
    parts = []
    for rank in range(world):
        indptr, indices = dcp_shard(case, rank, world)
        parts.append(kimi_ops.mla_decode(case.q, case.kv_cache, indptr, indices, q_scale=q_scale, seq_lens=seq_lens,
                                         dcp_rank=rank, dcp_world_size=world, **case.kwargs))
    o, lse = kimi_ops.mla_merge(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    assert_attention_close(o, lse, o_ref, lse_ref, rtol=FP8Q_RTOL, lse_atol=1e-5)


def test_reference_no_requests(reference):
    q_scale = torch.ones(1)
    q = torch.zeros(0, 12, 576).to(FN)
    cache = torch.zeros(4, 576).to(FN)
    indptr, indices = torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    o, lse = kimi_ops.mla_decode(q, cache, indptr, indices, qlen=1, scale=0.1, kv_scale=1.0, q_scale=q_scale)
    assert o.shape == (0, 12, 512) and o.dtype == torch.bfloat16 and lse.shape == (0, 12)
    o_part, _ = kimi_ops.mla_decode_splitkv(q, cache, indptr, indices, qlen=1, scale=0.1, kv_scale=1.0,
                                            num_splits=2, q_scale=q_scale)
    assert o_part.shape == (2, 0, 12, 512)


# --- errors -------------------------------------------------------------------------------------

ERRORS = {
    "fp8 q without q_scale": (lambda c, s: (c.q, c.kv_cache, None),
                              r"q_scale must be a float32 tensor of one element .* when q is torch.float8_e4m3fn"),
    "bf16 q with q_scale": (lambda c, s: (c.q.float().to(torch.bfloat16), c.kv_cache, s),
                            r"q_scale must be None when q is torch.bfloat16"),
    "q_scale float64": (lambda c, s: (c.q, c.kv_cache, s.double()),
                        r"q_scale must be a float32 tensor of one element .*got .*float64"),
    "q_scale python float": (lambda c, s: (c.q, c.kv_cache, 0.5), None),  # the schema refuses it
    "q_scale two elements": (lambda c, s: (c.q, c.kv_cache, s.repeat(2)),
                             r"q_scale must be a float32 tensor of one element \(one per-tensor scale\), "
                             r"got shape \(2,\)"),
    "q_scale per head": (lambda c, s: (c.q, c.kv_cache, s.repeat(4, 1)), r"q_scale must be .*one element"),
    "q_scale device": (lambda c, s: (c.q, c.kv_cache, s.to("meta")), r"q_scale must be on q's device \(cpu\)"),
    "fnuz q with fn cache": (lambda c, s: (c.q.float().to(FNUZ), c.kv_cache, s),
                             r"q must be float8_e4m3fn with a torch.float8_e4m3fn cache"),
    "float16 q": (lambda c, s: (c.q.half(), c.kv_cache, None), r"q must be a \[T, H, 576\] bfloat16 tensor "
                  r"\(or fp8 e4m3fn / e4m3fnuz with q_scale\), got .*float16"),
}


@pytest.mark.parametrize("op", ["mla_decode", "mla_decode_splitkv"])
@pytest.mark.parametrize("name", list(ERRORS))
def test_fp8q_bad_input(reference, op, name):
    case, q_scale = fp8_case([6, 3], heads=4, qlen=2, seed=9)
    q, cache, s = ERRORS[name][0](case, q_scale)
    message = ERRORS[name][1]
    fn = getattr(kimi_ops, op)
    extra = dict(num_splits=2) if op == "mla_decode_splitkv" else {}
    call = lambda: fn(q, cache, case.kv_indptr, case.kv_indices, q_scale=s, **extra, **case.kwargs)  # noqa: E731
    if message is None:
        with pytest.raises((TypeError, RuntimeError)):
            call()
        return
    with pytest.raises(ValueError, match=message):
        call()
    # the fake implementation runs the same checks (torch.compile fails the same way)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(ValueError, match=message):
        call()


# --- the Triton kernel under the interpreter (CPU, subprocess) ----------------------------------

def check_triton_fp8q(lens, qlen, H, S, *, kv_dtype=FN, q_dtype=FN, oob=0, gen=None, device="cpu",
                      kv_scale=0.5, q_gain=1.0, kernels=None, merge=None, pow2_exact=True):
    """The Triton split kernel (or ``kernels``') on an fp8 q with a per-tensor amax scale, into
    NaN-poisoned outputs, merged, against the float64 oracle on q8 * q_scale: the fp8-query
    contract; a power-of-two scale gives the bf16 query q8 * scale (``pow2_exact``: where one
    kernel serves both queries; bit for bit in the interpreter, on the GPU o to 1e-3 rel L2 and the
    lse to 2^-17 relative; else within the contract). Returns (rel L2, max |dlse|)."""
    import test_triton_attention as t
    if kernels is None:
        import kimi_ops.kernels.attention as kernels
    merge = merge or kernels.mla_merge
    q, kv, indptr, idx = t.make_inputs(lens, qlen, H, dtype=kv_dtype, kv_scale=kv_scale, oob=oob, device=device,
                                       gen=gen)
    q8, q_scale = quantize_per_tensor(q.float() * q_gain, q_dtype)
    real = torch.empty
    torch.empty = t._poisoned_empty(real)
    try:
        o_part, lse_part = kernels.mla_decode_splitkv(q8, kv, indptr, idx, qlen, t.SCALE, kv_scale, S,
                                                      q_scale=q_scale)
    finally:
        torch.empty = real
    T = q.shape[0]
    assert o_part.shape == (S, T, H, 512) and o_part.dtype == torch.bfloat16 and lse_part.dtype == torch.float32
    assert not torch.isnan(o_part).any() and not torch.isnan(lse_part).any(), "an output left unwritten or NaN"
    assert (o_part[torch.isneginf(lse_part)] == 0).all(), "an empty split stores o = 0"
    o, lse = merge(o_part, lse_part)
    ro, rl = t.oracle(q8.double() * q_scale.double(), kv, indptr, idx, qlen, t.SCALE, kv_scale)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl)), "-inf exactly where the reference has it"
    fin = ~torch.isneginf(rl)
    assert (o[~fin] == 0).all()
    lerr = (lse.double()[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
    den = ro.norm().item()
    err = (o.double() - ro).norm().item() / den if den > 0 else o.double().norm().item()
    assert err <= FP8Q_RTOL, f"relative L2 error {err}"
    assert lerr <= FP8Q_LSE_ATOL, f"lse error {lerr}"
    # the scale is read from the device and applied as q8 * q_scale: a power of two is exact
    if q_dtype == FN:
        p2 = torch.tensor([2.0 ** -5], dtype=torch.float32, device=device)
        a = kernels.mla_decode_splitkv(q8, kv, indptr, idx, qlen, t.SCALE, kv_scale, S, q_scale=p2)
        q16 = (q8.float() * p2).to(torch.bfloat16)
        if pow2_exact:
            b = kernels.mla_decode_splitkv(q16, kv, indptr, idx, qlen, t.SCALE, kv_scale, S)
            assert torch.equal(torch.isneginf(a[1]), torch.isneginf(b[1]))
            if device == "cpu":
                assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), "q_scale = 2^-5 != the bf16 query q8 * 2^-5"
            else:
                # compiled for the GPU, the two queries are two specializations of the kernel, and the
                # compiler may contract FMAs differently in each (the H200, H = 12: o a bf16 ulp off
                # in places, the lse 4.75 f32 ulps): tolerances far below what a misapplied scale moves
                fin_ab = ~torch.isneginf(b[1])
                drift = ((a[1][fin_ab] - b[1][fin_ab]).abs()
                         / b[1][fin_ab].abs().clamp_min(1.0)).max().item() if fin_ab.any() else 0.0
                o_rel = ((a[0].double() - b[0].double()).norm() / b[0].double().norm().clamp_min(1e-30)).item()
                assert drift <= 2.0 ** -17 and o_rel <= 1e-3, f"q_scale = 2^-5: lse {drift:.2e}, o {o_rel:.2e} off"
        else:
            o2, lse2 = merge(*a)
            ro2, rl2 = t.oracle(q16, kv, indptr, idx, qlen, t.SCALE, kv_scale)
            fin2 = ~torch.isneginf(rl2)
            assert torch.equal(torch.isneginf(lse2), ~fin2)
            if ro2.norm() > 0:
                assert ((o2.double() - ro2).norm() / ro2.norm()).item() <= FP8Q_RTOL
            if fin2.any():
                assert (lse2.double()[fin2] - rl2[fin2]).abs().max().item() <= FP8Q_LSE_ATOL
    return err, lerr


def _interp(body, seed=0, mma="bf16", timeout=300):
    """``body`` under the interpreter (conftest.run_interpreted), with this module as ``f``."""
    run_interpreted("import test_fp8_query as f\nfrom test_fp8_query import FN, FNUZ", body, seed=seed,
                    timeout=timeout, KIMI_OPS_TRITON_MMA=mma)


@pytest.mark.parametrize("mma", ["bf16", "fp8"])
def test_interp_fp8q_e4m3fn(mma):
    # the first generation on an fp8 q; the KV side's edges (n < qlen, out-of-range rows,
    # nothing visible) in one MMA scheme: the fp8 one takes them with a bf16 q in
    # test_triton_attention.test_interp_decode_e4m3fn[fp8-first]
    edges = "" if mma == "fp8" else """
f.check_triton_fp8q([5, 1, 0, 2], 4, 3, 9, gen=g)         # more splits than tokens, n < qlen
f.check_triton_fp8q([80, 9], 3, 12, 2, oob=6, gen=g)      # out-of-range indices read as zero rows
f.check_triton_fp8q([0, 0], 2, 12, 4, gen=g)              # nothing visible at all
"""
    _interp("""
f.check_triton_fp8q([100, 0, 3, 70], 2, 12, 3, gen=g)     # zero-length and short requests, splits
f.check_triton_fp8q([40], 1, 12, 1, gen=g, q_gain=1e-3)   # a small query: a small q_scale
f.check_triton_fp8q([40, 3], 2, 4, 2, gen=g, pow2_exact=False)   # the GPU cuda backend's check of 2^-5
""" + edges, mma=mma)


def test_interp_fp8q_fnuz():
    # gfx942's formats: an e4m3fn / e4m3fnuz q on an e4m3fnuz cache; then NVIDIA's path for an
    # e4m3fnuz q (and cache): bytes decoded in the kernel (forced here)
    _interp("""
f.check_triton_fp8q([70, 33, 0], 2, 12, 2, kv_dtype=FNUZ, q_dtype=FN, gen=g)
f.check_triton_fp8q([50, 4], 3, 4, 3, kv_dtype=FNUZ, q_dtype=FNUZ, oob=3, gen=g)
import kimi_ops.kernels.attention as A
A.native_fnuz = lambda: False   # q and cache as e4m3fnuz codes (A._as_codes)
f.check_triton_fp8q([70, 33, 0], 2, 12, 2, kv_dtype=FNUZ, q_dtype=FNUZ, gen=g)
""")


def test_interp_fp8q_through_the_op():
    # the public op on the triton backend (the cuda backend's fallback branch runs this kernel)
    _interp("""
import os, kimi_ops
from conftest import oracle_decode, assert_attention_close
os.environ["KIMI_OPS_BACKEND"] = "triton"
case, q_scale = f.fp8_case([64, 0, 9], heads=12, qlen=2, seed=4, block_size=16)
o, lse = kimi_ops.mla_decode(*case.args, num_splits=3, q_scale=q_scale, **case.kwargs)
assert_attention_close(o, lse, *oracle_decode(case, q_scale), rtol=f.FP8Q_RTOL, lse_atol=f.FP8Q_LSE_ATOL)
""")


# --- the fp8-query variants cross-compile (no GPU) -----------------------------------------------

@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles real kernels")
@pytest.mark.parametrize("target", ["sm90", "gfx950", "gfx942"])
def test_fp8q_variants_cross_compile(target, tmp_path):
    """The split kernel with an e4m3fn q (CROSS_COMPILE_SPECS' *_q8) compiles for every target and
    keeps its 16-bit MMAs (the q is converted in registers): bf16 on AMD, f16 on NVIDIA (the
    first generation's f16 dots)."""
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import cross_compile

    res = cross_compile.run(target, str(tmp_path), only=["splitkv_bf16_fn_m16_q8", "splitkv_bf16_fn_m64_q8"],
                            quiet=True)
    assert len(res) == 2, res
    kind = ".f16.f16" if target == "sm90" else "bf16"
    for r in res:
        assert r["mma"] and all(kind in k and "e4m3" not in k and "fp8" not in k for k in r["mma"]), \
            (target, r["name"], r["mma"])


# --- GPU (the lead's H200 run) ------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _backend_ready(backend):
    from kimi_ops import dispatch
    if not torch.cuda.is_available():
        return False
    return dispatch.unavailable_reason(backend, torch.device("cuda")) is None


class _OpKernels:
    """The public ops under a backend, shaped like the kernel modules check_triton_fp8q takes."""

    @staticmethod
    def mla_decode_splitkv(q, kv, indptr, idx, qlen, scale, kv_scale, S, q_scale=None):
        return kimi_ops.mla_decode_splitkv(q, kv, indptr, idx, qlen=qlen, scale=scale, kv_scale=kv_scale,
                                           num_splits=S, q_scale=q_scale)

    mla_merge = staticmethod(kimi_ops.mla_merge)


@gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("H", [12, 96])
def test_gpu_fp8q_grid(backend, H, monkeypatch):
    if not _backend_ready(backend):
        pytest.skip(f"the {backend} backend cannot run here")
    monkeypatch.setenv("KIMI_OPS_BACKEND", backend)
    g = torch.Generator().manual_seed(H)
    worst = (0.0, 0.0)
    for qlen in (1, 2, 4, 8):
        cases = [([0, 1, 2, 7, 63, 64, 65, 300], 3), ([4096, 17, 2500, 0], 8), ([5, 1, 0, 2], 9), ([16384], 32)]
        for lens, S in cases:
            e = check_triton_fp8q(lens, qlen, H, S, device="cuda", gen=g, oob=2 if qlen == 2 else 0,
                                  kernels=_OpKernels, pow2_exact=backend == "triton")
            worst = (max(worst[0], e[0]), max(worst[1], e[1]))
    print(f"fp8 q, {backend}, H={H}: worst rel L2 {worst[0]:.2e}, worst |lse| {worst[1]:.2e}")


@gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_fp8q_cuda_graph_new_scale(backend, monkeypatch):
    """mla_decode on an fp8 q captured in a CUDA graph; q8 and q_scale rewritten in place between
    replays (a scale computed on the device each step): replay == eager, within the contract."""
    if not _backend_ready(backend):
        pytest.skip(f"the {backend} backend cannot run here")
    monkeypatch.setenv("KIMI_OPS_BACKEND", backend)
    case, q_scale = fp8_case([700, 3, 0, 2000], heads=12, qlen=2, seed=21, device="cuda")

    def step():
        return kimi_ops.mla_decode(*case.args, num_splits=4, q_scale=q_scale, **case.kwargs)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, lse_g = step()
    g = torch.Generator().manual_seed(22)
    for gain in (1.0, 37.0, 1e-2):
        q8, s = quantize_per_tensor(torch.randn(case.q.shape, generator=g) * gain)
        case.q.copy_(q8.cuda())
        q_scale.copy_(s.cuda())
        graph.replay()
        o_e, lse_e = step()
        torch.cuda.synchronize()
        assert torch.equal(o_g, o_e) and torch.equal(lse_g, lse_e)
        assert_attention_close(o_g, lse_g, *oracle_decode(case, q_scale), rtol=FP8Q_RTOL, lse_atol=FP8Q_LSE_ATOL)
