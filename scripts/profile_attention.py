"""One mla_decode_splitkv launch on a representative memory-bound shape, for Nsight Compute.

    ncu --kernel-name regex:_split_kv_kernel --launch-skip 2 --launch-count 1 --set full \\
        --clock-control none python3 scripts/profile_attention.py [--batch 32 --context 8192]

Three launches: two warm-ups (compilation, caches) and the profiled one. The script's own tree
comes first on sys.path, so run from a copy of the repository it profiles that copy's build.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kimi_ops  # noqa: E402
from kimi_ops import dispatch  # noqa: E402
from kimi_ops.workloads import decode_workload  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--qlen", type=int, default=1)
    parser.add_argument("--heads", type=int, default=12)
    args = parser.parse_args()
    work = decode_workload([args.context] * args.batch, heads=args.heads, qlen=args.qlen, device="cuda")
    splits = dispatch.default_num_splits(args.batch, work.q.shape[0], args.heads, work.num_tokens, work.q.device)
    for _ in range(3):
        kimi_ops.mla_decode_splitkv(*work.decode_args(), num_splits=splits, **work.decode_kwargs())
    torch.cuda.synchronize()
    print(f"batch {args.batch} context {args.context} qlen {args.qlen} heads {args.heads} splits {splits}")


if __name__ == "__main__":
    main()
