"""The backend table and the host-side split heuristic."""

import pytest
import torch

from kimi_ops import dispatch


def test_every_op_has_a_reference():
    for op, table in dispatch.IMPLEMENTATIONS.items():
        assert "reference" in table, op


@pytest.mark.parametrize("env,expected", [("", "reference"), ("auto", "reference"), ("reference", "reference")])
def test_cpu_backend(monkeypatch, env, expected):
    monkeypatch.setenv("KIMI_OPS_BACKEND", env)
    for op in dispatch.IMPLEMENTATIONS:
        assert dispatch.backend_for(op, torch.device("cpu")) == expected


def test_triton_on_cpu_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.backend_for("mla_decode_splitkv", torch.device("cpu")) == "triton"
    # ops with no Triton kernel run their torch code
    assert dispatch.backend_for("mxfp4_quantize", torch.device("cpu")) == "reference"


def test_num_splits_is_one_on_cpu():
    assert dispatch.default_num_splits(4, 8, 12, 4000, torch.device("cpu")) == 1


def test_num_splits_fills_the_gpu(monkeypatch):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "triton")  # the Triton kernel's heuristic
    monkeypatch.setattr(dispatch, "multiprocessor_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    one_long = dispatch.default_num_splits(1, 1, 12, 65536, gpu)
    many_short = dispatch.default_num_splits(128, 128, 12, 128 * 1024, gpu)
    short = dispatch.default_num_splits(1, 1, 12, 300, gpu)
    # many short requests: two 16-tile programs an SM (the two-programs-an-SM model, session 52)
    assert one_long == 128 and many_short == 2 and short == 2
    assert dispatch.default_num_splits(1, 1, 12, 8192, gpu) == 64       # 128-token splits: 14.2 us, 22.0 at 32
    # where the tiles divide evenly (session 52's H100 sweep): 32 x 8 programs of 16 rows (two an
    # SM), 8 x 16 (one an SM: a split of 16 tiles is too short to share); 64 x 2 row blocks of 96 heads
    assert dispatch.default_num_splits(32, 32, 12, 32 * 8192, gpu) == 8
    assert dispatch.default_num_splits(8, 8, 12, 8 * 8192, gpu) == 16
    assert dispatch.default_num_splits(64, 64, 96, 64 * 4096, gpu) == 1
    for args in [(8, 8, 12, 8 * 8192), (64, 64, 96, 64 * 4096), (32, 256, 12, 32 * 32768), (1, 1, 12, 1 << 22)]:
        assert 1 <= dispatch.default_num_splits(*args, gpu) <= 256


def test_num_splits_follows_the_backend(monkeypatch):
    from kimi_ops.kernels import sm90
    from kimi_ops.kernels import attention
    monkeypatch.setattr(dispatch, "multiprocessor_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    for backend, module in (("cuda", sm90), ("triton", attention)):
        monkeypatch.setattr(dispatch, "backend_for", lambda op, device, b=backend: b)
        assert dispatch.default_num_splits(8, 8, 12, 8 * 8192, gpu) == module.suggest_num_splits(8, 1, 12, 8 * 8192, 132)
