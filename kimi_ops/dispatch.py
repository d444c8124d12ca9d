"""Which implementation serves an op call: the backend table and the override.

``KIMI_OPS_BACKEND`` (read at every call, so tests and scripts may change it):

==========  ====================================================================
auto        the default. CPU tensors: ``reference``. CUDA / ROCm tensors: ``cuda``
            where the op has a csrc kernel, ``kimi_ops._C`` is built and the
            device is sm_90; else ``triton``; else ``reference``.
reference   the pure-torch reference (:mod:`kimi_ops.reference`), on any device.
triton      the Triton kernels (:mod:`kimi_ops.kernels`). On CPU tensors this
            needs ``TRITON_INTERPRET=1`` in the environment before kimi_ops is
            first used (Triton's interpreter then runs the kernels on the CPU).
cuda        the Hopper kernels of ``kimi_ops._C``; CUDA tensors only.
==========  ====================================================================

An op with no kernel of the forced backend runs the next one in the order
cuda -> triton -> reference (``mxfp4_quantize`` / ``mxfp4_dequantize`` are plain
torch code on every device). A forced backend that the op has a kernel for but
that cannot run here raises a ``RuntimeError`` saying why.
"""

import functools
import importlib
import importlib.util
import os
from collections.abc import Callable

import torch

from .device import compute_capability, device_index, multiprocessor_count

BACKENDS = ("auto", "reference", "triton", "cuda")
ENV_VAR = "KIMI_OPS_BACKEND"

# op -> backend -> "module:function" (imported on first use, so Triton and the
# extension load only when a call needs them).
IMPLEMENTATIONS: dict[str, dict[str, str]] = {
    "mla_decode_splitkv": {
        "reference": "kimi_ops.reference.attention:mla_decode_splitkv",
        "triton": "kimi_ops.kernels.triton_m1c:mla_decode_splitkv",
        "cuda": "kimi_ops.kernels.sm90:mla_decode_splitkv",
    },
    "mla_merge": {
        "reference": "kimi_ops.reference.attention:mla_merge",
        "triton": "kimi_ops.kernels.triton_m1c:mla_merge",
        "cuda": "kimi_ops.kernels.sm90:mla_merge",
    },
    "mla_cache_write": {
        "reference": "kimi_ops.reference.attention:mla_cache_write",
        "triton": "kimi_ops.kernels.cache:mla_cache_write",
    },
    "mla_norm_cache_write": {
        "reference": "kimi_ops.reference.attention:mla_norm_cache_write",
        "triton": "kimi_ops.kernels.pre_norm:mla_norm_cache_write",
    },
    "mla_norm_cache_write_q_b": {
        "reference": "kimi_ops.reference.attention:mla_norm_cache_write_q_b",
        "triton": "kimi_ops.kernels.pre_norm:mla_norm_cache_write_q_b",
        "cuda": "kimi_ops.kernels.sm90_gemv:mla_norm_cache_write_q_b",
    },
    "mxfp4_quantize": {"reference": "kimi_ops.reference.mxfp4:mxfp4_quantize"},
    "mxfp4_dequantize": {"reference": "kimi_ops.reference.mxfp4:mxfp4_dequantize"},
    "bmm_a16wfp4": {
        "reference": "kimi_ops.reference.mxfp4:bmm_a16wfp4",
        "triton": "kimi_ops.kernels.mxfp4:bmm_a16wfp4",
    },
    "mla_query": {
        "reference": "kimi_ops.reference.mxfp4:mla_query",
        "triton": "kimi_ops.kernels.query:mla_query",
    },
    "gemm_a16w8_block": {
        "reference": "kimi_ops.reference.fp8:gemm_a16w8_block",
        "triton": "kimi_ops.kernels.fp8_gemm:gemm_a16w8_block",
        "cuda": "kimi_ops.kernels.sm90_gemv:gemm_a16w8_block",
    },
    "mla_v_up_proj": {
        "reference": "kimi_ops.reference.mxfp4:mla_v_up_proj",
        "triton": "kimi_ops.kernels.up_proj:v_up_proj",
    },
    "gemm_a16w16": {
        "reference": "kimi_ops.reference.linear:gemm_a16w16",
        "cuda": "kimi_ops.kernels.sm90_gemv:gemm_a16w16",
    },
}

_FALLBACK_ORDER = ("cuda", "triton", "reference")


def requested_backend() -> str:
    """The backend ``KIMI_OPS_BACKEND`` asks for (``auto`` when unset)."""
    name = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if name not in BACKENDS:
        raise RuntimeError(f"kimi_ops: {ENV_VAR} must be one of {', '.join(BACKENDS)}, got {name!r}")
    return name


@functools.cache
def _load(target: str) -> Callable:
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


@functools.cache
def triton_unavailable_reason() -> str | None:
    """None if Triton is installed, else why not. (Looked up, not imported: importing
    Triton freezes TRITON_INTERPRET's meaning for the process.)"""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    return None


@functools.cache
def cuda_extension_unavailable_reason() -> str | None:
    """None if kimi_ops._C (the csrc kernels) is importable, else why not."""
    try:
        importlib.import_module("kimi_ops._C")
    except ImportError as exc:
        return f"kimi_ops._C is not built ({exc}); reinstall with a CUDA torch and nvcc present"
    return None


def unavailable_reason(backend: str, device: torch.device) -> str | None:
    if backend == "reference":
        return None
    if backend == "triton":
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            return "the triton backend on CPU tensors needs TRITON_INTERPRET=1 set before kimi_ops is used"
        if device.type not in ("cpu", "cuda"):
            return f"no Triton backend for {device.type} tensors"
        return triton_unavailable_reason()
    if backend == "cuda":
        if device.type != "cuda" or torch.version.hip is not None or not torch.cuda.is_available():
            return "the cuda backend needs CUDA tensors on an NVIDIA GPU"
        if compute_capability(device_index(device)) != (9, 0):
            return "the cuda backend's kernels are built for sm_90 (Hopper) only"
        return cuda_extension_unavailable_reason()
    raise AssertionError(backend)


def backend_for(op: str, device: torch.device) -> str:
    """The backend that serves ``op`` on ``device`` under the current override."""
    available = IMPLEMENTATIONS[op]
    requested = requested_backend()
    if requested == "auto":
        candidates = ("reference",) if device.type == "cpu" else _FALLBACK_ORDER
        for backend in candidates:
            if backend in available and unavailable_reason(backend, device) is None:
                return backend
        return "reference"
    if requested == "cuda" and (device.type != "cuda" or torch.version.hip is not None):
        raise RuntimeError(f"kimi_ops.{op}: {ENV_VAR}=cuda cannot run here: it needs CUDA tensors "
                           f"on an NVIDIA GPU, got {device.type} tensors")
    for backend in _FALLBACK_ORDER[_FALLBACK_ORDER.index(requested):]:
        if backend in available:
            reason = unavailable_reason(backend, device)
            if reason is not None:
                raise RuntimeError(f"kimi_ops.{op}: {ENV_VAR}={requested} cannot run here: {reason}")
            return backend
    return "reference"


def implementation(op: str, device: torch.device) -> Callable:
    """The function that computes ``op`` for tensors on ``device``."""
    return _load(IMPLEMENTATIONS[op][backend_for(op, device)])


def default_num_splits(num_requests: int, num_rows: int, num_heads: int, num_indices: int,
                       device: torch.device) -> int:
    """A split count from shapes and the device alone (never device data).

    GPU tensors: the heuristic of the kernel that will run, with ``num_indices / num_requests``
    as a request's length (a fixed-capacity index buffer overestimates it, which only adds
    splits): :func:`kimi_ops.kernels.sm90.suggest_num_splits` for the ``cuda`` backend (one wave of
    CTAs), :func:`kimi_ops.kernels.triton_m1c.suggest_num_splits` for Triton (NVIDIA's first
    generation: the tiles spread evenly over waves of one program a multiprocessor, splits of at
    least 128 tokens, at most 256; AMD's second: about four programs a multiprocessor, splits of
    at least 256 tokens, at most 64).
    CPU tensors: 1 (the reference gains nothing from splitting).
    """
    if device.type != "cuda" or num_requests == 0:
        return 1
    if backend_for("mla_decode_splitkv", device) == "cuda":
        from .kernels.sm90 import suggest_num_splits
        return suggest_num_splits(num_requests, max(1, num_rows // num_requests), num_heads, num_indices,
                                  multiprocessor_count(device_index(device)))
    from .kernels.triton_m1c import arch_of, suggest_num_splits
    return suggest_num_splits(num_requests, max(1, num_rows // num_requests), num_heads, num_indices,
                              multiprocessor_count(device_index(device)), arch=arch_of(device))
