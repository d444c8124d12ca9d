"""A whole decode step (metadata advance + layer) and its CUDA-graph capture.

:func:`decode_step` is the unit the demo, the benchmark and the tests capture: it grows
every request by ``qlen`` tokens (:meth:`DecodeMetadata.advance_`, device ops in place) and
runs the layer, whose ``pre`` appends this step's rows to the cache. :class:`GraphedStep`
captures any such function (eager or ``torch.compile``'d) in a ``torch.cuda.CUDAGraph`` with
a static hidden-state buffer; replays then run the same kernels on the updated buffers.
"""

import os

import torch


def decode_step(layer, hidden: torch.Tensor, kv_cache: torch.Tensor, md) -> torch.Tensor:
    """One decode step: ``md.advance_()`` then ``layer(hidden, kv_cache, md)``."""
    md.advance_()
    return layer(hidden, kv_cache, md)


def compile_step(fn, **kwargs):
    """``torch.compile(fn, fullgraph=True, **kwargs)`` with Inductor's programmatic dependent
    launch (``triton.enable_pdl``, where this torch has it; Inductor applies it on sm_90+ CUDA
    only) unless ``KIMI_OPS_PDL=0``: its kernels then start while the previous one finishes, as
    kimi_ops' Triton kernels do (kimi_ops/kernels/pdl.py). On the H200 (torch 2.11) the compiled
    Kimi-K3 step in a CUDA graph took 61.4 us instead of 65.0 at batch 1 and 76.6 instead of 78.5
    at batch 8 (docs/PERF.md, session 21)."""
    options = dict(kwargs.pop("options", None) or {})
    if os.environ.get("KIMI_OPS_PDL", "1") != "0" and hasattr(torch._inductor.config.triton, "enable_pdl"):
        options.setdefault("triton.enable_pdl", True)
    return torch.compile(fn, fullgraph=True, options=options or None, **kwargs)


def snapshot(kv_cache: torch.Tensor, md) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of the state a step mutates (the cache and the metadata buffers)."""
    tensors = [kv_cache, md.kv_indptr, md.kv_indices, md.seq_lens, md.slot_mapping, md.positions]
    return [(t, t.clone()) for t in tensors]


def restore(saved) -> None:
    """Put a :func:`snapshot` back, in place (same storage, so captured graphs still see it)."""
    for t, copy in saved:
        t.copy_(copy)


class GraphedStep:
    """``fn(layer, hidden, kv_cache, md)`` captured in a CUDA graph.

    Warm-up calls (Triton / inductor compilation, cuBLAS workspaces) run on a side stream,
    and the cache and metadata are restored afterwards, so capturing leaves the state as it
    was. ``step(hidden)`` copies ``hidden`` into the static input, replays, and returns the
    static output buffer (overwritten by the next replay: clone to keep it).
    """

    def __init__(self, fn, layer, kv_cache: torch.Tensor, md, hidden_example: torch.Tensor, warmup: int = 2):
        self.static_hidden = hidden_example.clone()
        saved = snapshot(kv_cache, md)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn(layer, self.static_hidden, kv_cache, md)
        torch.cuda.current_stream().wait_stream(side)
        restore(saved)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_out = fn(layer, self.static_hidden, kv_cache, md)

    def __call__(self, hidden: torch.Tensor | None = None) -> torch.Tensor:
        if hidden is not None:
            self.static_hidden.copy_(hidden)
        self.graph.replay()
        return self.static_out


def mark_static(layer, kv_cache: torch.Tensor, md) -> None:
    """Mark the layer's weights, the cache and the metadata buffers as static addresses, so
    ``torch.compile(mode="reduce-overhead")`` (CUDA graph trees) neither copies them into its
    own buffers each call nor refuses the graph because the step mutates them in place."""
    mark = torch._dynamo.mark_static_address
    for t in layer.buffers():
        mark(t)
    for t in (kv_cache, md.kv_indptr, md.kv_indices, md.seq_lens, md.slot_mapping, md.positions, md.block_table):
        mark(t)
