#!/usr/bin/env bash
# The device call that checks mla_decode's work-list grid (csrc/mla_decode_sm90.cu, p.work_list)
# and picks its balance depth: build; every test (GPU ones included); the three
# sanitizers on scripts/sanitize_cuda.py; the balance sweep (split grid vs work list x waves 1-4);
# the timing table with the defaults. Logs under $OUT:
#   run(command="bash scripts/device_sm90_experiments.sh", carry=[".whl"])
set -uo pipefail
. scripts/device_env.sh
( time python3 -m pip install -q --no-build-isolation --no-deps -e . ) > "$OUT/build.log" 2>&1
echo "build rc=$?"
timeout 360 python3 -m pytest -q -ra -n 8 tests > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?" >> "$OUT/pytest.log"
grep -E "passed|failed|FAILED|ERROR" "$OUT/pytest.log" | tail -15
for tool in racecheck synccheck memcheck; do
    timeout 90 compute-sanitizer --tool $tool python3 scripts/sanitize_cuda.py 2>&1 | tail -3 | sed "s/^/$tool: /" \
        | tee -a "$OUT/sanitizer.log"
done
timeout 150 python3 scripts/gpu_cuda_check.py --no-check --balance 2>&1 | grep -E "^balance|Error|error" \
    | tee "$OUT/balance.log"
timeout 100 python3 scripts/gpu_cuda_check.py --no-check --time --skip-triton 2>&1 | grep -E "^cuda +H|Error|error" \
    | tee "$OUT/time.log"
# the MXFP4 / M1a kernels' variants table (their GPU grid ran in the pytest above)
timeout 150 python3 scripts/bench_query.py --variants --out "$OUT/bench_query.md" --json "$OUT/bench_query.json" \
    > "$OUT/bench_query.log" 2>&1
echo "bench_query rc=$?" | tee -a "$OUT/bench_query.log"
