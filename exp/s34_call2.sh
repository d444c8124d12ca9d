#!/usr/bin/env bash
# Session 34, branch s33/gemv-m16 (exp/m16_tree = git archive of it; refresh after changing it):
#   run(command="bash exp/s34_call2.sh", carry=["exp", ".whl"], timeout_s=590)
# The sm90 GEMV at 9-32 rows, fp8 and bf16 weights (two / four 8-token MMA tiles, one k-block a step).
# Predicted: fp8 qkv_a + gate at M 16 / 32 ~19 / ~23 us (Triton tl.dot) -> 11-14 us; q_b / o_proj
# -30-50%; the fp8 layer at batch 16 91.5 -> 75-80 us, batch 32 116 -> 100-105; bf16 (cuBLAS today)
# batch 32 107.6 -> 100-104; batch 8 unchanged. KIMI_OPS_SM90_GEMV=8: rows capped at 8 (main's path).
set -uo pipefail
mkdir -p ${OUT:-out}; OUT=$(cd ${OUT:-out} && pwd); export PYTHONUNBUFFERED=1
. scripts/device_env.sh
R=$PWD/exp/m16_tree; cd $R
ls kimi_ops/_C*.so >/dev/null 2>&1 || cp /tmp/m16_C/_C*.so kimi_ops/ 2>/dev/null || { ( time MAX_JOBS=16 python3 setup.py build_ext --inplace ) > $OUT/build.log 2>&1; echo "build rc=$? at ${SECONDS}s"; mkdir -p /tmp/m16_C; cp kimi_ops/_C*.so /tmp/m16_C/; }
export PYTHONPATH=$R${PYTHONPATH:+:$PYTHONPATH}
timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider -rf --tb=short tests/test_gemv.py tests/test_fp8_weights.py -k "not interp" > $OUT/pytest.log 2>&1
echo "pytest rc=$? at ${SECONDS}s"; tail -n 2 $OUT/pytest.log; grep -E "^FAILED|^ERROR" $OUT/pytest.log | head
for e in 8 1; do
  KIMI_OPS_SM90_GEMV=$e timeout 90 python3 scripts/bench_gemv.py --m 8,16,24,32 --out $OUT/gemv_$e > $OUT/gemv_$e.log 2>&1
  echo "bench_gemv KIMI_OPS_SM90_GEMV=$e rc=$? at ${SECONDS}s"; grep -E "^\|" $OUT/gemv_$e/bench_gemv.md | head -n 12
done
for r in 1 2; do for e in 8 1; do
  KIMI_OPS_SM90_GEMV=$e timeout 100 python3 scripts/bench_layer.py --only-ours --variants ours_compiled_graph \
    --weights fp8,bf16 --batches 8,16,32 --out $OUT/layer_$e$r > $OUT/layer_$e$r.log 2>&1
  echo "layer GEMV=$e round $r rc=$? at ${SECONDS}s"; grep -E "^\| (fp8|bf16)" $OUT/layer_$e$r/bench_layer.md | cut -d'|' -f2,3,7
done; done
