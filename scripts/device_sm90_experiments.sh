#!/usr/bin/env bash
# The device calls that say whether the experimental paths of the cuda backend are right,
# race-free and faster, before any becomes a default (all are off on main):
#   * KIMI_OPS_SM90_WS=1: splitkv_ws_kernel, the warp-specialized 16-row M1c
#   * KIMI_OPS_SM90_BALANCE_WAVES=2|3 with more splits, empty splits' o unwritten (mla_decode)
#   * KIMI_OPS_SM90_PDL=1: the merge launched as a programmatic dependent of the split kernel
#   * KIMI_OPS_SM90_CONVERT=1|2|3: fp8 -> f16 by integer ops for V / K / both (16-row, 2-stage CTAs)
# Two calls of under 10 minutes each (the build is kept between calls on a warm machine):
#   run(command="bash scripts/device_sm90_experiments.sh 1", carry=[".whl"])
#       build; the switches' own GPU tests; timing with the defaults and with each switch
#   run(command="bash scripts/device_sm90_experiments.sh 2", carry=[".whl"])
#       every cuda test (the per-tile code is shared by all kernels); sanitizers; balance sweep; ncu
set -uo pipefail
PART=${1:-1}
. scripts/device_env.sh
( time python3 -m pip install -q --no-build-isolation --no-deps -e . ) > "$OUT/build.log" 2>&1
echo "build rc=$?"
if [ "$PART" = 1 ]; then
    # structured cases first, on the warp-specialized kernel: they say where a wrong kernel goes wrong
    KIMI_OPS_SM90_WS=1 timeout 90 python3 scripts/gpu_cuda_check.py --skip-triton 2>&1 | tee "$OUT/check.log"
    timeout 180 python3 -m pytest -q -n 8 tests/test_cuda_attention.py -k "ws or convert or private or pdl" 2>&1 \
        | tail -8 | tee "$OUT/pytest_switches.log"
    # every shape with the defaults, then each switch alone on the 16-row shapes it touches
    timeout 100 python3 scripts/gpu_cuda_check.py --no-check --time --skip-triton 2>&1 | grep -E "^cuda +H" \
        | sed "s/^/default /" | tee -a "$OUT/time.log"
    SHAPES="q1 b8 8k,q1 b32 32k,q1 b1 32k,q2 b32 8k,varlen"
    for switch in KIMI_OPS_SM90_WS=1 KIMI_OPS_SM90_PDL=1 KIMI_OPS_SM90_CONVERT=1 KIMI_OPS_SM90_CONVERT=2 \
                  KIMI_OPS_SM90_CONVERT=3; do
        env $switch timeout 60 python3 scripts/gpu_cuda_check.py --no-check --time --skip-triton --shapes "$SHAPES" \
            2>&1 | grep -E "^cuda +H" | sed "s/^/$switch /" | tee -a "$OUT/time.log"
    done
fi
if [ "$PART" = 2 ]; then
    timeout 240 python3 -m pytest -q -n 8 tests/test_cuda_attention.py 2>&1 | tail -8 | tee "$OUT/pytest_cuda.log"
    for tool in racecheck synccheck memcheck; do  # the new paths: WS ring, PDL merge (CONVERT: same memory ops)
        KIMI_OPS_SM90_WS=1 KIMI_OPS_SM90_PDL=1 timeout 60 compute-sanitizer --tool $tool python3 scripts/sanitize_cuda.py \
            2>&1 | tail -3 | sed "s/^/ws+pdl $tool: /" | tee -a "$OUT/sanitizer.log"
    done
    timeout 120 python3 scripts/gpu_cuda_check.py --no-check --balance 2>&1 | grep -E "^balance" | tee "$OUT/balance.log"
    # Which pipe bounds splitkv_kernel (16-row CTAs, b32 x 8k)? Per-pipe utilisation and the executed
    # SASS opcode mix (F2FP = the fp8 -> f16 conversions, HMMA, PRMT, LOP3, LDS/LDSM, BAR).
    if command -v ncu >/dev/null; then
        timeout 120 ncu --kernel-name "regex:splitkv_kernel" --launch-skip 2 --launch-count 1 \
            --section ComputeWorkloadAnalysis --section InstructionStats --section WarpStateStats \
            --section SpeedOfLight --clock-control none --import-source no -f -o /tmp/pipes \
            python3 scripts/profile_attention.py > "$OUT/ncu_pipes_run.log" 2>&1
        ncu --import /tmp/pipes.ncu-rep --page details --print-details all > "$OUT/ncu_pipes.txt" 2>&1
        grep -iE "pipe|F2FP|HMMA|PRMT|LOP3|LDSM|LDS|BAR|Issue Slots|Executed Ipc|Duration|Stall" "$OUT/ncu_pipes.txt" | head -60
    fi
fi
