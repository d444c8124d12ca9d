"""Triton kernels of kimi_ops (portable: H200, gfx950, gfx942, and ``TRITON_INTERPRET=1`` on CPU).

Each kernels module may expose ``CROSS_COMPILE_SPECS``: a list of dicts naming every kernel variant its
host launcher can launch (keys: ``name``, ``kernel`` (the ``triton.jit`` function),
``signature`` ({arg: triton type string such as ``"*bf16"``, ``"i32"``, ``"fp32"``,
or ``"constexpr"``}), ``constexprs`` ({arg: value}), ``num_warps``, ``num_stages``,
optional ``targets`` (subset of ``{"gfx950", "gfx942", "sm90"}``)), so that ``scripts/cross_compile.py`` compiles them all for
gfx950 / gfx942 / sm90 without a GPU.  Modules are listed in
``CROSS_COMPILE_MODULES`` below (missing ones are skipped).
"""

import os


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``: CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def native_fnuz() -> bool:
    """Whether a Triton kernel can take an e4m3fnuz tensor as such: on ROCm, and in an
    interpreter that knows the type (Triton 3.8's does, 3.6's raises "fail to convert fp8e4b8
    to ir type"). Elsewhere the launchers pass its bytes as uint8 and the kernels decode them."""
    import torch

    if torch.version.hip is not None:
        return True
    if not interpreting():
        return False
    from triton.runtime import interpreter

    return hasattr(interpreter.InterpreterBuilder, "get_fp8e4b8_ty")


CROSS_COMPILE_MODULES = (
    "kimi_ops.kernels.attention",
    "kimi_ops.kernels.triton_m1c",
    "kimi_ops.kernels.cache",
    "kimi_ops.kernels.mxfp4",
    "kimi_ops.kernels.query",
)
