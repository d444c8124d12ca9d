"""Every class of host-checkable bad input raises an error saying what was expected and what came."""

import pytest
import torch

import kimi_ops
from conftest import make_decode_case


@pytest.fixture(autouse=True)
def _reference_backend(monkeypatch):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")


@pytest.fixture
def case():
    return make_decode_case([6, 3], heads=4, qlen=2, seed=9)


def decode(case, **over):
    args = dict(q=case.q, kv_cache=case.kv_cache, kv_indptr=case.kv_indptr, kv_indices=case.kv_indices)
    kwargs = dict(case.kwargs, num_splits=2)
    for key, value in over.items():
        (args if key in args else kwargs)[key] = value
    return kimi_ops.mla_decode_splitkv(*args.values(), **kwargs)


DECODE_ERRORS = {
    "q dtype": (lambda c: dict(q=c.q.half()), r"q must be a \[T, H, 576\] bfloat16 tensor \(or fp8 .* with q_scale\), got .*float16"),
    "q rank": (lambda c: dict(q=c.q[0]), r"q must be a \[T, H, 576\] bfloat16 tensor .*, got shape \(4, 576\)"),
    "q width": (lambda c: dict(q=c.q[..., :512]), r"q must be .* got shape \(4, 4, 512\)"),
    "q strides": (lambda c: dict(q=c.q.transpose(1, 2).contiguous().transpose(1, 2)),
                  r"q must be contiguous in its last dim, got strides"),
    "cache dtype": (lambda c: dict(kv_cache=c.kv_cache.to(torch.bfloat16)),
                    r"kv_cache must be an fp8 \(e4m3fn or e4m3fnuz\) tensor .*got .*bfloat16"),
    "cache width": (lambda c: dict(kv_cache=c.kv_cache[:, :512].contiguous()),
                    r"kv_cache must be an fp8 tensor whose last dim is 576 .* got shape \(\d+, 512\)"),
    "cache strides": (lambda c: dict(kv_cache=c.kv_cache.view(-1, 2, 576).transpose(0, 1)),
                      r"kv_cache must be contiguous"),
    "indptr dtype": (lambda c: dict(kv_indptr=c.kv_indptr.long()), r"kv_indptr must be a 1-D int32 tensor"),
    "indptr rank": (lambda c: dict(kv_indptr=c.kv_indptr[None]), r"kv_indptr must be a 1-D int32 tensor"),
    "indptr empty": (lambda c: dict(kv_indptr=c.kv_indptr[:0]), r"kv_indptr must be .* at least one entry"),
    "indptr length": (lambda c: dict(kv_indptr=c.kv_indptr[:2]),
                      r"q.shape\[0\] must be R \* qlen = 1 \* 2 .*got 4"),
    "indices dtype": (lambda c: dict(kv_indices=c.kv_indices.long()), r"kv_indices must be a 1-D int32 tensor"),
    "qlen not dividing": (lambda c: dict(qlen=3), r"q.shape\[0\] must be R \* qlen = 2 \* 3 .*got 4"),
    "qlen zero": (lambda c: dict(qlen=0), r"qlen must be an int >= 1, got 0"),
    "num_splits zero": (lambda c: dict(num_splits=0), r"num_splits must be an int >= 1, got 0"),
    "device": (lambda c: dict(kv_indices=c.kv_indices.to("meta")), r"all tensors must be on one device"),
}


@pytest.mark.parametrize("name", list(DECODE_ERRORS))
def test_decode_bad_input(case, name):
    make, message = DECODE_ERRORS[name]
    with pytest.raises(ValueError, match=message):
        decode(case, **make(case))


def test_decode_bad_num_splits_none_allowed_only_for_mla_decode(case):
    kimi_ops.mla_decode(*case.args, num_splits=None, **case.kwargs)
    with pytest.raises(ValueError, match=r"mla_decode: num_splits must be an int >= 1, got -1"):
        kimi_ops.mla_decode(*case.args, num_splits=-1, **case.kwargs)


def test_merge_bad_input():
    o = torch.zeros(2, 3, 4, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"lse_part must be shape \(2, 3, 4\).*got shape \(2, 3, 5\)"):
        kimi_ops.mla_merge(o, torch.zeros(2, 3, 5))
    with pytest.raises(ValueError, match=r"lse_part must be a \[S, T, H\] float32 tensor"):
        kimi_ops.mla_merge(o, torch.zeros(2, 3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"o_part must be a \[S, T, H, 512\] bfloat16 tensor"):
        kimi_ops.mla_merge(o[..., :256], torch.zeros(2, 3, 4))


def test_cache_write_bad_input():
    cache = torch.zeros(8, 576).to(torch.float8_e4m3fn)
    kv_c, k_pe, slots = torch.zeros(3, 512), torch.zeros(3, 64), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=r"kv_c must be a \[T, 512\] bf16/f16/f32 tensor, got shape \(3, 500\)"):
        kimi_ops.mla_cache_write(kv_c[:, :500], k_pe, cache, slots, 1.0)
    with pytest.raises(ValueError, match=r"k_pe must be shape \(3, 64\)"):
        kimi_ops.mla_cache_write(kv_c, k_pe[:2], cache, slots, 1.0)
    with pytest.raises(ValueError, match=r"slot_mapping must be a 1-D int32/int64 tensor"):
        kimi_ops.mla_cache_write(kv_c, k_pe, cache, slots.float(), 1.0)
    with pytest.raises(ValueError, match=r"slot_mapping must be length 3"):
        kimi_ops.mla_cache_write(kv_c, k_pe, cache, slots[:2], 1.0)
    with pytest.raises(ValueError, match=r"kv_cache must be an fp8"):
        kimi_ops.mla_cache_write(kv_c, k_pe, cache.float(), slots, 1.0)


def test_mxfp4_bad_input():
    with pytest.raises(ValueError, match=r"w must be a bf16/f16/f32 tensor whose last dim is a positive multiple of 32"):
        kimi_ops.mxfp4_quantize(torch.zeros(4, 48))
    with pytest.raises(ValueError, match=r"w must be a bf16/f16/f32 tensor"):
        kimi_ops.mxfp4_quantize(torch.zeros(4, 64, dtype=torch.int32))
    packed, scale = torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"w_scale must be shape \(4, 2\) \(one scale per 32 elements\)"):
        kimi_ops.mxfp4_dequantize(packed, scale[:, :1])
    with pytest.raises(ValueError, match=r"w_packed must be a uint8 tensor"):
        kimi_ops.mxfp4_dequantize(packed.float(), scale)
    x = torch.zeros(1, 2, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"w_packed must be shape \(1, N, 16\) for x \(1, 2, 32\)"):
        kimi_ops.bmm_a16wfp4(x, packed[None], torch.zeros(1, 4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"x must be a \[B, M, K\] bfloat16 tensor"):
        kimi_ops.bmm_a16wfp4(x.float(), packed[None], torch.zeros(1, 4, 2, dtype=torch.uint8))


def test_query_bad_input():
    q_nope, q_pe = torch.zeros(2, 3, 128, dtype=torch.bfloat16), torch.zeros(2, 3, 64, dtype=torch.bfloat16)
    w_uk = torch.zeros(3, 128, 512, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"w_uk must be a bf16 \[3, 128, L\] tensor"):
        kimi_ops.mla_query(q_nope, q_pe, w_uk[:2])
    with pytest.raises(ValueError, match=r"q_pe must be \[T, H, P\] with \[T, H\] = \(2, 3\)"):
        kimi_ops.mla_query(q_nope, q_pe[:1], w_uk)
    with pytest.raises(ValueError, match=r"pad_heads must be None or an int >= H = 3, got 2"):
        kimi_ops.mla_query(q_nope, q_pe, w_uk, pad_heads=2)
    with pytest.raises(ValueError, match=r"w_uk must be an MXFP4 uint8 \[3, L, 64\] tensor"):
        kimi_ops.mla_query(q_nope, q_pe, torch.zeros(3, 512, 32, dtype=torch.uint8),
                           torch.zeros(3, 512, 2, dtype=torch.uint8))


def test_backend_override_errors(case, monkeypatch):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "fastest")
    with pytest.raises(RuntimeError, match=r"KIMI_OPS_BACKEND must be one of auto, reference, triton, cuda, got 'fastest'"):
        kimi_ops.mla_decode(*case.args, **case.kwargs)
    monkeypatch.setenv("KIMI_OPS_BACKEND", "cuda")
    with pytest.raises(RuntimeError, match=r"KIMI_OPS_BACKEND=cuda cannot run here: .*needs CUDA tensors"):
        kimi_ops.mla_merge(torch.zeros(1, 1, 1, 512, dtype=torch.bfloat16), torch.zeros(1, 1, 1))
    monkeypatch.setenv("KIMI_OPS_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=r"KIMI_OPS_BACKEND=triton cannot run here: .*needs TRITON_INTERPRET=1"):
        kimi_ops.mla_decode(*case.args, **case.kwargs)
