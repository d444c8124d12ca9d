"""scripts/ncu_phases.py on a small hand-made Nsight Compute source table (CPU)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))

import ncu_phases  # noqa: E402

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed", "stall_wait",
          "stall_barrier", "stall_lg"]
ROWS = [  # (source, samples, executed, wait, barrier, lg): a prologue, a 100-iteration loop, an epilogue
    ("MOV R1, c[0x0][0x28]", 5, 1, 5, 0, 0),
    ("LDGSTS.E.BYPASS.128 [R1], desc[UR8][R2.64]", 30, 100, 0, 0, 30),
    ("HGMMA.64x24x16.F32 R120, R140, gdesc[UR4], RZ", 20, 100, 20, 0, 0),
    ("BAR.SYNC.DEFER_BLOCKING 0x0", 10, 100, 0, 10, 0),
    ("@P0 MUFU.EX2 R3, R3", 15, 200, 15, 0, 0),
    ("HGMMA.64x48x16.F32 R24, R120, gdesc[UR12], R24", 25, 100, 25, 0, 0),
    ("EXIT", 1, 1, 1, 0, 0),
]


def write_table(path):
    with open(path, "w") as f:
        f.write('"Kernel Name","splitkv_tm_kernel"\n')
        f.write(",".join(f'"{h}"' for h in HEADER) + "\n")
        for k, row in enumerate(ROWS):
            f.write(",".join(f'"{v}"' for v in (hex(16 * k),) + row) + "\n")


def test_loop_and_phases(tmp_path):
    path = tmp_path / "sass.csv"
    write_table(path)
    header, rows = ncu_phases.read_table(path)
    body, iterations = ncu_phases.loop_body(header, rows)
    assert iterations == 100 and len(body) == 5  # prologue and epilogue left out
    parts = ncu_phases.summarize(header, body, iterations)
    # loader | QK + barrier | softmax + PV
    assert [p["samples"] for p in parts] == [30, 30, 40]
    assert abs(sum(p["share"] for p in parts) - 1) < 1e-9
    assert parts[0]["kinds"] == [("LDGSTS", 1)] and parts[0]["stalls"][0] == ("lg", 1.0)
    assert dict(parts[2]["kinds"]) == {"MUFU": 2, "HGMMA": 1}
    assert dict(parts[1]["stalls"]) == {"wait": 20 / 30, "barrier": 10 / 30, "lg": 0.0}


def test_main_prints_every_phase(tmp_path, capsys):
    path = tmp_path / "sass.csv"
    write_table(path)
    assert ncu_phases.main([str(path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "main loop: 5 instructions, 100 warp-iterations" in out
    assert out.count("phase ") == 3 and "LDGSTS" in out
