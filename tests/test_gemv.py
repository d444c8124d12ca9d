"""The decode layer's projections at small M: the op ``kimi_ops.gemm_a16w16`` (bf16 weights) and
the ``cuda`` backend of both it and ``kimi_ops.gemm_a16w8_block`` (fp8 block-scaled weights): the
small-M Hopper kernel of csrc/sm90/gemv.cuh (kimi_ops/kernels/sm90_gemv.py).

CPU (CI): the op's schema, errors, opcheck and torch.compile over it, its reference against
float64. GPU (skipped without CUDA; the kernel needs sm_90 and kimi_ops._C): both weight types at
Kimi-K3 TP8's shapes and at ragged ones (N not a multiple of 16, a partial last k-block, block_n
16 / 64 / 128, strided x), M = 1..32 (one, two and four 8-token tiles) and 33..64 (the fp8 weight's
kernel of csrc/sm90/gemm_fp8_rows64.cuh: split K over a cluster), against float64, into
NaN-poisoned memory; every e4m3 code (subnormals included) and x over 80 binades; chains
launched with ``constant_w`` (programmatic dependent launch) bit for bit against plain launches;
the calls the kernels do not take (M > 32 with a bf16 w, M > 64, K % 32, misaligned x) still correct.
"""
from __future__ import annotations

import pytest
import torch

import kimi_ops
from conftest import requires_sm90
from kimi_ops.reference.fp8 import quantize_fp8_blocks
from test_fp8_weights import gemm64, random_fp8


def bound_ok(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| over bf16's rounding of each element plus f32-sum slack (<= 1 passes)."""
    y = y.cpu().double()
    return ((y - ref).abs() / (2.0 ** -8 * ref.abs() + 1e-5 * ref.abs().max())).max().item()


def test_schema_errors_and_reference():
    assert (str(torch.ops.kimi_ops.gemm_a16w16.default._schema)
            == "kimi_ops::gemm_a16w16(Tensor x, Tensor w, *, bool constant_w=False) -> Tensor")
    x = torch.randn(3, 96).to(torch.bfloat16)
    w = torch.randn(40, 96).to(torch.bfloat16)
    y = kimi_ops.gemm_a16w16(x, w)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 40)
    assert bound_ok(y, x.double() @ w.double().T) <= 1.0
    with pytest.raises(ValueError, match="x must be a bf16"):
        kimi_ops.gemm_a16w16(x.float(), w)
    with pytest.raises(ValueError, match="w must be a bf16"):
        kimi_ops.gemm_a16w16(x, w.float())
    with pytest.raises(ValueError, match="K must agree"):
        kimi_ops.gemm_a16w16(x[:, :64], w)


def test_row_limit_switch(monkeypatch):
    from kimi_ops.kernels import sm90_gemv
    x, w = torch.randn(2, 64).to(torch.bfloat16), torch.randn(16, 64).to(torch.bfloat16)
    monkeypatch.setenv(sm90_gemv.ENV, "7")
    with pytest.raises(ValueError, match="KIMI_OPS_SM90_GEMV must be 0, 1, 8, 16, 32 or 64"):
        sm90_gemv.serves(x, w)
    monkeypatch.setenv(sm90_gemv.ENV, "32")
    assert not sm90_gemv.serves(x, w)   # CPU tensors: never the kernel


def test_opcheck_and_compile():
    x = torch.randn(5, 64).to(torch.bfloat16)
    w = torch.randn(48, 64).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.kimi_ops.gemm_a16w16.default, (x, w))
    torch.library.opcheck(torch.ops.kimi_ops.gemm_a16w16.default, (x, w), {"constant_w": True})
    assert torch.equal(kimi_ops.gemm_a16w16(x, w, constant_w=True), kimi_ops.gemm_a16w16(x, w))

    def fn(x, w):
        return torch.relu(kimi_ops.gemm_a16w16(x * 2, w)).float() * 0.5

    torch._dynamo.reset()
    assert torch.equal(torch.compile(fn, fullgraph=True)(x, w), fn(x, w))


# --- GPU -------------------------------------------------------------------------------------------

KIMI_K3 = ((3648, 7168), (2304, 1536), (7168, 1536))   # fused qkv_a + gate, q_b, o_proj (TP8)


def _poison(m, n):
    torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")   # freed: the next allocation's bytes


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 16, 17, 32])
def test_gpu_bf16_kimi_k3_shapes(m, monkeypatch):
    from kimi_ops.kernels import sm90_gemv
    if m > sm90_gemv.BF16_MAX_M:   # past the bf16 default (cuBLAS there): the four-tile path, opted in
        monkeypatch.setenv(sm90_gemv.ENV, "32")
    for n, k in KIMI_K3:
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).to(torch.bfloat16)
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        assert sm90_gemv.serves(x, w)
        _poison(m, n)
        y = kimi_ops.gemm_a16w16(x, w)
        ref = x.double().cpu() @ w.double().cpu().T
        rel = float((y.cpu().double() - ref).norm() / ref.norm())
        print(f"gemm_a16w16 M {m} N {n} K {k}: rel L2 {rel:.2e}, max err / bound {bound_ok(y, ref):.2f}")
        assert bound_ok(y, ref) <= 1.0 and rel <= 4e-3


def _fp8_kernel_error(m, w, s, bn):
    """The cuda backend's gemm_a16w8_block of a random [m, K] x on w (which the kernels must take),
    into poisoned memory: (max err / bound, rel L2) against float64."""
    from kimi_ops.kernels import sm90_gemv
    n, k = w.shape
    x = torch.randn(m, k).to(torch.bfloat16)
    wd, sd, xd = w.cuda(), s.cuda(), x.cuda()
    assert sm90_gemv.serves(xd, wd, sd, bn, 128)
    _poison(m, n)
    y = kimi_ops.gemm_a16w8_block(xd, wd, sd, block_n=bn, block_k=128)
    ref = gemm64(x, w, s, bn, 128)
    return bound_ok(y, ref), float((y.cpu().double() - ref).norm() / ref.norm())


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4, 7, 8, 9, 13, 16, 17, 24, 32, 33, 40, 48, 57, 64])
def test_gpu_fp8_kimi_k3_shapes(m):
    for (n, k), bn in zip(KIMI_K3, (64, 128, 128)):   # the fused qkv_a + gate on its 64-row scale grid
        w, s = random_fp8(n, k, bn, 128, seed=n + m)
        bound, rel = _fp8_kernel_error(m, w, s, bn)
        print(f"gemm_a16w8_block (cuda) M {m} N {n} K {k} block_n {bn}: rel L2 {rel:.2e}, max err / bound {bound:.2f}")
        assert bound <= 1.0 and rel <= 4e-3


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("mt", ["1", "2"])
def test_gpu_fp8_rows64_forms(mt, monkeypatch):
    """33-64 rows (csrc/sm90/gemm_fp8_rows64.cuh) in both of its forms, 16 weight rows a warp (the
    default) and 32 (KIMI_OPS_SM90_ROWS64_MT=2), at the token-tile boundaries (6 tiles to 48
    rows, 8 above) on Kimi-K3's shapes and a ragged one, against float64."""
    monkeypatch.setenv("KIMI_OPS_SM90_ROWS64_MT", mt)
    for (n, k), bn in zip(KIMI_K3 + ((1000, 4160),), (64, 128, 128, 16)):
        w, s = random_fp8(n, k, bn, 128, seed=n + int(mt))
        for m in (33, 48, 49, 64):
            assert _fp8_kernel_error(m, w, s, bn)[0] <= 1.0, (mt, m, n, k)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("m", [9, 12, 16])
def test_gpu_fp8_two_token_tiles_equal_two_launches(m):
    # 9..16 rows take two 8-token MMA tiles a launch and one k-block a step; a token's sums keep
    # their order (gemv.cuh), so the rows come out bit for bit as from launches of <= 8 rows
    op = torch.ops.kimi_ops._gemv_sm90
    for (n, k), bn in zip(KIMI_K3, (64, 128, 128)):
        w, s = random_fp8(n, k, bn, 128, seed=n - m)
        wd, sd = w.cuda(), s.cuda()
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        whole = op(x, wd, sd, bn, False)
        halves = torch.cat([op(x[:8].contiguous(), wd, sd, bn, False), op(x[8:].contiguous(), wd, sd, bn, False)])
        assert torch.equal(whole, halves), (m, n, k)


@requires_sm90
@pytest.mark.gpu
def test_gpu_ragged_shapes_and_strides(monkeypatch):
    """N not a multiple of 16, K with a partial last k-block, small scale blocks, strided and
    offset x, M at the kernel's limit and past it, misaligned x or w (the fallback)."""
    from kimi_ops.kernels import sm90_gemv
    x17, w17 = torch.randn(17, 64, device="cuda").to(torch.bfloat16), torch.randn(16, 64, device="cuda").to(torch.bfloat16)
    assert not sm90_gemv.serves(x17, w17)                 # bf16 weights: 16 rows by default
    monkeypatch.setenv(sm90_gemv.ENV, "32")
    for m, n, k in ((1, 200, 96), (8, 37, 512), (6, 16, 32), (3, 1000, 4128), (25, 200, 96), (32, 16, 32),
                    (16, 1000, 4128), (12, 37, 512)):
        big = torch.randn(m, k + 64, device="cuda").to(torch.bfloat16)
        x = big[:, 8:8 + k]                                    # rows k + 64 apart, 16-byte aligned
        w = torch.randn(n, k, device="cuda").to(torch.bfloat16)
        assert sm90_gemv.serves(x, w)
        _poison(m, n)
        y = kimi_ops.gemm_a16w16(x, w)
        assert bound_ok(y, x.cpu().double() @ w.cpu().double().T) <= 1.0, (m, n, k)
    monkeypatch.setenv(sm90_gemv.ENV, "64")             # fp8 weights: their default limit (64 rows)
    for m, n, k, bn in ((1, 200, 192, 16), (8, 40, 320, 64), (5, 130, 1024, 128), (2, 7, 64, 16), (16, 40, 320, 64),
                        (11, 130, 1024, 128), (32, 40, 320, 64), (21, 7, 64, 16),
                        # 33-64 rows (gemm_fp8_rows64.cuh): split K in clusters of 1..8 CTAs, one split
                        # at 33000 rows (258 row tiles), a lone 64-column k-block, rows < 16
                        (33, 200, 192, 16), (64, 40, 320, 64), (47, 130, 1024, 128), (40, 7, 64, 16),
                        (57, 1000, 4160, 64), (36, 33000, 128, 128)):
        w, s = random_fp8(n, k, bn, 128, seed=n)
        x = torch.randn(m, k).to(torch.bfloat16)
        wd, sd = w.cuda(), s.cuda()
        xd = torch.randn(m, k + 32, device="cuda").to(torch.bfloat16)[:, 16:16 + k]
        xd.copy_(x)
        assert sm90_gemv.serves(xd, wd, sd, bn, 128)
        _poison(m, n)
        y = kimi_ops.gemm_a16w8_block(xd, wd, sd, block_n=bn, block_k=128)
        assert bound_ok(y, gemm64(x, w, s, bn, 128)) <= 1.0, (m, n, k, bn)
    # what the kernel does not take runs the other path, still right
    w = torch.randn(64, 96, device="cuda").to(torch.bfloat16)
    w_off = torch.randn(64 * 96 + 1, device="cuda").to(torch.bfloat16)[1:].view(64, 96)  # contiguous, 2 bytes off
    x1 = torch.randn(2, 96, device="cuda").to(torch.bfloat16)
    assert w_off.is_contiguous() and not sm90_gemv.serves(x1, w_off)
    assert bound_ok(kimi_ops.gemm_a16w16(x1, w_off), x1.cpu().double() @ w_off.cpu().double().T) <= 1.0
    for x in (torch.randn(33, 96, device="cuda").to(torch.bfloat16),                   # M > 32
              torch.randn(2, 97, device="cuda").to(torch.bfloat16)[:, 1:],            # misaligned rows
              torch.randn(0, 96, device="cuda").to(torch.bfloat16)):                  # M = 0
        assert not sm90_gemv.serves(x, w)
        y = kimi_ops.gemm_a16w16(x, w)
        assert y.shape == (x.shape[0], 64)
        if x.shape[0]:
            assert bound_ok(y, x.cpu().double() @ w.cpu().double().T) <= 1.0
    w2, s2 = random_fp8(64, 100, 128, 128, seed=1)                                     # K % 64 != 0
    x2 = torch.randn(2, 100).to(torch.bfloat16)
    assert not sm90_gemv.serves(x2.cuda(), w2.cuda(), s2.cuda())
    y2 = kimi_ops.gemm_a16w8_block(x2.cuda(), w2.cuda(), s2.cuda())
    assert bound_ok(y2, gemm64(x2, w2, s2, 128, 128)) <= 1.0
    w3, s3 = random_fp8(64, 128, 128, 128, seed=2)                                      # M > 64 (fp8 w)
    x3 = torch.randn(65, 128).to(torch.bfloat16)
    assert not sm90_gemv.serves(x3.cuda(), w3.cuda(), s3.cuda())
    assert bound_ok(kimi_ops.gemm_a16w8_block(x3.cuda(), w3.cuda(), s3.cuda()), gemm64(x3, w3, s3, 128, 128)) <= 1.0


@requires_sm90
@pytest.mark.gpu
def test_gpu_private_op_checks():
    """The launcher's own guards (the Python side never passes these). Their messages are
    literals: csrc/sm90/gemv_sm90.cu says why."""
    op = torch.ops.kimi_ops._gemv_sm90
    x = torch.randn(9, 64, device="cuda").to(torch.bfloat16)
    w = torch.randn(32, 64, device="cuda").to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="x must be bf16"):
        op(x[:2].float(), w, None, 0)
    with pytest.raises(RuntimeError, match="w must be contiguous and 16-byte aligned"):
        op(x[:2, :48], w[:, :48], None, 0)
    with pytest.raises(RuntimeError, match="w_scale_inv is required"):
        op(x[:2], w.to(torch.float8_e4m3fn), None, 128)
    x33 = torch.randn(33, 64, device="cuda").to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="at most 64 rows of x with an fp8 w, 32 with a bf16 one"):
        op(x33, w, None, 0)
    with pytest.raises(RuntimeError, match="at most 64 rows of x with an fp8 w, 32 with a bf16 one"):
        op(torch.randn(65, 64, device="cuda").to(torch.bfloat16), w.to(torch.float8_e4m3fn),
           torch.ones(1, 1, device="cuda"), 32)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        op(x[:2, :48], w[:, :48].contiguous(), None, 0)


@requires_sm90
@pytest.mark.gpu
def test_gpu_replays_in_a_cuda_graph():
    x = torch.randn(4, 1536, device="cuda").to(torch.bfloat16)
    w = torch.randn(2304, 1536, device="cuda").to(torch.bfloat16)
    eager = kimi_ops.gemm_a16w16(x, w)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kimi_ops.gemm_a16w16(x, w)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = kimi_ops.gemm_a16w16(x, w)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, kimi_ops.gemm_a16w16(x, w)) and not torch.equal(out, eager)


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("fp8,m", [(False, 3), (True, 3), (True, 48)])
def test_gpu_pdl_chain(fp8, m):
    """constant_w=True (programmatic dependent launch: the weight streams while the previous kernel
    finishes): in a graph of such kernels where each GEMV's x is the previous kernel's output, the
    results equal the same chain launched plainly, bit for bit."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    w1 = (torch.randn(2304, 1536, device="cuda", generator=gen) / 40).to(torch.bfloat16)
    w2 = (torch.randn(7168, 2304, device="cuda", generator=gen) / 48).to(torch.bfloat16)
    args1, args2 = (w1,), (w2,)
    if fp8:
        args1 = quantize_fp8_blocks(w1, 128, 128)
        args2 = quantize_fp8_blocks(w2, 128, 128)
    gemm = kimi_ops.gemm_a16w8_block if fp8 else kimi_ops.gemm_a16w16
    x = torch.randn(m, 1536, device="cuda", generator=gen).to(torch.bfloat16)
    torch.cuda.synchronize()  # the weights are written long before the chain (PDL reads them early)

    def chain(pdl):  # x of each GEMV: the output of the kernel just before it (the second: a GEMV
        h = gemm(torch.sigmoid(x), *args1, constant_w=pdl)  # that lets it launch early,
        return gemm(h, *args2, constant_w=pdl)              # griddepcontrol.launch_dependents)

    plain = chain(False)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chain(True)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain(True)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain)
    assert torch.equal(chain(True), plain)  # eager


@requires_sm90
@pytest.mark.gpu
@pytest.mark.parametrize("m", [3, 40])
@pytest.mark.parametrize("case", ["every_code", "subnormal_codes", "x_range"])
def test_gpu_fp8_every_code_exact(case, m):
    """The fp8 weight's conversion is exact for every finite e4m3 code: a weight drawn from all 254
    finite codes; one of e4m3's subnormal codes only (|w| < 2^-6: were they flushed to zero anywhere,
    the outputs would be zero); and x from 2^-40 to 2^40 with block scales from 2^-30 to 2^20;
    against float64."""
    from kimi_ops.kernels import sm90_gemv
    gen = torch.Generator().manual_seed(11)
    n, k = 96, 1024
    if case == "subnormal_codes":
        codes = torch.tensor([c for c in range(256) if c & 0x78 == 0], dtype=torch.uint8)
    else:
        codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    w = codes[torch.randint(len(codes), (n, k), generator=gen)].view(torch.float8_e4m3fn)
    s = torch.rand(n // 16, k // 128, generator=gen) + 0.5
    x = torch.randn(m, k, generator=gen)
    if case == "x_range":
        x = x * torch.exp2(torch.randint(-40, 41, (m, k), generator=gen).float())
        s = s * torch.exp2(torch.randint(-30, 21, s.shape, generator=gen).float())
    x = x.to(torch.bfloat16)
    wd, sd, xd = w.cuda(), s.cuda(), x.cuda()
    assert sm90_gemv.serves(xd, wd, sd, 16, 128)
    _poison(m, n)
    y = kimi_ops.gemm_a16w8_block(xd, wd, sd, block_n=16, block_k=128)
    ref = gemm64(x, w, s, 16, 128)
    assert ref.abs().min() > 0
    print(f"{case}: max err / bound {bound_ok(y, ref):.3f}, |ref| {ref.abs().min():.2e} .. {ref.abs().max():.2e}")
    assert bound_ok(y, ref) <= 1.0
