#!/usr/bin/env bash
# The GPU image rehearsed on the CPU (make gpu-rehearsal; not part of make test): a virtual
# environment of the GPU image's versions, none of this project's own environment: Python 3.12
# where one is found (else 3.11), torch 2.11.0 (the registry's build, which runs on the CPU),
# triton 3.6.0 where installable, and the packages the image brings (numpy, pandas, pyarrow,
# matplotlib, huggingface-hub, tokenizers, tensorboard, pytest); torchtitan and the rest come
# only from the carried wheels/ (prepare_wheels.sh), installed by gpu_check.sh into a private
# folder as on the GPU machine, which also puts the torch_compat shims on PYTHONPATH (torch <
# 2.14). Then both dry runs, end to end:
#   benchmarks/gpu_check.sh --dry-run            (every section of the check, tiny shapes)
#   benchmarks/gpu_check.sh --speed --dry-run    (the training-speed plan, tiny shapes; one
#                                                 variant, the baseline, made to fail)
# Output: LOGS (default /tmp/lrattnres_rehearsal)/{check,speed}.{json,log}.
#   benchmarks/gpu_rehearsal.sh [LOGS]
set -euo pipefail
cd "$(dirname "$0")/.."
LOGS=${1:-/tmp/lrattnres_rehearsal}
VENV=${REHEARSAL_VENV:-$HOME/.cache/titan-lrattnres/gpu-image-torch2.11}
TORCH=${REHEARSAL_TORCH:-2.11.0}
TRITON=${REHEARSAL_TRITON:-3.6.0}
mkdir -p "$LOGS"

if [ ! -x "$VENV/bin/python" ]; then
  base=""
  for c in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12 python3.11; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import venv' 2>/dev/null; then base=$c; break; fi
  done
  [ -n "$base" ] || { echo "gpu_rehearsal: no Python 3.12 or 3.11 found" >&2; exit 1; }
  echo "[gpu_rehearsal] creating $VENV with $("$base" --version)"
  "$base" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q -U pip
  # the registry's default build (CUDA, ~3 GB with its nvidia wheels; runs on the CPU);
  # REHEARSAL_TORCH_INDEX=https://download.pytorch.org/whl/cpu for the CPU-only build
  "$VENV/bin/python" -m pip install -q ${REHEARSAL_TORCH_INDEX:+--index-url "$REHEARSAL_TORCH_INDEX"} \
    "torch==$TORCH"
  "$VENV/bin/python" -m pip install -q "triton==$TRITON" ||
    echo "[gpu_rehearsal] triton $TRITON not installable here: going on without it"
  touch "$VENV/.complete"
fi
[ -f "$VENV/.complete" ] || { echo "gpu_rehearsal: $VENV is incomplete; remove it" >&2; exit 1; }
# What the GPU image brings beside torch: torchtitan's and datasets' other imports (tensorboard:
# torchtitan's metrics import it at module level; the GPU image's Trainer ran, so it has it).
# Installed on every run (a no-op once there), so the list can grow without a new venv.
"$VENV/bin/python" -m pip install -q numpy pandas "pyarrow>=21" matplotlib huggingface-hub \
  tokenizers safetensors "fsspec<=2026.2.0" requests tqdm xxhash pyyaml filelock packaging \
  httpx tensorboard pytest hypothesis 2> >(grep -v "^WARNING: Location" >&2)
if ! compgen -G "wheels/*.whl" >/dev/null; then
  PYTHON="$VENV/bin/python" benchmarks/prepare_wheels.sh
fi
"$VENV/bin/python" - <<'PY'
import importlib.metadata as m
for d in ("torch", "triton", "torchtitan"):
    try:
        print(f"[gpu_rehearsal] {d} {m.version(d)}")
    except m.PackageNotFoundError:
        print(f"[gpu_rehearsal] {d}: not installed (the carried wheels bring torchtitan)")
PY
# the venv's own Python, nothing of the project's environment; a fresh wheel site and caches
export PYTHON="$VENV/bin/python" PYTHONPATH="" LRATTNRES_WHEEL_SITE="$LOGS/wheel_site"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 LRATTNRES_COMPAT_VERBOSE=1
rm -rf "$LRATTNRES_WHEEL_SITE"
rc=0
set -o pipefail
echo "[gpu_rehearsal] gpu_check.sh --dry-run"
benchmarks/gpu_check.sh "$LOGS/check.json" --dry-run 2>&1 | tee "$LOGS/check.log" || true
# Every section must pass but one known gap: context_parallel's 2 CPU ranks reach
# fully_shard(dp_mesh_dims=...), which torch 2.11 lacks and torch_compat does not patch (one GPU
# never reaches it: docs/gpu-check.md, "Not patched"); it is reported, not hidden.
"$PYTHON" - "$LOGS/check.json" <<'PY' || rc=1
import json, sys
r = json.load(open(sys.argv[1]))
bad, known = [], []
for name in r["caps_s"]:
    s = r.get(name, {})
    err = s.get("error") or ("all_ok False" if s.get("all_ok") is False else None)
    if err is None:
        continue
    text = json.dumps(s)
    if name == "context_parallel" and "dp_mesh_dims" in text:
        known.append(name)
    else:
        bad.append(f"{name}: {str(err).strip().splitlines()[-1][:200]}")
print(f"[gpu_rehearsal] check dry run: torch {r['versions']['torch']}, "
      f"shims {r['versions']['torch_compat_patches']}: "
      + ("every section ok" if not bad else f"BAD: {bad}")
      + (f"; known gap (not patched): {known} fully_shard(dp_mesh_dims=...) at 2 ranks"
         if known else ""))
sys.exit(1 if bad else 0)
PY
echo "[gpu_rehearsal] gpu_check.sh --speed --dry-run --fail-variant baseline"
# one variant made to fail on purpose: the run reports FAILED for it alone (exit status 1)
benchmarks/gpu_check.sh --speed "$LOGS/speed.json" --dry-run --fail-variant baseline 2>&1 |
  tee "$LOGS/speed.log" || true
"$PYTHON" - "$LOGS/speed.json" <<'PY' || rc=1
import json, sys
r = json.load(open(sys.argv[1]))
bad = []
if not r.get("gate", {}).get("all_ok"):
    bad.append("gate")
for name, case in r["step_ratios"]["cases"].items():
    rows = case.get("variants") or {}
    if "made to fail on purpose" not in rows.get("baseline", {}).get("error", ""):
        bad.append(f"{name}/baseline did not fail")
    for v, row in rows.items():
        if ("error" in row) != (v == "baseline"):
            bad.append(f"{name}/{v}: {row.get('error')}")
for c, run in r["trainer"]["runs"].items():
    if run.get("returncode") != 0 or not run.get("tokens_per_s"):
        bad.append(f"trainer {c}")
print(f"[gpu_rehearsal] speed dry run: torch {r['versions']['torch']}, "
      f"shims {r['versions']['torch_compat_patches']}, "
      + ("every figure as expected (baseline failed on purpose)" if not bad else f"BAD: {bad}"))
sys.exit(1 if bad else 0)
PY
echo "[gpu_rehearsal] $([ $rc = 0 ] && echo OK || echo FAILED); logs in $LOGS"
exit $rc
