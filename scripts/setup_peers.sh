#!/usr/bin/env bash
# Device side: install the carried peer wheels (.whl/) into /tmp/site and check the unpacked
# peers (.peers/: vLLM's Triton file, FlashInfer with its prebuilt kernels, FlashMLA's two .so).
# Run from the repo root; idempotent. scripts/peers.py finds both by itself
# (.peers/flashinfer first on sys.path, /tmp/site last); the exports printed at the end are
# for using them from any other Python.
# Never fails: a peer that cannot load is reported by the benchmark, which should still run.
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n '2,/^[^#]/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; fi
SITE=${KIMI_PEERS_SITE:-/tmp/site}
mkdir -p "$SITE"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
    || echo "WARNING: pip install of .whl/*.whl into $SITE failed (see above)"
fi
for f in .peers/vllm/triton_decode_attention.py .peers/flashinfer/flashinfer/__init__.py \
         .peers/flashmla/_flashmla_C.abi3.so .peers/flashmla/_flashmla_extension_C.abi3.so; do
  [ -f "$f" ] && echo "peer file: $f" || echo "MISSING: $f (that peer will report 'did not run')"
done
ls -d .peers/flashinfer/flashinfer/data/aot/*/ 2>/dev/null | sed 's#^#prebuilt flashinfer kernel: #' \
  || echo "no prebuilt flashinfer kernel: its JIT build would need the full wheel"
echo "export PYTHONPATH=$PWD/.peers/flashinfer:\${PYTHONPATH:+\$PYTHONPATH:}$SITE"
echo "export FLASHINFER_WORKSPACE_BASE=/tmp/flashinfer-ws"
