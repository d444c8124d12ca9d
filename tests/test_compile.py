"""torch.compile(fullgraph=True) captures a decode step built from the ops, and
matches eager (the cache write included)."""

import pytest
import torch

import kimi_ops
from conftest import assert_attention_close, make_decode_case, oracle_decode


@pytest.fixture(autouse=True)
def _reference_backend(monkeypatch):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")


def decode_step(q, kv_c, k_pe, kv_cache, slots, kv_indptr, kv_indices, qlen: int, scale: float, kv_scale: float):
    kimi_ops.mla_cache_write(kv_c, k_pe, kv_cache, slots, kv_scale)
    o, lse = kimi_ops.mla_decode(q, kv_cache, kv_indptr, kv_indices, qlen=qlen, scale=scale, kv_scale=kv_scale)
    return o.float() * 2.0, lse


@pytest.mark.parametrize("qlen", [1, 2])
def test_compiled_decode_step_matches_eager(qlen):
    torch._dynamo.reset()
    case = make_decode_case([7, 12, 3], heads=12, qlen=qlen, spare_rows=8, seed=qlen)
    # this step's new tokens land on the spare rows the requests' last positions point to
    num_new = case.q.shape[0]
    slots = case.kv_indices[(case.kv_indptr[1:] - 1).long()].repeat_interleave(qlen)[:num_new].long()
    slots[1::2] = -1 if qlen > 1 else slots[1::2]
    kv_c = torch.randn(num_new, 512).to(torch.bfloat16)
    k_pe = torch.randn(num_new, 64).to(torch.bfloat16)
    compiled = torch.compile(decode_step, fullgraph=True)
    cache_eager, cache_compiled = case.kv_cache.clone(), case.kv_cache.clone()
    args = (case.kv_indptr, case.kv_indices, qlen, case.scale, case.kv_scale)
    o_e, lse_e = decode_step(case.q, kv_c, k_pe, cache_eager, slots, *args)
    o_c, lse_c = compiled(case.q, kv_c, k_pe, cache_compiled, slots, *args)
    assert torch.equal(cache_eager.view(torch.uint8), cache_compiled.view(torch.uint8)), "the cache write happened"
    assert torch.equal(o_e, o_c) and torch.equal(lse_e, lse_c)
    case.kv_cache = cache_eager
    o_ref, lse_ref = oracle_decode(case)
    assert_attention_close(o_c / 2, lse_c, o_ref, lse_ref)
