"""Every entry point in scripts/ answers --help with a usage text and does nothing else (CPU, no GPU).

scripts/ holds what a user or maintainer runs (docs/perf-history.md lists the experiments that
left it and the commit that last held each). A Python script must parse its arguments with
argparse under ``if __name__ == "__main__":`` (its help: ``usage:`` and its description); a shell
script must answer -h / --help before it does any work, by printing its header comment. Both are
checked in the source first, so a new script without --help fails here without being run (a shell
script that ignored --help would start building or benchmarking).
"""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SCRIPTS = os.path.join(ROOT, "scripts")
KINDS = {".py": "python", ".sh": "shell"}
HELP_TEST = re.compile(r'^if \[ "\$\{1:-\}" = "-h" \] \|\| \[ "\$\{1:-\}" = "--help" \]; then')


def entries():
    return sorted(f for f in os.listdir(SCRIPTS) if os.path.isfile(os.path.join(SCRIPTS, f)))


def header_comment(lines):
    """The text of a shell script's leading comment block (shebang skipped), '# ' stripped."""
    out = []
    for line in lines[1:] if lines and lines[0].startswith("#!") else lines:
        if not line.startswith("#"):
            break
        out.append(re.sub(r"^# ?", "", line))
    return out


def test_scripts_are_python_or_shell():
    """Only .py and .sh files: a one-off .cu or notebook belongs on a branch or in history."""
    others = [f for f in entries() if os.path.splitext(f)[1] not in KINDS]
    assert not others, f"scripts/ holds files that are neither .py nor .sh: {others}"


def help_command(name):
    """The argv that asks ``name`` for its help, after checking its source can answer it."""
    path = os.path.join(SCRIPTS, name)
    with open(path) as f:
        src = f.read()
    if name.endswith(".py"):
        assert "ArgumentParser(" in src and re.search(r'^if __name__ == "__main__":', src, re.M), (
            f"scripts/{name}: no argparse parser under `if __name__ == \"__main__\":`, so --help would run it")
        return [sys.executable, path, "--help"]
    lines = src.splitlines()
    body = [line for line in lines if line.strip() and not line.startswith("#")]
    # the help test may follow `set -uo pipefail`, nothing else
    first = body[1] if body and body[0].startswith("set ") and len(body) > 1 else (body[0] if body else "")
    assert HELP_TEST.match(first), (
        f"scripts/{name}: the first command is not the -h / --help test (found {first!r}); add\n"
        '  if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n \'2,/^set -uo/p\' "$0" '
        "| sed '$d; s/^# \\{0,1\\}//'; exit 0; fi")
    return ["bash", path, "--help"]


@pytest.mark.parametrize("name", [f for f in entries() if os.path.splitext(f)[1] in KINDS])
def test_help(name, tmp_path):
    cmd = help_command(name)
    env = dict(os.environ, PYTHONPATH=ROOT, KIMI_OPS_NO_EXTENSION="1", OUT=str(tmp_path / "out"))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"scripts/{name} --help: rc {done.returncode}\n{done.stderr[-2000:]}"
    text = done.stdout
    if name.endswith(".py"):
        assert text.startswith("usage: "), text[:500]
        assert "-h, --help" in text and len(text.strip().splitlines()) >= 3, text
    else:
        with open(os.path.join(SCRIPTS, name)) as f:
            want = header_comment(f.read().splitlines())
        assert len(want) >= 2, f"scripts/{name}: a header comment of two lines or more says what it does"
        assert text.splitlines()[: len(want)] == want, text
        assert not (tmp_path / "out").exists(), f"scripts/{name} --help did work (created $OUT)"


def test_sanitize_cuda_runs_each_tool(tmp_path):
    """``sanitize_cuda.py --tools all`` runs the script's own cases under compute-sanitizer once a
    tool, with --error-exitcode so a reported error fails it; a tool's failure fails the whole run.
    A stand-in compute-sanitizer on PATH records its arguments (racecheck "finds" an error)."""
    fake = tmp_path / "bin" / "compute-sanitizer"
    fake.parent.mkdir()
    log = tmp_path / "calls.txt"
    fake.write_text('#!/usr/bin/env bash\necho "$@" >> "%s"\necho "========= ERROR SUMMARY: 0 errors"\n'
                    '[ "$2" = racecheck ] && exit 1\nexit 0\n' % log)
    fake.chmod(0o755)
    env = dict(os.environ, PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=ROOT)
    script = os.path.join(SCRIPTS, "sanitize_cuda.py")
    done = subprocess.run([sys.executable, script, "--tools", "all"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    calls = log.read_text().splitlines()
    assert [c.split()[:4] for c in calls] == [["--tool", t, "--error-exitcode", "1"]
                                             for t in ("memcheck", "racecheck", "synccheck")], calls
    assert all(c.split()[4:] == [sys.executable, os.path.abspath(script), "--cases", "attention,projections"]
               for c in calls), calls
    assert done.returncode == 1, done.stdout + done.stderr
    assert "racecheck: rc=1" in done.stdout and "memcheck: rc=0" in done.stdout, done.stdout
    log.unlink()
    one = subprocess.run([sys.executable, script, "--tools", "memcheck", "--cases", "projections"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert one.returncode == 0 and log.read_text().split()[-2:] == ["--cases", "projections"], one.stdout
    for args, word in ((["--tools", "memcheck,nosuchtool"], "nosuchtool"), (["--cases", "nosuchgroup"], "nosuchgroup")):
        bad = subprocess.run([sys.executable, script, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=120)
        assert bad.returncode == 2 and word in bad.stderr, (args, bad.stderr)
