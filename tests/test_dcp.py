"""Decode context parallel on CPU with gloo: W = 2, 4, 8 processes.

Every rank attends its shard (token p on rank p % W) for the gathered query of all
W * H heads, combines the partials, and must match the single-process attention
of its own heads over the whole cache (the float64 oracle of conftest).
"""

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kimi_ops
from conftest import assert_attention_close, make_decode_case, oracle_decode, requires_cuda
from kimi_ops.runtime import dcp

HEADS_PER_RANK = 4


def local_shard(case, rank, world):
    """This rank's CSR: request r's tokens at global positions p with p % world == rank."""
    indptr = case.kv_indptr.tolist()
    rows, local_indptr = [], [0]
    for r in range(len(indptr) - 1):
        rows.append(case.kv_indices[indptr[r]:indptr[r + 1]][rank::world])
        local_indptr.append(local_indptr[-1] + rows[-1].numel())
    return torch.tensor(local_indptr, dtype=torch.int32), torch.cat(rows)


def attention_rank(rank, world, init_file, qlen):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        # requests shorter than, equal to and not a multiple of W, and an empty one
        case = make_decode_case([0, 1, world - 1, world, 3 * world + 1, 29], heads=world * HEADS_PER_RANK,
                                qlen=qlen, seed=world * 7 + qlen)
        mine = slice(rank * HEADS_PER_RANK, (rank + 1) * HEADS_PER_RANK)
        gathered = dcp.query_all_gather(case.q[:, mine].contiguous(), group=dist.group.WORLD)
        assert torch.equal(gathered, case.q), "the gathered query is every rank's heads in rank order"
        indptr, indices = local_shard(case, rank, world)
        seq_lens = torch.tensor(case.lengths, dtype=torch.int32)
        o, lse = kimi_ops.mla_decode(gathered, case.kv_cache, indptr, indices, seq_lens=seq_lens,
                                     dcp_rank=rank, dcp_world_size=world, **case.kwargs)
        o_ref, lse_ref = oracle_decode(case)
        for method in dcp.COMBINES:
            o_mine, lse_mine = dcp.combine(o, lse, dist.group.WORLD, method=method)
            assert o_mine.shape == (case.q.shape[0], HEADS_PER_RANK, 512)
            assert_attention_close(o_mine, lse_mine, o_ref[:, mine], lse_ref[:, mine])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,qlen", [(2, 1), (2, 3), (4, 2), (8, 4)])
def test_dcp_attention_matches_one_process(tmp_path, monkeypatch, world, qlen):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")
    mp.spawn(attention_rank, args=(world, str(tmp_path / "init"), qlen), nprocs=world, join=True)


def test_combine_on_one_rank_and_bad_method():
    o, lse = torch.zeros(1, 2, 512, dtype=torch.bfloat16), torch.zeros(1, 2)
    assert dcp.combine(o, lse, None)[0] is o                    # one rank: nothing to combine
    with pytest.raises(ValueError, match=r"method must be one of \('all_to_all', 'gather_reduce_scatter'\), got 'ring'"):
        dcp.combine(o, lse, None, method="ring")


def check_shards_merge(device: str, world: int, qlen: int) -> None:
    """Every rank's shard through the current backend, merged, against the oracle."""
    case = make_decode_case([0, 1, world - 1, world, 2 * world + 5, 70], heads=12, qlen=qlen,
                            seed=world + 17 * qlen, device=device)
    seq_lens = torch.tensor(case.lengths, dtype=torch.int32, device=device)
    outs, lses = [], []
    for rank in range(world):
        indptr, indices = local_shard(case, rank, world)
        o, lse = kimi_ops.mla_decode(case.q, case.kv_cache, indptr.to(device), indices.to(device), num_splits=3,
                                     seq_lens=seq_lens, dcp_rank=rank, dcp_world_size=world, **case.kwargs)
        outs.append(o)
        lses.append(lse)
    assert_attention_close(*kimi_ops.mla_merge(torch.stack(outs), torch.stack(lses)), *oracle_decode(case))


def test_dcp_bounds_in_the_triton_kernel_interpreted():
    code = "import test_dcp; [test_dcp.check_shards_merge('cpu', w, q) for w, q in ((2, 1), (3, 2), (4, 4))]"
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([os.path.dirname(here), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", KIMI_OPS_BACKEND="triton", CUDA_VISIBLE_DEVICES="", PYTHONPATH=path)
    result = subprocess.run([sys.executable, "-c", code], cwd=here, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


@requires_cuda
@pytest.mark.parametrize("world,qlen", [(2, 1), (4, 3), (8, 2), (8, 8)])
def test_dcp_bounds_in_the_gpu_kernel(world, qlen):
    check_shards_merge("cuda", world, qlen)
