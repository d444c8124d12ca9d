"""CUDA-graph timing shared by the benchmark scripts (DESIGN.md's method).

A module, not a command: scripts/bench_attention.py, bench_merge.py, bench_query.py, bench_dcp.py,
bench_dcp_step.py and gpu_cuda_check.py import ``time_graph`` from it (``sys.path`` holds scripts/).
Run by itself it only answers --help.
"""
import statistics

import torch


def time_graph(fns, reps, before_replay=None):
    """fns: one closure per rotating input set. Runs each once outside the capture (compiles,
    warms caches), captures all of them in one CUDA graph, replays it ``reps`` times; returns
    (median seconds a call, the per-replay samples). ``before_replay`` (e.g. ``dist.barrier``
    for collectives) runs before each timed replay, outside the timed span."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if before_replay is not None:
            before_replay()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e-3 / len(fns))
    del graph
    return statistics.median(samples), samples


if __name__ == "__main__":
    import argparse
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
