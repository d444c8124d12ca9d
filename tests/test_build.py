"""The build of kimi_ops._C (setup.py): it says what it builds and why, and where nvcc and a CUDA
torch exist the extension must have been built (issue 30: a failed or skipped build fell back
to pure Python silently and CI stayed green). KIMI_OPS_NO_EXTENSION=1 (a CPU-only install, or a
checkout run from PYTHONPATH) opts out of that check, as it opts out of the build."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT, setup_module_of_repo


def build_plan():
    """setup.py's BuildPlan here; the environment it may touch (CUDA_HOME) is restored."""
    saved = dict(os.environ)
    try:
        return setup_module_of_repo().build_plan()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_extension_is_built_where_nvcc_and_a_cuda_torch_exist():
    if os.environ.get("KIMI_OPS_NO_EXTENSION") == "1":
        pytest.skip("KIMI_OPS_NO_EXTENSION=1: the extension is skipped on purpose")
    plan = build_plan()
    if not plan.builds:
        pytest.skip(f"no extension to build here: {plan.message}")
    from kimi_ops import dispatch
    reason = dispatch.cuda_extension_unavailable_reason()
    assert reason is None, (
        f"setup.py would be {plan.message}, but {reason}. The install did not build it (a build "
        f"error, or the install ran without --no-build-isolation); set KIMI_OPS_NO_EXTENSION=1 to "
        f"run without the extension on purpose")


def _setup_line(env):
    r = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [line for line in r.stderr.splitlines() if line.startswith("kimi_ops setup: ")]
    assert len(lines) == 1, r.stderr[-3000:]
    return lines[0]


def test_setup_says_it_skips_on_request():
    line = _setup_line(dict(os.environ, KIMI_OPS_NO_EXTENSION="1"))
    assert line == "kimi_ops setup: skipping kimi_ops._C: KIMI_OPS_NO_EXTENSION=1 (pure Python + Triton)"


def test_setup_says_what_it_builds_and_why():
    env = {k: v for k, v in os.environ.items() if k != "KIMI_OPS_NO_EXTENSION"}
    line = _setup_line(env)
    import torch
    if torch.version.cuda and build_plan().builds:
        assert line.startswith("kimi_ops setup: building kimi_ops._C for sm_90a with nvcc at "), line
        assert f"torch {torch.__version__}, CUDA {torch.version.cuda}" in line, line
    elif not torch.version.cuda and not torch.version.hip:
        assert line == f"kimi_ops setup: skipping kimi_ops._C: torch {torch.__version__} is a CPU build " \
                       f"(no CUDA, no ROCm)", line
    else:
        assert line.startswith("kimi_ops setup: "), line


def test_the_readme_virtual_environment_is_ignored_by_git(tmp_path):
    """The README makes .venv/ in the checkout; the repository's .gitignore (alone: a scratch
    repository, so no local info/exclude hides a missing entry) must ignore it."""
    import shutil
    if shutil.which("git") is None:
        pytest.skip("no git")
    shutil.copy(os.path.join(ROOT, ".gitignore"), tmp_path / ".gitignore")
    env = dict(os.environ, GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True, env=env)
    for path in (".venv/", ".venv/bin/python", ".ci-venv/lib/x.py"):
        r = subprocess.run(["git", "check-ignore", "--no-index", "-q", path], cwd=tmp_path, env=env,
                           capture_output=True)
        assert r.returncode == 0, f"{path} is not ignored by .gitignore"
