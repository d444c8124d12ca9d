#!/usr/bin/env bash
# One call on the GPU machine: build kimi_ops (with kimi_ops._C), run every test (GPU tests
# included), run the demo; with 2+ GPUs also the DCP demo and benchmarks over NCCL. Logs land in
# $OUT (or ./out). Carry .whl (expecttest) with the call:
#   run(command="bash scripts/device_check.sh", carry=[".whl"])
# TEST_BUDGET: seconds the tests may take (default 420; they are killed after it, the names of
# the results so far are in $OUT/pytest.log). PYTEST_ARGS: more pytest arguments (e.g. "-k gpu").
# The interpreter tests (names with "interp": CPU-only, the slowest, run by CI) are left out unless
# ALL_TESTS=1: with them the whole suite had reached ~72% when 400 s ran out (H100, 2026-12-06).
# DCP_ONLY=1 runs only the DCP tests and the multi-GPU part (for the several-GPU kinds):
#   run(command="DCP_ONLY=1 bash scripts/device_check.sh", carry=[".whl"], kind="nvidia-h200-x4")
# SANITIZE=1 also runs compute-sanitizer memcheck, racecheck and synccheck on the Hopper kernels'
# small cases (scripts/sanitize_cuda.py --tools all) -> $OUT/sanitizer.log.
# PROFILE=1 (with ncu on PATH) also profiles one split-kernel launch of scripts/profile_attention.py
# (Nsight Compute --set full) -> $OUT/ncu_details.txt.
set -uo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; fi
. scripts/device_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
( time python3 -m pip install -q --no-build-isolation --no-deps -e . ) > "$OUT/build.log" 2>&1
echo "build rc=$?" | tee -a "$OUT/build.log"
python3 -c "import kimi_ops._C, torch; print(torch.ops.kimi_ops._build_info())" 2>&1 | tee -a "$OUT/build.log"
if [ -n "${DCP_ONLY:-}" ]; then
    python3 -m pytest -q -ra -n 8 tests/test_dcp.py tests/test_runtime_gpu.py > "$OUT/pytest.log" 2>&1
    echo "pytest rc=$?" >> "$OUT/pytest.log"
    tail -n 8 "$OUT/pytest.log"
else
    # -v names each result as it ends, so a run cut by the time limit still says which failed
    select=(-k "not interp"); [ -n "${ALL_TESTS:-}" ] && select=()
    timeout "${TEST_BUDGET:-420}" python3 -m pytest -v -ra -n 16 -p no:cacheprovider tests "${select[@]}" ${PYTEST_ARGS:-} \
        > "$OUT/pytest.log" 2>&1
    echo "pytest rc=$?" >> "$OUT/pytest.log"
    grep -E "FAILED|ERROR" "$OUT/pytest.log" | grep -v "^E " | sort -u | head -n 40
    python3 -m kimi_ops demo ${DEMO_ARGS:-} > "$OUT/demo.log" 2>&1
    echo "demo rc=$?" >> "$OUT/demo.log"
    tail -n 30 "$OUT/pytest.log"
    cat "$OUT/demo.log"
fi
GPUS=$(python3 -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -ge 2 ]; then
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
    timeout 180 python3 -m kimi_ops demo --dcp "$GPUS" > "$OUT/demo_dcp.log" 2>&1; echo "demo --dcp rc=$?" >> "$OUT/demo_dcp.log"
    : > "$OUT/bench_dcp.log"
    for w in 2 4 8; do  # the combine at each power-of-two world size the GPUs allow
        [ "$w" -le "$GPUS" ] || break
        timeout 120 python3 scripts/bench_dcp.py --world "$w" >> "$OUT/bench_dcp.log" 2>&1; echo "bench_dcp W=$w rc=$?" >> "$OUT/bench_dcp.log"
    done
    timeout 300 python3 scripts/bench_dcp_step.py --world "$GPUS" > "$OUT/bench_dcp_step.log" 2>&1
    echo "bench_dcp_step rc=$?" >> "$OUT/bench_dcp_step.log"
    grep -vE "Warning|warn|return func" "$OUT/demo_dcp.log" "$OUT/bench_dcp.log" "$OUT/bench_dcp_step.log" | tail -n 30
fi
if [ -n "${SANITIZE:-}" ]; then
    python3 scripts/sanitize_cuda.py --tools all --timeout 90 2>&1 | tee "$OUT/sanitizer.log"
fi
if [ -n "${PROFILE:-}" ] && command -v ncu >/dev/null; then
    timeout 240 ncu --kernel-name "regex:splitkv_kernel|_split_kv_kernel" --launch-skip 2 --launch-count 1 --set full \
        --clock-control none --import-source no -f -o /tmp/prof python3 scripts/profile_attention.py > "$OUT/ncu_run.log" 2>&1
    ncu --import /tmp/prof.ncu-rep --page details > "$OUT/ncu_details.txt" 2>&1
    grep -iE "Duration|Memory Throughput|DRAM Throughput|Registers Per|Local|Achieved Occupancy|Theoretical Occupancy|Warp Cycles Per Issued|Block Limit|Shared Memory Configuration|Stall" "$OUT/ncu_details.txt" | head -40
fi
