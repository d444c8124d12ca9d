"""Programmatic dependent launch (kimi_ops.kernels.pdl, csrc/sm90: ``KIMI_OPS_PDL``, on by
default on sm_90+): which launches take it, and on the GPU that it changes no bit of a decode
loop (a kernel reading its predecessor's output before ``griddepcontrol.wait`` would)."""
import pytest
import torch

from kimi_ops.kernels import pdl

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_pdl_args_off_where_it_cannot_run(monkeypatch):
    assert pdl.pdl_args(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert pdl.pdl_args(torch.device("cuda", 0)) == {"PDL": False}, "the interpreter has no PDL"


@requires_cuda
@pytest.mark.gpu
def test_pdl_args_follow_the_switch(monkeypatch):
    dev = torch.device("cuda", torch.cuda.current_device())
    monkeypatch.setenv("KIMI_OPS_PDL", "0")
    assert pdl.pdl_args(dev) == {"PDL": False}
    monkeypatch.setenv("KIMI_OPS_PDL", "1")
    want = torch.version.hip is None and torch.cuda.get_device_capability(dev)[0] >= 9
    got = pdl.pdl_args(dev)
    print(f"PDL on {torch.cuda.get_device_name(dev)}: {got}")
    assert got["PDL"] == (want and pdl._triton_takes_launch_pdl())


@requires_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("qlen,weights", [(1, "mxfp4"), (2, "bf16"), (1, "fp8")])
def test_gpu_pdl_decode_loop_bitwise_equals_plain_launches(monkeypatch, qlen, weights):
    """A 40-step decode loop (cache writes, M1a, M1c + M1b, W_UV, the projections on their
    constant_w kernel; requests of 0 to 1000 tokens) captured in a CUDA graph with PDL and
    without: the same outputs and cache, bit for bit."""
    from kimi_ops.runtime.graph import GraphedStep, decode_step, restore, snapshot
    from test_runtime import rel, run_loop
    from test_runtime_gpu import _gpu_loop_case

    monkeypatch.setenv("KIMI_OPS_BACKEND", "auto")
    steps = 40
    layer, cache, md, hiddens, _, _ = _gpu_loop_case(qlen, weights, steps)
    start = snapshot(cache, md)
    outs, ends = {}, {}
    monkeypatch.setenv("KIMI_OPS_SM90_PDL", "1")  # the Hopper kernels' opt-in too
    for flag in ("0", "1"):
        restore(start)
        monkeypatch.setenv("KIMI_OPS_PDL", flag)
        with torch.no_grad():
            graphed = GraphedStep(decode_step, layer, cache, md, hiddens[0])
        outs[flag] = run_loop(graphed, layer, cache, md, hiddens)
        ends[flag] = [t.clone() for t, _ in snapshot(cache, md)]
    diff = max(rel(a, b) for a, b in zip(outs["1"], outs["0"]))
    print(f"PDL loop ({steps} steps, qlen {qlen}, {weights}): max rel diff vs plain launches {diff:.2e}")
    assert all(torch.equal(a, b) for a, b in zip(outs["1"], outs["0"])), "PDL changed an output"
    assert all(torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b)
               for a, b in zip(ends["1"], ends["0"])), "PDL changed the cache or the metadata"


def test_compile_step_asks_inductor_for_pdl(monkeypatch):
    """kimi_ops.runtime.graph.compile_step: fullgraph, Inductor's PDL where this torch has it,
    none with KIMI_OPS_PDL=0; a caller's own options kept."""
    from kimi_ops.runtime.graph import compile_step

    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    has = hasattr(torch._inductor.config.triton, "enable_pdl")
    compile_step(abs, options={"max_autotune": False})
    assert seen[-1]["fullgraph"] is True
    assert seen[-1]["options"] == ({"max_autotune": False, "triton.enable_pdl": True} if has else {"max_autotune": False})
    monkeypatch.setenv("KIMI_OPS_PDL", "0")
    compile_step(abs)
    assert seen[-1] == {"fullgraph": True, "options": None}


def test_compile_step_runs_on_cpu():
    from kimi_ops.runtime.graph import compile_step

    torch._dynamo.reset()
    x = torch.randn(33)
    assert torch.equal(compile_step(lambda t: torch.relu(t) * 2)(x), torch.relu(x) * 2)
