"""The whole decode step (metadata advance + pre / attend / post) under torch.compile and CUDA graphs.

* CPU (CI): ``torch.compile(fullgraph=True)`` captures the step as one graph; expecttest pins
  the graph's ops (Dynamo's graph, and the heavy ops of the functionalized ATen graph), so a
  graph break, a new copy or a lost in-place cache write shows up as a diff
  (``EXPECTTEST_ACCEPT=1`` rewrites the pins). A decode loop compiled with inductor matches
  the eager loop step by step.
GPU versions (the >= 100-step loop under CUDA graphs): tests/test_runtime_gpu.py.
"""

import operator
import os
import textwrap

import expecttest
import pytest
import torch

from kimi_ops.runtime import MLAConfig
from kimi_ops.runtime.graph import decode_step
from test_runtime import SMALL, check_step, make_step, rel, run_loop

def op_name(node) -> str:
    """A node's target, spelled the same across torch 2.11-2.14 (older Dynamo records
    ``x == y`` as the method ``.__eq__``, newer as the function ``eq``)."""
    t = node.target
    if node.op == "call_method":
        if t.startswith("__") and t.endswith("__") and hasattr(operator, t.strip("_")):
            return t.strip("_")
        return f".{t}"
    if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(t)
    if isinstance(t, torch._ops.HigherOrderOperator):
        return t.name()
    return getattr(t, "__name__", str(t))


HEAVY = ("kimi_ops.", "auto_functionalized", "aten.mm", "aten.bmm", "aten.addmm", "aten.copy", "aten.clone",
         "aten.searchsorted", "aten.cumsum", "aten.index_put", "aten.scatter")


def heavy_ops(graph_module) -> str:
    """The heavy ATen / custom ops of a functionalized graph, one a line, in order."""
    return "\n".join(op_name(n) for n in graph_module.graph.nodes
                     if n.op == "call_function" and op_name(n).startswith(HEAVY))


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
.remainder add where .to .to .clamp_min .copy_ .copy_ .copy_ .copy_ kimi_ops.gemm_a16w16 .split
getitem getitem .split getitem getitem getitem kimi_ops.mla_norm_cache_write_q_b getitem getitem
.view .split getitem getitem kimi_ops.mla_query kimi_ops.mla_decode getitem kimi_ops.mla_v_up_proj
kimi_ops.gemm_a16w16""")
        self.assertExpectedInline(heavy_ops(aten[0]), """\
aten.cumsum.default
aten.searchsorted.Tensor
aten.copy.default
aten.copy.default
aten.copy.default
aten.copy.default
kimi_ops.gemm_a16w16.default
auto_functionalized_v2
kimi_ops.mla_query.default
kimi_ops.mla_decode.default
kimi_ops.mla_v_up_proj.default
kimi_ops.gemm_a16w16.default""")

    def test_deepseek_step_with_rope_and_bf16_is_one_graph(self):
        layer, cache, md, hidden, _ = make_step(MLAConfig.small(gate=False, rope=True, heads=2), SMALL, qlen=1)
        _, dynamo, aten = record_graphs(decode_step, layer, hidden, cache, md)
        self.assertEqual((len(dynamo), len(aten)), (1, 1), "one graph: no graph break")
        self.assertExpectedInline(heavy_ops(aten[0]), """\
aten.cumsum.default
aten.searchsorted.Tensor
aten.copy.default
aten.copy.default
aten.copy.default
aten.copy.default
kimi_ops.gemm_a16w16.default
auto_functionalized_v2
kimi_ops.mla_query.default
kimi_ops.mla_decode.default
kimi_ops.mla_v_up_proj.default
kimi_ops.gemm_a16w16.default""")


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
