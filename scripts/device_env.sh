# Sourced by the device scripts: $OUT for logs, unbuffered Python, and the wheels carried in
# .whl/ (run(..., carry=[".whl"]): test dependencies the device image lacks) on PYTHONPATH.
# Run by itself with --help it prints this and does nothing.
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
    sed -n '1,/^[^#]/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; return 0 2>/dev/null || exit 0
fi
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
