#!/usr/bin/env bash
# Branch wip/sm90-warp-specialized: one device call that says whether splitkv_ws_kernel (the
# warp-specialized 16-row M1c) is right, race-free and faster than splitkv_kernel:
#   run(command="bash scripts/device_ws_check.sh")
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
( time python3 -m pip install -q --no-build-isolation --no-deps -e . ) > "$OUT/build.log" 2>&1
echo "build rc=$?"
# structured cases first: they say where a wrong kernel goes wrong
timeout 120 python3 scripts/gpu_cuda_check.py 2>&1 | grep -v triton | tee "$OUT/check.log"
timeout 240 python3 -m pytest -q tests/test_cuda_attention.py 2>&1 | tail -6 | tee "$OUT/pytest_cuda.log"
for ws in 1 0; do
    KIMI_OPS_SM90_WS=$ws timeout 150 python3 scripts/gpu_cuda_check.py --time --skip-triton 2>&1 \
        | grep -E "^cuda +H" | sed "s/^/ws=$ws /" | tee -a "$OUT/time.log"
done
for tool in racecheck synccheck memcheck; do
    timeout 120 compute-sanitizer --tool $tool python3 scripts/sanitize_cuda.py 2>&1 | tail -3 | sed "s/^/$tool: /" \
        | tee -a "$OUT/sanitizer.log"
done
