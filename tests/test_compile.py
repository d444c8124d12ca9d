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


def test_compiled_decode_fp8_query_takes_a_new_scale():
    """An fp8 query (q8, q_scale) under torch.compile(fullgraph=True): q_scale is a graph input
    (a device tensor), so a new scale runs the same graph and matches eager and the oracle."""
    from conftest import quantize_per_tensor

    torch._dynamo.reset()
    case = make_decode_case([9, 0, 30], heads=12, qlen=2, seed=5)
    q8, q_scale = quantize_per_tensor(case.q.float())

    def attend(q8, q_scale, kv_cache, kv_indptr, kv_indices, qlen: int, scale: float, kv_scale: float):
        o, lse = kimi_ops.mla_decode(q8, kv_cache, kv_indptr, kv_indices, qlen=qlen, scale=scale,
                                     kv_scale=kv_scale, q_scale=q_scale)
        o2, lse2 = kimi_ops.ops.mla_merge(*kimi_ops.mla_decode_splitkv(
            q8, kv_cache, kv_indptr, kv_indices, qlen=qlen, scale=scale, kv_scale=kv_scale, num_splits=2,
            q_scale=q_scale))
        return o.float() * 2.0, lse, o2, lse2

    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(attend, fullgraph=True, dynamic=False)
    args = (case.kv_cache, case.kv_indptr, case.kv_indices, case.qlen, case.scale, case.kv_scale)
    for s in (q_scale, q_scale * 3.0, q_scale / 64.0):
        got = compiled(q8, s, *args)
        want = attend(q8, s, *args)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        case.q = q8
        o_ref, lse_ref = oracle_decode(case, s)
        assert_attention_close(got[0] / 2, got[1], o_ref, lse_ref)
        assert_attention_close(got[2], got[3], o_ref, lse_ref)
    assert counters["stats"]["unique_graphs"] == 1, "a new q_scale value must not recompile"
