#!/usr/bin/env bash
# The device call that checks and times the Hopper split kernel's variants (csrc/mla_decode_sm90.cu):
# build; the cuda attention tests (both QK splits, every ring depth, the work-list grid); the QK
# split sweep (16-row shapes, HBM and L2 pools); the three sanitizers on scripts/sanitize_cuda.py;
# the timing table with the defaults. FULL=1 also runs every test (GPU ones included) and the
# MXFP4 / M1a variants table. Logs under $OUT:
#   run(command="bash scripts/device_sm90_experiments.sh", carry=[".whl"])
set -uo pipefail
. scripts/device_env.sh
( time python3 -m pip install -q --no-build-isolation --no-deps -e . ) > "$OUT/build.log" 2>&1
echo "build rc=$?"; tail -3 "$OUT/build.log"
timeout 240 python3 -m pytest -q -ra -n 8 tests/test_cuda_attention.py > "$OUT/pytest_cuda.log" 2>&1
echo "pytest cuda rc=$?" >> "$OUT/pytest_cuda.log"
grep -E "passed|failed|FAILED|ERROR|rc=" "$OUT/pytest_cuda.log" | tail -15
timeout 200 python3 scripts/gpu_cuda_check.py --no-check --qk-split 2>&1 | grep -E "^qk split|Error|error" \
    | tee "$OUT/qk_split.log"
for tool in racecheck synccheck memcheck; do
    timeout 120 compute-sanitizer --tool $tool python3 scripts/sanitize_cuda.py 2>&1 | tail -3 | sed "s/^/$tool: /" \
        | tee -a "$OUT/sanitizer.log"
done
timeout 100 python3 scripts/gpu_cuda_check.py --no-check --time --skip-triton 2>&1 | grep -E "^cuda +H|Error|error" \
    | tee "$OUT/time.log"
if [ "${FULL:-0}" = 1 ]; then
    timeout 360 python3 -m pytest -q -ra -n 8 tests > "$OUT/pytest.log" 2>&1
    echo "pytest rc=$?" >> "$OUT/pytest.log"
    grep -E "passed|failed|FAILED|ERROR|rc=" "$OUT/pytest.log" | tail -15
    timeout 150 python3 scripts/bench_query.py --variants --out "$OUT/bench_query.md" --json "$OUT/bench_query.json" \
        > "$OUT/bench_query.log" 2>&1
    echo "bench_query rc=$?" | tee -a "$OUT/bench_query.log"
fi
