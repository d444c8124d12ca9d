"""Every bad flag of ``python -m kimi_ops demo``: one line on stderr saying what is wrong, exit 2,
before any work (issue 30: --batch 0 / --context 0 / --splits 0 silently became defaults,
--qlen 9 was accepted, --device cuda without a GPU, --device bogus, --block-size 0 and
--attention-only --batch -1 ended in tracebacks, --dcp N ran other defaults than --help said)."""

import contextlib
import io
import os
import re
import subprocess
import sys
import time

import pytest
import torch

from kimi_ops import demo
from kimi_ops.demo_dcp import dcp_options

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _int_flag(flags, rule):
    """(flags, the line that refuses them) for an integer flag whose value (the last word) breaks
    ``rule`` (">= 1", "1..8")."""
    flag, got = flags[-2:]
    return flags, rf"argument {flag}: must be {rule}, got {got}"


# (flags, a regex the one stderr line must match)
BAD_FLAGS = [_int_flag(flags, ">= 1") for flags in (
    ["--batch", "0"], ["--context", "0"], ["--block-size", "0"], ["--steps", "0"], ["--dcp", "0"],
    ["--check-every", "0"], ["--attention-only", "--batch", "-1"], ["--attention-only", "--repeats", "0"])]
BAD_FLAGS += [_int_flag(["--qlen", "9"], "1..8"), _int_flag(["--qlen", "0"], "1..8"),
              _int_flag(["--attention-only", "--splits", "0"], "1..65535"),
              _int_flag(["--attention-only", "--heads", "0"], "1..128")]
BAD_FLAGS += [
    (["--device", "bogus"], r"argument --device: must be cpu, cuda or cuda:N, got 'bogus'"),
    (["--device", "mps"], r"argument --device: must be cpu, cuda or cuda:N, got 'mps'"),
    (["--batch", "two"], r"argument --batch: expected an integer, got 'two'"),
    (["--attention-only", "--dcp", "2"], r"argument --dcp: --attention-only runs one process"),
    (["--weights", "int4"], r"argument --weights: invalid choice: 'int4'"),
]
if not torch.cuda.is_available():
    BAD_FLAGS.append((["--device", "cuda"], r"argument --device: cuda was asked for but no CUDA GPU is visible"))
    BAD_FLAGS.append((["--device", "cuda:0", "--dcp", "2"], r"argument --device: cuda:0 was asked for"))
elif torch.cuda.device_count() < 8:
    BAD_FLAGS.append((["--device", "cuda", "--dcp", "8"], r"argument --dcp: 8 ranks on --device cuda need 8 GPUs"))


def _check_refused(flags, message, returncode, out, err):
    lines = err.strip().splitlines()
    ok = (returncode == 2 and out == "" and len(lines) == 1
          and re.search(message, lines[0]) and lines[0].startswith("python -m kimi_ops demo: error: "))
    assert ok, (flags, returncode, out[-500:], err[-1500:])


def test_a_bad_flag_on_the_command_line():
    # the real entry point, in a fresh Python: one line on stderr, exit 2, before any work
    flags, message = BAD_FLAGS[0]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kimi_ops", "demo", *flags], env=env,
                          capture_output=True, text=True, timeout=300)
    _check_refused(flags, message, proc.returncode, proc.stdout, proc.stderr)
    assert time.perf_counter() - start < 60, "refused after the work, not before"


@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_every_bad_flag_says_what_is_wrong_in_one_line_and_exits_2(monkeypatch, flags, message):
    # in this process (what __main__ runs, with stderr captured): refused before the demo starts
    from kimi_ops import __main__ as cli

    def no_work(*_):
        raise AssertionError(f"{flags}: accepted, the demo started")
    monkeypatch.setattr(demo, "run_demo", no_work)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        cli.main(["demo", *flags])
    _check_refused(flags, message, exit_.value.code, out.getvalue(), err.getvalue())


def _parse(*flags):
    from kimi_ops.__main__ import Parser
    parser = Parser(prog="python -m kimi_ops demo")
    demo.add_arguments(parser)
    args = parser.parse_args(list(flags))
    demo.check_arguments(parser, args)
    return parser, args


HELP = ("decode requests (default 8; --attention-only: 4; --dcp: 4)",
        "about this many cached tokens a request (default 512; --attention-only: 300; --dcp: 256)",
        "decode steps (default 32; --dcp: 8)")


@pytest.mark.parametrize("job,flags,expected", [
    ("layer", [], (8, 512, 32)),
    ("attention", ["--attention-only"], (4, 300, 32)),
    ("dcp", ["--dcp", "2"], (4, 256, 8)),
])
def test_defaults_are_what_help_says(job, flags, expected):
    parser, args = _parse(*flags)
    text = " ".join(parser.format_help().split())
    for line in HELP:
        assert line in text, (line, text)
    assert demo.mode(args) == job
    if job == "dcp":
        opts = dcp_options(args)                       # what run_dcp_demo runs
        assert (opts["batch"], opts["context"], opts["steps"], opts["block"]) == expected + (16,)
    else:
        demo.apply_defaults(args, job)                 # what run_layer_demo / run_attention_demo run
        assert (args.batch, args.context, args.steps) == expected


def test_dcp_takes_the_flags_given():
    _, args = _parse("--dcp", "2", "--steps", "20", "--batch", "3", "--block-size", "64", "--context", "99")
    opts = dcp_options(args)
    assert (opts["batch"], opts["context"], opts["steps"], opts["block"]) == (3, 99, 20, 64)


def test_good_flags_parse():
    _, args = _parse("--batch", "2", "--context", "5", "--qlen", "8", "--device", "cpu", "--block-size", "1",
                     "--attention-only", "--splits", "65535", "--heads", "128")
    assert (args.batch, args.context, args.qlen, args.device, args.block_size, args.splits, args.heads) == \
        (2, 5, 8, "cpu", 1, 65535, 128)
