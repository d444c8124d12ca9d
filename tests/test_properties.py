"""Property tests (hypothesis) of the attention contract, on the reference backend.

* Merging is associative: merging two groups of partials and then the two results equals
  merging all of them at once (how DCP merges split partials, then ranks' partials).
* The split count never changes the answer: any num_splits, merged, is the unsplit attention.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kimi_ops
from conftest import assert_attention_close, make_decode_case, oracle_decode


@pytest.fixture(autouse=True)
def _reference_backend(monkeypatch):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")


@settings(max_examples=25, deadline=None)
@given(splits=st.integers(2, 9), cut=st.integers(1, 8), rows=st.integers(1, 4), heads=st.integers(1, 5),
       empty=st.lists(st.booleans(), min_size=9, max_size=9), seed=st.integers(0, 2**16))
def test_merge_is_associative(splits, cut, rows, heads, empty, seed):
    cut = min(cut, splits - 1)
    gen = torch.Generator().manual_seed(seed)
    o = torch.randn(splits, rows, heads, 512, generator=gen).to(torch.bfloat16)
    lse = torch.randn(splits, rows, heads, generator=gen) * 4
    for s in range(splits):
        if empty[s]:
            lse[s], o[s] = float("-inf"), 0
    whole_o, whole_lse = kimi_ops.mla_merge(o, lse)
    a_o, a_lse = kimi_ops.mla_merge(o[:cut], lse[:cut])
    b_o, b_lse = kimi_ops.mla_merge(o[cut:], lse[cut:])
    two_o, two_lse = kimi_ops.mla_merge(torch.stack([a_o, b_o]), torch.stack([a_lse, b_lse]))
    # the two-stage merge rounds its intermediate o to bf16 once more (~2^-9 relative)
    assert_attention_close(two_o, two_lse, whole_o.double(), whole_lse.double(), rtol=6e-3)


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=4), qlen=st.integers(1, 4),
       splits=st.integers(1, 50), seed=st.integers(0, 2**16))
def test_any_split_count_gives_the_whole_attention(lengths, qlen, splits, seed):
    case = make_decode_case(lengths, heads=3, qlen=qlen, spare_rows=5, seed=seed)
    o_part, lse_part = kimi_ops.mla_decode_splitkv(*case.args, num_splits=splits, **case.kwargs)
    assert_attention_close(*kimi_ops.mla_merge(o_part, lse_part), *oracle_decode(case))
