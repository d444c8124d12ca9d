"""Pure-torch reference for ``gemm_a16w16``: a bf16 projection, ``y = x @ w^T``.

x ``[M, K]`` bf16, w ``[N, K]`` bf16 -> y ``[M, N]`` bf16 with float32 accumulation: torch's own
bf16 ``F.linear`` (cuBLAS on a GPU, which accumulates in float32; the CPU's bf16 GEMM likewise).
It is also what the op runs wherever the ``cuda`` backend's small-M kernel does not
(:mod:`kimi_ops.kernels.sm90_gemv`). The tests' oracle is float64 (tests/test_gemv.py).
"""

import torch
import torch.nn.functional as F


def gemm_a16w16(x: torch.Tensor, w: torch.Tensor, *, constant_w: bool = False) -> torch.Tensor:
    """``x [M, K]`` bf16 @ ``w [N, K]^T`` bf16 -> bf16 ``[M, N]`` (``constant_w``, a launch hint
    for the sm_90 kernel, changes nothing here)."""
    return F.linear(x, w)
