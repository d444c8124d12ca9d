#!/usr/bin/env python3
"""Static cost of a kernel's loops, read from its SASS (no GPU needed).

For every loop of the selected kernels (a predicated backward branch spanning at least
--min-size instructions) it prints the instructions of one iteration, the stall cycles ptxas encoded in
their control words (a lower bound on one warp's issue time, before any scoreboard wait), the
instructions that wait on a scoreboard (a variable-latency result: shared / global loads,
MUFU, barriers) and the opcodes with the most stall cycles. docs/PERF.md's session 13 compares
kernel variants this way before a GPU can time them.

Control word (sm_70 and later, the second 64-bit word cuobjdump prints for each instruction):
bits 41-44 stall cycles, 45 yield, 46-48 write scoreboard, 49-51 read scoreboard, 52-57 wait mask.

    python3 -m pip install nvidia-cuda-cuobjdump-cu13 nvidia-nvdisasm-cu13  # if the toolkit lacks them
    nvcc -O3 -gencode=arch=compute_90a,code=sm_90a ... -c csrc/sm90/mla_decode_sm90.cu -o /tmp/m.o
    python3 scripts/sass_loops.py /tmp/m.o --kernel 'splitkv_kernelILi2'

The input is an object / cubin / .so, disassembled with `cuobjdump -sass` ($CUOBJDUMP or PATH;
it runs nvdisasm, also from PATH), or a text file of `cuobjdump -sass` output.
"""

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys

INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\* 0x([0-9a-f]{16}) \*/")
CONTROL = re.compile(r"^\s*/\* 0x([0-9a-f]{16}) \*/\s*$")
FUNCTION = re.compile(r"^\s*Function : (\S+)")
# a loop's back edge is a predicated branch (out-of-line stubs return with an unconditional one)
BRANCH = re.compile(r"^@!?U?P[0-6]\s+BRA(?:\.[A-Z.]+)?\s+(?:[A-Z0-9]+,\s*)?(0x[0-9a-f]+)")


def parse(text):
    """{function: [(address, text, control word)]} from `cuobjdump -sass` output."""
    functions, current, pending = {}, None, None
    for line in text.splitlines():
        m = FUNCTION.match(line)
        if m:
            current = functions.setdefault(m.group(1), [])
            continue
        m = INSTR.match(line)
        if m and current is not None:
            pending = (int(m.group(1), 16), m.group(2))
            continue
        m = CONTROL.match(line)
        if m and pending is not None:
            current.append((pending[0], pending[1], int(m.group(1), 16)))
            pending = None
    return functions


def opcode(text):
    """The mnemonic without predicate or modifiers: '@!P0 LDSM.16.M88.4 R4, [R2]' -> 'LDSM'."""
    words = text.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def loops(instrs, min_size):
    """(first index, last index) of each predicated backward branch spanning >= min_size instructions."""
    index = {addr: i for i, (addr, _, _) in enumerate(instrs)}
    found = []
    for i, (_, text, _) in enumerate(instrs):
        m = BRANCH.match(text)
        if m:
            target = index.get(int(m.group(1), 16))
            if target is not None and target < i and i - target + 1 >= min_size:
                found.append((target, i))
    return found


def cost(instrs):
    """Instructions, encoded stall cycles, scoreboard waits and stall cycles by opcode."""
    stalls, waits, by_op = 0, 0, collections.Counter()
    for _, text, control in instrs:
        stall = (control >> 41) & 0xF
        stalls += stall
        waits += ((control >> 52) & 0x3F) != 0
        by_op[opcode(text)] += stall
    return len(instrs), stalls, waits, by_op


def disassemble(path):
    if not path.endswith((".o", ".cubin", ".so")):
        with open(path) as f:
            return f.read()
    tool = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump")
    if tool is None:
        sys.exit("sass_loops.py: cuobjdump not found (set CUOBJDUMP, or pip install nvidia-cuda-cuobjdump-cu13)")
    done = subprocess.run([tool, "-sass", path], capture_output=True, text=True)
    if done.returncode != 0:  # e.g. nvdisasm, which cuobjdump -sass runs, not on PATH
        sys.exit(f"sass_loops.py: {tool} -sass failed: {done.stderr.strip()}")
    return done.stdout


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help="object / cubin / .so, or a text file of cuobjdump -sass output")
    parser.add_argument("--kernel", default=".", help="regex on the mangled function name")
    parser.add_argument("--min-size", type=int, default=200, help="shortest loop reported, in instructions")
    args = parser.parse_args()
    functions = parse(disassemble(args.input))
    pattern = re.compile(args.kernel)
    shown = 0
    for name, instrs in functions.items():
        if not pattern.search(name):
            continue
        for first, last in loops(instrs, args.min_size):
            n, stalls, waits, by_op = cost(instrs[first : last + 1])
            top = ", ".join(f"{op} {c}" for op, c in by_op.most_common(6))
            print(f"{name}\n  loop {instrs[first][0]:#x}..{instrs[last][0]:#x}: {n} instructions, "
                  f"{stalls} stall cycles, {waits} scoreboard waits; stall cycles by opcode: {top}")
            shown += 1
    if shown == 0:
        sys.exit(f"sass_loops.py: no loop of >= {args.min_size} instructions in a function matching {args.kernel!r}")


if __name__ == "__main__":
    main()
