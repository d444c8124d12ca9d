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
from conftest import assert_attention_close, dcp_shard, make_decode_case, oracle_decode, requires_cuda
from kimi_ops.runtime import dcp
from kimi_ops.runtime.config import MLAConfig
from kimi_ops.runtime.layer import MLADecodeLayer, random_hf_weights
from kimi_ops.runtime.metadata import allocate_blocks, build_decode_metadata, cache_rows

HEADS_PER_RANK = 4


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
        indptr, indices = dcp_shard(case, rank, world)
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


def check_shards_merge(device: str, world: int, qlen: int, splits: int = 3) -> None:
    """Every rank's shard through the current backend (``splits`` KV splits a request), merged,
    against the oracle."""
    case = make_decode_case([0, 1, world - 1, world, 2 * world + 5, 70], heads=12, qlen=qlen,
                            seed=world + 17 * qlen, device=device)
    seq_lens = torch.tensor(case.lengths, dtype=torch.int32, device=device)
    outs, lses = [], []
    for rank in range(world):
        indptr, indices = dcp_shard(case, rank, world)
        o, lse = kimi_ops.mla_decode(case.q, case.kv_cache, indptr, indices, num_splits=splits,
                                     seq_lens=seq_lens, dcp_rank=rank, dcp_world_size=world, **case.kwargs)
        outs.append(o)
        lses.append(lse)
    assert_attention_close(*kimi_ops.mla_merge(torch.stack(outs), torch.stack(lses)), *oracle_decode(case))


def test_dcp_bounds_in_the_triton_kernel_interpreted():
    # two shardings (an even and an odd world, qlen 1 and 2), one split a request (a third of
    # the interpreter's time; the GPU test runs 3): the reference test above sweeps worlds 2-8
    # and qlen 1-4 through the same bounds; this checks the Triton kernel applies them
    code = "import test_dcp; [test_dcp.check_shards_merge('cpu', w, q, 1) for w, q in ((2, 1), (3, 2))]"
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join([os.path.dirname(here), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, TRITON_INTERPRET="1", KIMI_OPS_BACKEND="triton", CUDA_VISIBLE_DEVICES="", PYTHONPATH=path)
    result = subprocess.run([sys.executable, "-c", code], cwd=here, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("world", [2, 3, 4, 8])
@pytest.mark.parametrize("qlen", [1, 2, 4])
def test_dcp_bounds_in_the_reference(monkeypatch, world, qlen):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")
    check_shards_merge("cpu", world, qlen)


@requires_cuda
@pytest.mark.parametrize("world,qlen", [(2, 1), (4, 3), (8, 2), (8, 8)])
def test_dcp_bounds_in_the_gpu_kernel(world, qlen):
    check_shards_merge("cuda", world, qlen)


# --- the whole layer under DCP ----------------------------------------------------------------

LAYER_TOLERANCE = 1e-2
"""Relative L2 between a DCP rank's layer output and the one-process layer's. Both run the
same bf16 GEMMs; they differ in the attention's partials (per rank and per split, each
rounded to bf16: ~1.7e-3 apiece, two of them) and in how W_UV and o_proj round what follows,
so a few 1e-3; 1e-2 leaves room without hiding a wrong shard (which is off by O(1))."""


FP8_STATIC_SCALE = 2.0 ** -5
"""The fp8-query layer runs with this static q_scale on both sides: the same q8 bytes in the
DCP rank and in the one-process layer, so the comparison stays as tight as the bf16 one."""
FP8_DYNAMIC_TOLERANCE = 3e-2
"""The per-tensor amax scale of DCP (max over every rank's heads) differs from one process's
(its own heads): against the one-process bf16 layer, the query's quantization adds ~1.2e-2
here (measured); 3e-2 still catches a wrong shard or a wrong scale (O(1))."""


def layer_rank(rank, world, init_file, qlen, steps, combine, query="bf16"):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        every_head = MLAConfig(name="dcp_test", hidden_size=256, total_heads=2 * world, tp=1, q_lora_rank=128)
        config = every_head.replace(tp=world)                     # 2 heads a rank
        checkpoint = random_hf_weights(every_head, seed=0)        # unsharded: each rank takes its heads
        # query: "bf16" (pre's bf16=True on both), "fp8-static" (bf16=False, one static scale on
        # both), "fp8" (the DCP default: fp8 with the amax over the ranks, vs the bf16 layer)
        mode = dict(bf16=dict(bf16=True), fp8=dict(), **{"fp8-static": dict(bf16=False, q_scale=FP8_STATIC_SCALE)})
        sharded = MLADecodeLayer(config, seed=None, dcp_group=dist.group.WORLD, dcp_combine=combine, **mode[query])
        sharded.load_weights(checkpoint, tp_rank=rank)
        assert sharded.query_bf16 == (query == "bf16"), "fp8 by default under DCP"
        whole = MLADecodeLayer(config, seed=None, **(mode[query] if query != "fp8" else {}))
        whole.load_weights(checkpoint, tp_rank=rank)
        assert whole.query_bf16 == (query != "fp8-static"), "bf16 by default at DCP1"
        tolerance = FP8_DYNAMIC_TOLERANCE if query == "fp8" else LAYER_TOLERANCE
        requests, block_size = 3, 4
        # requests start at different lengths: the first step's earlier tokens are history
        history = [0, 1, world + 1]
        max_len = max(history) + qlen * steps
        block_table, num_blocks = allocate_blocks(requests, max_len, block_size, seed=1)
        seq_lens = torch.tensor([h + qlen for h in history], dtype=torch.int32)
        build = dict(block_size=block_size, qlen=qlen, max_tokens=requests * max_len)
        md_rank = build_decode_metadata(seq_lens, block_table, dcp_world_size=world, dcp_rank=rank, **build)
        md_whole = build_decode_metadata(seq_lens, block_table, **build)
        cache_rank = sharded.new_kv_cache(num_blocks, block_size)
        cache_whole = whole.new_kv_cache(num_blocks, block_size)
        gen = torch.Generator().manual_seed(5)
        for k, n in enumerate(history):                     # history rows, on whichever rank owns them
            for p in range(n):
                row = torch.randn(1, 576, generator=gen).to(torch.bfloat16)
                slot_whole = cache_rows(block_table, k, torch.tensor([p]), block_size)
                kimi_ops.mla_cache_write(row[:, :512], row[:, 512:], cache_whole, slot_whole, sharded.kv_scale)
                slot = cache_rows(block_table, k, torch.tensor([p // world]), block_size)
                slot = slot if p % world == rank else torch.tensor([-1])
                kimi_ops.mla_cache_write(row[:, :512], row[:, 512:], cache_rank, slot, sharded.kv_scale)
        for step in range(steps):
            hidden = torch.randn(requests * qlen, 256, generator=gen).to(torch.bfloat16)
            out, ref = sharded(hidden, cache_rank, md_rank), whole(hidden, cache_whole, md_whole)
            err = float((out.double() - ref.double()).norm() / ref.double().norm())
            assert err <= tolerance, f"rank {rank} step {step} ({query}): relative error {err:.2e}"
            md_rank.advance_()
            md_whole.advance_()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,qlen,combine,query", [
    (2, 1, "all_to_all", "bf16"), (2, 4, "gather_reduce_scatter", "bf16"), (4, 2, "all_to_all", "bf16"),
    (8, 3, "all_to_all", "bf16"), (2, 2, "all_to_all", "fp8-static"), (4, 1, "all_to_all", "fp8")])
def test_dcp_layer_matches_one_process(tmp_path, monkeypatch, world, qlen, combine, query):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")
    mp.spawn(layer_rank, args=(world, str(tmp_path / "init"), qlen, 3, combine, query), nprocs=world, join=True)


def fp8_gather_rank(rank, world, init_file, qlen):
    """The fp8 query's gather: every rank quantizes its heads with the scale of the amax over
    all ranks, gathers the bytes, and holds exactly the whole query quantized per tensor; the
    attention on it matches the oracle on q8 * q_scale (the fp8-query contract)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        case = make_decode_case([0, 1, world - 1, world, 3 * world + 1, 29], heads=world * HEADS_PER_RANK,
                                qlen=qlen, seed=world * 5 + qlen)
        # heads of very different sizes on different ranks: the scale must be the global one
        case.q = (case.q.float() * torch.logspace(-2, 1, world).repeat_interleave(HEADS_PER_RANK)[None, :, None]
                  ).to(torch.bfloat16)
        mine = slice(rank * HEADS_PER_RANK, (rank + 1) * HEADS_PER_RANK)
        local = case.q[:, mine].contiguous()
        amax = dcp.global_amax(local.abs().amax().float().reshape(1), dist.group.WORLD)
        q8, q_scale = kimi_ops.quantize_query(local, q_scale=kimi_ops.query_scale(local, amax=amax))
        gathered, gathered_scale = dcp.query_all_gather_fp8(q8, q_scale, dist.group.WORLD)
        whole8, whole_scale = kimi_ops.quantize_query(case.q)
        assert gathered.dtype == torch.float8_e4m3fn and torch.equal(gathered_scale, whole_scale)
        assert torch.equal(gathered.view(torch.uint8), whole8.view(torch.uint8)), "the bytes of the whole query"
        indptr, indices = dcp_shard(case, rank, world)
        seq_lens = torch.tensor(case.lengths, dtype=torch.int32)
        o, lse = kimi_ops.mla_decode(gathered, case.kv_cache, indptr, indices, q_scale=gathered_scale,
                                     seq_lens=seq_lens, dcp_rank=rank, dcp_world_size=world, **case.kwargs)
        case.q = whole8
        o_ref, lse_ref = oracle_decode(case, whole_scale)
        o_mine, lse_mine = dcp.combine(o, lse, dist.group.WORLD)
        assert_attention_close(o_mine, lse_mine, o_ref[:, mine], lse_ref[:, mine], rtol=4e-3, lse_atol=4e-3)
        sizes = dcp.query_gather_bytes(case.q.shape[0], HEADS_PER_RANK, world, fp8=True)
        bf16 = dcp.query_gather_bytes(case.q.shape[0], HEADS_PER_RANK, world, fp8=False)
        assert sizes["gathered"] == gathered.numel() and bf16["gathered"] == 2 * gathered.numel()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world,qlen", [(2, 2), (4, 1)])
def test_dcp_fp8_query_gather(tmp_path, monkeypatch, world, qlen):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")
    mp.spawn(fp8_gather_rank, args=(world, str(tmp_path / "init"), qlen), nprocs=world, join=True)


def test_query_gather_bytes():
    # Kimi-K3 at TP8 x DCP8: 12 heads a rank, 32 decode rows; bf16 1152 bytes a row and head, fp8 576 + 4
    bf16 = dcp.query_gather_bytes(32, 12, 8, fp8=False)
    fp8 = dcp.query_gather_bytes(32, 12, 8, fp8=True)
    assert bf16 == dict(send=32 * 12 * 1152, recv=7 * 32 * 12 * 1152, gathered=8 * 32 * 12 * 1152)
    assert fp8 == dict(send=32 * 12 * 576 + 4, recv=7 * (32 * 12 * 576 + 4), gathered=8 * 32 * 12 * 576)
    assert dcp.query_gather_bytes(32, 12, 8, fp8=True, static_scale=True)["send"] == 32 * 12 * 576
    assert dcp.query_gather_bytes(32, 12, 1, fp8=True)["recv"] == 0


def test_bench_dcp_step_smoke_on_gloo():
    """scripts/bench_dcp_step.py (issue 8's step latency, DCP W vs DCP1) runs end to end on the
    CPU: 2 gloo ranks, eager steps, one row for each batch."""
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_dcp_step.py"
    result = subprocess.run([sys.executable, str(script), "--world", "2", "--cpu", "--batches", "1,2",
                             "--context", "32", "--reps", "1"], capture_output=True, text=True, timeout=300,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.startswith(("| 1 |", "| 2 |"))]
    assert len(rows) == 2 and all(line.count("|") == 6 for line in rows), result.stdout
