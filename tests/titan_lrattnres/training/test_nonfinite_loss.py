"""A non-finite loss is recognised by its value (``torch.isfinite`` on each step's loss), never
by the wording of torchtitan's error: in the trainer's step (torchtitan stops at a logged step)
and in the checkpointer's guard (a save after such a step, logged or not). The end-to-end run
(a NaN at step 7, logged every step or never) is ``test_train_cpu.py::test_nan_loss_...``."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torchtitan.trainer import Trainer

from tests.titan_lrattnres._tiny import checkpointer
from titan_lrattnres.components import integrity
from titan_lrattnres.components.checkpoint import NonFiniteLossError
from titan_lrattnres.training.trainer import LRAttnResTrainer


@pytest.fixture
def step(monkeypatch):
    """``step(loss, error)``: one training step of a bare ``LRAttnResTrainer`` whose forward and
    backward return ``loss`` and whose torchtitan step then raises ``error`` (or not)."""

    def run(loss: float, error: BaseException | None):
        trainer = object.__new__(LRAttnResTrainer)
        trainer.step, trainer._loss_finite = 7, None
        trainer.parallel_dims = SimpleNamespace(pp_enabled=False, dp_cp_enabled=False)
        trainer.checkpointer = checkpointer()

        def torchtitan_step(self, data_iterator):
            self.forward_backward_step(input_dict={}, labels=None, global_valid_tokens=None)
            if error is not None:
                raise error

        monkeypatch.setattr(Trainer, "forward_backward_step", lambda self, **kw: torch.tensor(loss))
        monkeypatch.setattr(Trainer, "train_step", torchtitan_step)
        trainer.train_step(iter(()))
        return trainer

    return run


@pytest.mark.parametrize("loss", [math.nan, math.inf, -math.inf])
def test_a_nonfinite_loss_stops_whatever_torchtitan_says(step, loss):
    with pytest.raises(NonFiniteLossError, match="at step 7; .*no checkpoint was saved") as e:
        step(loss, RuntimeError("some other wording"))
    assert str(e.value.__cause__) == "some other wording"


def test_a_finite_loss_leaves_torchtitans_error_alone(step):
    error = RuntimeError("Loss is not finite (global_avg_loss=nan) at step 7. Stopping training.")
    with pytest.raises(RuntimeError) as e:
        step(1.5, error)
    assert e.value is error  # the message is no evidence: the value was finite


@pytest.mark.parametrize("loss, finite", [(2.0, True), (math.nan, False)])
def test_the_step_hands_its_finiteness_to_the_checkpointer(step, loss, finite):
    trainer = step(loss, None)  # a step torchtitan does not check (not logged)
    assert bool(trainer.checkpointer.loss_finite) is finite


def test_a_save_after_a_nonfinite_loss_is_refused(tmp_path):
    ckpt = checkpointer(tmp_path, interval=5)
    folder = tmp_path / "checkpoint"
    ckpt.loss_finite = torch.isfinite(torch.tensor(3.0))
    assert ckpt.save(5)
    assert integrity.problem(folder / "step-5") is None  # recorded, intact
    ckpt.loss_finite = torch.isfinite(torch.tensor(math.nan))
    assert not ckpt.save(7)  # no save due: nothing checked
    with pytest.raises(NonFiniteLossError, match=f"at step 10; .*kept: {folder}/step-5\\."):
        ckpt.save(10)
    assert sorted(p.name for p in folder.iterdir()) == ["step-5"]
    ckpt.close()
