#!/usr/bin/env bash
# One call on the H200: issue 27's table. Installs the carried peers (scripts/setup_peers.sh),
# builds kimi_ops._C in place, runs scripts/bench_attention.py --grid issue27 beside FlashMLA
# (fp8 and bf16-KV), FlashInfer (fp8 and bf16-KV) and vLLM's Triton MLA, and prints the peer
# table last. Logs, json and md under $OUT (or ./out). Carry the peers, prepared on the machine
# without a GPU by `python scripts/peers.py prepare` (it fills .whl/ and .peers/), with it:
#   run(command="bash scripts/device_bench.sh", carry=[".whl", ".peers"])
# BENCH_ARGS: more bench_attention.py arguments (e.g. "--reps 7"; a later --mma / --peers / --grid
# wins: "--grid small" measures batch 1-8 from 256 tokens to 64k beside the same peers);
# CALL_BUDGET: seconds the whole script may take (default 570, inside run()'s 600 s limit); the
# benchmark gets what the build left (the json / md are written after every shape, so a stopped
# run still leaves the shapes it measured, and the table below still prints).
# GPU_TESTS=1: then the Hopper kernels' GPU tests on the same build (test_cuda_attention, test_pdl,
# test_runtime_gpu, -k "not interp", ~140 s) -> $OUT/pytest.log, the Triton kernels' (what every
# other GPU runs: test_triton_attention, test_fp8_query, -k gpu, ~85 s) -> $OUT/pytest_triton.log,
# and the projections' (test_gemv, test_fp8_weights, -m gpu, ~60 s) -> $OUT/pytest_gemm.log; the
# benchmark leaves them TEST_TIME seconds (default 320) of CALL_BUDGET. The table and the tests in one call:
#   run(command="GPU_TESTS=1 CALL_BUDGET=570 bash scripts/device_bench.sh", carry=[".whl", ".peers"])
set -uo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; fi
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$(date +%s)
{
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    bash scripts/setup_peers.sh
} > "$OUT/setup.log" 2>&1
grep -E "torch|MISSING|WARNING|prebuilt|peer file" "$OUT/setup.log"
( time MAX_JOBS=16 python3 setup.py build_ext --inplace ) > "$OUT/build.log" 2>&1
echo "build rc=$? ($(( $(date +%s) - start )) s since start)" | tee -a "$OUT/build.log"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
python3 -c "import kimi_ops._C, torch; print(torch.ops.kimi_ops._build_info())" 2>&1 | tail -n 3 | tee -a "$OUT/build.log"
left=$(( ${CALL_BUDGET:-570} - ($(date +%s) - start) ))
[ -n "${GPU_TESTS:-}" ] && left=$(( left - ${TEST_TIME:-320} ))
echo "benchmark: ${left} s left for it"
timeout "$left" python3 scripts/bench_attention.py --grid issue27 --out "$OUT" --mma bf16 \
    --peers flashmla_fp8,flashmla_bf16,flashinfer,flashinfer_bf16,vllm_triton ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
echo "bench rc=$? ($(( $(date +%s) - start )) s since start)" | tee -a "$OUT/bench.log"
grep -E "^(backend |kimi_ops fp8|device )|Traceback|Error" "$OUT/bench.log" | head -n 20
grep -E "^H[0-9]+ B" "$OUT/bench.log" | cut -c1-600
echo
cat "$OUT/bench_attention_peers.md" 2>/dev/null || echo "no peer table: see $OUT/bench.log"
# pytest in what is left of CALL_BUDGET: gpu_tests LOG PYTEST_ARGS... (timeout 0 would mean no limit)
gpu_tests() {
    local log=$1 left_s=$(( ${CALL_BUDGET:-570} - ($(date +%s) - start) ))
    shift
    if [ "$left_s" -gt 10 ]; then
        timeout "$left_s" python3 -m pytest -q -n 8 -p no:cacheprovider "$@" > "$log" 2>&1
        echo "pytest rc=$? ($(( $(date +%s) - start )) s since start)" >> "$log"
    else
        echo "did not run: CALL_BUDGET spent" > "$log"
    fi
    tail -n 3 "$log"
}
if [ -n "${GPU_TESTS:-}" ]; then
    export PYTHONPATH=$PYTHONPATH:${KIMI_PEERS_SITE:-/tmp/site}  # setup_peers.sh installed the carried wheels there (expecttest: opcheck)
    gpu_tests "$OUT/pytest.log" tests/test_cuda_attention.py tests/test_pdl.py tests/test_runtime_gpu.py -k "not interp"
    gpu_tests "$OUT/pytest_triton.log" -ra tests/test_triton_attention.py tests/test_fp8_query.py -k gpu
    gpu_tests "$OUT/pytest_gemm.log" -m gpu tests/test_gemv.py tests/test_fp8_weights.py
fi
