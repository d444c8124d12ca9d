"""Triton M1c / M1b / cache-write kernels against a brute-force float64 oracle.

CPU (CI): the kernels run under TRITON_INTERPRET=1 on CPU tensors, in a subprocess
(TRITON_INTERPRET must be set before triton.jit decorates the kernels; the parent pytest
process may already have imported them compiled).  GPU (skipped without CUDA): the
issue's correctness grid and a CUDA-graph capture replayed after changing the inputs in place.
"""
from __future__ import annotations

import math
import os
import sys

import pytest
import torch
import triton
import triton.language as tl

from conftest import run_interpreted

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from kimi_ops.kernels.cache import fp8_value  # noqa: E402

needs_fnuz_triton = pytest.mark.skipif(
    tuple(int(v) for v in triton.__version__.split(".")[:2]) < (3, 7),
    reason="Triton 3.6 cannot lower e4m3fnuz: no interpreter type for it, and gfx942's "
           "float32 -> fp8e4m3fnuz conversion asserts; the fnuz path needs Triton >= 3.7")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SCALE = 1.0 / math.sqrt(192.0)
HAS_CUDA = torch.cuda.is_available()


# ----------------------------------------------------------------------------------------------
# oracle and inputs (shared by the CPU subprocess and the GPU tests)

def make_inputs(lens, qlen, H, *, dtype=torch.float8_e4m3fn, kv_scale=0.5, extra=37, oob=0,
                device="cpu", gen=None):
    """Fresh random inputs: a cache whose rows are randomly permuted among NaN-filled unused
    rows; ``oob`` indices replaced by out-of-range ones (read as zero rows)."""
    R = len(lens)
    total = int(sum(lens))
    N = total + extra
    perm = torch.randperm(N, generator=gen)[:total].to(torch.int32)
    fmax = torch.finfo(dtype).max
    x = torch.randn(N, 576, generator=gen) * 2.0
    kv = (x / kv_scale).clamp(-fmax, fmax).to(dtype)
    used = torch.zeros(N, dtype=torch.bool)
    used[perm.long()] = True
    nan_code = 0x7F if dtype == torch.float8_e4m3fn else 0x80
    kv.view(torch.uint8)[~used] = nan_code
    if oob and total:
        pos = torch.randperm(total, generator=gen)[:oob]
        bad = torch.tensor([N, N + 1000, -1, -7, 2**31 - 1, -2**31], dtype=torch.int32)
        perm[pos] = bad[torch.arange(len(pos)) % len(bad)]
    indptr = torch.zeros(R + 1, dtype=torch.int32)
    if R:
        indptr[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0).to(torch.int32)
    q = torch.randn(R * qlen, H, 576, generator=gen).to(torch.bfloat16)
    return q.to(device), kv.to(device), indptr.to(device), perm.to(device)


def oracle(q, kv, indptr, indices, qlen, scale, kv_scale):
    """float64 brute force: (o [T, H, 512], lse [T, H])."""
    T, H, _ = q.shape
    R = T // qlen
    N = kv.shape[0]
    dev = q.device
    o = torch.zeros(T, H, 512, dtype=torch.float64, device=dev)
    lse = torch.full((T, H), -math.inf, dtype=torch.float64, device=dev)
    ip = indptr.tolist()
    for r in range(R):
        a, b = ip[r], ip[r + 1]
        n = b - a
        if n <= 0:
            continue
        ids = indices[a:b].long()
        ok = (ids >= 0) & (ids < N)
        k = torch.zeros(n, 576, dtype=torch.float64, device=dev)
        k[ok] = kv[ids[ok]].double()
        qq = q[r * qlen:(r + 1) * qlen].double().reshape(qlen * H, 576)
        s = (scale * kv_scale) * (qq @ k.T)  # [qlen*H, n]
        pos = torch.arange(qlen, device=dev).repeat_interleave(H)
        lim = (n - qlen + pos + 1).clamp(0, n)
        vis = torch.arange(n, device=dev)[None, :] < lim[:, None]
        s = s.masked_fill(~vis, -math.inf)
        l = torch.logsumexp(s, dim=1)
        p = torch.exp(s - l[:, None].clamp_min(-1e300)).nan_to_num(0.0)
        oo = kv_scale * (p @ k[:, :512])
        has = lim > 0
        oo[~has] = 0
        o[r * qlen:(r + 1) * qlen] = oo.reshape(qlen, H, 512)
        lse[r * qlen:(r + 1) * qlen] = torch.where(has, l, torch.full_like(l, -math.inf)).reshape(qlen, H)
    return o, lse


def quantize_q(q, dtype=torch.float8_e4m3fn):
    """bf16 q -> (fp8 q, float32 [1] q_scale) with q ~ q8 * q_scale (per-tensor amax scale)."""
    amax = q.float().abs().max().clamp_min(1e-12)
    q_scale = (amax / torch.finfo(dtype).max).reshape(1).to(torch.float32)
    return (q.float() / q_scale).clamp(-torch.finfo(dtype).max, torch.finfo(dtype).max).to(dtype), q_scale


def check_decode(lens, qlen, H, S, *, dtype=torch.float8_e4m3fn, oob=0, device="cpu", gen=None,
                 kv_scale=0.5, kernels=None, fp8_q=False, scale=SCALE, q_mul=None):
    """``kernels``: the module whose mla_decode_splitkv / mla_merge run (default: the Triton
    backend's, :mod:`kimi_ops.kernels.triton_m1c`). ``fp8_q``: q quantized to fp8 with a
    q_scale tensor (issue 28); the oracle takes the same fp8 q and q_scale. ``q_mul``: powers of
    two (a float, or a tensor broadcast to q's [T, H, 1]) multiplied into the bf16 q, exactly."""
    if kernels is None:
        import kimi_ops.kernels.triton_m1c as kernels
    mla_decode_splitkv, mla_merge = kernels.mla_decode_splitkv, kernels.mla_merge

    q, kv, indptr, idx = make_inputs(lens, qlen, H, dtype=dtype, kv_scale=kv_scale, oob=oob,
                                     device=device, gen=gen)
    if q_mul is not None:
        q = q * torch.as_tensor(q_mul, dtype=torch.bfloat16, device=q.device)
    if fp8_q:
        q8, q_scale = quantize_q(q, torch.float8_e4m3fnuz if dtype == torch.float8_e4m3fnuz else torch.float8_e4m3fn)
        o_part, lse_part = mla_decode_splitkv(q8, kv, indptr, idx, qlen, scale, kv_scale, S, q_scale=q_scale)
        q = q8  # for the oracle, with SCALE * q_scale below
    else:
        q_scale = None
        o_part, lse_part = mla_decode_splitkv(q, kv, indptr, idx, qlen, scale, kv_scale, S)
    T = q.shape[0]
    assert o_part.shape == (S, T, H, 512) and o_part.dtype == torch.bfloat16
    assert lse_part.shape == (S, T, H) and lse_part.dtype == torch.float32
    assert not torch.isnan(o_part).any(), "NaN in o_part"
    assert not torch.isnan(lse_part).any(), "NaN in lse_part"
    assert not torch.isposinf(lse_part).any()
    # empty partials are exactly 0 / -inf
    empty = torch.isneginf(lse_part)
    assert (o_part[empty] == 0).all(), "a split with no token must store o = 0"
    o, lse = mla_merge(o_part, lse_part)
    ro, rl = oracle(q, kv, indptr, idx, qlen, scale * (1.0 if q_scale is None else float(q_scale)), kv_scale)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl)), "-inf pattern differs"
    fin = ~torch.isneginf(rl)
    assert (o[~fin] == 0).all()
    lerr = (lse.double()[fin] - rl[fin]).abs().max().item() if fin.any() else 0.0
    den = ro.norm().item()
    err = (o.double() - ro).norm().item() / den if den > 0 else (o.double().norm().item())
    assert lerr <= 1e-3, f"lse error {lerr}"
    assert err <= 4e-3, f"relative L2 error {err}"
    # the partition is a partition: merging the splits in another order gives the same
    perm = torch.randperm(S, generator=gen).to(o_part.device)
    o2, lse2 = mla_merge(o_part[perm].contiguous(), lse_part[perm].contiguous())
    assert torch.equal(torch.isneginf(lse2), torch.isneginf(lse))
    assert (lse2[fin] - lse[fin]).abs().max().item() <= 1e-5 if fin.any() else True
    return err, lerr


def check_rising(H, qlen, rise, *, lens=(1000, 300), splits=(1, 3), kv_scale=2.0, device="cpu",
                 gen=None, kernels=None):
    """Scores that climb (or fall) by ``rise`` natural-log units every 64 tokens (q = 1 in 16
    columns, the token's value in the cache's first 16), so the running max keeps moving and
    |lse| reaches ~rise * n / 128. lse within 1e-3 + 1e-6 |lse| (f32 holds an lse of 5e3 to
    2.4e-4), rel. L2 of o within 4e-3. Returns the worst |dlse|."""
    if kernels is None:
        import kimi_ops.kernels.triton_m1c as kernels
    q, kv, indptr, idx = make_inputs(list(lens), qlen, H, kv_scale=kv_scale, gen=gen)
    q.zero_()
    q[..., :16] = 1.0
    per_unit = SCALE * 16
    fmax = torch.finfo(kv.dtype).max
    for r, n in enumerate(lens):
        t = torch.arange(n, dtype=torch.float32)
        value = (t - n / 2) * (rise / 64) / per_unit
        rows = idx[int(indptr[r]): int(indptr[r + 1])].long()
        kv[rows, :16] = (value / kv_scale).clamp(-fmax, fmax)[:, None].to(kv.dtype)
    q, kv, indptr, idx = (x.to(device) for x in (q, kv, indptr, idx))
    ro, rl = oracle(q, kv, indptr, idx, qlen, SCALE, kv_scale)
    worst = 0.0
    for S in splits:
        o, lse = kernels.mla_merge(*kernels.mla_decode_splitkv(q, kv, indptr, idx, qlen, SCALE, kv_scale, S))
        assert not torch.isnan(o).any()
        fin = ~torch.isneginf(rl)
        assert torch.equal(torch.isneginf(lse), ~fin)
        d = (lse.double()[fin] - rl[fin]).abs()
        worst = max(worst, d.max().item())
        assert (d <= 1e-3 + 1e-6 * rl[fin].abs()).all(), (rise, S, d.max().item(), rl.abs().max().item())
        assert ((o.double() - ro).norm() / ro.norm()).item() <= 4e-3
    return worst


def check_climb(H, qlen, step, *, lens=(1000, 333), splits=(1, 3), kv_scale=0.5, device="cpu",
                gen=None, kernels=None):
    """A dense score climb: random q (every row the same), each token's cache row = noise +
    a_j * sign(q) with a_j rising so that the score climbs by ``step`` natural-log units every
    64 tokens. Unlike :func:`check_rising` every one of the 576 products is nonzero and the dot
    reaches ~1e5, so an MMA whose chained accumulation truncates (instead of rounding) shows
    as an lse bias that grows with the chain. lse within 1e-3 (|lse| < 4096 here: f32 holds
    it to 2.4e-4), rel. L2 of o within 4e-3. Returns the worst |dlse|."""
    if kernels is None:
        import kimi_ops.kernels.triton_m1c as kernels
    q, kv, indptr, idx = make_inputs(list(lens), qlen, H, kv_scale=kv_scale, gen=gen)
    q[:] = q[:1, :1]
    sgn = torch.sign(q[0, 0].float())
    per_unit = SCALE * kv_scale * q[0, 0].float().abs().sum().item()  # score per unit of a_j
    fmax = torch.finfo(kv.dtype).max
    for r, n in enumerate(lens):
        a = torch.arange(n, dtype=torch.float32) * (step / 64) / per_unit
        a = a - a[-1] / 2
        rows = idx[int(indptr[r]): int(indptr[r + 1])].long()
        noise = torch.randn(n, 576, generator=gen)
        kv[rows] = (noise + a[:, None] * sgn[None, :]).clamp(-fmax, fmax).to(kv.dtype)
    q, kv, indptr, idx = (x.to(device) for x in (q, kv, indptr, idx))
    ro, rl = oracle(q, kv, indptr, idx, qlen, SCALE, kv_scale)
    fin = ~torch.isneginf(rl)
    assert rl[fin].abs().max().item() < 4096
    worst = 0.0
    for S in splits:
        o, lse = kernels.mla_merge(*kernels.mla_decode_splitkv(q, kv, indptr, idx, qlen, SCALE, kv_scale, S))
        assert not torch.isnan(o).any()
        assert torch.equal(torch.isneginf(lse), ~fin)
        d = (lse.double()[fin] - rl[fin]).abs().max().item()
        worst = max(worst, d)
        assert d <= 1e-3, (step, S, d, rl[fin].abs().max().item())
        assert ((o.double() - ro).norm() / ro.norm()).item() <= 4e-3
    return worst


def _poisoned_empty(real_empty):
    # torch.empty that returns NaN-filled float tensors: an output element the kernel does not
    # write (e.g. a row whose splits are all empty, which must read back exactly 0) shows up
    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t
    return empty


def _merge_poisoned(o_part, lse_part):
    from kimi_ops.kernels.attention import mla_merge

    real = torch.empty
    torch.empty = _poisoned_empty(real)
    try:
        return mla_merge(o_part, lse_part)
    finally:
        torch.empty = real


def check_merge(S, T, H, device="cpu", gen=None, spread=4.0, dead_frac=0.4, perm=True, dead_nan=False):
    """mla_merge against a float64 merge.  lse_s ~ U(-spread, spread); a fraction dead_frac of
    the splits is empty (o = 0, lse = -inf); flat row 0 has every split empty, flat row 1
    exactly one live split (its o and lse must come back bit for bit), flat row 2 (S > 1)
    only its last split live, flat row 3 every split live with lse rising.  perm: also merge
    the splits in another order (same lse within 1e-5).  dead_nan: the empty splits' o is NaN instead of 0 (stricter than the
    contract: an empty split's o must not be read into the sum at all)."""
    o_part = torch.randn(S, T, H, 512, generator=gen).to(torch.bfloat16)
    lse_part = (torch.rand(S, T, H, generator=gen) * 2 - 1) * spread
    dead = torch.rand(S, T, H, generator=gen) < dead_frac
    TH = T * H
    flat_dead = dead.view(S, TH)
    if TH > 0:
        flat_dead[:, 0] = True                      # a row every split of which is empty
    one = None
    if TH > 1:
        one = int(torch.randint(0, S, (1,), generator=gen))
        flat_dead[:, 1] = True                      # a row with exactly one live split
        flat_dead[one, 1] = False
    if TH > 2 and S > 1:
        flat_dead[:, 2] = True                      # only the last split (of the last chunk) live
        flat_dead[S - 1, 2] = False
    if TH > 3:
        flat_dead[:, 3] = False                     # every split live, lse rising with the split:
        lse_part.view(S, TH)[:, 3] = torch.linspace(-spread, spread, S)  # later chunks rescale
    lse_part[dead] = -math.inf
    o_part[dead] = math.nan if dead_nan else 0.0
    o, lse = _merge_poisoned(o_part.to(device), lse_part.to(device))
    assert o.shape == (T, H, 512) and lse.shape == (T, H)
    o, lse = o.cpu(), lse.cpu()
    o_in = o_part
    o_part = o_part.masked_fill(dead[..., None], 0.0)  # for the reference
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    lp = lse_part.double()
    rl = torch.logsumexp(lp, dim=0)
    w = torch.exp(lp - rl.clamp_min(-1e300)[None]).nan_to_num(0.0)
    ro = (w[..., None] * o_part.double()).sum(0)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    fin = ~torch.isneginf(rl)
    if fin.any():
        assert (lse.double()[fin] - rl[fin]).abs().max().item() <= 1e-5
    assert (o[~fin] == 0).all()
    if TH:
        assert (o.view(TH, 512)[0] == 0).all() and torch.isneginf(lse.view(TH)[0])
    if one is not None:
        assert torch.equal(o.view(TH, 512)[1], o_part.view(S, TH, 512)[one, 1])
        assert lse.view(TH)[1].item() == lse_part.view(S, TH)[one, 1].item()
    if TH > 2 and S > 1:
        assert torch.equal(o.view(TH, 512)[2], o_part.view(S, TH, 512)[S - 1, 2])
    # every element: one bf16 rounding (<= 2^-9 relative) plus f32 accumulation error
    mag = (w[..., None] * o_part.double().abs()).sum(0)
    bad = (o.double() - ro).abs() > ro.abs() * 2.0 ** -8 + mag * 1e-5 + 1e-30
    assert not bad.any(), (bad.nonzero()[:5], o.double()[bad][:5], ro[bad][:5])
    if ro.norm() > 0:
        err = (o.double() - ro).norm() / ro.norm()
        assert err <= 3e-3, err
    if not perm or S == 1:
        return
    # the splits in another order: the same lse within 1e-5
    perm = torch.randperm(S, generator=gen)
    o2, lse2 = _merge_poisoned(o_in[perm].contiguous().to(device), lse_part[perm].contiguous().to(device))
    o2, lse2 = o2.cpu(), lse2.cpu()
    assert torch.equal(torch.isneginf(lse2), torch.isneginf(lse))
    if fin.any():
        assert (lse2[fin] - lse[fin]).abs().max().item() <= 1e-5
    assert ((o2.double() - o.double()).abs() <= o.double().abs() * 2.0 ** -7 + mag * 2e-5 + 1e-30).all()


def check_cache_write(dtype, xdt, sdt, T=24, N=61, device="cpu", gen=None):
    from kimi_ops.kernels.cache import mla_cache_write

    fmax = torch.finfo(dtype).max
    x = torch.randn(T, 576, generator=gen) * 4
    x[:3] *= 1000.0        # saturation
    x[3:6] *= 1e-3         # subnormals
    x[6, :7] = torch.tensor([0.0, -0.0, math.inf, -math.inf, 448.0, -240.0, 232.0])
    x = x.to(xdt)
    kv_c, k_pe = x[:, :512].contiguous(), x[:, 512:].contiguous()
    slots = torch.randperm(N, generator=gen)[:T].to(sdt)
    slots[1] = -1
    slots[2] = N
    slots[4] = N + 100
    cache = torch.empty(N, 576, dtype=torch.uint8)
    cache.random_(0, 256, generator=gen)
    cache = cache.view(dtype)
    for kv_scale in (0.37, 1.0, 0.0123):
        ref = cache.clone()
        got = cache.clone().to(device)
        mla_cache_write(kv_c.to(device), k_pe.to(device), got, slots.to(device), kv_scale)
        ok = (slots >= 0) & (slots < N)
        ref[slots[ok].long()] = (x.float() / kv_scale).clamp(-fmax, fmax).to(dtype)[ok]
        a, b = got.cpu().view(torch.uint8), ref.view(torch.uint8)
        assert torch.equal(a, b), f"{int((a != b).sum())} bytes differ ({dtype}, {xdt}, {kv_scale})"


# ----------------------------------------------------------------------------------------------
# CPU: the interpreter, in a subprocess

def _interp(body, seed=0, mma="fp8", timeout=240, kernel=None):
    """``body`` under the interpreter (conftest.run_interpreted), with this module as ``t``.
    kernel: KIMI_OPS_TRITON_KERNEL for the subprocess (default: fp8 -> the first generation,
    whose fp8 hi + lo scheme it is; bf16 -> auto, i.e. triton_m1c in the interpreter)."""
    if kernel is None:
        kernel = "first" if mma == "fp8" else "auto"
    run_interpreted("import test_triton_attention as t", body, seed=seed, timeout=timeout,
                    KIMI_OPS_TRITON_MMA=mma, KIMI_OPS_TRITON_KERNEL=kernel)


@pytest.mark.parametrize("mma,kernel", [("fp8", "first"), ("bf16", "first"), ("bf16", "m1c")])
def test_interp_decode_e4m3fn(mma, kernel):
    # the first generation (both MMA schemes: what NVIDIA GPUs run) and triton_m1c (AMD)
    _interp("""
t.check_decode([100, 0, 3, 70], 2, 12, 3, gen=g)        # zero-length and short requests, splits
t.check_decode([130], 1, 16, 1, gen=g)                  # one split
t.check_decode([5, 1, 0, 2], 4, 3, 9, gen=g)            # more splits than tokens, n < qlen
t.check_decode([80, 9], 3, 12, 2, oob=6, gen=g)         # out-of-range indices read as zero rows
t.check_decode([40, 17], 8, 1, 5, gen=g)                # qlen 8, H 1
t.check_decode([0, 0], 2, 12, 4, gen=g)                 # nothing visible at all
""" if (mma, kernel) != ("bf16", "first") else """
t.check_decode([100, 0, 3, 70], 2, 12, 3, gen=g)        # (the GPU grid covers this path fully)
t.check_decode([80, 9], 3, 12, 2, oob=6, gen=g)
""", mma=mma, kernel=kernel)


def test_interp_decode_heads():
    # the token-major kernel (bf16 dots): 96 / 128 heads are 6 / 8 row blocks of 16
    _interp("""
t.check_decode([33, 70], 1, 96, 2, gen=g)
t.check_decode([66], 1, 128, 3, gen=g)
t.check_decode([20, 7], 5, 12, 2, gen=g)
t.check_decode([9], 6, 12, 1, gen=g)
""", mma="bf16")


def test_interp_decode_fp8_query():
    # issue 28: fp8 q + q_scale (both interpreter program shapes: 12 and 36 rows a request)
    _interp("""
t.check_decode([100, 0, 33], 1, 12, 2, gen=g, fp8_q=True)
t.check_decode([40, 7], 3, 12, 3, oob=2, gen=g, fp8_q=True)
import kimi_ops.kernels.triton_m1c as M
q, kv, ip, ix = t.make_inputs([10], 1, 4, gen=g)
for bad in (dict(q_scale=torch.ones(1)),):  # bf16 q with a q_scale: refused, naming it
    try:
        M.mla_decode_splitkv(q, kv, ip, ix, 1, 0.1, 0.5, 1, **bad)
        raise AssertionError("accepted")
    except ValueError as e:
        assert "q_scale" in str(e)
try:
    M.mla_decode_splitkv(q.to(torch.float8_e4m3fn), kv, ip, ix, 1, 0.1, 0.5, 1)
    raise AssertionError("accepted")
except ValueError as e:
    assert "q_scale" in str(e)
""", mma="bf16")


def test_f16_dots_where_taken(monkeypatch):
    """The first generation's bf16 mode takes f16 dots on NVIDIA sm_89+ (cvt.rn.f16x2.e4m3x2) and in
    the interpreter, not on AMD, not with KIMI_OPS_TRITON_F16=0; its fp8 mode never."""
    import kimi_ops.kernels.attention as A

    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert A._f16_dots("bf16", cpu) and not A._f16_dots("fp8", cpu)
    monkeypatch.setattr(torch.version, "hip", None)
    for cc, taken in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(A, "compute_capability", lambda index, cc=cc: cc)
        assert A._f16_dots("bf16", gpu) == taken, cc
    monkeypatch.setattr(torch.version, "hip", "6.4")
    assert not A._f16_dots("bf16", gpu)
    monkeypatch.setenv(A.F16_ENV, "0")
    assert not A._f16_dots("bf16", cpu)
    # the words tile: by default wherever the prefetch runs (up to 32 rows, bf16 mode) but in 16-row
    # programs of 64-token tiles (the short programs), forced on / off by the switch
    monkeypatch.delenv(A.WORDS_ENV, raising=False)
    assert A._words("bf16", 16, 32) and A._words("bf16", 32, 64) and not A._words("bf16", 16, 64)
    assert not A._words("bf16", 64, 64) and not A._words("fp8", 16, 32)
    assert A._config(12, "bf16") == (16, 32, 4, 2) and A._config(24, "bf16") == (32, 64, 8, 2)
    assert A._config(12, "bf16", A.SMALL_PROGRAM_TOKENS) == (16, 32, 4, 2)
    assert A._config(12, "bf16", A.SMALL_PROGRAM_TOKENS - 1) == (16, 64, 8, 2)  # short programs
    assert A._config(48, "bf16") == (64, 64, 8, 2) and A._config(24, "bf16", 10) == (32, 64, 8, 2)
    assert A._tiles_a_program(32 * 8192, 32, 4, 64) == 32 and A._tiles_a_program(8192, 1, 64, 64) == 2
    monkeypatch.setenv(A.WORDS_ENV, "1")
    assert A._words("bf16", 16, 64) and not A._words("bf16", 64, 64)
    monkeypatch.setenv(A.WORDS_ENV, "0")
    assert not A._words("bf16", 16, 32) and not A._words("bf16", 32, 64)


def test_first_generation_split_counts():
    """suggest_num_splits' picks at the shapes its two-programs-an-SM model was fitted on (H100,
    session 52): a second program an SM at qlen 1, batch 32 / 128 (8 / 2 splits, 256 programs), not
    at batch 8 (16: the split's 16 tiles); 8-warp programs (qlen 2 - 8, 96 heads) keep one an SM;
    one request of 8k takes 64 splits of 128 tokens, run as short programs."""
    import kimi_ops.kernels.attention as A

    k = 8192
    assert A.suggest_num_splits(32, 1, 12, 32 * k) == 8 and A.suggest_num_splits(128, 1, 12, 128 * k) == 2
    assert A.suggest_num_splits(8, 1, 12, 8 * k) == 16 and A.suggest_num_splits(32, 2, 12, 32 * k) == 4
    assert A.suggest_num_splits(1, 1, 12, k) == 64 and A.suggest_num_splits(1, 1, 12, 8 * k) == 128
    assert A._config(12, "bf16", A._tokens_a_program(k, 1, 64)) == (16, 64, 8, 2)
    assert A.suggest_num_splits(32, 4, 12, 32 * k) == 4 and A.suggest_num_splits(8, 1, 96, 8 * k) == 8
    for args in ((16, 1, 12, 16 * k), (3, 1, 12, 3 * 5000), (64, 1, 12, 64 * 300)):
        s = A.suggest_num_splits(*args)
        assert 1 <= s <= max(1, args[3] // args[0] // 128), (args, s)


@pytest.mark.parametrize("f16,words", [("1", "0"), ("1", "1"), ("0", "0")])
def test_interp_first_generation_q_range(f16, words):
    # NVIDIA's first generation, bf16 mode: with f16 dots a bf16 q is scaled a program by a power
    # of two into f16's range: a block far above it (2^40: |q| ~ 2^42 > 65504) and far below it
    # (2^-60: every element under f16's smallest subnormal), the scores kept the same by the
    # scale; rows 2^-12 .. 2^12 apart within one program; qlen 8 (a 64-row block, no prefetch);
    # negative and zero scales (the sign is folded into q)
    _interp(f"""
import os
import kimi_ops.kernels.attention as A
os.environ[A.F16_ENV] = "{f16}"
os.environ[A.WORDS_ENV] = "{words}"   # the opt-in words tile (16 and 32 rows)
if {f16 == "1"}:   # bf16 dots (f16 "0") scale nothing: bf16 has float32's range; the signs below
    for e in (40, -60):
        t.check_decode([90, 5], 2, 12, 2, gen=g, kernels=A, q_mul=2.0**e, scale=t.SCALE * 2.0**-e)
    rows = 2.0 ** torch.randint(-12, 13, (2 * 2, 12, 1), generator=g).double()
    t.check_decode([90, 5], 2, 12, 2, gen=g, kernels=A, q_mul=rows)
    if {words == "0"}:   # 96 rows: never the words tile (16 / 32 rows)
        t.check_decode([70], 8, 12, 2, gen=g, kernels=A, q_mul=2.0**20, scale=t.SCALE * 2.0**-20)
# the scale's sign is folded into q (the words tile: one of the three signs, the same fold)
for sc, ks in ((-t.SCALE, 0.5), (t.SCALE, -0.5), (0.0, 0.5))[:1 if {words == "1"} else 3]:
    t.check_decode([90, 5], 2, 12, 2, gen=g, kernels=A, scale=sc, kv_scale=ks)
if {words == "0"}:
    t.check_decode([70], 8, 12, 2, gen=g, kernels=A, scale=-t.SCALE)
""", mma="bf16", kernel="first")


def fp8_dots_match_bf16_dots(lens, qlen, H, S, dtype, gen):
    """The second generation on an fp8 q of the cache's type, fp8 dots for S against the same
    kernel with ``KIMI_OPS_TRITON_FP8_DOTS=0`` (q converted to bf16): in the interpreter both
    sum the same exact products in f32, so the partials agree bit for bit; and the fp8-dot
    call passes check_decode."""
    import kimi_ops.kernels.triton_m1c as M

    assert M.takes_fp8_dots(M.pick_config("interp", qlen * H), dtype, dtype), "not the fp8-dot config"
    check_decode(lens, qlen, H, S, dtype=dtype, gen=gen, fp8_q=True)
    q, kv, indptr, idx = make_inputs(lens, qlen, H, dtype=dtype, gen=gen)
    q8, q_scale = quantize_q(q, dtype)
    fp8 = M.mla_decode_splitkv(q8, kv, indptr, idx, qlen, SCALE, 0.5, S, q_scale=q_scale)
    os.environ[M.FP8_DOTS_ENV] = "0"
    try:
        bf16 = M.mla_decode_splitkv(q8, kv, indptr, idx, qlen, SCALE, 0.5, S, q_scale=q_scale)
    finally:
        del os.environ[M.FP8_DOTS_ENV]
    assert torch.equal(fp8[0], bf16[0]) and torch.equal(fp8[1], bf16[1]), "fp8 dots != bf16 dots"


def test_fp8_dots_where_the_mfma_takes_the_format(monkeypatch):
    """Which (target, q, cache) pairs run S as fp8 x fp8 dots: AMD only (gfx950 e4m3fn, gfx942
    e4m3fnuz), q of the cache's own type, and not with KIMI_OPS_TRITON_FP8_DOTS=0."""
    import kimi_ops.kernels.triton_m1c as M

    fn, fnuz = torch.float8_e4m3fn, torch.float8_e4m3fnuz
    want = {("gfx950", fn): True, ("gfx950", fnuz): False, ("gfx942", fn): False,
            ("gfx942", fnuz): True, ("sm90", fn): False, ("sm90", fnuz): False,
            ("nvidia", fn): False, ("nvidia", fnuz): False}
    for (arch, dt), taken in want.items():
        for rows in (12, 96):
            cfg = M.pick_config(arch, rows)
            assert M.takes_fp8_dots(cfg, dt, dt) == taken, (arch, dt, rows)
            other = fnuz if dt == fn else fn
            assert not M.takes_fp8_dots(cfg, other, dt), (arch, "q of another fp8 type", dt)
    monkeypatch.setenv(M.FP8_DOTS_ENV, "0")
    assert not M.takes_fp8_dots(M.pick_config("gfx950", 12), fn, fn)


def test_interp_fp8_dots():
    # the fp8-dot S of AMD's second generation (the interpreter's 32-row config takes it)
    _interp("""
t.fp8_dots_match_bf16_dots([100, 0, 33], 2, 12, 3, torch.float8_e4m3fn, g)
t.fp8_dots_match_bf16_dots([70, 9], 3, 16, 2, torch.float8_e4m3fn, g)
from kimi_ops.kernels.attention import native_fnuz
if native_fnuz():   # Triton >= 3.7's interpreter: gfx942's pair, e4m3fnuz q and cache
    t.fp8_dots_match_bf16_dots([64, 5], 2, 12, 2, torch.float8_e4m3fnuz, g)
""", mma="bf16")


def test_interp_lse_large_scores():
    # lse in the thousands (scores rising along the context by 40 and 256 natural-log units a
    # 64-token tile): the stored lse stays within one f32 rounding of the truth plus 1e-6
    # relative (the bound test_cuda_attention uses); the first generation's
    # (m_log2 + log2 l) * ln 2 rounded three times
    _interp("""
for rise, ks in ((256.0, 12.0), (-256.0, 16.0)):
    t.check_rising(12, 1, rise, kv_scale=ks, splits=(3,), gen=g)
t.check_rising(16, 2, 256.0, kv_scale=16.0, lens=(700, 64), splits=(1,), gen=g)
t.check_climb(12, 1, 256.0, splits=(3,), gen=g)
""", mma="bf16")


@pytest.mark.parametrize("mma", ["fp8", "bf16"])
@needs_fnuz_triton
def test_interp_decode_e4m3fnuz(mma):
    # the gfx942 path: a native e4m3fnuz cache (fnuz splits of Q and P)
    _interp("""
t.check_decode([70, 33, 0], 2, 12, 2, dtype=torch.float8_e4m3fnuz, gen=g)
t.check_decode([50], 7, 2, 3, dtype=torch.float8_e4m3fnuz, oob=3, gen=g)
""", mma=mma)


def test_interp_decode_fnuz_bytes():
    # the NVIDIA path for an e4m3fnuz cache: bytes decoded in the kernel (forced here)
    _interp("""
import kimi_ops.kernels.attention as A
A.native_fnuz = lambda: False   # the cache as e4m3fnuz codes (A._as_codes)
t.check_decode([70, 33, 0], 2, 12, 2, dtype=torch.float8_e4m3fnuz, gen=g)
""")


@pytest.mark.parametrize("kernel", ["first", "m1c"])
def test_interp_decode_e4m3fn_bytes(kernel):
    # NVIDIA before sm_89 (Ampere: Triton has no e4m3fn there): the cache and an fp8 q reach the
    # kernels as e4m3fn codes, decoded by integer arithmetic (forced here)
    _interp("""
import kimi_ops.kernels.attention as A
A.native_e4m3fn = lambda device: False
kv = torch.zeros(4, 576, dtype=torch.float8_e4m3fn)
assert A._kv_mode(kv)[1] == A.FN_BYTES and A._kv_mode(kv)[0].dtype == torch.uint8
t.check_decode([100, 0, 3, 70], 2, 12, 3, oob=4, gen=g)
t.check_decode([40, 17], 8, 12, 2, gen=g)              # 96 rows (the first generation's m64)
t.check_decode([100, 33], 1, 12, 2, gen=g, fp8_q=True)
""", mma="bf16", kernel=kernel)


@triton.jit
def _decode_codes(c_ptr, y_ptr, FNUZ: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(y_ptr + offs, fp8_value(tl.load(c_ptr + offs), FNUZ))


def check_fp8_value():
    """fp8_value (the kernels' integer decode) against torch's decode of every code, both formats:
    the same f32 bits, NaN where torch gives NaN (-0 kept for e4m3fn)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for dt in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        y = torch.empty(256, dtype=torch.float32)
        _decode_codes[(1,)](codes, y, FNUZ=dt == torch.float8_e4m3fnuz)
        ref = codes.view(dt).float()
        assert torch.equal(torch.isnan(y), torch.isnan(ref)), dt
        ok = ~torch.isnan(ref)
        assert torch.equal(y[ok].view(torch.int32), ref[ok].view(torch.int32)), dt


def test_interp_fp8_value():
    _interp("t.check_fp8_value()")


def test_interp_merge():
    # the kernel's edges: S not a multiple of the split chunk (1, 5, 17, 64, 65 = two chunks),
    # row counts that are not round, every column-block width (64 .. 512), LSE spreads of +-80
    _interp("""
t.check_merge(5, 6, 3, gen=g)
t.check_merge(1, 4, 12, gen=g)
t.check_merge(9, 3, 1, gen=g)
t.check_merge(17, 3, 5, gen=g)
t.check_merge(64, 2, 7, gen=g)
t.check_merge(65, 3, 5, gen=g)
t.check_merge(2, 1, 3, gen=g)
t.check_merge(5, 2, 5, gen=g, spread=80.0)
t.check_merge(65, 1, 3, gen=g, spread=80.0, dead_frac=0.8, dead_nan=True)
t.check_merge(17, 2, 3, gen=g, dead_nan=True)
t.check_merge(3, 23, 12, gen=g, perm=False)                 # 276 rows: 512-column blocks
t.check_merge(16, 11, 12, gen=g, spread=80.0, perm=False)   # 132 rows: 256-column blocks
t.check_merge(4, 0, 12, gen=g)                  # no rows
""")


def test_merge_configs_cross_compiled():
    # every launch shape mla_merge picks is in CROSS_COMPILE_SPECS, and the block sizes obey
    # the kernel's assumptions (power-of-two split chunk, column block dividing 512)
    import kimi_ops.kernels.attention as A

    specs = {(s["constexprs"]["BLOCK_S"], s["constexprs"]["BLOCK_C"], s["num_warps"])
             for s in A.CROSS_COMPILE_SPECS if s["kernel"] is A._merge_kernel}
    for S in list(range(1, 140)) + [255, 256, 1000]:
        for TH in (1, 3, 12, 24, 33, 96, 132, 264, 384, 1000, 1536, 98304):
            bs, bc, warps = A._merge_config(S, TH)
            assert (bs, bc, warps) in specs, (S, TH, bs, bc, warps)
            assert bs & (bs - 1) == 0 and 512 % bc == 0 and bs * bc <= A.MERGE_TILE
            assert bs >= min(S, A.MERGE_MAX_SPLITS)


def test_interp_cache_write():
    _interp("""
for dt in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
    t.check_cache_write(dt, torch.bfloat16, torch.int64, gen=g)
t.check_cache_write(torch.float8_e4m3fn, torch.float32, torch.int32, T=8, gen=g)
t.check_cache_write(torch.float8_e4m3fnuz, torch.float16, torch.int32, T=8, gen=g)
""")


# ----------------------------------------------------------------------------------------------
# GPU

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")


def _gpu_gen(seed):
    return torch.Generator().manual_seed(seed)


def check_decode_grid(H, gen, *, kernels=None, qlens=(1, 2, 3, 4, 8), max_splits=64):
    """The issue's GPU correctness grid for one head count: qlen 1..8, lengths 0 to 64k, uniform
    and mixed, 1 to ``max_splits`` splits (more splits than tokens included), out-of-range
    indices at qlen 3. Returns (worst rel. L2, worst |lse - ref|)."""
    worst = (0.0, 0.0)
    for qlen in qlens:
        cases = [
            ([0, 1, 2, 7, 63, 64, 65, 300], 3),      # short and boundary lengths
            ([1000] * 4, 1),
            ([4096, 17, 2500, 0], 8),
            ([5, 1, 0, 2], 9),                       # more splits than tokens, n < qlen
            ([16384], 64),
        ]
        if H <= 16:
            cases += [([65536], 32), ([65536, 3, 9000], max_splits)]
        elif qlen in (1, 8):
            cases += [([65536], 16)]
        for lens, S in cases:
            e = check_decode(lens, qlen, H, S, device="cuda", gen=gen, oob=2 if qlen == 3 else 0, kernels=kernels)
            worst = (max(worst[0], e[0]), max(worst[1], e[1]))
    return worst


def check_variable_lengths(gen, kernels=None):
    """24 log-normal lengths around 3000 (one empty), 1 / 7 / 64 splits, qlen 1 and 4."""
    lens = torch.distributions.LogNormal(math.log(3000), 1.0).sample((24,)).clamp(0, 65536).long().tolist()
    lens[0] = 0
    for S in (1, 7, 64):
        for qlen in (1, 4):
            check_decode(lens, qlen, 12, S, device="cuda", gen=gen, kernels=kernels)


@gpu
@pytest.mark.parametrize("mma", [
    "bf16",
    pytest.param("fp8", marks=pytest.mark.xfail(
        reason="sm_90 fp8 wgmma accumulates with reduced precision: lse error ~1e-2 (docs/PERF.md)",
        strict=False)),
])
@pytest.mark.parametrize("H", [12, 16, 96, 128])
@pytest.mark.parametrize("kernel", ["auto", "m1c"])
def test_gpu_grid(H, mma, kernel, monkeypatch):
    # auto: what NVIDIA runs (the first generation); m1c: the token-major kernel AMD runs
    if kernel == "m1c" and (mma == "fp8" or H in (16, 128)):
        pytest.skip("triton_m1c: no first-generation MMA variants (KIMI_OPS_TRITON_MMA); H 12 and 96 cover its row blocks")
    monkeypatch.setenv("KIMI_OPS_TRITON_MMA", mma)
    monkeypatch.setenv("KIMI_OPS_TRITON_KERNEL", kernel)
    worst = check_decode_grid(H, _gpu_gen(H))
    print(f"H={H} mma={mma}: worst rel L2 {worst[0]:.2e}, worst |lse| {worst[1]:.2e}")


@gpu
@pytest.mark.parametrize("rise", [-40.0, 0.5, 4.0, 40.0, 256.0])
@pytest.mark.parametrize("H,qlen", [(12, 1), (16, 2), (96, 1)])
@pytest.mark.parametrize("kernel", ["first", "m1c"])
def test_gpu_rising_scores(H, qlen, rise, kernel, monkeypatch):
    """The lse contract where the running max keeps moving (issue 29 item 4), kv_scale 2 and
    (large |lse|) 12."""
    monkeypatch.setenv("KIMI_OPS_TRITON_KERNEL", kernel)
    g = _gpu_gen(23)
    for ks in (2.0, 12.0):
        worst = check_rising(H, qlen, rise, kv_scale=ks, device="cuda", gen=g)
        print(f"H={H} qlen={qlen} rise={rise} kv_scale={ks}: worst |dlse| {worst:.2e}")


@gpu
@pytest.mark.parametrize("step", [16.0, 64.0, 256.0])
@pytest.mark.parametrize("H,qlen", [(12, 1), (16, 2), (96, 1)])
@pytest.mark.parametrize("kernel", ["first", "m1c"])
def test_gpu_dense_climb(H, qlen, step, kernel, monkeypatch):
    """Issue 29 item 4's suspect: scores climbing by up to 2^8 a tile with all 576 products
    nonzero (dots ~1e5), where a truncating MMA accumulation chain biases the lse."""
    monkeypatch.setenv("KIMI_OPS_TRITON_KERNEL", kernel)
    worst = check_climb(H, qlen, step, device="cuda", gen=_gpu_gen(41))
    print(f"dense climb H={H} qlen={qlen} step={step} kernel={kernel}: worst |dlse| {worst:.2e}")


@gpu
@pytest.mark.parametrize("H", [12, 96])
@pytest.mark.parametrize("kernel", ["first", "m1c"])
def test_gpu_fp8_query(H, kernel, monkeypatch):
    monkeypatch.setenv("KIMI_OPS_TRITON_KERNEL", kernel)
    g = _gpu_gen(29)
    for qlen in (1, 2, 4):
        for lens, S in (([0, 1, 65, 3000], 3), ([16384], 16), ([4096, 17], 64)):
            check_decode(lens, qlen, H, S, device="cuda", gen=g, fp8_q=True)


@gpu
def test_gpu_variable_lengths():
    check_variable_lengths(_gpu_gen(7))


@gpu
def test_gpu_fnuz_cache():
    g = _gpu_gen(3)
    check_decode([3000, 0, 129], 2, 12, 4, dtype=torch.float8_e4m3fnuz, device="cuda", gen=g)


@gpu
def test_gpu_merge():
    g = _gpu_gen(5)
    check_merge(64, 40, 12, device="cuda", gen=g)
    check_merge(1, 3, 128, device="cuda", gen=g)
    for S, T, H in [(1, 1, 12), (5, 1, 12), (17, 32, 12), (64, 1, 12), (65, 7, 12), (9, 128, 12),
                    (64, 128, 12), (2, 23, 12), (3, 1, 1)]:
        check_merge(S, T, H, device="cuda", gen=g)
        check_merge(S, T, H, device="cuda", gen=g, spread=80.0, dead_frac=0.7, dead_nan=True)


@gpu
def test_gpu_cache_write():
    g = _gpu_gen(11)
    for dt in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        for xdt in (torch.bfloat16, torch.float16, torch.float32):
            for sdt in (torch.int32, torch.int64):
                check_cache_write(dt, xdt, sdt, T=300, N=700, device="cuda", gen=g)


def check_graph_replay(decode, seed=13):
    """``decode(q, kv, indptr, indices, qlen, num_splits) -> (o, lse)`` captured in a CUDA graph,
    replayed after the lengths, indices and q changed in place: bit-equal to eager, within the
    contract of the oracle."""
    g = _gpu_gen(seed)
    qlen, H, S, R, cap = 2, 12, 8, 6, 9000
    q, kv, indptr, idx = make_inputs([cap // R] * R, qlen, H, device="cuda", gen=g, extra=2000)
    idx_buf = torch.zeros(cap, dtype=torch.int32, device="cuda")
    idx_buf[: idx.numel()] = idx

    def step():
        return decode(q, kv, indptr, idx_buf, qlen, S)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, lse_g = step()
    for trial in range(3):
        lens = torch.randint(0, cap // R, (R,), generator=g)
        lens[trial] = 0
        new_ptr = torch.zeros(R + 1, dtype=torch.int32)
        new_ptr[1:] = torch.cumsum(lens, 0)
        indptr.copy_(new_ptr)
        idx_buf.copy_(idx[torch.randperm(cap, generator=g).to(idx.device)])  # named rows only
        q.copy_(torch.randn(q.shape, generator=g).to(torch.bfloat16))
        graph.replay()
        o_e, lse_e = step()
        torch.cuda.synchronize()
        assert torch.equal(o_g, o_e) and torch.equal(lse_g, lse_e)
        ro, rl = oracle(q, kv, indptr, idx_buf, qlen, SCALE, 0.5)
        fin = ~torch.isneginf(rl)
        assert torch.equal(torch.isneginf(lse_g), ~fin)
        assert ((o_g.double() - ro).norm() / ro.norm()).item() <= 4e-3


@gpu
@pytest.mark.parametrize("kernel", ["first", "m1c"])
def test_gpu_cuda_graph(kernel, monkeypatch):
    """Capture the Triton splitkv + merge, change lengths / indices / q in place, replay == eager,
    on both kernel generations (m1c's two programs a row block once stored lse values that
    differed in the last bit, so replay and eager differed by which one stored last)."""
    from kimi_ops.kernels.triton_m1c import mla_decode_splitkv, mla_merge
    monkeypatch.setenv("KIMI_OPS_TRITON_KERNEL", kernel)

    check_graph_replay(lambda q, kv, indptr, idx, qlen, S: mla_merge(
        *mla_decode_splitkv(q, kv, indptr, idx, qlen, SCALE, 0.5, S)))
