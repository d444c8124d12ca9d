"""OCP MXFP4 (quantize / dequantize) and ``bmm_a16wfp4`` against the spec and float64 math.

The oracles are written here, independently of kimi_ops.reference: the OCP spec's E2M1 value
table, a brute-force nearest-value quantizer in float64 (ties to the even code), and float64
matrix products on weights dequantized by that table.

CPU (CI): the reference directly; the Triton kernel under TRITON_INTERPRET=1 in a subprocess
(TRITON_INTERPRET must be set before triton.jit decorates the kernels, and this pytest process
may already hold them compiled). GPU (skipped without CUDA): the Kimi-K3 TP8 grid, opcheck on
CUDA tensors, CUDA-graph replay.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from kimi_ops.kernels.mxfp4 import _mxfp4_decode, _mxfp4_decode_even_odd
from kimi_ops.reference import mxfp4 as ref

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

# OCP Microscaling Formats v1.0, table of FP4 E2M1 values (code -> value)
SPEC_E2M1 = {
    0b0000: 0.0, 0b0001: 0.5, 0b0010: 1.0, 0b0011: 1.5, 0b0100: 2.0, 0b0101: 3.0, 0b0110: 4.0, 0b0111: 6.0,
    0b1000: -0.0, 0b1001: -0.5, 0b1010: -1.0, 0b1011: -1.5, 0b1100: -2.0, 0b1101: -3.0, 0b1110: -4.0,
    0b1111: -6.0,
}


# ----------------------------------------------------------------------------------------------
# float64 oracles (shared with the interpreter subprocess and the GPU tests)

def oracle_dequantize(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 [..., K] from the spec table and 2^(s - 127) (0xFF -> NaN)."""
    packed = packed.cpu().view(torch.uint8)
    scale = scale.cpu().view(torch.uint8)
    table = torch.tensor([SPEC_E2M1[c] for c in range(16)], dtype=torch.float64)
    codes = torch.stack((packed & 15, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1).long()
    vals = table[codes]
    s = scale.to(torch.float64)
    mult = torch.where(scale == 255, torch.full_like(s, float("nan")), torch.exp2(s - 127))
    return (vals.unflatten(-1, (-1, 32)) * mult.unsqueeze(-1)).flatten(-2)


def oracle_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Brute force in float64: e = floor(log2 amax) - 2 clamped to [-127, 127], each element to
    the nearest of the 16 code values (ties: the even code), NaN/inf blocks -> scale 255, codes 0."""
    x = w.cpu().to(torch.float64).unflatten(-1, (-1, 32))
    finite = torch.isfinite(x)
    bad = (~finite).any(-1)
    amax = torch.where(finite, x.abs(), torch.zeros_like(x)).amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127.0))
    e = e.clamp(-127, 127)
    v = torch.where(finite, x, torch.zeros_like(x)) / torch.exp2(e).unsqueeze(-1)
    mags = torch.tensor([SPEC_E2M1[c] for c in range(8)], dtype=torch.float64)
    dist = (v.abs().unsqueeze(-1) - mags).abs()                         # [..., 32, 8]
    best = dist.min(-1, keepdim=True).values
    cand = (dist == best)
    # among equally near codes take the even one (RNE: mantissa bit 0)
    even = torch.arange(8) % 2 == 0
    pick = torch.where((cand & even).any(-1), (cand & even).float().argmax(-1), cand.float().argmax(-1))
    codes = pick.to(torch.uint8) | (torch.signbit(x).to(torch.uint8) << 3)
    codes = torch.where(bad.unsqueeze(-1), torch.zeros_like(codes), codes).flatten(-2)
    scale = torch.where(bad, torch.full_like(e, 255.0), e + 127).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), scale


def oracle_bmm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.cpu().to(torch.float64) @ oracle_dequantize(packed, scale).transpose(-1, -2)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.cpu().to(torch.float64)
    assert not torch.isnan(got).any(), "NaN in the output"
    return float((got - want).norm() / want.norm())


def random_weights(shape, *, gen=None, spread=True):
    """Weights with a different magnitude per 32-block (so the scales vary)."""
    w = torch.randn(shape, generator=gen)
    if spread:
        mag = torch.exp2(torch.randint(-8, 8, (*shape[:-1], shape[-1] // 32), generator=gen).float())
        w = (w.unflatten(-1, (-1, 32)) * mag.unsqueeze(-1)).flatten(-2)
    return w


# ----------------------------------------------------------------------------------------------
# the format, on the reference

def test_spec_value_table_and_nibble_order():
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes | (codes << 4)).reshape(1, 16)                     # both nibbles = code
    scale = torch.full((1, 1), 127, dtype=torch.uint8)                  # 2^0
    got = ref.mxfp4_dequantize(packed, scale, dtype=torch.float32)
    want = torch.tensor([SPEC_E2M1[c] for c in range(16)]).repeat_interleave(2)
    assert torch.equal(got[0], want)
    assert torch.equal(torch.signbit(got[0]), torch.signbit(want))      # code 8 is -0
    # element 2i in the low nibble: byte 0x21 -> (code 1, code 2) = (0.5, 1.0)
    packed = torch.full((1, 16), 0x21, dtype=torch.uint8)
    got = ref.mxfp4_dequantize(packed, scale, dtype=torch.float32)
    assert got[0, :4].tolist() == [0.5, 1.0, 0.5, 1.0]
    assert ref.E2M1_VALUES == tuple(SPEC_E2M1[c] for c in range(16))


def test_dequantize_matches_oracle_and_e8m0_dtype():
    g = torch.Generator().manual_seed(1)
    packed = torch.randint(0, 256, (3, 5, 64), dtype=torch.uint8, generator=g)
    # 253 and 254 with large codes overflow float32 (documented); quantize never makes them
    scale = torch.randint(0, 253, (3, 5, 4), dtype=torch.uint8, generator=g)
    scale[0, 0, 0], scale[0, 0, 1], scale[0, 0, 2] = 0, 1, 252           # extremes
    want = oracle_dequantize(packed, scale)
    got = ref.mxfp4_dequantize(packed, scale, dtype=torch.float32)
    assert torch.equal(got.double(), want)
    big = ref.mxfp4_dequantize(torch.tensor([[0x27] * 16], dtype=torch.uint8),
                               torch.tensor([[254]], dtype=torch.uint8), dtype=torch.float32)
    assert big[0, 0].item() == float("inf") and big[0, 1].item() == 2.0 ** 127
    if hasattr(torch, "float8_e8m0fnu"):
        got2 = ref.mxfp4_dequantize(packed, scale.view(torch.float8_e8m0fnu), dtype=torch.float32)
        assert torch.equal(got2, got)
    small = scale.clamp(80, 170)                                         # inside bf16's range
    assert torch.equal(ref.mxfp4_dequantize(packed, small).double(), oracle_dequantize(packed, small))


def _quantize_one_block(values):
    w = torch.tensor(values + [0.0] * (32 - len(values)), dtype=torch.float32)
    packed, scale = ref.mxfp4_quantize(w)
    codes = torch.stack((packed & 15, packed >> 4), -1).flatten()
    return codes[: len(values)].tolist(), int(scale[0])


def test_rne_ties_with_scale_one():
    # amax 4 -> e = floor(log2 4) - 2 = 0 -> scale byte 127; ties go to the even code
    vals = [4.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.75, -2.5, -5.0]
    codes, s = _quantize_one_block(vals)
    assert s == 127
    assert codes == [6, 0, 2, 2, 4, 4, 6, 6, 8, 10, 12, 14]
    # off-tie values go to the nearest
    codes, _ = _quantize_one_block([4.0, 0.26, 0.74, 2.51, 3.49, 5.01, 4.99])
    assert codes == [6, 1, 1, 5, 5, 7, 6]


def test_saturation_to_six():
    # amax 7.9 -> e = 0: 7.9 and 6.5 exceed the largest E2M1 value and saturate to +-6
    codes, s = _quantize_one_block([7.9, -6.5, 6.0, 5.5])
    assert s == 127 and codes == [7, 15, 7, 7]
    d = ref.mxfp4_dequantize(*ref.mxfp4_quantize(torch.tensor([7.9] + [0.0] * 31)), dtype=torch.float32)
    assert d[0].item() == 6.0


def test_all_zero_block():
    w = torch.zeros(2, 64)
    w[1, 32:] = -0.0
    w[1, :32] = torch.randn(32)
    packed, scale = ref.mxfp4_quantize(w)
    assert scale[0].tolist() == [0, 0]                  # documented: E8M0 byte 0 (2^-127)
    assert scale[1, 1].item() == 0
    assert packed[0].eq(0).all()
    assert packed[1, 16:].eq(0x88).all()                # -0.0 keeps its sign (code 8)
    d = ref.mxfp4_dequantize(packed, scale)
    assert d[0].eq(0).all() and d[1, 32:].eq(0).all()


def test_huge_and_tiny_amax():
    fmax = torch.finfo(torch.float32).max
    w = torch.zeros(4, 32)
    w[0, :3] = torch.tensor([fmax, -fmax / 3, 1.0])     # e = 127 - 2 = 125
    w[1, :2] = torch.tensor([2.0 ** -124, 2.0 ** -125])  # e = -126
    w[2, :2] = torch.tensor([1e-40, -3e-41])            # subnormal: clamped to e = -127
    w[3, :2] = torch.tensor([2.0 ** -125, 2.0 ** -127])  # e = -127 exactly (no clamp effect)
    packed, scale = ref.mxfp4_quantize(w)
    assert scale[:, 0].tolist() == [252, 1, 0, 0]
    assert torch.equal(packed, oracle_quantize(w)[0])
    d = ref.mxfp4_dequantize(packed, scale, dtype=torch.float32)
    assert torch.isfinite(d).all()
    assert d[0, 0].item() == 6.0 * 2.0 ** 125           # saturated (fmax / 2^125 = 8 - eps)
    assert d[1, 0].item() == 2.0 ** -124 and d[1, 1].item() == 2.0 ** -125
    assert d[2].eq(0).all()                             # below the smallest representable
    assert d[3, 0].item() == 2.0 ** -125 and d[3, 1].item() == 2.0 ** -127


def test_nan_and_inf_blocks_get_nan_scale():
    w = torch.randn(3, 96)
    w[0, 5] = float("nan")
    w[1, 40] = float("inf")
    w[2, 95] = -float("inf")
    packed, scale = ref.mxfp4_quantize(w)
    assert scale[0, 0] == 255 and scale[1, 1] == 255 and scale[2, 2] == 255
    assert (scale != 255).sum() == 6
    assert packed[0, :16].eq(0).all() and packed[1, 16:32].eq(0).all()
    d = ref.mxfp4_dequantize(packed, scale, dtype=torch.float32)
    assert torch.isnan(d[0, :32]).all() and torch.isnan(d[1, 32:64]).all() and torch.isnan(d[2, 64:]).all()
    assert torch.isfinite(d[0, 32:]).all() and torch.isfinite(d[1, :32]).all()
    # other blocks exactly as without the NaN
    clean = w.clone()
    clean[0, 5] = clean[1, 40] = clean[2, 95] = 0.0
    p2, s2 = ref.mxfp4_quantize(clean)
    assert torch.equal(packed[0, 16:], p2[0, 16:]) and torch.equal(scale[0, 1:], s2[0, 1:])
    assert torch.equal(oracle_quantize(w)[1], scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantize_matches_brute_force_oracle(dtype):
    g = torch.Generator().manual_seed(2)
    w = random_weights((6, 7, 128), gen=g).to(dtype)
    w[0, 0, :32] = 0
    w[1, 1, 32:64] *= 1e-3
    packed, scale = ref.mxfp4_quantize(w)
    opacked, oscale = oracle_quantize(w)
    assert torch.equal(scale, oscale)
    assert torch.equal(packed, opacked)
    assert packed.shape == (6, 7, 64) and scale.shape == (6, 7, 4)
    assert packed.dtype == scale.dtype == torch.uint8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_a_fixed_point(dtype):
    g = torch.Generator().manual_seed(3)
    w = random_weights((4, 9, 256), gen=g)
    w[0, 0, :32] *= 1e-30 if dtype != torch.float16 else 1e-6
    w[0, 1, :32] *= 1e30 if dtype != torch.float16 else 1e3
    w[0, 2, :32] = 0
    w = w.to(dtype)
    packed, scale = ref.mxfp4_quantize(w)
    for out in (torch.bfloat16, torch.float32):
        d = ref.mxfp4_dequantize(packed, scale, dtype=out)
        assert torch.equal(d.double(), oracle_dequantize(packed, scale))     # exact
        p2, s2 = ref.mxfp4_quantize(d)
        assert torch.equal(p2, packed) and torch.equal(s2, scale)
    # and the error of one round trip is the format's (about 1/8 relative per element, RMS)
    d = ref.mxfp4_dequantize(packed, scale, dtype=torch.float32)
    err = (d.double() - w.double()).norm() / w.double().norm()
    assert err < 0.2


def test_quantize_rejects_bad_k():
    with pytest.raises(ValueError, match="multiple of 32"):
        ref.mxfp4_quantize(torch.randn(4, 48))


def test_ops_layer_round_trip():
    import kimi_ops

    w = torch.randn(3, 64, 128, dtype=torch.bfloat16)
    p, s = kimi_ops.mxfp4_quantize(w)
    assert torch.equal(kimi_ops.mxfp4_dequantize(p, s), ref.mxfp4_dequantize(p, s))
    if hasattr(torch, "float8_e8m0fnu"):
        assert torch.equal(kimi_ops.mxfp4_dequantize(p, s.view(torch.float8_e8m0fnu)),
                           ref.mxfp4_dequantize(p, s))


def test_reference_bmm_matches_float64():
    g = torch.Generator().manual_seed(4)
    for b, m, n, k in ((3, 1, 512, 128), (3, 37, 128, 512), (2, 5, 40, 64)):
        x = torch.randn(b, m, k, generator=g).to(torch.bfloat16)
        p, s = ref.mxfp4_quantize(random_weights((b, n, k), gen=g))
        y = ref.bmm_a16wfp4(x, p, s)
        assert y.dtype == torch.bfloat16 and y.shape == (b, m, n)
        assert rel_err(y, oracle_bmm(x, p, s)) < 4e-3
    # strided x (a transposed view of [T, H, K]) reads the same values
    xt = torch.randn(9, 3, 128, dtype=torch.bfloat16)
    p, s = ref.mxfp4_quantize(torch.randn(3, 64, 128))
    assert torch.equal(ref.bmm_a16wfp4(xt.transpose(0, 1), p, s),
                       ref.bmm_a16wfp4(xt.transpose(0, 1).contiguous(), p, s))


# ----------------------------------------------------------------------------------------------
# the Triton kernel: shared checks (run in the interpreter subprocess and on the GPU)

def check_bmm(b, m, n, k, *, device="cpu", dot_scaled=None, config=None, strided=False,
              nan_block=False, seed=0, gemv=None):
    from kimi_ops.kernels import mxfp4 as K

    g = torch.Generator().manual_seed(seed)
    if strided == "odd":   # x = columns 1 .. K of [B, M, K + 1]: K contiguous but rows at odd elements
        x = torch.randn(b, m, k + 1, generator=g).to(torch.bfloat16).to(device)[..., 1:]
    elif strided == "k":   # x = a [B, K, M] tensor transposed: stride_xk = M, stride_xm = 1
        x = torch.randn(b, k, m, generator=g).to(torch.bfloat16).to(device).transpose(1, 2)
    elif strided == "nan_tail":   # x = the first K columns of [B, M, K + 64] whose other columns are NaN
        x = torch.full((b, m, k + 64), float("nan"), dtype=torch.bfloat16, device=device)
        x[..., :k] = torch.randn(b, m, k, generator=g).to(torch.bfloat16)
        x = x[..., :k]
    elif strided:   # x = q_nope.transpose(0, 1) of a [M, B, K] tensor, read in place
        x = torch.randn(m, b, k, generator=g).to(torch.bfloat16).to(device).transpose(0, 1)
    else:
        x = torch.randn(b, m, k, generator=g).to(torch.bfloat16).to(device)
    p, s = ref.mxfp4_quantize(random_weights((b, n, k), gen=g))
    if nan_block:
        s[0, n - 1, 0] = 255
    want = oracle_bmm(x, p, s)
    y = K.bmm_a16wfp4(x, p.to(device), s.to(device), dot_scaled=dot_scaled, config=config, gemv=gemv)
    assert y.shape == (b, m, n) and y.dtype == torch.bfloat16 and y.is_contiguous()
    if nan_block:
        assert torch.isnan(y[0, :, n - 1]).all().item()
        y = y.clone()
        y[0, :, n - 1] = 0
        want[0, :, n - 1] = 0
    err = rel_err(y, want)
    assert err < 4e-3, (b, m, n, k, dot_scaled, gemv, config, strided, err)
    # same function as the reference (float32 math on the same weights, one bf16 rounding)
    r = ref.bmm_a16wfp4(x.cpu(), p, s)
    if nan_block:
        r[0, :, n - 1] = 0
    assert rel_err(r, want) < 4e-3
    return err


@triton.jit
def _decode_both_kernel(p_ptr, s_ptr, joined_ptr, even_ptr, odd_ptr, BN: tl.constexpr, BK: tl.constexpr):
    """One tile [BN, BK] (contiguous packed [BN, BK/2], scales [BN, BK/32]) through both decodes
    (the tl.dot kernel's joined one, the GEMV's even / odd one)."""
    rows = tl.arange(0, BN)[:, None]
    cp = tl.arange(0, BK // 2)[None, :]
    wp = tl.load(p_ptr + rows * (BK // 2) + cp)
    ws = tl.load(s_ptr + rows * (BK // 32) + tl.arange(0, BK // 32)[None, :])
    tl.store(joined_ptr + rows * BK + tl.arange(0, BK)[None, :], _mxfp4_decode(wp, ws, BN, BK))
    we, wo = _mxfp4_decode_even_odd(wp, tl.load(s_ptr + rows * (BK // 32) + cp // 16))
    tl.store(even_ptr + rows * (BK // 2) + cp, we)
    tl.store(odd_ptr + rows * (BK // 2) + cp, wo)


def check_decode_even_odd(device="cpu"):
    """The GEMV's even / odd decode against the spec table, exactly, for every E8M0 byte (0, 1: float32
    subnormals; 253, 254 with large codes: inf in float32; 255: NaN) with each of the 16 E2M1 codes
    in both nibbles, and against the joined decode (equal values; -0.0 where it gives +0.0)."""
    bn, bk = 32, 512                                   # scales [32, 16]: each byte value twice
    j = torch.arange(bk // 32)
    lo = torch.arange(16)
    # block (r, j) holds bytes lo | ((lo + r + j) % 16) << 4: all 16 codes in even and odd places
    hi = (lo[None, None, :] + torch.arange(bn)[:, None, None] + j[None, :, None]) % 16
    packed = (lo[None, None, :] | (hi << 4)).reshape(bn, bk // 2).to(torch.uint8)
    scale = (torch.arange(bn * bk // 32) % 256).reshape(bn, bk // 32).to(torch.uint8)
    joined = torch.empty(bn, bk, device=device)
    even = torch.empty(bn, bk // 2, device=device)
    odd = torch.empty(bn, bk // 2, device=device)
    _decode_both_kernel[(1,)](packed.to(device), scale.to(device), joined, even, odd, BN=bn, BK=bk)
    got = torch.stack((even, odd), dim=-1).reshape(bn, bk).cpu()
    want = oracle_dequantize(packed, scale).float()    # rounds only where float32 overflows (inf)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(got, joined.cpu(), rtol=0, atol=0, equal_nan=True)
    fin = ~torch.isnan(want)
    assert torch.equal(torch.signbit(got[fin]), torch.signbit(want[fin])), "signs (code 8 is -0.0)"
    assert torch.isnan(got[scale.repeat_interleave(32, dim=1) == 255]).all()
    assert torch.isinf(got).any()                                # float32 overflow (s = 253, 254)
    s_tiny = scale.repeat_interleave(32, dim=1) <= 1
    assert (got[s_tiny] != 0).any() and (got[s_tiny].abs() < torch.finfo(torch.float32).tiny).any()


_INTERP = r"""
import sys, torch
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
import {module} as t
{body}
print("OK")
"""


def run_interpreted(module: str, body: str, timeout: int = 300):
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    code = _INTERP.format(root=ROOT, tests=os.path.dirname(os.path.abspath(__file__)), module=module,
                          body=body)
    r = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]


def test_interp_bmm_a16wfp4():
    run_interpreted("test_mxfp4", """
import triton
# Triton 3.6's interpreter cannot run tl.dot_scaled (its format strings); 3.7+ can
ds_paths = (False, True) if tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 7) else (False,)
for ds in ds_paths:   # in-register decode + tl.dot; MXFP8 hi+lo x fp4 dot_scaled (gfx950's)
    t.check_bmm(2, 1, 64, 128, dot_scaled=ds, gemv=False)       # M = 1 (tl.dot kernel forced)
    t.check_bmm(2, 19, 48, 512, dot_scaled=ds, strided=True)    # K loop, N and M tails, strided x
t.check_bmm(1, 3, 32, 96, dot_scaled=False, nan_block=True)     # K tail; NaN scale -> NaN column
# through the op layer and the dispatcher (M = 5, K = 128: the tl.dot kernel by default)
import os, kimi_ops
os.environ["KIMI_OPS_BACKEND"] = "triton"
x = torch.randn(5, 2, 128).to(torch.bfloat16).transpose(0, 1)
p, s = t.ref.mxfp4_quantize(torch.randn(2, 64, 128))
y = kimi_ops.bmm_a16wfp4(x, p, s)
assert t.rel_err(y, t.oracle_bmm(x, p, s)) < 4e-3
if hasattr(torch, "float8_e8m0fnu"):
    assert torch.equal(kimi_ops.bmm_a16wfp4(x, p, s.view(torch.float8_e8m0fnu)), y)
""")


def test_interp_bmm_a16wfp4_gemv():
    run_interpreted("test_mxfp4", """
from kimi_ops.kernels import mxfp4 as K
t.check_decode_even_odd()                                    # the GEMV's decode: every scale byte and code, exact
# (BLOCK_M, BLOCK_K, K_TILES, X_PAIRS) of each case in the comments
t.check_bmm(2, 1, 64, 128, gemv=True)                        # M = 1, K = 128: (1, 128, 1, pairs)
t.check_bmm(2, 1, 40, 512, gemv=True, strided=True)          # M = 1, K = 512: (1, 512, 1, pairs), N tail, x^T(0, 1)
t.check_bmm(2, 1, 40, 512, gemv=True, config=(1, 16, 128, 4))   # M = 1, K = 512 in 4 unrolled chunks
t.check_bmm(2, 3, 48, 128, gemv=True, strided="k")           # M = 3 (M tail), N tail, stride_xk != 1: halves
t.check_bmm(1, 3, 32, 512, gemv=True, strided="odd")         # K = 512, rows at odd elements: halves
t.check_bmm(2, 8, 24, 512, gemv=True, strided=True)          # M = 8, K = 512: (8, 512, 1, pairs), N tail
t.check_bmm(1, 8, 40, 160, gemv=True)                        # K tail in chunk 2 (160 = 128 + 32)
t.check_bmm(1, 5, 32, 96, gemv=True, strided="nan_tail")     # K tail in chunk 1: x's NaN columns >= K unread
t.check_bmm(1, 3, 32, 96, gemv=True, nan_block=True)         # NaN scale -> NaN column
t.check_bmm(1, 2, 24, 320, gemv=True, config=(4, 16, 32, 4))    # 10 chunks of 32: the runtime loop
t.check_bmm(1, 7, 20, 64, gemv=True, config=(8, 8, 512, 2))     # BLOCK_K clamped to K, BLOCK_N 8
t.check_bmm(1, 2, 16, 1024, gemv=True)                       # K > 512: 2 chunks of 512


class Spy:   # counts the GEMV kernel's launches and runs them
    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


spy = K._bmm_a16wfp4_gemv_kernel = Spy(K._bmm_a16wfp4_gemv_kernel)
# the default rule (no argument, KIMI_OPS_MXFP4_GEMV unset) through the op layer: the GEMV at M = 1
# (W_UK-like K = 128 and W_UV-like K = 512) and at M = 8 with K = 512; the tl.dot kernel at M = 8,
# K = 128 and at M = 9
import os, kimi_ops
os.environ["KIMI_OPS_BACKEND"] = "triton"
os.environ.pop("KIMI_OPS_MXFP4_GEMV", None)
p, s = t.ref.mxfp4_quantize(t.random_weights((2, 64, 128)))
pv, sv = t.ref.mxfp4_quantize(t.random_weights((2, 48, 512)))
for m, (pp, ss), gemv in ((1, (p, s), True), (1, (pv, sv), True), (8, (pv, sv), True), (8, (p, s), False),
                          (9, (pv, sv), False)):
    x = torch.randn(m, 2, pp.shape[2] * 2).to(torch.bfloat16).transpose(0, 1)    # x^T(0, 1), as the model's
    before = spy.launches
    assert t.rel_err(kimi_ops.bmm_a16wfp4(x, pp, ss), t.oracle_bmm(x, pp, ss)) < 4e-3, (m, pp.shape)
    assert spy.launches - before == int(gemv), (m, pp.shape)
# the environment variable forces either kernel
x = torch.randn(2, 1, 128).to(torch.bfloat16)
for env, gemv in (("0", False), ("1", True)):
    os.environ["KIMI_OPS_MXFP4_GEMV"] = env
    before = spy.launches
    assert t.rel_err(kimi_ops.bmm_a16wfp4(x, p, s), t.oracle_bmm(x, p, s)) < 4e-3
    assert spy.launches - before == int(gemv), env
del os.environ["KIMI_OPS_MXFP4_GEMV"]
# same values as the tl.dot kernel up to summation order (one bf16 rounding of an f32 sum each)
x = torch.randn(3, 4, 256).to(torch.bfloat16)
p, s = t.ref.mxfp4_quantize(t.random_weights((3, 48, 256)))
a = K.bmm_a16wfp4(x, p, s, gemv=True).float()
d = K.bmm_a16wfp4(x, p, s, gemv=False, dot_scaled=False).float()
assert ((a - d).abs() <= 2 ** -7 * d.abs() + 1e-6 * d.abs().max()).all()
""")


class _RecordLaunch:
    """Stands in for a jitted kernel: records the launch's keyword arguments, runs nothing."""

    def __init__(self):
        self.kwargs = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.kwargs.append(kwargs)


@pytest.mark.parametrize("env,arg,m,k,dot_scaled,want", [
    # the default rule (gemv_wins): M = 1 always, 2 <= M <= 8 only at K >= 512
    (None, None, 1, 128, False, True), (None, None, 1, 512, False, True), (None, None, 2, 128, False, False),
    (None, None, 8, 128, False, False), (None, None, 2, 512, False, True), (None, None, 8, 512, False, True),
    (None, None, 8, 1024, False, True), (None, None, 9, 512, False, False), (None, None, 64, 128, False, False),
    ("true", None, 1, 128, False, True), ("", None, 8, 128, False, False),     # other values: the rule
    # KIMI_OPS_MXFP4_GEMV=0 / 1 force (M <= GEMV_MAX_M), the argument overrides the environment
    ("0", None, 1, 128, False, False), (" 0 ", None, 8, 512, False, False), ("1", None, 8, 128, False, True),
    ("1", None, 9, 128, False, False), ("1", False, 1, 128, False, False), ("0", True, 8, 128, False, True),
    (None, False, 1, 512, False, False), (None, True, 8, 128, False, True), (None, True, 9, 512, False, False),
    # the dot_scaled path (gfx950's) never runs the GEMV
    (None, None, 1, 128, True, False), ("1", None, 1, 128, True, False), (None, True, 3, 512, True, False),
])
def test_gemv_host_choice(monkeypatch, env, arg, m, k, dot_scaled, want):
    from kimi_ops.kernels import mxfp4 as K

    if env is None:
        monkeypatch.delenv("KIMI_OPS_MXFP4_GEMV", raising=False)
    else:
        monkeypatch.setenv("KIMI_OPS_MXFP4_GEMV", env)
    monkeypatch.setattr(torch.version, "hip", None)
    rec_d, rec_g = _RecordLaunch(), _RecordLaunch()
    monkeypatch.setattr(K, "_bmm_a16wfp4_kernel", rec_d)
    monkeypatch.setattr(K, "_bmm_a16wfp4_gemv_kernel", rec_g)
    p, s = ref.mxfp4_quantize(torch.randn(2, 64, k))
    K.bmm_a16wfp4(torch.randn(2, m, k).to(torch.bfloat16), p, s, dot_scaled=dot_scaled, gemv=arg)
    assert (len(rec_g.kwargs), len(rec_d.kwargs)) == ((1, 0) if want else (0, 1))
    if want:
        kw = rec_g.kwargs[0]
        assert (kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["num_warps"]) == K.gemv_config(m, 64, k)
        assert kw["BLOCK_M"] >= m and kw["K_TILES"] == -(-k // kw["BLOCK_K"]) and kw["X_PAIRS"] is True
    else:
        assert rec_d.kwargs[0]["DOT_SCALED"] is dot_scaled


def test_gemv_pdl_changes_the_load_order_not_the_sums(monkeypatch):
    """A constant_w GEMV launches the same chunks with PDL and without (the float32 sums' order;
    tests/test_pdl.py checks the bits on the GPU): PDL only moves the weight loads (W_FIRST)."""
    from kimi_ops.kernels import mxfp4 as K

    p, s = ref.mxfp4_quantize(torch.randn(2, 128, 512))
    x = torch.randn(2, 1, 512).to(torch.bfloat16)
    seen = {}
    for on in (False, True):
        rec = _RecordLaunch()
        monkeypatch.setattr(K, "_bmm_a16wfp4_gemv_kernel", rec)
        monkeypatch.setattr(K, "pdl_args", lambda dev, on=on: {"PDL": on})
        K.launch_gemv(x, p, s, torch.empty(2, 1, 128, dtype=torch.bfloat16), constant_w=True)
        seen[on] = rec.kwargs[0]
    assert seen[True]["BLOCK_K"] == seen[False]["BLOCK_K"] == 256
    assert (seen[True]["W_FIRST"], seen[False]["W_FIRST"]) == (True, False)


def test_gemv_rule_and_configs():
    """gemv_wins / gemv_config against the H200 measurements they encode (Kimi-K3 TP8, 12 heads)."""
    from kimi_ops.kernels import mxfp4 as K

    if torch.version.hip is None:
        assert K.gemv_wins(1, 512, 128) and K.gemv_wins(1, 128, 512)          # W_UK, W_UV at T = 1
        assert not K.gemv_wins(8, 512, 128) and K.gemv_wins(8, 128, 512)      # T = 8: W_UV only
    assert not K.gemv_wins(9, 128, 512) and not K.gemv_wins(64, 128, 512)
    assert K.gemv_config(1, 512, 128) == (1, 16, 128, 4)     # W_UK T = 1: 2.58 us
    assert K.gemv_config(1, 128, 512) == (1, 16, 512, 8)     # W_UV T = 1: 3.09 us
    assert K.gemv_config(8, 128, 512) == (8, 16, 512, 8)     # W_UV T = 8: 4.82 us
    # a model's weight (constant_w): two 256 chunks whether PDL runs or not (the sums' order)
    assert K.gemv_config(1, 128, 512, constant_w=True) == (1, 16, 256, 8)


def test_gemv_rule_off_on_rocm(monkeypatch):
    from kimi_ops.kernels import mxfp4 as K

    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.delenv("KIMI_OPS_MXFP4_GEMV", raising=False)
    assert not K.gemv_wins(1, 512, 128) and not K.use_gemv(1, 512, 128)
    assert K.use_gemv(1, 512, 128, gemv=True)
    monkeypatch.setenv("KIMI_OPS_MXFP4_GEMV", "1")
    assert K.use_gemv(1, 512, 128)


def test_gemv_config_and_launch_args(monkeypatch):
    from kimi_ops.kernels import mxfp4 as K

    for m in range(1, K.GEMV_MAX_M + 1):
        for n, k in ((512, 128), (128, 512), (40, 96), (8, 32), (64, 160), (64, 4096)):
            bm, bn, bk, warps = K.gemv_config(m, n, k)
            assert bm >= m and bm & (bm - 1) == 0 and bm <= 8
            assert 32 <= bk <= 512 and bk & (bk - 1) == 0
            if k >= 512:      # one chunk of 512 at 8 warps (W_UV)
                assert (bk, warps) == (512, 8)
            else:             # BLOCK_K <= 128 at 4 warps: the x row tile has fewer elements than the CTA threads
                assert bk <= 128 and warps == 4 and bk // 2 < 32 * warps
            assert bm * bn * bk // 2 // (32 * warps) <= 128          # partial sums per thread
    rec = _RecordLaunch()
    monkeypatch.setattr(K, "_bmm_a16wfp4_gemv_kernel", rec)
    p, s = ref.mxfp4_quantize(torch.randn(3, 64, 160))
    x = torch.randn(3, 5, 160).to(torch.bfloat16)
    K.bmm_a16wfp4(x, p, s, gemv=True, config=(8, 32, 64, 2))
    kw = rec.kwargs[-1]
    assert (kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["K_TILES"], kw["num_warps"]) == (8, 32, 64, 3, 2)
    K.bmm_a16wfp4(x, p, s, gemv=True, config=(8, 16, 1024, 4))          # BLOCK_K clamped to K's power of two
    assert (rec.kwargs[-1]["BLOCK_K"], rec.kwargs[-1]["K_TILES"]) == (256, 1)
    # x read as uint32 pairs only when K is contiguous and rows start 4-byte aligned
    assert K.gemv_x_pairs(x) and K.gemv_x_pairs(torch.randn(5, 3, 160).to(torch.bfloat16).transpose(0, 1))
    assert not K.gemv_x_pairs(torch.randn(3, 160, 5).to(torch.bfloat16).transpose(1, 2))
    assert not K.gemv_x_pairs(torch.randn(3, 5, 161).to(torch.bfloat16)[..., 1:])
    assert not K.gemv_x_pairs(torch.randn(3, 5, 161).to(torch.bfloat16)[..., :160])    # odd row stride
    K.bmm_a16wfp4(torch.randn(3, 5, 161).to(torch.bfloat16)[..., 1:], p, s, gemv=True)
    assert rec.kwargs[-1]["X_PAIRS"] is False
    # a config of the other kernel's kind is refused, as is BLOCK_M < M
    with pytest.raises(ValueError, match="GEMV kernel runs"):
        K.bmm_a16wfp4(x, p, s, gemv=True, config=(16, 32, 128, 4, 1))
    with pytest.raises(ValueError, match="tl.dot kernel runs"):
        K.bmm_a16wfp4(x, p, s, gemv=False, config=(8, 32, 128, 4))
    with pytest.raises(ValueError, match="tl.dot kernel runs"):
        K.bmm_a16wfp4(torch.randn(3, 9, 160).to(torch.bfloat16), p, s, gemv=True, config=(8, 32, 128, 4))
    with pytest.raises(ValueError, match="BLOCK_M"):
        K.bmm_a16wfp4(x, p, s, gemv=True, config=(4, 32, 128, 4))


def test_cross_compile_specs_cover_launches():
    from kimi_ops.kernels import mxfp4 as K

    names = [s["name"] for s in K.CROSS_COMPILE_SPECS]
    assert len(names) == len(set(names))
    dot_specs = [s for s in K.CROSS_COMPILE_SPECS if s["kernel"] is K._bmm_a16wfp4_kernel]
    gemv_specs = [s for s in K.CROSS_COMPILE_SPECS if s["kernel"] is K._bmm_a16wfp4_gemv_kernel]
    assert len(dot_specs) + len(gemv_specs) == len(names)
    for spec in K.CROSS_COMPILE_SPECS:
        assert set(spec["signature"]) == set(spec["kernel"].arg_names)
        assert set(spec["constexprs"]) == {k for k, v in spec["signature"].items() if v == "constexpr"}
    # the tl.dot kernel: every config bmm_config gives each target (AMD's own where it differs), on
    # each path the target takes (decode everywhere, dot_scaled on gfx950)
    for amd, targets in ((False, ("sm90",)), (True, ("gfx950", "gfx942"))):
        launched = {K.bmm_config(m, n, k, amd=amd) for n, k in ((512, 128), (128, 512))
                    for m in (1, 8, 32, 33, 64, 256, 512)}
        for target in targets:
            for ds in ((False, True) if target == "gfx950" else (False,)):
                covered = {(s["constexprs"]["BLOCK_M"], s["constexprs"]["BLOCK_N"], s["constexprs"]["BLOCK_K"],
                            s["num_warps"], s["num_stages"]) for s in dot_specs
                           if s["constexprs"]["DOT_SCALED"] is ds and target in s["targets"]}
                assert launched <= covered, (target, ds)
    # the GEMV kernel: every config gemv_config gives for M <= GEMV_MAX_M, x as pairs and as halves
    launched = {(*K.gemv_config(m, n, k), -(-k // K.gemv_config(m, n, k)[2])) for n, k in ((512, 128), (128, 512))
                for m in range(1, K.GEMV_MAX_M + 1)}
    for pairs in (True, False):
        covered = {(s["constexprs"]["BLOCK_M"], s["constexprs"]["BLOCK_N"], s["constexprs"]["BLOCK_K"],
                    s["num_warps"], s["constexprs"]["K_TILES"]) for s in gemv_specs
                   if s["constexprs"]["X_PAIRS"] is pairs}
        assert launched <= covered, pairs
    # every form on every target, but the sm_90-only copies of the decode layer's launches (PDL, W_FIRST)
    assert all(s["targets"] == (("sm90",) if s["constexprs"]["W_FIRST"] else ("gfx950", "gfx942", "sm90"))
               for s in gemv_specs)


# ----------------------------------------------------------------------------------------------
# GPU

@requires_cuda
@pytest.mark.parametrize("gemv", [False, True, None], ids=["dot", "gemv", "default"])
@pytest.mark.parametrize("m", [1, 8, 64, 256, 512])
@pytest.mark.parametrize("n,k", [(512, 128), (128, 512)])
def test_gpu_bmm_grid(m, n, k, gemv):
    # the GEMV needs dot_scaled off (None: the host's choice); with gemv=True, M > GEMV_MAX_M checks
    # the fallback to the tl.dot kernel; gemv=None is the library's default (gemv_wins)
    ds = False if gemv else None
    check_bmm(12, m, n, k, device="cuda", dot_scaled=ds, gemv=gemv, strided=(n == 512), seed=m)
    check_bmm(12, m, n, k, device="cuda", dot_scaled=ds, gemv=gemv, strided=False, seed=m + 1)


@requires_cuda
def test_gpu_bmm_dot_scaled_and_nan():
    check_bmm(12, 33, 512, 128, device="cuda", dot_scaled=True)
    check_bmm(3, 7, 64, 96, device="cuda", nan_block=True)


@requires_cuda
def test_gpu_bmm_gemv_edges():
    check_decode_even_odd(device="cuda")
    for m in (1, 3, 8):
        check_bmm(12, m, 128, 512, device="cuda", dot_scaled=False, gemv=True, strided="k", seed=m)
        check_bmm(12, m, 512, 128, device="cuda", dot_scaled=False, gemv=True, strided="odd", seed=m)
    check_bmm(3, 7, 64, 96, device="cuda", dot_scaled=False, gemv=True, nan_block=True)
    check_bmm(2, 5, 40, 160, device="cuda", dot_scaled=False, gemv=True, strided="nan_tail")
    check_bmm(2, 2, 24, 320, device="cuda", dot_scaled=False, gemv=True, config=(4, 16, 32, 4))   # runtime loop
    check_bmm(2, 2, 64, 1024, device="cuda", dot_scaled=False, gemv=True)                          # 2 chunks of 512
    for cfg in ((8, 16, 128, 4), (8, 16, 256, 8), (8, 8, 128, 4), (8, 32, 128, 8)):   # bench_query's sweep
        check_bmm(12, 8, 128, 512, device="cuda", dot_scaled=False, gemv=True, strided=True, config=cfg)


@requires_cuda
def test_gpu_quantize_matches_cpu():
    w = random_weights((12, 512, 128)).to(torch.bfloat16)
    p, s = ref.mxfp4_quantize(w)
    pc, sc = ref.mxfp4_quantize(w.cuda())
    assert torch.equal(pc.cpu(), p) and torch.equal(sc.cpu(), s)
    assert torch.equal(ref.mxfp4_dequantize(pc, sc).cpu(), ref.mxfp4_dequantize(p, s))


@requires_cuda
@pytest.mark.parametrize("gemv_env,m", [(None, 1), (None, 8), (None, 16), ("0", 1), ("1", 8)])
def test_gpu_opcheck_and_graph(monkeypatch, gemv_env, m):
    # W_UK's shape: the default runs the GEMV at M = 1 and the tl.dot kernel at M = 8, 16
    import kimi_ops  # noqa: F401

    if gemv_env is None:
        monkeypatch.delenv("KIMI_OPS_MXFP4_GEMV", raising=False)
    else:
        monkeypatch.setenv("KIMI_OPS_MXFP4_GEMV", gemv_env)

    x = torch.randn(12, m, 128, device="cuda", dtype=torch.bfloat16)
    p, s = ref.mxfp4_quantize(torch.randn(12, 512, 128, device="cuda"))
    torch.library.opcheck(torch.ops.kimi_ops.bmm_a16wfp4, (x, p, s))
    torch.library.opcheck(torch.ops.kimi_ops.mxfp4_quantize, (torch.randn(4, 64, device="cuda"),))
    torch.library.opcheck(torch.ops.kimi_ops.mxfp4_dequantize, (p, s))
    y = torch.ops.kimi_ops.bmm_a16wfp4(x, p, s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.kimi_ops.bmm_a16wfp4(x, p, s)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(y, oracle_bmm(x, p, s)) < 4e-3
