"""The contract's holes (issue 30): strided index tensors, CUDA grid limits, non-finite scales.

Every case below is refused by the shared host checks (kimi_ops/checks.py) before any backend
runs, so it fails alike on the reference, on Triton (CPU: under TRITON_INTERPRET=1, in a
subprocess, as tests/test_triton_attention.py does; GPU: in process), on the cuda backend and
in the fake implementations (meta tensors). Before the checks, the Triton kernels took strided
kv_indices / kv_indptr / slot_mapping silently and read or wrote the wrong rows, R or
num_splits > 65535 ended in "Triton Error [CUDA]: invalid argument", and NaN / inf scales
gave NaN outputs or NaN bytes in the cache. The accepted cases (zero and negative scales, the
contiguous copy of a refused view) are checked against the float64 oracle of conftest.py.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
import torch

import kimi_ops
from conftest import assert_attention_close, make_decode_case, oracle_decode, requires_cuda

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
DECODE_OPS = ("mla_decode_splitkv", "mla_decode")


def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as ``t`` in a non-contiguous view (every other element of a buffer)."""
    buf = torch.full((2 * t.numel(),), -7, dtype=t.dtype, device=t.device)
    view = buf[::2]
    view.copy_(t)
    assert not view.is_contiguous() and (t.device.type == "meta" or torch.equal(view, t))
    return view


def _decode(op, case, **over):
    args = dict(q=case.q, kv_cache=case.kv_cache, kv_indptr=case.kv_indptr, kv_indices=case.kv_indices)
    kwargs = dict(case.kwargs, num_splits=2, seq_lens=None)
    for key, value in over.items():
        (args if key in args else kwargs)[key] = value
    return getattr(kimi_ops, op)(*args.values(), **kwargs)


def _merged(op, case, **over):
    """(o, lse) of ``op``; mla_decode_splitkv's partials merged by mla_merge."""
    out = _decode(op, case, **over)
    return kimi_ops.mla_merge(*out) if op == "mla_decode_splitkv" else out


def _write_args(device, t=4, n=10):
    gen = torch.Generator().manual_seed(3)
    kv_c = torch.randn(t, 512, generator=gen).to(torch.bfloat16).to(device)
    k_pe = torch.randn(t, 64, generator=gen).to(torch.bfloat16).to(device)
    cache = torch.zeros(n, 576, dtype=torch.float8_e4m3fn, device=device)
    slots = torch.tensor([3, -1, 0, 7], dtype=torch.int64, device=device)[:t]
    return kv_c, k_pe, cache, slots


def refusals(device):
    """(name, call, message regex) of every refused input on ``device``."""
    case = make_decode_case([6, 3], heads=2, qlen=2, seed=5, device=device)
    lens = torch.tensor(case.lengths, dtype=torch.int32, device=device)
    out = []
    for op in DECODE_OPS:
        for arg in ("kv_indices", "kv_indptr"):
            out.append((f"{op} strided {arg}", lambda op=op, arg=arg: _decode(op, case, **{arg: strided(getattr(case, arg))}),
                        rf"kimi_ops\.{op}: {arg} must be contiguous .*got a strided view: shape \(\d+,\) strides \(2,\)"))
        out.append((f"{op} strided seq_lens", lambda op=op: _decode(op, case, seq_lens=strided(lens)),
                    rf"kimi_ops\.{op}: seq_lens must be contiguous .*strides \(2,\)"))
        # R = 65536 requests (q an expanded view: nothing is allocated)
        num = 65536
        big = dict(q=torch.zeros(1, 1, 576, dtype=torch.bfloat16, device=device).expand(num, 1, 576),
                   kv_indptr=torch.zeros(num + 1, dtype=torch.int32, device=device),
                   kv_indices=torch.zeros(0, dtype=torch.int32, device=device), qlen=1, num_splits=1)
        out.append((f"{op} R > 65535", lambda op=op, big=big: _decode(op, case, **big),
                    rf"kimi_ops\.{op}: R = len\(kv_indptr\) - 1 \(the number of requests\) must be at most 65535 "
                    r".*got 65536"))
        out.append((f"{op} num_splits > 65535", lambda op=op: _decode(op, case, num_splits=65536),
                    rf"kimi_ops\.{op}: num_splits must be at most 65535 .*got 65536"))
        for arg in ("scale", "kv_scale"):
            for bad in (math.nan, math.inf, -math.inf):
                out.append((f"{op} {arg}={bad}", lambda op=op, arg=arg, bad=bad: _decode(op, case, **{arg: bad}),
                            rf"kimi_ops\.{op}: {arg} must be a finite float \(zero and negative are allowed\), "
                            rf"got {re.escape(str(bad))}"))
    kv_c, k_pe, cache, slots = _write_args(device)
    out.append(("mla_cache_write strided slot_mapping",
                lambda: kimi_ops.mla_cache_write(kv_c, k_pe, cache, strided(slots), 1.0),
                r"kimi_ops\.mla_cache_write: slot_mapping must be contiguous .*shape \(4,\) strides \(2,\)"))
    for bad in (math.nan, math.inf, -math.inf):
        out.append((f"mla_cache_write kv_scale={bad}",
                    lambda bad=bad: kimi_ops.mla_cache_write(kv_c, k_pe, cache, slots, bad),
                    rf"kimi_ops\.mla_cache_write: kv_scale must be a finite float .*got {re.escape(str(bad))}"))
    out.append(("mla_cache_write kv_scale=0", lambda: kimi_ops.mla_cache_write(kv_c, k_pe, cache, slots, 0.0),
                r"kimi_ops\.mla_cache_write: kv_scale must be finite and non-zero .*got 0\.0"))
    return out


def check_refusals(device):
    """Every refusal raises ValueError with its message, and (off meta) writes no cache byte."""
    for name, call, message in refusals(device):
        try:
            call()
        except ValueError as exc:
            assert re.search(message, str(exc)), (name, str(exc), message)
        else:
            raise AssertionError(f"{name}: accepted, expected ValueError matching {message!r}")


def check_accepted(device):
    """Zero and negative scales are well defined; the contiguous copy of a refused view runs."""
    for scale_over in (dict(scale=0.0), dict(scale=-0.07), dict(kv_scale=-0.5), dict(kv_scale=0.0)):
        case = make_decode_case([7, 2, 0], heads=2, qlen=2, seed=11, device=device)
        for key, value in scale_over.items():
            setattr(case, key, value)
        o_ref, lse_ref = oracle_decode(case)
        for op in DECODE_OPS:
            o, lse = _merged(op, case)
            assert_attention_close(o, lse, o_ref, lse_ref)
            if scale_over.get("kv_scale") == 0.0:   # every score 0 (lse = log n), every value 0
                assert (o == 0).all(), (op, scale_over)
    case = make_decode_case([6, 3], heads=2, qlen=2, seed=5, device=device)
    o_ref, lse_ref = oracle_decode(case)
    for op in DECODE_OPS:
        o, lse = _merged(op, case, kv_indices=strided(case.kv_indices).contiguous(),
                         kv_indptr=strided(case.kv_indptr).contiguous())
        assert_attention_close(o, lse, o_ref, lse_ref)
    kv_c, k_pe, cache, slots = _write_args(device)
    kimi_ops.mla_cache_write(kv_c, k_pe, cache, strided(slots).contiguous(), -2.0)
    got = cache.cpu().float()
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            row = torch.cat([kv_c[t], k_pe[t]]).cpu().float() / -2.0
            expected = row.to(torch.float8_e4m3fn).float()
            assert torch.equal(got[slot], expected), (t, slot)


def check_hidden_rows(device):
    """A listed row past a position's causal bound does not change that position's output as
    long as it is finite (the contract; a NaN there is documented as poisoning, and
    validate_decode_inputs(check_finite=True) catches it): bitwise equal outputs."""
    case = make_decode_case([6, 4], heads=2, qlen=3, seed=8, device=device)
    hidden = int(case.kv_indices[5])            # request 0's last token: only its position 2 sees it
    fmax = torch.finfo(case.kv_cache.dtype).max
    for op in DECODE_OPS:
        o0, lse0 = _merged(op, case)
        changed = case.kv_cache.clone()
        flat = changed.view(-1, 576)
        flat[hidden] = (torch.sign(torch.randn(576)) * fmax).to(flat.dtype).to(device)
        o1, lse1 = _merged(op, case, kv_cache=changed)
        keep = [0, 1, 3, 4, 5]                  # every query row but request 0's position 2
        assert torch.equal(o0[keep], o1[keep]) and torch.equal(lse0[keep], lse1[keep]), op
        assert not torch.equal(o0[2], o1[2]), "position 2 sees the changed row"


# --- CPU: the reference, the fake implementations, Triton's interpreter -----------------------

def test_reference_refuses(monkeypatch):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")
    check_refusals("cpu")


def test_fake_impls_refuse():
    """Meta tensors run the fake implementations (what torch.compile traces with)."""
    check_refusals("meta")


def test_reference_accepts_zero_and_negative_scales(monkeypatch):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")
    check_accepted("cpu")


def test_reference_hidden_rows(monkeypatch):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")
    check_hidden_rows("cpu")


def test_refused_cache_write_writes_nothing(monkeypatch):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")
    kv_c, k_pe, cache, slots = _write_args("cpu")
    before = cache.view(torch.uint8).clone()
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError):
            kimi_ops.mla_cache_write(kv_c, k_pe, cache, slots, bad)
    assert torch.equal(cache.view(torch.uint8), before)


_INTERP = r"""
import sys
sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
import test_contract as t
t.check_refusals("cpu")
t.check_accepted("cpu")
t.check_hidden_rows("cpu")
print("OK")
"""


def test_triton_interpreter_refuses_and_accepts():
    env = dict(os.environ, TRITON_INTERPRET="1", KIMI_OPS_BACKEND="triton", CUDA_VISIBLE_DEVICES="")
    r = subprocess.run([sys.executable, "-c", _INTERP.format(root=ROOT, tests=TESTS)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-3000:] + r.stderr[-6000:]


# --- GPU: every backend that runs there ------------------------------------------------------

def _gpu_backends():
    from kimi_ops import dispatch
    names = ["triton"]
    if dispatch.unavailable_reason("cuda", torch.device("cuda")) is None:
        names.append("cuda")
    return names


@requires_cuda
@pytest.mark.gpu
def test_gpu_refuses_and_accepts(monkeypatch):
    for backend in _gpu_backends():
        monkeypatch.setenv("KIMI_OPS_BACKEND", backend)
        check_refusals("cuda")
        check_accepted("cuda")
        check_hidden_rows("cuda")
