#!/usr/bin/env bash
# Session 34's first call, on main (session 33: the fp8 GEMM transposed at M >= 33 by default):
#   run(command="bash exp/s34_call1.sh", carry=["exp", ".whl"], timeout_s=590)
# 1. the fp8 GEMM at M 16 / 32 alone: configs x the transposed form (exp/s33_sweep.py; no _C needed).
#    Predicted: some transposed 16 / 32-row config (wgmma m64nM, the weight from registers) beats
#    today's mma.sync tiles by >= 10% at qkv_a + gate (M 32: 22.7 us in session 20's sweep).
# 2. build; the fp8 layer at batch 16, 32, 64 (PERF.md's batch-64 row with the transposed default).
# 3. where batch 1 goes now (8 kernels): the per-kernel profile of the compiled fp8 step, with PDL
#    off (KIMI_OPS_PDL=0: each kernel's own time) and on (the default).
# 4. test_fp8_weights + test_runtime_gpu on the GPU in what time is left.
set -uo pipefail
mkdir -p ${OUT:-out}; OUT=$(cd ${OUT:-out} && pwd); export PYTHONUNBUFFERED=1
. scripts/device_env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
timeout 160 python3 exp/s33_sweep.py 140 > $OUT/sweep.log 2>&1; echo "sweep rc=$? at ${SECONDS}s"; grep -v Warn $OUT/sweep.log | tail -n 32
ls kimi_ops/_C*.so >/dev/null 2>&1 || { ( time MAX_JOBS=16 python3 setup.py build_ext --inplace ) > $OUT/build.log 2>&1; echo "build rc=$? at ${SECONDS}s"; }
timeout 100 python3 scripts/bench_layer.py --only-ours --variants ours_compiled_graph \
  --weights fp8 --batches 16,32,64 --out $OUT/layer > $OUT/layer.log 2>&1
echo "layer rc=$? at ${SECONDS}s"; grep -E "^\| fp8" $OUT/layer/bench_layer.md 2>/dev/null | cut -d'|' -f2,3,7
for pdl in 0 1; do
  KIMI_OPS_PDL=$pdl timeout 70 python3 scripts/bench_layer.py --only-ours --variants ours_compiled_graph \
    --weights fp8 --batches 1 --profile --out $OUT/profile_pdl$pdl > $OUT/profile_pdl$pdl.log 2>&1
  echo "profile PDL=$pdl rc=$? at ${SECONDS}s"; grep -E "^ +[0-9.]+ us|profile of|^\| fp8" $OUT/profile_pdl$pdl.log | head -n 14
done
timeout $(( 575 - SECONDS )) python3 -m pytest -q -n 14 -p no:cacheprovider -rf --tb=short tests/test_fp8_weights.py \
  tests/test_runtime_gpu.py -k "not interp" > $OUT/pytest.log 2>&1
echo "pytest rc=$? at ${SECONDS}s"; tail -n 2 $OUT/pytest.log; grep -E "^FAILED|^ERROR" $OUT/pytest.log | head
