"""Build script: packaging metadata lives in pyproject.toml; this adds kimi_ops._C.

kimi_ops._C (csrc/) is built when torch is importable at build time (install
with ``--no-build-isolation`` so the build sees your torch) and either
  * torch is a CUDA build and nvcc (CUDA_HOME) exists: csrc/*.cpp + csrc/*.cu + csrc/sm90/*.cu,
    device code for sm_90a (Hopper), or
  * torch is a ROCm build and ROCM_HOME exists: csrc/*.cpp only (the Hopper
    kernels have no AMD counterpart; AMD runs the Triton kernels).
Otherwise the package is pure Python (+ Triton). KIMI_OPS_NO_EXTENSION=1
skips the extension. The build prints one line saying which and why
(``kimi_ops setup: building ...`` / ``skipping ...``; pip shows it with ``-v``).
"""

import glob
import os
import shlex
import shutil
import sys

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


class BuildPlan:
    """What the build does about kimi_ops._C and why: ``kind`` is "cuda", "rocm" or None (skip);
    ``message`` the one line the build prints (tests/test_build.py reads the same plan)."""

    def __init__(self, kind, message):
        self.kind, self.message = kind, message

    @property
    def builds(self):
        return self.kind is not None


def build_plan():
    if os.environ.get("KIMI_OPS_NO_EXTENSION") == "1":
        return BuildPlan(None, "skipping kimi_ops._C: KIMI_OPS_NO_EXTENSION=1 (pure Python + Triton)")
    toolkit = cuda_toolkit_root()
    if toolkit and "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ:
        os.environ["CUDA_HOME"] = toolkit
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, ROCM_HOME
    except ImportError as exc:
        return BuildPlan(None, f"skipping kimi_ops._C: torch is not importable at build time ({exc}); "
                               "install torch first and pip install with --no-build-isolation")
    if torch.version.cuda:
        nvcc = os.path.join(CUDA_HOME, "bin", "nvcc") if CUDA_HOME else None
        if nvcc and os.path.isfile(nvcc):
            return BuildPlan("cuda", f"building kimi_ops._C for sm_90a with nvcc at {nvcc} (torch {torch.__version__}, "
                                     f"CUDA {torch.version.cuda}): the Hopper kernels, about a minute on 2 cores; "
                                     "KIMI_OPS_NO_EXTENSION=1 skips it")
        return BuildPlan(None, f"skipping kimi_ops._C: torch {torch.__version__} is a CUDA build but no nvcc was "
                               "found (not on PATH, no /usr/local/cuda, CUDA_HOME unset)")
    if torch.version.hip:
        if ROCM_HOME:
            return BuildPlan("rocm", f"building kimi_ops._C (host code only) for ROCm at {ROCM_HOME} "
                                     f"(torch {torch.__version__})")
        return BuildPlan(None, f"skipping kimi_ops._C: torch {torch.__version__} is a ROCm build but ROCM_HOME "
                               "was not found")
    return BuildPlan(None, f"skipping kimi_ops._C: torch {torch.__version__} is a CPU build (no CUDA, no ROCm)")


# nvcc's flags for csrc/ (tests/test_sm90_resources.py compiles the kernels with the same). C++20 for
# both compilers whatever torch's build helper would pick (torch 2.11's picks C++17; torch 2.14's
# headers require C++20): one language level for every supported torch.
CXX_STD = "-std=c++20"
NVCC_FLAGS = ["-O3", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr", CXX_STD]


def extension_modules():
    plan = build_plan()
    print(f"kimi_ops setup: {plan.message}", file=sys.stderr, flush=True)
    if not plan.builds:
        return [], {}
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    cpp = sorted(glob.glob("csrc/*.cpp"))
    cxx = ["-O3", CXX_STD]
    if plan.kind == "cuda":
        nvcc = NVCC_FLAGS + shlex.split(os.environ.get("KIMI_OPS_NVCC_FLAGS", ""))  # extra flags for A/B builds
        ext = CUDAExtension("kimi_ops._C", cpp + sorted(glob.glob("csrc/*.cu") + glob.glob("csrc/sm90/*.cu")),
                            extra_compile_args={"cxx": cxx, "nvcc": nvcc})
    else:
        ext = CppExtension("kimi_ops._C", cpp, extra_compile_args={"cxx": cxx})
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=False)}


if __name__ == "__main__":   # setuptools' build backend runs this file as __main__; tests import it
    ext_modules, cmdclass = extension_modules()
    setup(ext_modules=ext_modules, cmdclass=cmdclass)
