"""fp8 tl.dot GEMM at M = 16 / 32 (where the layer's fp8 step is slowest against its floor):
configs x the transposed form, each projection alone (bench_layer.time_calls: 24 calls a graph).
    python3 exp/s33_sweep.py [deadline_s]"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import bench_layer as B  # noqa: E402
from kimi_ops.kernels import fp8_gemm  # noqa: E402
from kimi_ops.reference.fp8 import quantize_fp8_blocks  # noqa: E402

deadline = float(sys.argv[1]) if len(sys.argv) > 1 else 200
start = time.time()
CONFIGS = {
    16: [None, (16, 64, 128, 2, 4, 6), (16, 128, 128, 2, 4, 4), (16, 128, 128, 4, 8, 4), (16, 64, 128, 4, 4, 6)],
    32: [None, (32, 128, 128, 4, 4, 4), (32, 128, 128, 4, 8, 4), (32, 64, 128, 2, 4, 6), (64, 128, 128, 4, 8, 4)],
}
for name, n, k in B.FP8_GEMM_SHAPES:
    ws = [quantize_fp8_blocks(torch.randn(n, k, device="cuda") / k ** 0.5) for _ in range(B._weight_copies(n * k))]
    for m, cfgs in CONFIGS.items():
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        for cfg in cfgs:
            c = cfg or fp8_gemm.gemm_config(m, n, k, 128, 132)
            cells = []
            for swap in (False, True):
                if time.time() - start > deadline:
                    print("deadline"); sys.exit(0)
                try:
                    t = B.time_calls(lambda i, c=c, swap=swap: (lambda w=ws[i][0], s=ws[i][1]: fp8_gemm.gemm_a16w8_block(
                        x, w, s, config=c, gemv=False, swap=swap)), len(ws))
                    cells.append(f"{t * 1e6:7.2f}")
                except Exception as exc:  # noqa: BLE001
                    cells.append(type(exc).__name__)
            print(f"{name:11s} M {m:3d} {'default ' if cfg is None else '        '}{','.join(map(str, c)):22s} plain / swap us: {' / '.join(cells)}", flush=True)
