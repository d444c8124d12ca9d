#!/usr/bin/env python3
"""CPU model of how evenly the cuda backend's work-list grid spreads a batch over the SMs.

    python3 scripts/split_model.py [--waves 1 2] [--slots 264] [--cta-us 2.0] [--tile-us 3.3]

Each request of n tokens is cut the way ``splitkv_kernel`` cuts it: chunks of
max(ceil(n / S), ceil(all tokens / balance_ctas)) rounded up to 64, S = the work list's cap
(one per 128 tokens of the average request, at most 128), balance_ctas = waves x requests x
``hopper.one_wave_splits``. The CTAs start in launch order on ``--slots`` CTA slots (264 = 132
SMs x 2 CTAs), each as soon as a slot frees, and take ``--cta-us`` + ``--tile-us`` a 64-token
tile (3.3 us: a 16-row CTA's tile at b32 32k on the H200). Launch orders: ``request`` (each
request's splits in turn, the kernel before session 7) and ``lpt`` (the kernel's
``find_work_item``: every whole chunk, then the partial last chunks by length class, >= 3/4 of a
chunk first). Printed: the batch's time over a uniform batch of the same tokens at the same rate
(the model gave 205 us for bench_attention.py's variable-length batch in request order, measured
199-204 us; LPT 160 us, measured 174 us against 173 us for the uniform batch). No GPU.
"""
import argparse
import heapq
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kimi_ops.kernels.sm90 import _split_cap, one_wave_splits  # noqa: E402

TAIL_CLASSES = 4  # csrc: kTailClasses


def work_items(lens, waves, order):
    """Tokens of every CTA in launch order."""
    cap = _split_cap(len(lens), sum(lens))
    balanced = -(-sum(lens) // (waves * len(lens) * one_wave_splits(len(lens), 1, 12, sum(lens))))
    classes = [[] for _ in range(TAIL_CLASSES + 1)]  # lpt: whole chunks, then tails >= 3/4, ...
    in_request_order = []
    for n in lens:
        chunk = -(-max(-(-n // cap), balanced) // 64) * 64
        splits = [min(chunk, n - k * chunk) for k in range(-(-n // chunk))]
        in_request_order += splits
        for tokens in splits:
            q = chunk // 4
            cls = 0 if tokens == chunk else 1 + (tokens < 3 * q) + (tokens < 2 * q) + (tokens < q)
            classes[cls].append(tokens)
    return in_request_order if order == "request" else sum(classes, [])


def batch_us(items, slots, cta_us, tile_us):
    finish = [0.0] * slots
    for tokens in items:
        heapq.heappush(finish, heapq.heappop(finish) + cta_us + math.ceil(tokens / 64) * tile_us)
    return max(finish)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--waves", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--slots", type=int, default=264)
    ap.add_argument("--cta-us", type=float, default=2.0)
    ap.add_argument("--tile-us", type=float, default=3.3)
    args = ap.parse_args()
    batches = []
    for seed, sigma in [(0, 0.8)] + [(s, g) for s in (1, 2, 3) for g in (0.5, 0.8, 1.2)]:
        torch.manual_seed(seed)  # seed 0, sigma 0.8: bench_attention.py's variable-length batch
        lens = torch.distributions.LogNormal(math.log(8192), sigma).sample((64,)).clamp(16, 65536).long().tolist()
        batches.append((f"b64 log-normal ~8k, seed {seed}, sigma {sigma}", lens))
    for name, lens in batches:
        uniform = [sum(lens) // 64] * 64
        line = []
        for waves in args.waves:
            times = {order: batch_us(work_items(lens, waves, order), args.slots, args.cta_us, args.tile_us)
                     for order in ("request", "lpt")}
            ref = batch_us(work_items(uniform, waves, "lpt"), args.slots, args.cta_us, args.tile_us)
            line.append(f"waves {waves}: request {times['request']:.0f} us ({times['request'] / ref:.2f}x), "
                        f"lpt {times['lpt']:.0f} us ({times['lpt'] / ref:.2f}x), uniform {ref:.0f} us")
        print(f"{name:40s} {sum(lens):7d} tokens  " + "; ".join(line))


if __name__ == "__main__":
    main()
