"""The reference attention ops (CPU backend) against the brute-force oracle of conftest."""

import math

import pytest
import torch

import kimi_ops
from conftest import (KV_ROW, assert_attention_close, fp8_round_oracle, make_decode_case,
                      oracle_decode)

LENGTH_SETS = {
    "uniform": [40, 40, 40],
    "variable": [0, 1, 2, 7, 65, 130],   # zero-length and shorter-than-qlen requests included
    "single": [300],
}


@pytest.fixture(autouse=True)
def _reference_backend(monkeypatch):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")


@pytest.mark.parametrize("qlen", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("heads", [1, 12, 16, 96])
@pytest.mark.parametrize("lengths", list(LENGTH_SETS), ids=str)
def test_decode_matches_oracle(qlen, heads, lengths):
    case = make_decode_case(LENGTH_SETS[lengths], heads=heads, qlen=qlen, seed=qlen * 131 + heads)
    o_ref, lse_ref = oracle_decode(case)
    o, lse = kimi_ops.mla_decode(*case.args, **case.kwargs)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert_attention_close(o, lse, o_ref, lse_ref)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 64, 400])
@pytest.mark.parametrize("qlen", [1, 4])
def test_splitkv_partials_merge_to_the_whole(num_splits, qlen):
    case = make_decode_case(LENGTH_SETS["variable"], heads=12, qlen=qlen, seed=num_splits)
    o_part, lse_part = kimi_ops.mla_decode_splitkv(*case.args, num_splits=num_splits, **case.kwargs)
    assert o_part.shape == (num_splits, case.q.shape[0], 12, 512)
    assert lse_part.shape == (num_splits, case.q.shape[0], 12)
    assert not torch.isnan(o_part).any() and not torch.isnan(lse_part).any()
    empty = torch.isinf(lse_part)
    assert (o_part[empty] == 0).all(), "an empty split's o is 0"
    o_ref, lse_ref = oracle_decode(case)
    # every split sees a disjoint share of a row's visible tokens: at least S - visible splits are empty
    for t in range(case.q.shape[0]):
        r, i = divmod(t, qlen)
        visible = max(0, case.lengths[r] - qlen + i + 1)
        assert int(empty[:, t, 0].sum()) >= num_splits - visible
        # a partial's LSE never exceeds the whole's
        assert (lse_part[:, t].double() <= lse_ref[t] + 1e-4).all()
    o, lse = kimi_ops.mla_merge(o_part, lse_part)
    assert_attention_close(o, lse, o_ref, lse_ref)


def test_decode_on_paged_cache_shapes():
    for shape in ("blocks", "blocks1"):
        case = make_decode_case([33, 70], heads=12, qlen=2, block_size=16, seed=5)
        if shape == "blocks1":
            case.kv_cache = case.kv_cache.unsqueeze(2)          # [blocks, block_size, 1, 576]
        o, lse = kimi_ops.mla_decode(*case.args, **case.kwargs)
        assert_attention_close(o, lse, *oracle_decode(case))


def test_decode_with_e4m3fnuz_cache():
    case = make_decode_case([50, 9], heads=16, qlen=2, dtype=torch.float8_e4m3fnuz, seed=11)
    assert_attention_close(*kimi_ops.mla_decode(*case.args, **case.kwargs), *oracle_decode(case))


def test_out_of_range_index_reads_a_zero_row():
    case = make_decode_case([20], heads=4, seed=3)
    num_rows = case.kv_cache.shape[0]
    bad = case.kv_indices.clone()
    bad[5], bad[9] = num_rows + 1000, -7
    o, lse = kimi_ops.mla_decode(case.q, case.kv_cache, case.kv_indptr, bad, **case.kwargs)
    zeroed = case.kv_cache.clone()
    extra = torch.zeros(1, KV_ROW).to(zeroed.dtype)
    zeroed = torch.cat([zeroed, extra])
    fixed = bad.clone()
    fixed[5] = fixed[9] = num_rows                                # the appended zero row
    case.kv_cache, case.kv_indices = zeroed, fixed
    assert_attention_close(o, lse, *oracle_decode(case))


def test_merge_against_oracle_with_empty_splits():
    gen = torch.Generator().manual_seed(7)
    splits, rows, heads = 5, 6, 3
    o_part = torch.randn(splits, rows, heads, 512, generator=gen).to(torch.bfloat16)
    lse_part = torch.randn(splits, rows, heads, generator=gen) * 3
    lse_part[1:3, 0] = -math.inf                                  # some splits empty
    lse_part[:, 1] = -math.inf                                    # a row with every split empty
    o_part[:, 1] = 0
    o_part[1:3, 0] = 0
    o, lse = kimi_ops.mla_merge(o_part, lse_part)
    lse64 = lse_part.double()
    lse_ref = torch.log(torch.exp(lse64).sum(0))
    w = torch.exp(lse64 - lse_ref)
    o_ref = torch.nan_to_num((w[..., None] * o_part.double()).sum(0))
    assert torch.isinf(lse[1]).all() and (lse[1] < 0).all() and (o[1] == 0).all()
    assert_attention_close(o, lse, o_ref, lse_ref)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32])
def test_cache_write_bytes(dtype, src_dtype):
    gen = torch.Generator().manual_seed(1)
    num_rows, tokens, kv_scale = 64, 9, 0.25
    cache = torch.randint(0, 256, (num_rows, KV_ROW), generator=gen, dtype=torch.uint8)
    cache[cache == 0x80] = 0                                      # avoid fnuz NaN noise in the bystanders
    cache = cache.view(dtype).reshape(4, 16, KV_ROW)
    before = cache.clone()
    kv_c = (torch.randn(tokens, 512, generator=gen) * 40).to(src_dtype)   # some values saturate
    k_pe = (torch.randn(tokens, 64, generator=gen) * 40).to(src_dtype)
    slots = torch.tensor([3, -1, 17, 63, 0, -1, 40, 41, 5], dtype=torch.int64)
    kimi_ops.mla_cache_write(kv_c, k_pe, cache, slots, kv_scale)
    flat, flat_before = cache.view(-1, KV_ROW).view(torch.uint8), before.view(-1, KV_ROW).view(torch.uint8)
    written = slots[slots >= 0]
    untouched = torch.ones(num_rows, dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(flat[untouched], flat_before[untouched]), "rows with no slot are unchanged"
    x = torch.cat([kv_c, k_pe], -1).float() / kv_scale
    expected = fp8_round_oracle(x, dtype).view(torch.uint8)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat[slot], expected[t]), f"row {t} -> slot {slot}"


def test_dcp_arguments_are_checked():
    case = make_decode_case([4, 4], heads=2)
    with pytest.raises(ValueError, match=r"seq_lens must be the global lengths \[R\] int32 when dcp_world_size > 1"):
        kimi_ops.mla_decode(*case.args, dcp_rank=0, dcp_world_size=2, **case.kwargs)
    with pytest.raises(ValueError, match=r"dcp_rank, dcp_world_size must be 0 <= dcp_rank < dcp_world_size, got \(2, 2\)"):
        kimi_ops.mla_decode(*case.args, seq_lens=torch.tensor([4, 4], dtype=torch.int32), dcp_rank=2,
                            dcp_world_size=2, **case.kwargs)
    with pytest.raises(ValueError, match=r"seq_lens must be a \[2\] int32 tensor"):
        kimi_ops.mla_decode(*case.args, seq_lens=torch.tensor([4], dtype=torch.int32), **case.kwargs)
