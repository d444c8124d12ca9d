"""scripts/sass_loops.py on a small hand-made cuobjdump -sass listing (CPU)."""
import os
import subprocess
import sys

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts")
sys.path.insert(0, SCRIPTS)

import sass_loops  # noqa: E402


def control(stall, wait_mask=0):
    """A control word with no scoreboard written or read (7 = none)."""
    return (stall << 41) | (7 << 46) | (7 << 49) | (wait_mask << 52)


# (text, stall, wait mask): a prologue, a 3-instruction loop closed by a predicated back edge, an
# exit, and an out-of-line stub whose unconditional branch back is not a loop
BODY = [
    ("MOV R1, c[0x0][0x28]", 1, 0),
    ("LDSM.16.M88.4 R4, [R2]", 2, 0),
    ("HMMA.16816.F32 R8, R4, R12, R8", 6, 0b000001),
    ("@!P0 BRA 0x10", 5, 0),
    ("EXIT", 1, 0),
    ("SHFL.BFLY PT, R3, R3, 0x1, 0x1f", 4, 0),
    ("BRA 0x0", 1, 0b000010),
]


def listing():
    lines = ["\tcode for sm_90a", "\t\tFunction : _Z6kernelv", "\t.headerflags @\"EF_CUDA_SM90\""]
    for k, (text, stall, wait) in enumerate(BODY):
        lines.append(f"        /*{16 * k:04x}*/                   {text} ;    /* 0x{0x1234 + k:016x} */")
        lines.append(f"                                                  /* 0x{control(stall, wait):016x} */")
    lines.append("\t\tFunction : _Z5otherv")
    lines.append(f"        /*0000*/                   @P1 BRA 0x0 ;    /* 0x{0:016x} */")
    lines.append(f"                                                  /* 0x{control(3):016x} */")
    return "\n".join(lines) + "\n"


def test_parse_and_loops():
    functions = sass_loops.parse(listing())
    assert list(functions) == ["_Z6kernelv", "_Z5otherv"]
    instrs = functions["_Z6kernelv"]
    assert [addr for addr, _, _ in instrs] == [16 * k for k in range(len(BODY))]
    assert sass_loops.opcode(instrs[3][1]) == "BRA" and sass_loops.opcode(instrs[1][1]) == "LDSM"
    assert sass_loops.loops(instrs, min_size=2) == [(1, 3)]  # the stub's branch back is not a loop
    assert sass_loops.loops(instrs, min_size=4) == []
    n, stalls, waits, by_op = sass_loops.cost(instrs[1:4])
    assert (n, stalls, waits) == (3, 2 + 6 + 5, 1)
    assert by_op["HMMA"] == 6 and by_op["BRA"] == 5


def test_cli_on_a_text_listing(tmp_path):
    path = tmp_path / "kernel.sass"
    path.write_text(listing())
    out = subprocess.run([sys.executable, os.path.join(SCRIPTS, "sass_loops.py"), str(path), "--kernel", "kernel",
                          "--min-size", "2"], capture_output=True, text=True, check=True).stdout
    assert "_Z6kernelv" in out and "_Z5otherv" not in out
    assert "3 instructions, 13 stall cycles, 1 scoreboard waits" in out
    missing = subprocess.run([sys.executable, os.path.join(SCRIPTS, "sass_loops.py"), str(path), "--kernel", "nothing"],
                             capture_output=True, text=True)
    assert missing.returncode != 0 and "no loop" in missing.stderr
