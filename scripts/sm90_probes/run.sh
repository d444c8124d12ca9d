#!/usr/bin/env bash
# Builds and runs the sm_90a probes on this machine's GPU (nvcc and an sm_90 GPU needed; ~1 min):
# wgmma_rates.py (wgmma's rate by N and operand path) and tile_phases.cu (splitkv_tm_kernel's
# per-tile pieces). BUILD (default build/sm90_probes) takes the generated source and binaries.
set -euo pipefail
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; fi
here=$(cd "$(dirname "$0")" && pwd)
build=${BUILD:-$here/../../build/sm90_probes}
mkdir -p "$build"
python3 "$here/wgmma_rates.py" --build "$build"
nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -I "$here/../../csrc/sm90" \
  -o "$build/tile_phases" "$here/tile_phases.cu"
"$build/tile_phases"
