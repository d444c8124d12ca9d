"""Triton kernels of kimi_ops (portable: H200, gfx950, gfx942, and ``TRITON_INTERPRET=1`` on CPU).

Each kernels module may expose ``CROSS_COMPILE_SPECS``: a list of dicts naming every kernel variant its
host launcher can launch (keys: ``name``, ``kernel`` (the ``triton.jit`` function),
``signature`` ({arg: triton type string such as ``"*bf16"``, ``"i32"``, ``"fp32"``,
or ``"constexpr"``}), ``constexprs`` ({arg: value}), ``num_warps``, ``num_stages``,
optional ``targets`` (subset of ``{"gfx950", "gfx942", "sm90", "sm80"}``; absent: all), optional
``divisible_16`` (the integer arguments that are multiples of 16 at the shapes the variant runs:
Triton's JIT specializes those at launch, and the compile differs)), so that
``scripts/cross_compile.py`` compiles them all for gfx950 / gfx942 / sm90 / sm80 without a GPU.
Modules are listed in ``CROSS_COMPILE_MODULES`` below (missing ones are skipped).
"""

import os


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``: CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


CROSS_COMPILE_MODULES = (
    "kimi_ops.kernels.attention",
    "kimi_ops.kernels.triton_m1c",
    "kimi_ops.kernels.cache",
    "kimi_ops.kernels.pre_norm",
    "kimi_ops.kernels.fp8_gemm",
    "kimi_ops.kernels.mxfp4",
    "kimi_ops.kernels.query",
)


def mxfp4_paths(decode_kind: str, dot_scaled_kind: str | None):
    """The MXFP4 kernels' launch paths for the cross-compile registry: (DOT_SCALED, kind, amd,
    targets) for the in-register decode with NVIDIA's config (sm90), the decode with AMD's config
    (gfx950, gfx942; the launchers pass ``amd=`` on ROCm) and, where the kernel has it, gfx950's
    tl.dot_scaled path (AMD's config)."""
    paths = [(False, decode_kind, False, ("sm90",)), (False, decode_kind, True, ("gfx950", "gfx942"))]
    if dot_scaled_kind is not None:
        paths.append((True, dot_scaled_kind, True, ("gfx950",)))
    return paths
