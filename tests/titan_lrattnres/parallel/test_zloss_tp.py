"""The z-loss under tensor parallel (vocabulary-parallel logsumexp): parity with one process on
CPU over gloo (slow).

Runs (``zloss_worker.py``: ``parallel_worker.py`` with the chunked z-loss at weight
``zloss_worker.WEIGHT`` = 1e-2 and AdamW; ``cpu_smoke`` with the sliced model, its vocabulary
1025 padded to 1088 head rows, 3 steps, ``--debug.seed 0 --debug.deterministic``) start from
one seed checkpoint written by one process and are checked against the one-process run from
it (``parallel_runs.assert_parity``: loss and gradient-clipping norm at every step, every
parameter's step-1 gradient, within ``RTOL``), and the z part itself: the logged z-loss and CE
of every step within ``RTOL``. The no-SP run compiles the loss (``aot_eager``) and validates
after its last step: its validation loss (CE alone) equals the one-process one.

Measured (TP=2 + SP type-checked, TP=2 without SP, FSDP2 x TP2 on 4 ranks): loss <= 1.3e-7,
grad norm <= 6.1e-8, z-loss <= 6.2e-8, step-1 gradients <= 8.3e-7 relative; validation loss
equal."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest

from tests.titan_lrattnres import parallel_runs
from tests.titan_lrattnres.parallel_runs import RTOL, Runs, assert_parity

TP2 = ["--parallelism.tensor_parallel_degree", "2"]
NO_SP = ["--parallelism.no-enable_sequence_parallel"]
VALIDATE = ["--validator.enable", "--validator.freq", "3", "--validator.steps", "1"]
MODEL = "sliced_v1025"  # 1088 head rows: rank 1 holds real rows 544..1024 and 63 padded
WORKER = Path(__file__).with_name("zloss_worker.py")


class ZLossRuns(Runs):
    """``Runs`` launching ``zloss_worker.py``; the reference validates after its last step."""

    def launch(self, model: str, out: Path, args: list[str], nproc: int = 1) -> Path:
        with mock.patch.object(parallel_runs, "WORKER", WORKER):
            return super().launch(model, out, args, nproc)

    def ref(self, model: str) -> Path:
        if model not in self.refs:
            self.refs[model] = self.run(model, f"ref_{model}", VALIDATE)
        return self.refs[model]


@pytest.fixture(scope="module")
def runs(env, tmp_path_factory):
    return ZLossRuns(env, tmp_path_factory.mktemp("zloss_tp_runs"))


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def assert_z_parity(run: Path, ref: Path) -> None:
    """The logged z part of every step equals the one-process one (and is not negligible)."""
    got, want = (json.loads((r / "loss_history.json").read_text()) for r in (run, ref))
    for g, w in zip(got, want, strict=True):
        assert w["z_loss"] > 1e-2 * w["loss"], w  # the z part is visible at this weight
        assert g["z_loss"] == pytest.approx(w["z_loss"], rel=RTOL, abs=0), (g, w)
        assert g["ce_loss"] == pytest.approx(w["ce_loss"], rel=RTOL, abs=0), (g, w)


CASES = {  # extra flags, ranks
    "tp2_sp_typechecked": ([*TP2, "--debug.spmd_typechecking"], 2),
    "tp2_no_sp_validated_compiled_loss": (
        [*TP2, *NO_SP, *VALIDATE, "--compile.enable", "--compile.backend", "aot_eager"]
        + ["--compile.components", "loss"],
        2,
    ),
    "fsdp2_x_tp2": (
        [*TP2, "--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"],
        4,
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_zloss_tp_equals_one_process(runs, case):
    args, nproc = CASES[case]
    run = runs.run(MODEL, f"zloss_{case}", args, nproc=nproc)
    ref = runs.ref(MODEL)
    assert_parity(run, ref)
    assert_z_parity(run, ref)
    s = _summary(run)
    assert s["world_size"] == nproc
    if "--validator.enable" in args:
        want = _summary(ref)["final_val_loss"]
        assert s["final_val_loss"] == pytest.approx(want, rel=RTOL, abs=0)
