#!/usr/bin/env bash
# The device call that checks and times the Hopper split kernel (csrc/sm90/mla_decode_sm90.cu): build;
# the cuda attention tests (FULL=1: every test, GPU ones included); the three sanitizers on
# scripts/sanitize_cuda.py; the timing table with the defaults; PROFILE=1: Nsight Compute on one
# launch of PROFILE_KERNEL (a regex, default splitkv_kernel: the 16-row kernel; splitkv_tm_kernel
# with PROFILE_ARGS="--qlen 8") of scripts/profile_attention.py $PROFILE_ARGS (default H12 q1 b32
# 8k), its stall samples per SASS instruction in ncu_sass.csv and by loop phase in ncu_phases.txt
# (scripts/ncu_phases.py), and each pipe's utilization and the shared-memory wavefronts and bank
# conflicts in ncu_pipes.txt (a second ncu run of the same launch); FULL=1: the MXFP4 / M1a
# variants table; VARIANT="NAME=VALUE": the cuda tests (unless VARIANT_TESTS=0) and the timing
# table again with that environment variable set (an A/B of a runtime switch in one call);
# BUILD_VARIANTS="name=nvcc flags;...": a copy of the tree built with KIMI_OPS_NVCC_FLAGS set to
# those flags per entry (in parallel with the main build), then the cuda attention tests (unless
# VARIANT_TESTS=0) and the timing table of each (an A/B of a compile-time variant);
# TESTS="files": the tests to run instead of the cuda ones; SHAPES="a,b": time only the shapes
# whose label contains one of these (gpu_cuda_check.py --shapes). Logs under $OUT:
#   run(command="FULL=1 PROFILE=1 bash scripts/device_sm90_experiments.sh", carry=[".whl"])
#   run(command="BUILD_VARIANTS='nocvt=-DMY_MACRO=1' bash scripts/device_sm90_experiments.sh", carry=[".whl"])
set -uo pipefail
. scripts/device_env.sh
IFS=';' read -ra build_variants <<< "${BUILD_VARIANTS:-}"
for entry in "${build_variants[@]}"; do
    name=${entry%%=*}
    rm -rf "/tmp/variant_$name" && mkdir -p "/tmp/variant_$name"
    cp -r setup.py pyproject.toml kimi_ops csrc scripts tests "/tmp/variant_$name/"
    ( cd "/tmp/variant_$name" && KIMI_OPS_NVCC_FLAGS="${entry#*=}" python3 setup.py build_ext --inplace \
        > "$OUT/build_$name.log" 2>&1; echo "build $name rc=$?" >> "$OUT/build_$name.log" ) &
done
( time python3 -m pip install -q --no-build-isolation --no-deps -e . ) > "$OUT/build.log" 2>&1
echo "build rc=$?"; tail -3 "$OUT/build.log"
wait
tests=${TESTS:-tests/test_cuda_attention.py}
[ "${FULL:-0}" = 1 ] && tests=tests
timeout 420 python3 -m pytest -q -ra -n 8 $tests > "$OUT/pytest.log" 2>&1
echo "pytest $tests rc=$?" >> "$OUT/pytest.log"
grep -E "passed|failed|FAILED|ERROR|rc=" "$OUT/pytest.log" | tail -15
for tool in racecheck synccheck memcheck; do
    timeout 90 compute-sanitizer --tool $tool python3 scripts/sanitize_cuda.py 2>&1 | tail -3 | sed "s/^/$tool: /" \
        | tee -a "$OUT/sanitizer.log"
done
timing() {  # the timing table of the tree in the current directory
    timeout 100 python3 scripts/gpu_cuda_check.py --no-check --time --skip-triton --shapes "${SHAPES:-}" 2>&1 \
        | grep -E "^cuda +H|Error|error"
}
timing | tee "$OUT/time.log"
for entry in "${build_variants[@]}"; do
    name=${entry%%=*}
    tail -1 "$OUT/build_$name.log"
    echo "== build variant $name (${entry#*=})" | tee -a "$OUT/time.log"
    # the copy's scripts (and pytest run from it) put its own tree and kimi_ops._C first on sys.path
    if [ "${VARIANT_TESTS:-1}" = 1 ]; then
        ( cd "/tmp/variant_$name" && timeout 300 python3 -m pytest -q -n 8 tests/test_cuda_attention.py 2>&1 \
            | tail -1 ) | tee -a "$OUT/time.log"
    fi
    ( cd "/tmp/variant_$name" && timing ) | tee -a "$OUT/time.log"
done
if [ -n "${VARIANT:-}" ]; then
    echo "== $VARIANT" | tee -a "$OUT/time.log"
    [ "${VARIANT_TESTS:-1}" = 1 ] && env "$VARIANT" timeout 300 python3 -m pytest -q -n 8 tests/test_cuda_attention.py 2>&1 \
        | tail -2 | tee -a "$OUT/time.log"
    ( export "${VARIANT?}" && timing ) | tee -a "$OUT/time.log"
fi
if [ "${PROFILE:-0}" = 1 ] && command -v ncu >/dev/null; then
    timeout 150 ncu --kernel-name "regex:${PROFILE_KERNEL:-splitkv_kernel}" --launch-skip 2 --launch-count 1 \
        --set full --clock-control none --import-source no -f -o /tmp/prof \
        python3 scripts/profile_attention.py ${PROFILE_ARGS:-} > "$OUT/ncu_run.log" 2>&1
    ncu --import /tmp/prof.ncu-rep --page details > "$OUT/ncu_details.txt" 2>&1
    ncu --import /tmp/prof.ncu-rep --page source --csv --print-source sass > "$OUT/ncu_sass.csv" 2>&1
    python3 scripts/ncu_phases.py "$OUT/ncu_sass.csv" --top 15 > "$OUT/ncu_phases.txt" 2>&1
    pipes="regex:sm__pipe_.*cycles_active\.avg\.pct_of_peak_sustained_active"
    pipes+=",regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active"
    pipes+=",regex:l1tex__data_pipe_lsu_wavefronts.*\.sum$,regex:l1tex__data_bank_conflicts_pipe_lsu.*\.sum$"
    timeout 120 ncu --kernel-name "regex:${PROFILE_KERNEL:-splitkv_kernel}" --launch-skip 2 --launch-count 1 \
        --clock-control none --metrics "$pipes" python3 scripts/profile_attention.py ${PROFILE_ARGS:-} 2>&1 \
        | grep -E "pct_of_peak|\.sum" | grep -v TriageCompute > "$OUT/ncu_pipes.txt"
    head -8 "$OUT/ncu_phases.txt"
    grep -iE "Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Warp Cycles Per Issued|Issue Slots|Stall" \
        "$OUT/ncu_details.txt" | head -20
fi
if [ "${FULL:-0}" = 1 ]; then
    timeout 120 python3 scripts/bench_query.py --variants --out "$OUT/bench_query.md" --json "$OUT/bench_query.json" \
        > "$OUT/bench_query.log" 2>&1
    echo "bench_query rc=$?" | tee -a "$OUT/bench_query.log"
fi
