"""Golden loss curves: record them, and compare a fresh recording with the stored one.

    python -m tests.titan_lrattnres.golden.regen          # replace curves.json with this machine's
    python -m tests.titan_lrattnres.golden.regen --add    # add / replace this environment's entry

A recording is one 20-step fp32 run per variant (``train_configs.tiny``: baseline, standard Full,
standard Block, sliced Block, projected Block) through ``python -m titan_lrattnres.train`` with
``--debug.deterministic``, one thread, on the tiny stdlib corpus (``trainer_runs``): the per-step
loss and grad norm and the final validation loss.

``curves.json`` holds entries ``{"environment", "curves"}``; ``environment`` is
``trainer_runs.environment()``. A fresh recording is compared with the entry of
- the same software and hardware: bit for bit (the run is deterministic: two recordings here
  agree to the bit);
- the same software (``SOFTWARE``), other hardware: within ``TOLERANCE``, with a warning saying
  so. Measured here against the stored curves: ATen's SIMD dispatch forced from AVX2 to none,
  the C kernels built for generic x86-64 instead of -march=native, or 2 threads instead of 1
  move the losses by at most 5.5e-7 relative, the val losses 1.3e-7, the grad norms 2.7e-4
  (the norm is the touchy one: see tests/titan_lrattnres/parallel/test_parity.py); scaling every
  depth logit by 1.01 (one line of the C kernel) moves the routed variants' losses by 1.5e-5 to 1e-4
  and their grad norms by 4.9e-4 to 3.9e-2, and fails all four within the tolerance too;
- other software (another torch, torchtitan, Python/stdlib or corpus): not compared; the test
  fails with this command, since bits and drift both change with them and a tolerance wide
  enough for them would hide real changes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import tempfile
from pathlib import Path

from tests.titan_lrattnres.trainer_runs import launch, tiny_corpus_env

HERE = Path(__file__).resolve().parent
CURVES = HERE / "curves.json"
COMMAND = "python -m tests.titan_lrattnres.golden.regen"
VARIANTS = ("tiny_baseline", "tiny_attnres_full", "tiny_attnres", "tiny_sliced", "tiny_projected")
FLAGS = ["--checkpoint.no-enable", "--debug.deterministic"]
SOFTWARE = ("python", "torch", "torchtitan", "corpus")
HARDWARE = (
    "machine",
    "cpu",
    "cpu_flags_sha256",
    "cpu_capability",
    "threads",
    "c_compiler",
    "c_kernels",
)
TOLERANCE = {"loss": 5e-6, "val_loss": 5e-6, "grad_norm": 2e-3}  # relative, other hardware


class NotComparable(Exception):
    """No stored entry has this software; the message says what differs and how to record."""


def record(workdir: Path, env: dict[str, str]) -> dict:
    """``{"environment", "curves": {variant: {"loss": [...], "grad_norm": [...],
    "val_loss"}}}`` from one launch of the five runs."""
    runs = [{"name": v, "argv": [v, "--dump_folder", str(workdir / v), *FLAGS]} for v in VARIANTS]
    results, environment = launch(runs, workdir, env)
    curves = {}
    for v in VARIANTS:
        r = results[v]
        if r["rc"] != 0 or not r["history"]:
            raise RuntimeError(f"golden run {v} failed:\n{r['output'][-4000:]}")
        curves[v] = {
            "loss": [h["loss"] for h in r["history"]],
            "grad_norm": [h["grad_norm"] for h in r["history"]],
            "val_loss": r["val_history"][-1]["loss"],
        }
    return {"environment": environment, "curves": curves}


def load(path: Path = CURVES) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"entries": []}


def _diff(a: dict, b: dict, keys) -> dict:
    return {k: (a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)}


def match(stored: dict, environment: dict) -> tuple[dict, dict]:
    """``(entry, hardware differences)``: the stored entry to compare with, bit for bit when the
    differences are empty. Raises ``NotComparable`` when no entry has this software."""
    same = [e for e in stored["entries"] if not _diff(e["environment"], environment, SOFTWARE)]
    if not same:
        recorded = "; ".join(
            ", ".join(f"{k} {e['environment'].get(k)}" for k in SOFTWARE) for e in stored["entries"]
        )
        here = ", ".join(f"{k} {environment.get(k)}" for k in SOFTWARE)
        raise NotComparable(
            f"no golden curves for this software ({here}); recorded: {recorded or 'none'}. "
            "Curves are compared only within one software version (bits and drift change with "
            f"torch, torchtitan, the stdlib and the corpus). Record them here with `{COMMAND}` "
            "(`--add` keeps the other entries), check that the change of versions explains the "
            "new curves, and commit tests/titan_lrattnres/golden/curves.json."
        )
    exact = [e for e in same if not _diff(e["environment"], environment, HARDWARE)]
    if exact:
        return exact[0], {}
    return same[0], _diff(same[0]["environment"], environment, HARDWARE)


def compare(stored: dict, fresh: dict, *, bitwise: bool) -> list[str]:
    """Readable differences between two variants' curves (empty when they agree)."""
    problems = []
    for key in ("loss", "grad_norm"):
        a, b = stored[key], fresh[key]
        if len(a) != len(b):
            problems.append(f"{key}: {len(b)} steps recorded now, {len(a)} stored")
            continue
        for step, (x, y) in enumerate(zip(a, b), start=1):
            rel = abs(x - y) / abs(x)
            if (x != y) if bitwise else rel > TOLERANCE[key]:
                problems.append(f"{key} at step {step}: stored {x!r}, now {y!r} (rel {rel:.1e})")
    x, y = stored["val_loss"], fresh["val_loss"]
    rel = abs(x - y) / abs(x)
    if (x != y) if bitwise else rel > TOLERANCE["val_loss"]:
        problems.append(f"val_loss: stored {x!r}, now {y!r} (rel {rel:.1e})")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    p.add_argument("--add", action="store_true", help="keep the entries of other environments")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lrattnres-golden-") as tmp:
        env = tiny_corpus_env(Path(tmp) / "data")
        fresh = record(Path(tmp) / "runs", env)
    stored = load()
    entries = stored["entries"] if args.add else []
    entries = [
        e for e in entries if _diff(e["environment"], fresh["environment"], SOFTWARE + HARDWARE)
    ]
    fresh["recorded"] = datetime.date.today().isoformat()
    entries.append(fresh)
    out = {
        "about": (
            "Golden loss curves (tests/titan_lrattnres/training/test_golden.py); "
            f"write with {COMMAND}"
        ),
        "runs": {v: [v, *FLAGS] for v in VARIANTS},
        "entries": entries,
    }
    text = json.dumps(out, indent=1)
    # one line per curve: lists of numbers (and of flags) inline
    text = re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m[1].split()) + "]", text)
    CURVES.write_text(text + "\n")
    for v, c in fresh["curves"].items():
        print(f"{v}: loss {c['loss'][0]:.4f} -> {c['loss'][-1]:.4f}, val {c['val_loss']:.4f}")
    print(f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'} in {CURVES}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
