#!/usr/bin/env python3
"""Where a kernel's main loop waits, phase by phase, from Nsight Compute's per-instruction table.

    ncu --set full -o prof ...                      # on the device (scripts/device_sm90_experiments.sh)
    ncu --import prof.ncu-rep --page source --csv --print-source sass > sass.csv
    python3 scripts/ncu_phases.py sass.csv [--top 20]

The main loop is the instructions executed at least half as often as the execution count that
accounts for the most executed instructions (a split kernel's tile loop). It is cut into phases at
its CTA barriers (BAR.SYNC, and B2R.RESULT: the read of a __syncthreads_or), since the split
kernels' phases end at one, and at the first MMA after the next tile's copies: loader, QK,
softmax, PV. For each phase: its share of the loop's stall samples, its instructions a warp a
loop iteration, the instruction kinds it holds most of (to tell the phases apart) and its top
stall reasons. --top also lists the hottest instructions.
"""
from __future__ import annotations

import argparse
import collections
import csv
import sys

SOURCE, SAMPLES, EXECUTED = "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"
BARRIERS = ("BAR.SYNC", "BAR.RED", "B2R.RESULT")
MMAS = ("HGMMA", "HMMA", "QGMMA")
COPIES = ("LDGSTS", "UBLKCP")


def read_table(path):
    """(header, rows) of the ``--page source --csv --print-source sass`` table (its first line,
    the kernel's name, skipped)."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    start = next(i for i, row in enumerate(lines) if SOURCE in row and EXECUTED in row)
    return lines[start], [row for row in lines[start + 1:] if len(row) == len(lines[start])]


def opcode(source):
    words = source.split()
    if not words:
        return "?"
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def loop_body(header, rows):
    """(rows, iterations): the main loop's rows, those executed at least half as often as the
    count that accounts for the most executed instructions (the loop's warp-iterations)."""
    executed = header.index(EXECUTED)
    counts = collections.Counter(int(r[executed]) for r in rows if int(r[executed]) > 1)
    if not counts:
        return [], 0
    common = max(counts, key=lambda c: (c * counts[c], c))
    body = [r for r in rows if int(r[executed]) >= common // 2]
    return body, common


def phases(header, body):
    """Split the loop body after each CTA barrier instruction, and a part that copies the next
    tile (cp.async / bulk copies) before its first MMA once more at that MMA (loader | QK)."""
    source = header.index(SOURCE)
    parts, current = [], []
    for row in body:
        current.append(row)
        if opcode(row[source]).startswith(BARRIERS):
            parts.append(current)
            current = []
    if current:
        parts.append(current)
    out = []
    for part in parts:
        ops = [opcode(r[source]) for r in part]
        first_mma = next((i for i, op in enumerate(ops) if op.startswith(MMAS)), None)
        if first_mma and any(op.startswith(COPIES) for op in ops[:first_mma]):
            out += [part[:first_mma], part[first_mma:]]
        else:
            out.append(part)
    return out


def summarize(header, body, iterations):
    """One dict per phase: samples, share, instructions an iteration, main kinds, main stalls."""
    source, samples, executed = header.index(SOURCE), header.index(SAMPLES), header.index(EXECUTED)
    stall_cols = [i for i, h in enumerate(header) if h.startswith("stall_") and "Not Issued" not in h]
    total = sum(int(r[samples]) for r in body) or 1
    result = []
    for part in phases(header, body):
        kinds, stalls = collections.Counter(), collections.Counter()
        for r in part:
            kinds[opcode(r[source]).split(".")[0]] += int(r[executed]) / iterations
            for i in stall_cols:
                stalls[header[i][len("stall_"):]] += int(r[i] or 0)
        n = sum(int(r[samples]) for r in part)
        stall_total = sum(stalls.values()) or 1
        result.append(dict(samples=n, share=n / total, instructions=sum(kinds.values()),
                           kinds=[(k, round(v)) for k, v in kinds.most_common(5)],
                           stalls=[(k, v / stall_total) for k, v in stalls.most_common(4)]))
    return result


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("table", help="ncu --page source --csv --print-source sass output")
    ap.add_argument("--top", type=int, default=0, help="also list the N hottest loop instructions")
    args = ap.parse_args(argv)
    header, rows = read_table(args.table)
    body, iterations = loop_body(header, rows)
    if not body:
        print("no instruction ran: nothing to split", file=sys.stderr)
        return 1
    print(f"main loop: {len(body)} instructions, {iterations} warp-iterations")
    for k, p in enumerate(summarize(header, body, iterations)):
        kinds = " ".join(f"{name}x{n}" for name, n in p["kinds"])
        stalls = " ".join(f"{name} {100 * f:.0f}%" for name, f in p["stalls"])
        print(f"phase {k}: {100 * p['share']:5.1f}% of samples, {p['instructions']:6.0f} instr a warp | {kinds} | "
              f"{stalls}")
    for share, text in hottest(header, body, args.top):
        print(f"{100 * share:5.1f}%  {text[:90]}")
    return 0


def hottest(header, body, n):
    """The n loop instructions with the most stall samples: (share of the loop's samples, SASS)."""
    source, samples = header.index(SOURCE), header.index(SAMPLES)
    total = sum(int(r[samples]) for r in body) or 1
    return [(int(r[samples]) / total, r[source].strip()) for r in sorted(body, key=lambda r: -int(r[samples]))[:n]]


if __name__ == "__main__":
    sys.exit(main())
