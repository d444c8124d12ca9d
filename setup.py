"""Build script: packaging metadata lives in pyproject.toml; this adds kimi_ops._C.

kimi_ops._C (csrc/) is built when torch is importable at build time (install
with ``--no-build-isolation`` so the build sees your torch) and either
  * torch is a CUDA build and nvcc (CUDA_HOME) exists: csrc/*.cpp + csrc/*.cu + csrc/sm90/*.cu,
    device code for sm_90a (Hopper), or
  * torch is a ROCm build and ROCM_HOME exists: csrc/*.cpp only (the Hopper
    kernels have no AMD counterpart; AMD runs the Triton kernels).
Otherwise the package is pure Python (+ Triton). KIMI_OPS_NO_EXTENSION=1
skips the extension.
"""

import glob
import os
import shlex
import shutil

from setuptools import setup


def cuda_toolkit_root():
    """The CUDA toolkit's root. torch guesses it from nvcc's path, which is wrong
    where nvcc is a wrapper script or a link in /usr/local/bin."""
    nvcc = shutil.which("nvcc")
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []
    for root in candidates + ["/usr/local/cuda"]:
        if os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")):
            return root
    return None


def extension_modules():
    if os.environ.get("KIMI_OPS_NO_EXTENSION") == "1":
        return [], {}
    toolkit = cuda_toolkit_root()
    if toolkit and "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ:
        os.environ["CUDA_HOME"] = toolkit
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, ROCM_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        return [], {}
    cpp = sorted(glob.glob("csrc/*.cpp"))
    cxx = ["-O3"]
    if torch.version.cuda and CUDA_HOME:
        nvcc = ["-O3", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr"]
        nvcc += shlex.split(os.environ.get("KIMI_OPS_NVCC_FLAGS", ""))  # extra flags for A/B builds
        ext = CUDAExtension("kimi_ops._C", cpp + sorted(glob.glob("csrc/*.cu") + glob.glob("csrc/sm90/*.cu")),
                            extra_compile_args={"cxx": cxx, "nvcc": nvcc})
    elif torch.version.hip and ROCM_HOME:
        ext = CppExtension("kimi_ops._C", cpp, extra_compile_args={"cxx": cxx})
    else:
        return [], {}
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=False)}


ext_modules, cmdclass = extension_modules()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
