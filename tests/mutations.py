"""Mutation check (not in CI): deliberate bugs in the maths must each fail the fast tests.

    python tests/mutations.py [--only NAME ...] [--json FILE] [--keep]

Each mutant is one or more exact text substitutions, applied to a copy of the working tree
(tracked and untracked, not ignored) in a temp folder; the fast subset (``SUBSET``) then runs
there with the CI hypothesis profile and stops at the first failure. The unmutated copy runs
first and must pass, else no kill means anything. Prints one line per mutant (killed by which
test, or SURVIVED) and exits 1 if any mutant survived.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The fast subset, quickest files first (pytest -x stops at the first failure): the maths tests
# (schedule, reference, C kernels, ops), the model against the independent slow loop, the golden
# loss curves; then the Triton kernels under the interpreter (TRITON_INTERPRET=1).
CO = "tests/custom_ops/"
SUBSET = [
    [CO + "test_schedule.py", CO + "test_reference_maths.py", CO + "test_cpu_kernels.py",
     CO + "test_custom_ops_read.py", "tests/titan_lrattnres/model/test_model.py",
     "tests/titan_lrattnres/model/test_block_layers.py", CO + "test_extreme_inputs.py",
     "tests/titan_lrattnres/training/test_golden.py"],
    ["tests/custom_ops_interp"],
]  # fmt: skip
DEPTH, MODEL, SCHED = (
    "titan_lrattnres/model/depth.py",
    "titan_lrattnres/model/model.py",
    "custom_ops/schedule.py",
)
REF, C, TRITON = (
    "custom_ops/reference.py",
    "custom_ops/cpu/depth_read.c",
    "custom_ops/kernels/merge.py",
)
EXTRAS = "extras = [*new_values, *([] if partial is None else [partial])]"
SITE = "h, row = read(row, partial, partial_key), row + 1"

# name -> [(file, old, new)]; each old text must occur exactly once in its file
MUTANTS: dict[str, list[tuple[str, str, str]]] = {
    "drop the partial": [
        (DEPTH, "return reference.merge_reads(out1, lse1, out2, lse2)[0]", "return out1"),
    ],
    "a block completed inside the layer left out": [
        (MODEL, EXTRAS, "extras = [] if partial is None else [partial]"),
    ],
    "addition instead of replacement": [
        (MODEL, SITE, "h, row = read(row, partial, partial_key) + values[-1], row + 1"),
    ],
    "wrong block end (floor)": [
        (
            SCHED,
            "return [-(-num_sublayers * i // n)",
            "return [(num_sublayers * i // n)",
        ),
    ],
    "key norm eps 1e-5": [
        (REF, "DEFAULT_EPS = torch.finfo(torch.float32).eps", "DEFAULT_EPS = 1e-5"),
    ],
    "missing key norm (reference)": [
        (
            REF,
            "return k / torch.hypot(rms, root_eps)",
            "return k",
        ),
    ],
    "missing key norm (C kernel)": [
        (
            C,
            "float rstd = (float)(1.0 / sqrt(ss / (double)r + eps));",
            "float rstd = 1.0f;",
        ),
    ],
    "P-LR key not normalised at emission": [
        (MODEL, "return o, key_rmsnorm(k, self.eps)", "return o, k.float()"),
    ],
    "S-LR head instead of tail": [
        (
            REF,
            "return [v[..., v.shape[-1] - rank :] for v in values]",
            "return [v[..., :rank] for v in values]",
        ),
    ],
    "merge without the LSE (C kernel)": [
        (C, "float w1 = expf(lse1 - m), w2", "float w1 = 1.0f, w2"),
    ],
    "merge without the LSE (reference)": [
        (
            REF,
            "w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)",
            "w1, w2 = torch.exp(lse1 * 0), torch.exp(lse2 * 0)",
        ),
    ],
    "merge without the LSE (Triton)": [
        (
            TRITON,
            "w1, w2 = tl.exp(lse1 - m), tl.exp(logit - m)",
            "w1, w2 = tl.exp(lse1 * 0.0), tl.exp(logit - m)",
        ),
    ],
    "query gradient of one token tile (Triton)": [
        (TRITON, "return (*grads, dq.sum(0))", "return (*grads, dq[0])"),
    ],
}


def _copy_tree(dst: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for f in filter(None, files):
        src = ROOT / f
        if src.is_file():
            (dst / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / f)


def _apply(tree: Path, edits) -> None:
    for file, old, new in edits:
        path = tree / file
        text = path.read_text()
        n = text.count(old)
        if n != 1:
            raise SystemExit(f"mutation target occurs {n} times in {file} (need 1): {old!r}")
        path.write_text(text.replace(old, new))


def _run_subset(tree: Path) -> tuple[str | None, float]:
    """First failing test id (None if all passed) and seconds spent."""
    env = dict(os.environ, CI="1", PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    env.pop("TRITON_INTERPRET", None)
    t0 = time.perf_counter()
    for paths in SUBSET:
        e = dict(env, TRITON_INTERPRET="1") if "custom_ops_interp" in paths[0] else env
        cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-rf", *paths]
        p = subprocess.run(cmd, cwd=tree, env=e, capture_output=True, text=True)
        if p.returncode != 0:
            m = re.search(r"^FAILED (\S+)", p.stdout, re.M)
            if m is None:  # a collection or usage error: the mutant is broken, not killed
                tail = p.stdout.strip().splitlines()[-1:] or [""]
                raise SystemExit(f"pytest exit {p.returncode} without a failed test: {tail[0]}")
            return m.group(1), time.perf_counter() - t0
    return None, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", help="mutant names (substring match)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--keep", action="store_true", help="keep the mutant trees")
    ns = ap.parse_args()
    names = [n for n in MUTANTS if not ns.only or any(o in n for o in ns.only)]
    base = Path(tempfile.mkdtemp(prefix="mutants-"))
    results = {}
    try:
        clean = base / "clean"
        _copy_tree(clean)
        failed, secs = _run_subset(clean)
        print(f"{'(unmutated)':45s} {'passes' if failed is None else 'FAILS: ' + failed} "
              f"({secs:.0f} s)", flush=True)  # fmt: skip
        if failed is not None:
            return 2
        for i, name in enumerate(names):
            tree = base / f"m{i}"
            _copy_tree(tree)
            _apply(tree, MUTANTS[name])
            killer, secs = _run_subset(tree)
            results[name] = {"killed_by": killer, "seconds": round(secs, 1)}
            print(f"{name:45s} {'killed by ' + killer if killer else 'SURVIVED'} ({secs:.0f} s)",
                  flush=True)  # fmt: skip
            if not ns.keep:
                shutil.rmtree(tree)
    finally:
        if not ns.keep:
            shutil.rmtree(base, ignore_errors=True)
    if ns.json:
        Path(ns.json).write_text(json.dumps(results, indent=2) + "\n")
    survived = [n for n, r in results.items() if r["killed_by"] is None]
    print(f"{len(results) - len(survived)}/{len(results)} mutants killed")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
