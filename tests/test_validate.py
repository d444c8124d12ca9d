"""The opt-in validators (kimi_ops/validate.py): device-data preconditions the ops never read
on the host. Issue 30: duplicate cache-write slots (undefined: the Triton kernel lands a mix of
the candidates' bytes) and NaN in a listed row past a position's causal bound (it poisons that
position on every backend: weight 0, but 0 x NaN = NaN) are documented and caught here."""

import pytest
import torch

import kimi_ops
from conftest import make_decode_case


def _nan_code(dtype):
    return 0x7F if dtype == torch.float8_e4m3fn else 0x80


def test_decode_validator_accepts_a_good_case_with_nan_spare_rows():
    case = make_decode_case([6, 0, 4], heads=2, qlen=3, seed=1)
    rows = case.kv_cache.view(-1, 576).float()
    assert torch.isnan(rows).any(), "the case has NaN-filled rows no request lists"
    kimi_ops.validate_decode_inputs(case.kv_cache, case.kv_indptr, case.kv_indices, check_finite=True)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_decode_validator_finds_nan_past_the_causal_bound(dtype):
    # request 0 has 6 tokens and qlen 3: its last two tokens are past position 0's bound
    case = make_decode_case([6, 4], heads=2, qlen=3, seed=2, dtype=dtype)
    hidden = int(case.kv_indices[5])
    case.kv_cache.view(-1, 576).view(torch.uint8)[hidden, 17] = _nan_code(dtype)
    kimi_ops.validate_decode_inputs(case.kv_cache, case.kv_indptr, case.kv_indices)   # off by default
    with pytest.raises(ValueError, match=rf"cache row {hidden} \(kv_indices\[5\], request 0's token 5\) is not "
                                         r"finite: every row a request lists must be, even one past a query "
                                         r"position's causal bound"):
        kimi_ops.validate_decode_inputs(case.kv_cache, case.kv_indptr, case.kv_indices, check_finite=True)


def test_decode_validator_names_the_request():
    case = make_decode_case([3, 0, 5], heads=1, qlen=1, seed=4)
    row = int(case.kv_indices[3 + 2])
    case.kv_cache.view(-1, 576).view(torch.uint8)[row, 24] = 0x7F
    with pytest.raises(ValueError, match=rf"cache row {row} \(kv_indices\[5\], request 2's token 2\)"):
        kimi_ops.validate_decode_inputs(case.kv_cache, case.kv_indptr, case.kv_indices, check_finite=True)


def test_decode_validator_ignores_the_index_tail():
    # kv_indices past kv_indptr[-1] (a fixed-capacity buffer's tail) is never read
    case = make_decode_case([4], heads=1, qlen=1, seed=3, spare_rows=3)
    spare = sorted(set(range(case.kv_cache.shape[0])) - set(case.kv_indices.tolist()))
    indices = torch.cat([case.kv_indices, torch.tensor(spare, dtype=torch.int32)])
    kimi_ops.validate_decode_inputs(case.kv_cache, case.kv_indptr, indices, check_finite=True)


def _cache(n=8):
    return torch.zeros(n, 576, dtype=torch.float8_e4m3fn)


def test_cache_write_validator_accepts_distinct_slots_and_skips():
    kimi_ops.validate_cache_write_inputs(_cache(), torch.tensor([3, -1, 0, -1, 7]))
    kimi_ops.validate_cache_write_inputs(_cache(), torch.tensor([], dtype=torch.int64))
    kimi_ops.validate_cache_write_inputs(_cache().view(2, 4, 576), torch.tensor([5, 1], dtype=torch.int32))


def test_cache_write_validator_finds_duplicates():
    with pytest.raises(ValueError, match=r"slot 2 appears 3 times in slot_mapping \(at \[1, 3, 4\]\): duplicate "
                                         r"slots in one mla_cache_write are undefined"):
        kimi_ops.validate_cache_write_inputs(_cache(), torch.tensor([0, 2, -1, 2, 2, -1]))


def test_cache_write_validator_finds_slots_outside_the_cache():
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 8 is neither -1 \(skip\) nor a row of the cache's 8"):
        kimi_ops.validate_cache_write_inputs(_cache(), torch.tensor([0, 8]))
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = -2 is neither -1"):
        kimi_ops.validate_cache_write_inputs(_cache(), torch.tensor([-2, 1]))


def test_cache_write_validator_finds_non_finite_rows():
    kv_c, k_pe = torch.zeros(3, 512), torch.zeros(3, 64)
    slots = torch.tensor([0, -1, 5])
    kv_c[1, 7] = float("nan")                 # a skipped row may hold anything
    kimi_ops.validate_cache_write_inputs(_cache(), slots, kv_c, k_pe)
    k_pe[2, 63] = float("inf")
    with pytest.raises(ValueError, match=r"k_pe\[2\] \(to slot 5\) is not finite"):
        kimi_ops.validate_cache_write_inputs(_cache(), slots, kv_c, k_pe)


def test_the_contract_is_documented():
    """README and the op docstrings state what the validators check."""
    import os
    readme = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "README.md")).read()
    assert "validate_cache_write_inputs" in readme and "Duplicate slots" in readme
    assert "check_finite=True" in readme
    assert "undefined" in kimi_ops.mla_cache_write.__doc__
    assert "finite" in kimi_ops.mla_decode_splitkv.__doc__
