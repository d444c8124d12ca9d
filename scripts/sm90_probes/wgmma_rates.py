"""Microbenchmark of wgmma's rate by N and operand path on sm_90a (a maintainers' tool).

Writes wgmma_rates.cu from wgmma_rates.cu.in (one inline-PTX wgmma wrapper per N and mode, written
out because PTX names every accumulator register), compiles it with nvcc for sm_90a against
csrc/sm90's headers and runs it on the local GPU. It prints the TFLOP/s of wgmma m64nNk16 for
N = 32 ... 256 with A in registers (rs), A from shared memory (ss), e4m3 (q), and A rebuilt from
fp8 bytes every other k-step (cv, ld), each with 1 and 2 warpgroups a SM, and first the ALU rate
of the e4m3 -> f16 conversion. docs/perf-history.md ("Session 23") has the H200's numbers.

    python3 scripts/sm90_probes/wgmma_rates.py [--build DIR] [--no-run]

scripts/sm90_probes/run.sh builds and runs this and tile_phases.cu.
"""
import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(HERE, "..", "..", "csrc", "sm90")
NS = (16, 24, 32, 48, 64, 96, 128, 192, 256)
SMALL_NS = (16, 24, 32, 48, 64)  # row counts of the token-major kernel (and halves): every mode
MODES = {"rs": "RS", "ss": "SS", "q": "Q", "cv": "CV", "ld": "LD"}


def wrapper(name: str, n: int, mode: str, dtype: str) -> str:
    """One wgmma as inline PTX: n / 2 f32 accumulators d, A in 4 registers (RS) or a descriptor."""
    nreg = n // 2
    acc = ", ".join(f"%{i}" for i in range(nreg))
    cons = ", ".join(f'"+f"(d[{i}])' for i in range(nreg))
    k, types = (16, "f32.f16.f16") if dtype == "f16" else (32, "f32.e4m3.e4m3")
    if mode == "RS":
        a = "{" + ", ".join(f"%{nreg + i}" for i in range(4)) + "}"
        b, pred = f"%{nreg + 4}", nreg + 5
        ins = '"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(bd)'
        sig, tail = "const uint32_t (&a)[4], uint64_t bd", "p, 1, 1, 0"
    else:
        a, b, pred = f"%{nreg}", f"%{nreg + 1}", nreg + 2
        ins = '"l"(ad), "l"(bd)'
        sig, tail = "uint64_t ad, uint64_t bd", "p, 1, 1, 0, 0" if dtype == "f16" else "p, 1, 1"
    return "\n".join([
        f"__device__ __forceinline__ void {name}(float (&d)[{nreg}], {sig}, int sd) {{",
        f'  asm volatile("{{\\n .reg .pred p;\\n setp.ne.b32 p, %{pred}, 0;\\n"',
        f'    " wgmma.mma_async.sync.aligned.m64n{n}k{k}.{types} {{{acc}}}, {a}, {b}, {tail};\\n}}\\n"',
        f'    : {cons} : {ins}, "r"(sd));',
        "}",
    ])


def source() -> str:
    wrappers = []
    for n in NS:
        wrappers += [wrapper(f"rs{n}", n, "RS", "f16"), wrapper(f"ss{n}", n, "SS", "f16"),
                     wrapper(f"q{n}", n, "SS", "e4m3")]
    runs = [f'  run<{n}, {MODES[m]}>("{m}", {n});'
            for n in NS for m in (MODES if n in SMALL_NS else ("rs", "ss", "q"))]
    with open(os.path.join(HERE, "wgmma_rates.cu.in")) as f:
        template = f.read()
    picks = " ".join(f"PICK({n})" for n in NS)
    return (template.replace("@WGMMA@", "\n".join(wrappers)).replace("@PICKS@", picks)
            .replace("@LAUNCH@", "\n".join(runs)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(HERE, "..", "..", "build", "sm90_probes"))
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--no-run", action="store_true", help="generate and compile only")
    args = ap.parse_args()
    os.makedirs(args.build, exist_ok=True)
    cu, exe = os.path.join(args.build, "wgmma_rates.cu"), os.path.join(args.build, "wgmma_rates")
    with open(cu, "w") as f:
        f.write(source())
    subprocess.run([args.nvcc, "-std=c++17", "-O3", "-gencode=arch=compute_90a,code=sm_90a", "-I", CSRC,
                    "-o", exe, cu], check=True)
    if not args.no_run:
        sys.stdout.flush()
        subprocess.run([exe], check=True)


if __name__ == "__main__":
    main()
