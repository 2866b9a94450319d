"""Multi-process parity runs shared by the tensor- and pipeline-parallel tests: seed checkpoints
(one process, ``--checkpoint.create_seed_checkpoint``), one-process references from them, and the
checks (``parallel_worker.py`` runs the trainer with the dump hooks)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests import forkserver
from titan_lrattnres.evaluation import inference

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("parallel_worker.py")
RTOL = 1e-5
RUN = ["--training.steps", "3", "--debug.seed", "0", "--debug.deterministic"]
RUN += ["--validator.no-enable"]


class Runs:
    """Seed checkpoints and one-process references, made once per model and reused; every run
    launches ``worker`` (a ``parallel_worker.py`` entry point)."""

    def __init__(self, env, root: Path, worker: Path = WORKER):
        self.env, self.root, self.worker = env, root, worker
        self.seeds: dict[str, Path] = {}
        self.refs: dict[str, Path] = {}

    def launch(self, model: str, out: Path, args: list[str], nproc: int = 1) -> Path:
        cmd = [sys.executable]
        if nproc > 1:
            cmd += ["-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
            cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0"]
        cmd += [str(self.worker), model, "--dump_folder", str(out), *args]
        e = dict(self.env, TP_DUMP=str(out / "dump.pt"), TP_GRADS=str(out / "grads.pt"))
        p = forkserver.run(cmd, env=e, cwd=ROOT, timeout=900)
        assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-6000:])
        return out

    def seed(self, model: str) -> Path:
        if model not in self.seeds:
            out = self.root / f"seed_{model}"
            args = ["--checkpoint.enable", "--checkpoint.create_seed_checkpoint"]
            self.launch(model, out, args)
            self.seeds[model] = out / "checkpoint" / "step-0"
        return self.seeds[model]

    def run(self, model: str, name: str, args: list[str], nproc: int = 1) -> Path:
        load = ["--checkpoint.initial_load_path", str(self.seed(model))]
        return self.launch(model, self.root / name, [*RUN, *load, *args], nproc)

    def ref(self, model: str) -> Path:
        if model not in self.refs:
            self.refs[model] = self.run(model, f"ref_{model}", [])
        return self.refs[model]


def _history(run: Path) -> list[dict]:
    return json.loads((run / "loss_history.json").read_text())


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_parity(run: Path, ref: Path) -> None:
    got, want = _history(run), _history(ref)
    assert [h["step"] for h in got] == [h["step"] for h in want] == [1, 2, 3]
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "grad_norm"):
            assert g[key] == pytest.approx(w[key], rel=RTOL, abs=0), (key, g, w)
    grads, ref_grads = torch.load(run / "grads.pt"), torch.load(ref / "grads.pt")
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        if ref_grads[name].norm() > 0:
            assert _rel(g, ref_grads[name]) < RTOL, name
        else:  # e.g. the embedding key's at step 1 (zero queries: a uniform read)
            assert g.norm() == 0, name


def assert_checkpoint_loads_in_one_process(run: Path) -> None:
    """The TP run's final checkpoint in one process: the same parameters, the same logits."""
    dump = torch.load(run / "dump.pt")
    model, _ = inference.load_model(run, model_args=dump["model_args"])
    for name, p in model.named_parameters():
        assert torch.equal(p, dump["params"][name]), name
    with torch.no_grad():
        logits = model(dump["tokens"])
    vocab = model.vocab_size
    assert _rel(logits[..., :vocab], dump["logits"][..., :vocab]) < RTOL
    assert torch.equal(logits.argmax(-1), dump["logits"].argmax(-1))
