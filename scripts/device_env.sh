# Sourced by the device scripts: $OUT for logs, unbuffered Python, and the wheels carried in
# .whl/ (run(..., carry=[".whl"]): test dependencies the device image lacks) on PYTHONPATH.
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
