"""torch.library.opcheck on every op, with several sample inputs each.

opcheck's test_schema runs the op under SchemaCheckMode, which cannot take
float8 tensors in current torch (it multiplies them); ops with an fp8 argument
run the other three test_utils, and test_declared_mutations_only checks by hand,
byte for byte, that only the declared argument changes.
"""

import pytest
import torch

import kimi_ops
from conftest import make_decode_case

ALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
NO_SCHEMA_UTILS = ALL_UTILS[1:]
ops = torch.ops.kimi_ops


@pytest.fixture(autouse=True)
def _reference_backend(monkeypatch):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")


DECODE_SAMPLES = [
    dict(lengths=[5, 0, 17], heads=12, qlen=1, block_size=None),
    dict(lengths=[9, 2], heads=16, qlen=3, block_size=8),
    dict(lengths=[33], heads=1, qlen=8, block_size=None),
]


def decode_samples():
    for i, sample in enumerate(DECODE_SAMPLES):
        yield make_decode_case(sample["lengths"], heads=sample["heads"], qlen=sample["qlen"],
                               block_size=sample["block_size"], spare_rows=3, seed=100 + i)


def bytes_of(t):
    return t.detach().contiguous().view(torch.uint8).clone() if t.dtype.itemsize == 1 else \
        t.detach().contiguous().view(-1).view(torch.uint8).clone()


def assert_only_declared_mutations(fn, args, mutated=()):
    """Run fn(*args); every tensor argument not in ``mutated`` keeps its bytes, and each
    one in ``mutated`` changes."""
    before = {i: bytes_of(a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
    fn()
    for i, b in before.items():
        changed = not torch.equal(bytes_of(args[i]), b)
        assert changed == (i in mutated), f"argument {i}: changed={changed}, declared={i in mutated}"


@pytest.mark.parametrize("case", list(decode_samples()), ids=lambda c: f"R{len(c.lengths)}q{c.qlen}")
def test_opcheck_decode_ops(case):
    for splits in (1, 3):
        torch.library.opcheck(ops.mla_decode_splitkv.default, case.args,
                              dict(num_splits=splits, **case.kwargs), test_utils=NO_SCHEMA_UTILS)
    torch.library.opcheck(ops.mla_decode.default, case.args, case.kwargs, test_utils=NO_SCHEMA_UTILS)
    torch.library.opcheck(ops.mla_decode.default, case.args, dict(num_splits=2, **case.kwargs),
                          test_utils=NO_SCHEMA_UTILS)
    assert_only_declared_mutations(lambda: kimi_ops.mla_decode(*case.args, num_splits=2, **case.kwargs),
                                   case.args)


@pytest.mark.parametrize("shape", [(1, 3, 12), (4, 2, 16), (2, 5, 1)])
def test_opcheck_merge(shape):
    splits, rows, heads = shape
    o_part = torch.randn(splits, rows, heads, 512).to(torch.bfloat16)
    lse_part = torch.randn(splits, rows, heads)
    lse_part[0, 0] = float("-inf")
    o_part[0, 0] = 0
    torch.library.opcheck(ops.mla_merge.default, (o_part, lse_part), test_utils=ALL_UTILS)


@pytest.mark.parametrize("slots_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tokens", [1, 5])
def test_opcheck_cache_write(slots_dtype, tokens):
    cache = torch.randn(4, 8, 576).to(torch.float8_e4m3fn)
    kv_c, k_pe = torch.randn(tokens, 512).to(torch.bfloat16), torch.randn(tokens, 64).to(torch.bfloat16)
    slots = torch.randperm(32)[:tokens].to(slots_dtype)
    slots[0] = -1 if tokens > 1 else slots[0]
    args = (kv_c, k_pe, cache, slots, 0.5)
    torch.library.opcheck(ops.mla_cache_write.default, args, test_utils=NO_SCHEMA_UTILS)
    assert_only_declared_mutations(lambda: kimi_ops.mla_cache_write(*args), args, mutated={2})


@pytest.mark.parametrize("shape", [(64,), (3, 32), (2, 4, 96)])
def test_opcheck_mxfp4_roundtrip_ops(shape):
    w = torch.randn(shape).to(torch.bfloat16)
    torch.library.opcheck(ops.mxfp4_quantize.default, (w,), test_utils=ALL_UTILS)
    packed, scale = kimi_ops.mxfp4_quantize(w)
    torch.library.opcheck(ops.mxfp4_dequantize.default, (packed, scale), test_utils=ALL_UTILS)
    torch.library.opcheck(ops.mxfp4_dequantize.default, (packed, scale), dict(dtype=torch.float32),
                          test_utils=ALL_UTILS)


@pytest.mark.parametrize("bmk_n", [(2, 1, 64, 32), (3, 5, 128, 48), (1, 8, 32, 16)])
def test_opcheck_bmm_a16wfp4(bmk_n):
    b, m, k, n = bmk_n
    packed, scale = kimi_ops.mxfp4_quantize(torch.randn(b, n, k))
    x = torch.randn(b, m, k).to(torch.bfloat16)
    torch.library.opcheck(ops.bmm_a16wfp4.default, (x, packed, scale), test_utils=ALL_UTILS)


@pytest.mark.parametrize("mxfp4", [False, True])
@pytest.mark.parametrize("tokens,heads,pad", [(1, 12, None), (3, 12, 16), (5, 2, 2)])
def test_opcheck_mla_query(mxfp4, tokens, heads, pad):
    q_nope = torch.randn(tokens, heads, 128).to(torch.bfloat16)
    q_pe = torch.randn(tokens, heads, 64).to(torch.bfloat16)
    if mxfp4:
        w_uk, w_uk_scale = kimi_ops.mxfp4_quantize(torch.randn(heads, 512, 128))
    else:
        w_uk, w_uk_scale = torch.randn(heads, 128, 512).to(torch.bfloat16) / 8, None
    torch.library.opcheck(ops.mla_query.default, (q_nope, q_pe, w_uk, w_uk_scale), dict(pad_heads=pad),
                          test_utils=ALL_UTILS)
