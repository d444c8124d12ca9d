#!/usr/bin/env python3
"""CPU model of how evenly the cuda backend's split-KV grid spreads a batch over the SMs.

    python3 scripts/split_model.py [--splits 12 16 18 24] [--balance 1.0 0.9] [--slots 264]

Each request of n tokens is cut the way ``splitkv_kernel`` cuts it: chunks of
max(ceil(n / S), ceil(all tokens / balance_ctas)) rounded up to 64, at most S of them
(balance_ctas = factor x requests x ``hopper.one_wave_splits``). The CTAs are placed greedily on
``--slots`` CTA slots (264 = 132 SMs x 2 CTAs), and the batch takes as long as the slot that got
the most tokens. Printed: that over the ideal (all tokens / slots). No GPU; the batches are
bench_attention.py's variable-length one (64 requests, log-normal around 8k) and a uniform
32 x 32k. (It reproduced the measured 1.8x of the variable-length batch at S = 12.)
"""
import argparse
import heapq
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kimi_ops.hopper import one_wave_splits, suggest_num_splits  # noqa: E402


def chunk_tokens(lens, splits, balance_ctas):
    """Tokens of every non-empty CTA, as the kernel cuts the requests."""
    total = sum(lens)
    out = []
    for n in lens:
        per = max(-(-n // splits), -(-total // balance_ctas))
        chunk = -(-per // 64) * 64
        out += [min(chunk, n - k * chunk) for k in range(splits) if k * chunk < n]
    return out


def makespan_ratio(lens, splits, balance_ctas, slots):
    loads = [0] * slots
    for tokens in chunk_tokens(lens, splits, balance_ctas):
        heapq.heappush(loads, heapq.heappop(loads) + tokens)
    return max(loads) / (sum(lens) / slots)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--splits", type=int, nargs="+", default=[12, 16, 18, 20, 24])
    ap.add_argument("--balance", type=float, nargs="+", default=[1.0, 0.9])
    ap.add_argument("--slots", type=int, default=264)
    args = ap.parse_args()
    torch.manual_seed(0)  # bench_attention.py's variable-length batch
    varlen = torch.distributions.LogNormal(math.log(8192), 0.8).sample((64,)).clamp(16, 65536).long().tolist()
    for name, lens in (("varlen b64 ~8k", varlen), ("uniform b32 32k", [32768] * 32)):
        wave = one_wave_splits(len(lens), 1, 12, sum(lens))
        print(f"{name}: {sum(lens)} tokens, one-wave splits {wave}, "
              f"suggest_num_splits {suggest_num_splits(len(lens), 1, 12, sum(lens))}")
        for s in args.splits:
            for f in args.balance:
                bal = max(1, int(f * len(lens) * wave))
                print(f"  S {s:3d}  balance_ctas {bal:4d} ({f:.2f}): "
                      f"{len(chunk_tokens(lens, s, bal)):4d} CTAs, "
                      f"slowest slot / ideal {makespan_ratio(lens, s, bal, args.slots):.2f}")


if __name__ == "__main__":
    main()
