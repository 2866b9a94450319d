#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py says what it measures, against which targets, and how
# it is sized to stay within 6 minutes on an H200; docs/gpu-check.md says how to run it). Runs the
# project's own model and Trainer on one GPU, with the project's environment or without
# torchtitan and network (tested with Python 3.12, torch 2.11, triton 3.6): the wheels in wheels/
# (benchmarks/prepare_wheels.sh) that are not installed go to a private folder on PYTHONPATH,
# and on torch < 2.14 benchmarks/torch_compat/ (a sitecustomize) patches what torchtitan 0.3.0
# needs before anything imports it.
#   benchmarks/gpu_check.sh [JSON_PATH] [--dry-run] [--sections a,b,...]
#   (--dry-run: tiny shapes on CPU, every section, under a minute)
#   benchmarks/gpu_check.sh --speed [JSON_PATH] [--dry-run] [--sections ...]: the training-speed
#   run instead (benchmarks/gpu_speed.py: step ratios against torchtitan's decoder, the kernel
#   table, the Trainer's tokens/s), within 9 minutes
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d)}"
MODULE=benchmarks.gpu_check
BUDGET=345
if [ "${1:-}" = "--speed" ]; then
  shift
  MODULE=benchmarks.gpu_speed
  BUDGET=525
fi
# Everything below, pip included, within 6 minutes (9 with --speed: GPU_CHECK_SECONDS + 15 s); the
# Python side gets the end as a deadline. A longer budget suits a single section run alone.
export GPU_CHECK_END=$(($(date +%s) + ${GPU_CHECK_SECONDS:-$BUDGET}))

# Wheels whose distribution is missing (any version present counts: never shadow an installed one).
if compgen -G "wheels/*.whl" >/dev/null; then
  missing=$("$PY" - wheels/*.whl <<'EOF'
import importlib.metadata, os, sys
for wheel in sys.argv[1:]:
    try:
        importlib.metadata.version(os.path.basename(wheel).split("-")[0])
    except importlib.metadata.PackageNotFoundError:
        print(wheel)
EOF
)
  if [ -n "$missing" ]; then
    site=${LRATTNRES_WHEEL_SITE:-/tmp/lrattnres_wheels}
    # shellcheck disable=SC2086 (one wheel path per word)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" $missing
    export PYTHONPATH="$PYTHONPATH:$site"
    echo "[gpu_check.sh] installed $(echo "$missing" | wc -l) carried wheels into $site"
  fi
fi
# importlib.metadata: the version without importing torch (seconds).
if "$PY" -c 'import importlib.metadata as m, sys
v = tuple(int(x) for x in m.version("torch").split("+")[0].split(".")[:2])
sys.exit(0 if v < (2, 14) else 1)'; then
  export PYTHONPATH="$PWD/benchmarks/torch_compat:$PYTHONPATH"
  echo "[gpu_check.sh] torch < 2.14: benchmarks/torch_compat on PYTHONPATH"
fi
mkdir -p benchmarks/results
exec timeout $((GPU_CHECK_END + 15 - $(date +%s))) "$PY" -m "$MODULE" "$@"
