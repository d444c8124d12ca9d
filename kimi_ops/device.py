"""Facts about the GPU a call runs on, shared by the dispatcher and the kernels' host code."""

import functools

import torch


@functools.cache
def multiprocessor_count(device_index: int) -> int:
    """The streaming multiprocessors (CUDA) / compute units (ROCm) of GPU ``device_index``."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def compute_capability(device_index: int) -> tuple[int, int]:
    """(major, minor) of GPU ``device_index`` (ROCm reports its own numbering: check
    ``torch.version.hip`` first)."""
    return torch.cuda.get_device_capability(device_index)


def device_index(device: torch.device) -> int:
    """``device``'s index, the current device where it names none."""
    return device.index if device.index is not None else torch.cuda.current_device()


def is_sm90(device: torch.device) -> bool:
    """Whether ``device`` is an NVIDIA GPU of compute capability 9.0 (H100 / H200: the cuda
    backend's and the Hopper-only Triton configs' target)."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return compute_capability(device_index(device)) == (9, 0)
