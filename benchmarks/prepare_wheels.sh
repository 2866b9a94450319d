#!/usr/bin/env bash
# Fills wheels/ (ignored by git) with the pure-Python wheels the GPU check needs on a GPU machine
# without network access or without torchtitan (tested with Python 3.12, torch 2.11, triton 3.6):
# torchtitan 0.3.0 and the 8 packages it imports beyond torch (docs/gpu-check.md), plus the peers
# timed beside our depth read. Run it where a package registry is reachable, copy the folder to
# the GPU machine with the repository, and benchmarks/gpu_check.sh installs what is missing there.
#   benchmarks/prepare_wheels.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-wheels}
PY=${PYTHON:-python3}
# Pinned: the versions checked against torch 2.11 on CPU (model build, cpu_smoke training).
MODEL=(torchtitan==0.3.0 spmd_types==0.2.3 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.6.1)
TRAIN=(torchdata==0.11.0 datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18)
# Peers' Requires-Dist (fla-core: einops; liger-kernel, flash-attn-res: torch, triton;
# fast-attnres: torch>=2.10) are expected on the GPU machine, so the peers travel alone.
PEERS=(fla-core==0.6.0 liger-kernel==0.8.5 fast-attnres==2.1.0 flash-attn-res==0.1.12)

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# --python-version 3.12: multiprocess ships one wheel per Python (py311, py312); a plain download
# on Python 3.11 would fetch one that does not install on the GPU machine's Python 3.12.
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$tmp" \
  "${MODEL[@]}" "${TRAIN[@]}" "${PEERS[@]}"

# Only pure-Python wheels can travel to another machine's interpreter; refuse anything else.
for w in "$tmp"/*.whl; do
  case "$(basename "$w")" in
    *-none-any.whl) ;;
    *) echo "prepare_wheels: $(basename "$w") is not pure Python" >&2; exit 1 ;;
  esac
  unzip -p "$w" '*.dist-info/WHEEL' | grep -q '^Root-Is-Purelib: true' ||
    { echo "prepare_wheels: $(basename "$w") is not purelib" >&2; exit 1; }
done

# Replace the folder's wheels so no stale second version stays (two versions stop the install).
mkdir -p "$DIR"
rm -f "$DIR"/*.whl
mv "$tmp"/*.whl "$DIR"/
n=$(ls "$DIR"/*.whl | wc -l)
kib=$(du -sk "$DIR" | cut -f1)
echo "prepare_wheels: $n wheels, $((kib / 1024)).$(((kib % 1024) * 10 / 1024)) MiB in $DIR/"
# The folder travels with the repository (~4.4 MiB expected); refuse anything far larger.
if [ "$kib" -gt $((16 * 1024)) ]; then
  echo "prepare_wheels: $DIR is over 16 MiB" >&2
  exit 1
fi
