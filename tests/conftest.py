"""Shared test data: random decode workloads and brute-force float64 oracles.

The oracles here are written independently of kimi_ops.reference (a plain loop
over requests and query rows), so a wrong reference cannot agree with itself.
"""

import math
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

KV_ROW, KV_LORA = 576, 512

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _sm90_ready() -> bool:
    from kimi_ops import dispatch
    return (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
            and dispatch.cuda_extension_unavailable_reason() is None)


requires_sm90 = pytest.mark.skipif(not _sm90_ready(), reason="needs an sm_90 GPU and kimi_ops._C")

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)


def setup_module_of_repo():
    """setup.py loaded as a module (its setup() call runs only as ``__main__``): the build plan,
    the CUDA toolkit lookup and the nvcc flags the tests check against."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kimi_ops_setup", os.path.join(ROOT, "setup.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@dataclass
class DecodeCase:
    q: torch.Tensor           # [T, H, 576] bf16
    kv_cache: torch.Tensor    # fp8, last dim 576
    kv_indptr: torch.Tensor   # [R + 1] int32
    kv_indices: torch.Tensor  # int32
    lengths: list[int]
    qlen: int
    scale: float
    kv_scale: float

    @property
    def kwargs(self):
        return dict(qlen=self.qlen, scale=self.scale, kv_scale=self.kv_scale)

    @property
    def args(self):
        return (self.q, self.kv_cache, self.kv_indptr, self.kv_indices)


def make_decode_case(lengths, *, heads=12, qlen=1, spare_rows=37, block_size=None,
                     dtype=torch.float8_e4m3fn, device="cpu", seed=0, kv_scale=None):
    """Requests of the given lengths over a cache whose rows are randomly permuted,
    with ``spare_rows`` rows no request uses filled with NaN (they must never be read).

    The cache holds N(0, 1) / kv_scale values in fp8 (so k = kv_scale * fp8 is about
    unit scale); q is N(0, 1) bf16; the softmax scale is 1/sqrt(192) as in Kimi-K3.
    """
    gen = torch.Generator().manual_seed(seed)
    kv_scale = kv_scale if kv_scale is not None else float(2.0 ** torch.randint(-3, 2, (), generator=gen))
    total = sum(lengths)
    num_rows = total + spare_rows
    if block_size:
        num_rows = -(-num_rows // block_size) * block_size
    values = torch.randn(num_rows, KV_ROW, generator=gen) / kv_scale
    fmax = torch.finfo(dtype).max
    rows = values.clamp(-fmax, fmax).to(dtype)
    perm = torch.randperm(num_rows, generator=gen)
    used, unused = perm[:total], perm[total:]
    rows[unused] = torch.tensor(float("nan")).to(dtype)
    indptr = torch.tensor([0] + list(itertools_accumulate(lengths)), dtype=torch.int32)
    cache = rows if not block_size else rows.view(-1, block_size, KV_ROW)
    q = torch.randn(len(lengths) * qlen, heads, KV_ROW, generator=gen).to(torch.bfloat16)
    return DecodeCase(q.to(device), cache.to(device), indptr.to(device), used.to(torch.int32).to(device),
                      list(lengths), qlen, 1.0 / math.sqrt(192.0), kv_scale)


def itertools_accumulate(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def oracle_decode(case: DecodeCase, q_scale=None):
    """float64 (o [T, H, 512], lse [T, H]) by a loop over every query row. An fp8 ``case.q``
    takes its ``q_scale`` (a float32 tensor of one element): the real query is q8 * q_scale."""
    q = case.q.cpu().double()
    if q_scale is not None:
        q = q * float(q_scale.cpu().reshape(()))
    rows = case.kv_cache.cpu().reshape(-1, KV_ROW).double() * case.kv_scale
    indptr, indices = case.kv_indptr.cpu().tolist(), case.kv_indices.cpu().long()
    num_rows, heads, _ = q.shape
    o = torch.zeros(num_rows, heads, KV_LORA, dtype=torch.float64)
    lse = torch.full((num_rows, heads), -math.inf, dtype=torch.float64)
    for r in range(len(indptr) - 1):
        n = indptr[r + 1] - indptr[r]
        for i in range(case.qlen):
            visible = n - case.qlen + i + 1
            if visible <= 0:
                continue
            k = rows[indices[indptr[r]:indptr[r] + visible]]        # [visible, 576]
            t = r * case.qlen + i
            s = case.scale * (q[t] @ k.T)                            # [H, visible]
            m = s.max(dim=1, keepdim=True).values
            p = torch.exp(s - m)
            lse[t] = (m + torch.log(p.sum(dim=1, keepdim=True))).squeeze(1)
            o[t] = (p / p.sum(dim=1, keepdim=True)) @ k[:, :KV_LORA]
    return o, lse


def assert_attention_close(o, lse, o_ref, lse_ref, *, rtol=4e-3, lse_atol=1e-3):
    """DESIGN.md's accuracy contract: relative L2 of o, absolute LSE error, -inf exactly."""
    o, lse = o.cpu().double(), lse.cpu().double()
    assert not torch.isnan(o).any(), "o has NaN"
    assert not torch.isnan(lse).any(), "lse has NaN"
    empty = torch.isinf(lse_ref)
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty), "lse is -inf exactly where the reference is"
    assert (o[empty] == 0).all(), "rows that see no token have o = 0"
    denom = o_ref.norm()
    if denom > 0:
        err = (o - o_ref).norm() / denom
        assert err <= rtol, f"relative L2 error of o {err:.3e} > {rtol}"
    if (~empty).any():
        lse_err = (lse - lse_ref)[~empty].abs().max()
        assert lse_err <= lse_atol, f"max |lse - ref| {lse_err:.3e} > {lse_atol}"


def fp8_round_oracle(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Nearest fp8 code of each float32 value by brute force over all 256 codes
    (saturating to the largest finite value, ties to the even code)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    values = codes.view(dtype).double()
    finite = torch.isfinite(values)
    codes, values = codes[finite], values[finite]
    x64 = x.double().reshape(-1, 1)
    fmax = values.max()
    x64 = x64.clamp(-fmax, fmax)
    dist = (x64 - values[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    candidates = dist == best
    # among equally near codes: the even mantissa (code & 1 == 0), then x's sign (-0 for -tiny)
    same_sign = (codes >= 128)[None, :] == (x.reshape(-1, 1) < 0)
    score = candidates.double() * 4 + ((codes & 1) == 0).double()[None, :] * 2 + same_sign.double()
    pick = score.argmax(dim=1)
    return codes[pick].reshape(x.shape).view(dtype)


def dcp_shard(case: DecodeCase, rank: int, world: int):
    """Rank ``rank``'s CSR under decode context parallel (token p of a request on rank
    p % world): (kv_indptr [R + 1] int32, kv_indices int32), on the case's device."""
    indptr = case.kv_indptr.tolist()
    rows, local_indptr = [], [0]
    for r in range(len(indptr) - 1):
        rows.append(case.kv_indices[indptr[r]:indptr[r + 1]][rank::world])
        local_indptr.append(local_indptr[-1] + rows[-1].numel())
    return (torch.tensor(local_indptr, dtype=torch.int32, device=case.kv_indices.device),
            torch.cat(rows) if rows else case.kv_indices[:0])


def quantize_per_tensor(x: torch.Tensor, dtype=torch.float8_e4m3fn):
    """Test-side fp8 quantization of a query, written apart from kimi_ops': (x8, scale) with
    scale = amax / fp8 max (float32, shape [1]; 1 for an all-zero x) and x8 = fp8(x / scale)
    (float32 division, round to nearest, saturated)."""
    fmax = torch.finfo(dtype).max
    amax = x.float().abs().max()
    scale = torch.where(amax > 0, amax / fmax, torch.ones_like(amax)).reshape(1)
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype), scale


_INTERPRETED = r"""
import sys, torch
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
{imports}
g = torch.Generator().manual_seed({seed})
torch.manual_seed({seed})
{body}
print("OK")
"""


def run_interpreted(imports: str, body: str, *, seed: int = 0, timeout: float = 300, **env: str) -> None:
    """Run ``body`` in a fresh Python under the Triton interpreter (TRITON_INTERPRET=1 must be
    set before triton is imported, hence the subprocess), with no GPU visible and ``env`` added
    to the environment: the repository root and tests/ on sys.path, then ``imports``, then a
    torch.Generator ``g`` and torch's global generator seeded with ``seed``.  Fails with the
    tails of the child's stdout and stderr unless it exits 0 having printed OK."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="", **env)
    code = _INTERPRETED.format(root=ROOT, tests=TESTS, imports=imports, seed=seed, body=body)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]
