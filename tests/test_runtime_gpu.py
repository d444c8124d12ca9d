"""GPU (skipped without CUDA): the layer at Kimi-K3 dims against the float64 oracle on the GPU
kernels, and a >= 100-step decode loop -- each step appends its tokens through mla_cache_write
and advances the metadata in place -- under ``torch.cuda.CUDAGraph`` and under
``torch.compile(mode="reduce-overhead")``, equal to the eager loop. (No expecttest import:
the device image lacks it.)"""

import pytest
import torch

from kimi_ops.runtime import MLAConfig
from kimi_ops.runtime.graph import GraphedStep, decode_step, mark_static, restore, snapshot
from test_runtime import check_step, make_step, rel, run_loop

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _gpu_loop_case(qlen, weights, steps):
    lens = [300, 0, 1000, 37, 5]           # a padding request (0) and a short one
    layer, cache, md, hidden, bt = make_step(MLAConfig.kimi_k3(), lens, qlen=qlen, weights=weights,
                                             block_size=16, spare=steps * qlen, device="cuda")
    md.seq_lens.sub_(torch.where(md.seq_lens > 0, qlen, 0).to(torch.int32))
    md.update_()
    gen = torch.Generator(device="cuda").manual_seed(3)
    hiddens = [torch.randn(hidden.shape, device="cuda", generator=gen).to(torch.bfloat16) for _ in range(steps)]
    return layer, cache, md, hiddens, bt, lens


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("weights", ["bf16", "mxfp4", "fp8"])
def test_gpu_kimi_k3_layer_matches_float64(monkeypatch, weights):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "auto")
    lens = [9, 700, 1, 0, 64]
    layer, cache, md, hidden, bt = make_step(MLAConfig.kimi_k3(), lens, qlen=2, weights=weights, block_size=16,
                                             device="cuda")
    err = check_step(layer, cache, md, hidden, bt, lens)
    print(f"GPU kimi_k3 {weights}: relative L2 error vs float64 {err:.2e}")


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("qlen,weights", [(1, "mxfp4"), (2, "bf16")])
def test_gpu_decode_loop_cuda_graph_and_reduce_overhead_match_eager(monkeypatch, qlen, weights):
    monkeypatch.setenv("KIMI_OPS_BACKEND", "auto")
    steps = 112
    layer, cache, md, hiddens, bt, lens = _gpu_loop_case(qlen, weights, steps)
    start = snapshot(cache, md)
    eager = run_loop(lambda h: decode_step(layer, h, cache, md), layer, cache, md, hiddens)
    end_eager = [t.clone() for t, _ in snapshot(cache, md)]

    # 1. the eager step captured in a torch.cuda.CUDAGraph, replayed after in-place updates
    restore(start)
    with torch.no_grad():
        graphed = GraphedStep(decode_step, layer, cache, md, hiddens[0])
    outs = run_loop(graphed, layer, cache, md, hiddens)
    graph_errs = [rel(g, e) for g, e in zip(outs, eager)]
    exact = all(torch.equal(g, e) for g, e in zip(outs, eager))
    print(f"CUDAGraph loop ({steps} steps, qlen {qlen}, {weights}): bit-exact {exact}, "
          f"max rel diff {max(graph_errs):.2e}")
    assert max(graph_errs) <= 1e-3
    assert torch.equal(md.seq_lens, end_eager[3]) and torch.equal(md.kv_indices, end_eager[2])

    # 2. torch.compile(mode="reduce-overhead") (CUDA graph trees), the state marked static
    restore(start)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters
    counters.clear()
    mark_static(layer, cache, md)
    compiled_step = torch.compile(decode_step, mode="reduce-overhead", fullgraph=True)
    outs = run_loop(lambda h: compiled_step(layer, h, cache, md), layer, cache, md, hiddens)
    skips = dict(counters["inductor"]).get("cudagraph_skips", 0)
    ro_errs = [rel(c, e) for c, e in zip(outs, eager)]
    print(f"reduce-overhead loop: cudagraph skips {skips}, max rel diff vs eager {max(ro_errs):.2e}")
    assert skips == 0, "the compiled step ran as a CUDA graph"
    assert max(ro_errs) <= 1e-2
    assert torch.equal(md.seq_lens, end_eager[3])
    # the last step against the float64 oracle
    check_step(layer, cache, md, hiddens[-1], bt, md.seq_lens.tolist(), out=outs[-1])
