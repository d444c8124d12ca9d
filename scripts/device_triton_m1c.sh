#!/usr/bin/env bash
# One H200 call for issue 29 (run from /work/main's copy root; this worktree rsynced to
# .xfer/triton2): the Triton GPU tests, the old-vs-new lse check on rising scores, then
# issue 27's grid for the triton backend beside vLLM's Triton MLA and FlashInfer.
#   run(command="bash .xfer/triton2/scripts/device_triton_m1c.sh", carry=[".xfer/triton2", ".whl", ".peers"])
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
start=$(date +%s)
ROOT=$PWD
bash scripts/setup_peers.sh > "$OUT/setup.log" 2>&1
eval "$(grep '^export ' "$OUT/setup.log")"
cd .xfer/triton2
ln -sfn "$ROOT/.peers" .peers; ln -sfn "$ROOT/.whl" .whl
export PYTHONPATH=$PWD:${PYTHONPATH:-} KIMI_OPS_NO_EXTENSION=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
timeout ${T_TEST:-95} python3 -m pytest -q -rs -s tests/test_triton_attention.py -k "gpu and not fp8-" -p no:cacheprovider > "$OUT/pytest.log" 2>&1
echo "pytest rc=$? ($(( $(date +%s) - start )) s)"
grep -E "worst|passed|failed|Error|assert" "$OUT/pytest.log" | tail -n 40
timeout 20 python3 - <<'PY' 2>&1 | tail -n 8
import sys, torch
sys.path.insert(0, "tests")
import test_triton_attention as t
import kimi_ops.kernels.attention as A
import kimi_ops.kernels.triton_m1c as M
for name, K in (("first generation", A), ("triton_m1c", M)):
    for rise, ks in ((40.0, 2.0), (256.0, 2.0), (256.0, 12.0)):
        try:
            w = t.check_rising(12, 1, rise, kv_scale=ks, device="cuda", gen=torch.Generator().manual_seed(1), kernels=K)
            print(name, rise, ks, f"worst |dlse| {w:.3e}")
        except AssertionError as e:
            print(name, rise, ks, "FAILS", str(e)[:120])
PY
left=$(( ${CALL_BUDGET:-185} - ($(date +%s) - start) ))
echo "bench: ${left} s left"
timeout "$left" python3 scripts/bench_attention.py --grid issue27 --backends triton --mma bf16 \
    --peers vllm_triton,flashinfer --reps 7 --out "$OUT" > "$OUT/bench.log" 2>&1
echo "bench rc=$? ($(( $(date +%s) - start )) s)"
grep -E "^H[0-9]+ B|Traceback|Error" "$OUT/bench.log" | cut -c1-400 | head -n 30
cat "$OUT/bench_attention_peers.md" 2>/dev/null | head -n 30
