#!/usr/bin/env bash
# The device call that checks mla_decode's work-list grid (csrc/mla_decode_sm90.cu, p.work_list)
# and picks its balance depth: build; every cuda test and the DCP bounds on the GPU; the three
# sanitizers on scripts/sanitize_cuda.py; the balance sweep (split grid vs work list x waves 1-4);
# the timing table with the defaults. Logs under $OUT:
#   run(command="bash scripts/device_sm90_experiments.sh", carry=[".whl"])
set -uo pipefail
. scripts/device_env.sh
( time python3 -m pip install -q --no-build-isolation --no-deps -e . ) > "$OUT/build.log" 2>&1
echo "build rc=$?"
timeout 240 python3 -m pytest -q -n 8 tests/test_cuda_attention.py "tests/test_dcp.py::test_dcp_bounds_in_the_gpu_kernel" \
    2>&1 | tail -15 | tee "$OUT/pytest_cuda.log"
for tool in racecheck synccheck memcheck; do
    timeout 90 compute-sanitizer --tool $tool python3 scripts/sanitize_cuda.py 2>&1 | tail -3 | sed "s/^/$tool: /" \
        | tee -a "$OUT/sanitizer.log"
done
timeout 150 python3 scripts/gpu_cuda_check.py --no-check --balance 2>&1 | grep -E "^balance|Error|error" \
    | tee "$OUT/balance.log"
timeout 100 python3 scripts/gpu_cuda_check.py --no-check --time --skip-triton 2>&1 | grep -E "^cuda +H|Error|error" \
    | tee "$OUT/time.log"
