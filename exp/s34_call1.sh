#!/usr/bin/env bash
# Session 34's first call, on main (session 33: the fp8 GEMM transposed at M >= 33 by default):
#   run(command="bash exp/s34_call1.sh", carry=["exp", ".whl"], timeout_s=590)
# 1. the fp8 GEMM at M 16 / 32 alone: configs x the transposed form (exp/s33_sweep.py; no _C needed):
#    predicted: some transposed 16 / 32-row config (wgmma m64nM with the weight in registers) beats
#    today's mma.sync tiles by >= 10% at qkv_a + gate (M 32: 22.7 us in session 20's sweep).
# 2. build; test_fp8_weights (the transposed default at M 64 on the GPU) and test_runtime_gpu.
# 3. the fp8 layer at batch 16, 32, 64 (the PERF.md row of batch 64 with the transposed default).
set -uo pipefail
mkdir -p ${OUT:-out}; OUT=$(cd ${OUT:-out} && pwd); export PYTHONUNBUFFERED=1
. scripts/device_env.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
timeout 200 python3 exp/s33_sweep.py 180 > $OUT/sweep.log 2>&1; echo "sweep rc=$? at ${SECONDS}s"; grep -v Warn $OUT/sweep.log | tail -n 32
ls kimi_ops/_C*.so >/dev/null 2>&1 || { ( time MAX_JOBS=16 python3 setup.py build_ext --inplace ) > $OUT/build.log 2>&1; echo "build rc=$? at ${SECONDS}s"; }
timeout 120 python3 -m pytest -q -n 14 -p no:cacheprovider -rf --tb=short tests/test_fp8_weights.py tests/test_runtime_gpu.py \
  -k "not interp" > $OUT/pytest.log 2>&1
echo "pytest rc=$? at ${SECONDS}s"; tail -n 2 $OUT/pytest.log; grep -E "^FAILED|^ERROR" $OUT/pytest.log | head
timeout $(( 570 - SECONDS )) python3 scripts/bench_layer.py --only-ours --variants ours_compiled_graph \
  --weights fp8 --batches 16,32,64 --out $OUT/layer > $OUT/layer.log 2>&1
echo "layer rc=$? at ${SECONDS}s"; grep -E "^\|" $OUT/layer/bench_layer.md 2>/dev/null | head -n 8
