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

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

ALL_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
NO_SCHEMA_UTILS = ALL_UTILS[1:]
ops = torch.ops.kimi_ops


@pytest.fixture(autouse=True)
def _default_backend(monkeypatch):
    """CPU: the reference; CUDA: whatever ``auto`` picks (the GPU kernels)."""
    monkeypatch.setenv("KIMI_OPS_BACKEND", "auto")


DECODE_SAMPLES = [
    dict(lengths=[5, 0, 17], heads=12, qlen=1, block_size=None),
    dict(lengths=[9, 2], heads=16, qlen=3, block_size=8),
    dict(lengths=[33], heads=1, qlen=8, block_size=None),
]


def decode_samples():
    for device in DEVICES:
        for i, sample in enumerate(DECODE_SAMPLES):
            yield make_decode_case(sample["lengths"], heads=sample["heads"], qlen=sample["qlen"],
                                   block_size=sample["block_size"], spare_rows=3, seed=100 + i, device=device)


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


def opcheck_and_mutations(name, args, kwargs=None, mutated=()):
    """torch.library.opcheck of ``torch.ops.kimi_ops.<name>`` (NO_SCHEMA_UTILS), then
    :func:`assert_only_declared_mutations` of one call."""
    kwargs = kwargs or {}
    op = getattr(torch.ops.kimi_ops, name)
    torch.library.opcheck(op.default, args, kwargs, test_utils=NO_SCHEMA_UTILS)
    assert_only_declared_mutations(lambda: op(*args, **kwargs), args, mutated=mutated)


@pytest.mark.parametrize("case", list(decode_samples()), ids=lambda c: f"{c.q.device.type}-R{len(c.lengths)}q{c.qlen}")
def test_opcheck_decode_ops(case):
    for splits in (1, 3):
        torch.library.opcheck(ops.mla_decode_splitkv.default, case.args,
                              dict(num_splits=splits, **case.kwargs), test_utils=NO_SCHEMA_UTILS)
    torch.library.opcheck(ops.mla_decode.default, case.args, case.kwargs, test_utils=NO_SCHEMA_UTILS)
    torch.library.opcheck(ops.mla_decode.default, case.args, dict(num_splits=2, **case.kwargs),
                          test_utils=NO_SCHEMA_UTILS)
    torch.library.opcheck(ops.mla_decode.default, case.args, dict(num_splits=2, constant_kv=True, **case.kwargs),
                          test_utils=NO_SCHEMA_UTILS)
    assert_only_declared_mutations(lambda: kimi_ops.mla_decode(*case.args, num_splits=2, **case.kwargs),
                                   case.args)
    seq_lens = (torch.tensor(case.lengths, dtype=torch.int32) * 2 + 1).to(case.q.device)  # as rank 1 of 2
    dcp = dict(seq_lens=seq_lens, dcp_rank=1, dcp_world_size=2, **case.kwargs)
    torch.library.opcheck(ops.mla_decode_splitkv.default, case.args, dict(num_splits=2, **dcp),
                          test_utils=NO_SCHEMA_UTILS)
    torch.library.opcheck(ops.mla_decode.default, case.args, dcp, test_utils=NO_SCHEMA_UTILS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", [(1, 3, 12), (4, 2, 16), (2, 5, 1)])
def test_opcheck_merge(shape, device):
    splits, rows, heads = shape
    o_part = torch.randn(splits, rows, heads, 512).to(torch.bfloat16).to(device)
    lse_part = torch.randn(splits, rows, heads).to(device)
    lse_part[0, 0] = float("-inf")
    o_part[0, 0] = 0
    torch.library.opcheck(ops.mla_merge.default, (o_part, lse_part), test_utils=ALL_UTILS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("slots_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tokens", [1, 5])
def test_opcheck_cache_write(slots_dtype, tokens, device):
    cache = torch.randn(4, 8, 576).to(torch.float8_e4m3fn).to(device)
    kv_c = torch.randn(tokens, 512).to(torch.bfloat16).to(device)
    k_pe = torch.randn(tokens, 64).to(torch.bfloat16).to(device)
    slots = torch.randperm(32)[:tokens].to(slots_dtype)
    slots[0] = -1 if tokens > 1 else slots[0]
    slots = slots.to(device)
    opcheck_and_mutations("mla_cache_write", (kv_c, k_pe, cache, slots, 0.5), mutated={2})


@pytest.mark.parametrize("shape", [(64,), (3, 32), (2, 4, 96)])
def test_opcheck_mxfp4_roundtrip_ops(shape):
    w = torch.randn(shape).to(torch.bfloat16)
    torch.library.opcheck(ops.mxfp4_quantize.default, (w,), test_utils=ALL_UTILS)
    packed, scale = kimi_ops.mxfp4_quantize(w)
    torch.library.opcheck(ops.mxfp4_dequantize.default, (packed, scale), test_utils=ALL_UTILS)
    torch.library.opcheck(ops.mxfp4_dequantize.default, (packed, scale), dict(dtype=torch.float32),
                          test_utils=ALL_UTILS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bmk_n", [(2, 1, 64, 32), (3, 5, 128, 48), (1, 8, 32, 16)])
def test_opcheck_bmm_a16wfp4(bmk_n, device):
    b, m, k, n = bmk_n
    packed, scale = kimi_ops.mxfp4_quantize(torch.randn(b, n, k, device=device))
    x = torch.randn(b, m, k, device=device).to(torch.bfloat16)
    torch.library.opcheck(ops.bmm_a16wfp4.default, (x, packed, scale), test_utils=ALL_UTILS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mxfp4", [False, True])
@pytest.mark.parametrize("tokens,heads,pad", [(1, 12, None), (3, 12, 16), (5, 2, 2)])
def test_opcheck_mla_query(mxfp4, tokens, heads, pad, device):
    q_nope = torch.randn(tokens, heads, 128, device=device).to(torch.bfloat16)
    q_pe = torch.randn(tokens, heads, 64, device=device).to(torch.bfloat16)
    if mxfp4:
        w_uk, w_uk_scale = kimi_ops.mxfp4_quantize(torch.randn(heads, 512, 128, device=device))
    else:
        w_uk, w_uk_scale = torch.randn(heads, 128, 512, device=device).to(torch.bfloat16) / 8, None
    torch.library.opcheck(ops.mla_query.default, (q_nope, q_pe, w_uk, w_uk_scale), dict(pad_heads=pad),
                          test_utils=ALL_UTILS)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mxfp4", [False, True])
@pytest.mark.parametrize("tokens,heads,gate", [(1, 12, True), (3, 2, False), (9, 2, True)])
def test_opcheck_mla_v_up_proj(mxfp4, tokens, heads, gate, device):
    o = torch.randn(tokens, heads, 512, device=device).to(torch.bfloat16)
    if mxfp4:
        w_uv, w_uv_scale = kimi_ops.mxfp4_quantize(torch.randn(heads, 128, 512, device=device))
    else:
        w_uv, w_uv_scale = torch.randn(heads, 128, 512, device=device).to(torch.bfloat16) / 8, None
    g = torch.rand(tokens, heads * 128, device=device).to(torch.bfloat16) if gate else None
    torch.library.opcheck(ops.mla_v_up_proj.default, (o, w_uv, w_uv_scale, g), test_utils=ALL_UTILS)


def fp8q_samples():
    from conftest import quantize_per_tensor
    for device in DEVICES:
        for i, sample in enumerate(DECODE_SAMPLES):
            case = make_decode_case(sample["lengths"], heads=sample["heads"], qlen=sample["qlen"],
                                    block_size=sample["block_size"], spare_rows=3, seed=200 + i, device=device)
            case.q, q_scale = quantize_per_tensor(case.q.float())
            yield case, q_scale.to(device)


@pytest.mark.parametrize("case_scale", list(fp8q_samples()),
                         ids=lambda c: f"{c[0].q.device.type}-R{len(c[0].lengths)}q{c[0].qlen}")
def test_opcheck_decode_ops_fp8_query(case_scale):
    """The fp8 query (q8 + q_scale): float8 q and cache, so test_schema cannot run; the q_scale
    argument, like every other, is left unchanged byte for byte."""
    case, q_scale = case_scale
    kwargs = dict(q_scale=q_scale, **case.kwargs)
    for splits in (1, 3):
        torch.library.opcheck(ops.mla_decode_splitkv.default, case.args, dict(num_splits=splits, **kwargs),
                              test_utils=NO_SCHEMA_UTILS)
    torch.library.opcheck(ops.mla_decode.default, case.args, kwargs, test_utils=NO_SCHEMA_UTILS)
    torch.library.opcheck(ops.mla_decode.default, case.args, dict(num_splits=2, **kwargs), test_utils=NO_SCHEMA_UTILS)
    args = case.args + (q_scale,)
    assert_only_declared_mutations(
        lambda: kimi_ops.mla_decode(*case.args, num_splits=2, **kwargs), args)
    seq_lens = (torch.tensor(case.lengths, dtype=torch.int32) * 2 + 1).to(case.q.device)
    dcp = dict(seq_lens=seq_lens, dcp_rank=1, dcp_world_size=2, **kwargs)
    torch.library.opcheck(ops.mla_decode.default, case.args, dcp, test_utils=NO_SCHEMA_UTILS)
