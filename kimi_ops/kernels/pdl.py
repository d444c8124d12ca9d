"""Programmatic dependent launch (PDL, sm_90+) for the Triton kernels of the decode chain.

With PDL a kernel is launched while the kernel before it on the stream is still running; its
programs then wait (``griddepcontrol.wait``) until that grid has finished and its writes are
visible, so the launch latency and the ramp-up of the next grid overlap the tail of the previous
one. The Hopper kernels (csrc/sm90/) can do the same (``KIMI_OPS_SM90_PDL=1``; off by default:
measured slower there), and so can Inductor's (``torch._inductor.config.triton.enable_pdl``). A
kernel launched with PDL must wait before it reads anything an earlier kernel may write:
:func:`wait_prior_grid` is the first statement of each kernel that takes ``PDL``, or comes right
after the loads of its weights where the caller promises them constant (the ops' ``constant_w``:
:func:`weights_first`). ``KIMI_OPS_PDL=0`` turns it off everywhere (read at each launch; a CUDA
graph keeps what its capture saw).
"""
import functools
import os

import torch
import triton
import triton.language as tl

from ..device import compute_capability, device_index
from . import interpreting

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: PDL stays off
    gdc_wait = gdc_launch_dependents = None


@functools.cache
def _triton_takes_launch_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return gdc_wait is not None and "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def _device_has_pdl(index: int) -> bool:
    return compute_capability(index)[0] >= 9


def pdl_args(device: torch.device) -> dict:
    """The launch keywords of a kernel taking ``PDL``: ``{"PDL": True, "launch_pdl": True}`` on
    an sm_90+ CUDA device whose Triton supports it (unless ``KIMI_OPS_PDL=0``), else
    ``{"PDL": False}`` (ROCm, the interpreter, older GPUs)."""
    on = (device.type == "cuda" and torch.version.hip is None and not interpreting()
          and os.environ.get("KIMI_OPS_PDL", "1") != "0" and _triton_takes_launch_pdl()
          and _device_has_pdl(device_index(device)))
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


def weights_first(constant_w: bool, pdl: dict) -> bool:
    """The ``W_FIRST`` switch of a kernel with a weight operand: load (and decode) the weight tile
    before :func:`wait_prior_grid`, so that its memory round trip overlaps the previous kernel's
    tail. Only when the caller promises that nothing queued before writes the weight
    (``constant_w``), and only where it matters: a PDL launch (``pdl``: :func:`pdl_args`'s
    keywords); and under the interpreter, where the wait is nothing, so the CPU tests run that
    form of the kernel too."""
    return constant_w and (pdl["PDL"] or interpreting())


@triton.jit
def wait_prior_grid(PDL: tl.constexpr):
    """With ``PDL``: wait for the previous grid on the stream (and its memory), then let the next
    grid start launching (its programs wait in turn). Without: nothing."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
