"""The AITER fallback's glue against a recording fake of aiter.mla.mla_decode_fwd.

No AMD GPU here: the fake checks the arguments the glue hands AITER (padded heads,
page-size-1 cache view, CSR, qo_indptr, scales) and computes the attention with
our reference, so the glue's padding and unpadding are checked end to end.
"""

import pytest
import torch

import kimi_ops
from conftest import assert_attention_close, make_decode_case, oracle_decode
from kimi_ops.runtime import aiter_fallback
from kimi_ops.runtime.metadata import DecodeMetadata


class RecordingDecodeFwd:
    """Stands in for aiter.mla.mla_decode_fwd: records its call and fills ``o`` (and the LSE)."""

    def __init__(self):
        self.calls = []

    def __call__(self, q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices, kv_last_page_lens, max_seqlen_q, *,
                 sm_scale, kv_scale, return_lse):
        self.calls.append(dict(q=q, kv_buffer=kv_buffer, o=o, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                               kv_indices=kv_indices, kv_last_page_lens=kv_last_page_lens,
                               max_seqlen_q=max_seqlen_q, sm_scale=sm_scale, kv_scale=kv_scale,
                               return_lse=return_lse))
        out, lse = kimi_ops.mla_decode(q, kv_buffer.view(-1, 576), kv_indptr, kv_indices, qlen=max_seqlen_q,
                                       scale=sm_scale, kv_scale=float(kv_scale))
        o.copy_(out)
        return o, (lse if return_lse else None)


def metadata_for(case):
    md = DecodeMetadata.allocate(len(case.lengths), case.kv_indices.numel(), qlen=case.qlen)
    md.kv_indptr.copy_(case.kv_indptr)
    md.kv_indices.copy_(case.kv_indices)
    md.seq_lens.copy_(torch.tensor(case.lengths, dtype=torch.int32))
    return md


@pytest.fixture(autouse=True)
def _reference_backend(monkeypatch):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")


@pytest.mark.parametrize("heads,padded", [(12, 16), (16, 16), (96, 96), (100, 112), (1, 16)])
@pytest.mark.parametrize("qlen", [1, 2])
def test_glue_pads_calls_and_unpads(heads, padded, qlen):
    case = make_decode_case([5, 0, 31], heads=heads, qlen=qlen, seed=heads + qlen)
    fake = RecordingDecodeFwd()
    o, lse = aiter_fallback.aiter_attend(case.q, case.kv_cache, metadata_for(case), scale=case.scale,
                                         kv_scale=case.kv_scale, return_lse=True, decode_fwd=fake)
    (call,) = fake.calls
    assert call["q"].shape == (case.q.shape[0], padded, 576)
    assert torch.equal(call["q"][:, :heads], case.q) and (call["q"][:, heads:] == 0).all()
    assert call["kv_buffer"].shape == (case.kv_cache.shape[0], 1, 1, 576)
    assert call["kv_buffer"].data_ptr() == case.kv_cache.data_ptr(), "the cache is viewed, not copied"
    assert call["qo_indptr"].tolist() == [0, qlen, 2 * qlen, 3 * qlen]
    assert call["kv_last_page_lens"].tolist() == [1, 1, 1]
    assert call["max_seqlen_q"] == qlen and call["sm_scale"] == case.scale and call["return_lse"]
    assert call["kv_scale"].tolist() == [case.kv_scale]
    assert o.shape == (case.q.shape[0], heads, 512) and lse.shape == (case.q.shape[0], heads)
    assert_attention_close(o, lse, *oracle_decode(case))


def test_glue_without_lse_and_dcp_bound():
    case = make_decode_case([7], heads=12, qlen=2)
    md = metadata_for(case)
    o, lse = aiter_fallback.aiter_attend(case.q, case.kv_cache, md, scale=case.scale, kv_scale=case.kv_scale,
                                         return_lse=False, decode_fwd=RecordingDecodeFwd())
    assert lse is None and o.shape == (2, 12, 512)
    md.dcp_world_size, md.dcp_rank = 2, 0
    with pytest.raises(ValueError, match=r"AITER fallback takes qlen 1 under decode context parallel"):
        aiter_fallback.aiter_attend(case.q, case.kv_cache, md, scale=case.scale, kv_scale=case.kv_scale,
                                    return_lse=True, decode_fwd=RecordingDecodeFwd())


def test_not_available_off_rocm():
    assert aiter_fallback.available() == (torch.version.hip is not None and
                                          __import__("importlib").util.find_spec("aiter") is not None)
    assert aiter_fallback.padded_heads(12) == 16 and aiter_fallback.padded_heads(128) == 128


def test_layer_asks_for_aiter_only_where_it_exists(monkeypatch):
    from kimi_ops.runtime import mla
    from kimi_ops.runtime.config import MLAConfig
    from kimi_ops.runtime.layer import MLADecodeLayer
    if not aiter_fallback.available():
        with pytest.raises(ValueError, match=r"attention='aiter' needs a ROCm torch with aiter importable"):
            MLADecodeLayer(MLAConfig.small(), attention="aiter")
    # attend routes to the glue when the layer asks for AITER (the glue itself checked above)
    layer = MLADecodeLayer(MLAConfig.small())
    layer.attention = "aiter"
    seen = []
    monkeypatch.setattr(aiter_fallback, "aiter_attend", lambda q, cache, md, **kw: seen.append(kw) or (q, None))
    case = make_decode_case([3], heads=4)
    mla.attend(layer, case.q, case.kv_cache, metadata_for(case))
    assert seen == [dict(scale=layer.config.softmax_scale, kv_scale=layer.kv_scale, return_lse=False)]
