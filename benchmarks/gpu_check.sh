#!/usr/bin/env bash
# One GPU check for a machine with torch (>= 2.11) + CUDA and NO torchtitan, within ~6 minutes:
# opcheck + reference parity on CUDA, op bandwidth (d in {1024, 4096}, S in {5, 9, 17, 49},
# 16k tokens, bf16), and a layer-stack training step per variant (ratios to baseline).
#   benchmarks/gpu_check.sh [JSON_PATH] [--dry-run]     (--dry-run: tiny shapes, CPU)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}"
mkdir -p benchmarks/results
exec timeout 360 "$PY" -m benchmarks.gpu_check "$@"
