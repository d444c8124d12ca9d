"""The whole decode step (metadata advance + pre / attend / post) under torch.compile and CUDA graphs.

* CPU (CI): ``torch.compile(fullgraph=True)`` captures the step as one graph; expecttest pins
  the graph's ops (Dynamo's graph, and the heavy ops of the functionalized ATen graph), so a
  graph break, a new copy or a lost in-place cache write shows up as a diff
  (``EXPECTTEST_ACCEPT=1`` rewrites the pins). A decode loop compiled with inductor matches
  the eager loop step by step.
* GPU (skipped without CUDA): the layer at Kimi-K3 dims against the float64 oracle on the
  Triton kernels, and a >= 100-step decode loop under ``torch.cuda.CUDAGraph`` and under
  ``torch.compile(mode="reduce-overhead")`` that equals the eager loop.
"""

import os
import textwrap

import expecttest
import pytest
import torch

from kimi_ops.runtime import MLAConfig
from kimi_ops.runtime.graph import GraphedStep, decode_step, mark_static, restore, snapshot
from test_runtime import SMALL, check_step, make_step

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def op_name(node) -> str:
    t = node.target
    if node.op == "call_method":
        return f".{t}"
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(t)
    if isinstance(t, torch._ops.HigherOrderOperator):
        return t.name()
    return getattr(t, "__name__", str(t))


HEAVY = ("kimi_ops.", "auto_functionalized", "aten.mm", "aten.bmm", "aten.addmm", "aten.copy", "aten.clone",
         "aten.searchsorted", "aten.cumsum", "aten.index_put", "aten.scatter")


def record_graphs(fn, *args):
    """Compile ``fn`` with fullgraph=True and a recording backend: (Dynamo graphs, ATen graphs)."""
    from torch._dynamo.backends.common import aot_autograd

    dynamo, aten = [], []

    def fw(gm, _):
        aten.append(gm)
        return gm.forward

    def backend(gm, example_inputs):
        dynamo.append(gm)
        return aot_autograd(fw_compiler=fw)(gm, example_inputs)

    torch._dynamo.reset()
    with torch.no_grad():
        out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return out, dynamo, aten


class TestCompiledGraph(expecttest.TestCase):
    def setUp(self):
        self._env = os.environ.get("KIMI_OPS_BACKEND")
        os.environ["KIMI_OPS_BACKEND"] = "reference"

    def tearDown(self):
        if self._env is None:
            os.environ.pop("KIMI_OPS_BACKEND", None)
        else:
            os.environ["KIMI_OPS_BACKEND"] = self._env

    def test_whole_step_is_one_graph_with_pinned_ops(self):
        # Kimi-K3's structure (merged gate, MXFP4 W_UK / W_UV, NoPE) at small dims, qlen 2
        layer, cache, md, hidden, _ = make_step(MLAConfig.small(), SMALL, qlen=2, weights="mxfp4")
        md.seq_lens.sub_(torch.where(md.seq_lens > 0, 2, 0).to(torch.int32))   # decode_step adds them back
        md.update_()
        _, dynamo, aten = record_graphs(decode_step, layer, hidden, cache, md)
        self.assertEqual((len(dynamo), len(aten)), (1, 1), "one graph: no graph break")
        ops = [op_name(n) for n in dynamo[0].graph.nodes if n.op in ("call_function", "call_method")]
        self.assertExpectedInline(textwrap.fill(" ".join(ops), 100), """\
gt where .to .add_ .to sub add div .clamp_min .cumsum .clamp_max .new_zeros cat .to arange
searchsorted lt .clamp_max getitem sub .clamp_min div .clamp getitem mul .remainder add where arange
div getitem sub .remainder add ge .remainder eq and_ .clamp_min div div .clamp getitem mul
.remainder add where .to .to .clamp_min .copy_ .copy_ .copy_ .copy_ linear .split getitem getitem
.split getitem getitem getitem .float .pow .mean add rsqrt mul .float mul .to .float .pow .mean add
rsqrt mul .float mul .to linear .view .split getitem getitem kimi_ops.mla_query
kimi_ops.mla_cache_write sigmoid kimi_ops.mla_decode getitem .transpose kimi_ops.bmm_a16wfp4
.transpose .reshape mul linear""")
        heavy = [op_name(n) for n in aten[0].graph.nodes
                 if n.op == "call_function" and op_name(n).startswith(HEAVY)]
        self.assertExpectedInline("\n".join(heavy), """\
aten.cumsum.default
aten.searchsorted.Tensor
aten.copy.default
aten.copy.default
aten.copy.default
aten.copy.default
aten.mm.default
aten.mm.default
kimi_ops.mla_query.default
auto_functionalized_v2
kimi_ops.mla_decode.default
kimi_ops.bmm_a16wfp4.default
aten.clone.default
aten.mm.default""")

    def test_deepseek_step_with_rope_and_bf16_is_one_graph(self):
        layer, cache, md, hidden, _ = make_step(MLAConfig.small(gate=False, rope=True, heads=2), SMALL, qlen=1)
        _, dynamo, aten = record_graphs(decode_step, layer, hidden, cache, md)
        self.assertEqual((len(dynamo), len(aten)), (1, 1), "one graph: no graph break")
        heavy = [op_name(n) for n in aten[0].graph.nodes
                 if n.op == "call_function" and op_name(n).startswith(HEAVY)]
        self.assertExpectedInline("\n".join(heavy), """\
aten.cumsum.default
aten.searchsorted.Tensor
aten.copy.default
aten.copy.default
aten.copy.default
aten.copy.default
aten.mm.default
aten.mm.default
kimi_ops.mla_query.default
auto_functionalized_v2
kimi_ops.mla_decode.default
aten.bmm.default
aten.clone.default
aten.mm.default""")


def run_loop(step, layer, cache, md, hiddens):
    """Outputs (clones) of ``step(hidden)`` over the hidden states, in order."""
    outs = []
    with torch.no_grad():
        for hidden in hiddens:
            outs.append(step(hidden).clone())
    return outs


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("qlen", [2])
def test_cpu_decode_loop_compiled_matches_eager(monkeypatch, qlen):
    """The loop logic the GPU test captures, on the CPU: eager vs inductor-compiled, step by step."""
    monkeypatch.setenv("KIMI_OPS_BACKEND", "reference")
    steps = 10
    lens = [6, 0, 21, 3]
    layer, cache, md, hidden, bt = make_step(MLAConfig.small(), lens, qlen=qlen, weights="mxfp4", spare=steps * qlen)
    md.seq_lens.sub_(torch.where(md.seq_lens > 0, qlen, 0).to(torch.int32))   # the loop's first step adds them
    md.update_()
    gen = torch.Generator().manual_seed(7)
    hiddens = [torch.randn(hidden.shape, generator=gen).to(torch.bfloat16) for _ in range(steps)]
    cache_c, md_c = cache.clone(), md.clone()
    eager = run_loop(lambda h: decode_step(layer, h, cache, md), layer, cache, md, hiddens)
    torch._dynamo.reset()
    compiled_step = torch.compile(decode_step, fullgraph=True)
    compiled = run_loop(lambda h: compiled_step(layer, h, cache_c, md_c), layer, cache_c, md_c, hiddens)
    assert torch.equal(md.seq_lens, md_c.seq_lens) and torch.equal(md.kv_indices, md_c.kv_indices)
    assert md.seq_lens.tolist() == [n + (steps - 1) * qlen if n else 0 for n in lens]
    errs = [rel(c, e) for c, e in zip(compiled, eager)]
    assert max(errs) <= 4e-3, errs
    same = (cache.view(torch.uint8) == cache_c.view(torch.uint8)).float().mean()
    assert same >= 0.999, f"caches agree to fp8 rounding flips ({same:.5f})"
    # the last step against the float64 oracle (state after the loop)
    check_step(layer, cache_c, md_c, hiddens[-1], bt, md_c.seq_lens.tolist(), out=compiled[-1])


# --- GPU --------------------------------------------------------------------------------------

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
@pytest.mark.parametrize("weights", ["bf16", "mxfp4"])
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
