"""``RunMetricsProcessor``: what torchtitan logs is also kept as the run's record (every logged
step, every validation); ``ZLossMetricsProcessor`` adds the z-loss / CE split to both."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from titan_lrattnres.components import zloss
from titan_lrattnres.components.metrics import RunMetricsProcessor
from titan_lrattnres.training import cpu

ONE_RANK = SimpleNamespace(pp_enabled=False, dp_cp_enabled=False, non_data_parallel_size=1)


@pytest.fixture(autouse=True)
def device_monitor():
    cpu.apply()  # torchtitan's device-memory monitor needs an accelerator otherwise


def processor(cls, steps: int):
    p = cls.Config(log_freq=1).build(parallel_dims=ONE_RANK)
    p.num_flops_per_token, p.total_steps = 1, steps  # as the trainer sets them
    return p


def log(p, step: int, loss: float, tokens: int) -> None:
    p.data_loading_times.append(0.0)  # as the trainer's batch generator notes each batch
    p.log(step, loss, loss, 0.5, extra_metrics={"n_tokens_seen": tokens})


def test_logged_steps_and_validations_are_kept():
    p = processor(RunMetricsProcessor, 3)
    for step in (1, 2, 3):
        log(p, step, 5.0 - step, 100 * step)
    p.log_validation(2.5, 3)
    assert [(h["step"], h["loss"], h["grad_norm"], h["tokens"]) for h in p.history] == [
        (1, 4.0, 0.5, 100),
        (2, 3.0, 0.5, 200),
        (3, 2.0, 0.5, 300),
    ]
    assert all("z_loss" not in h for h in p.history)
    assert 0 <= p.history[0]["time_s"] <= p.history[-1]["time_s"] and p.train_t0 is not None
    assert p.val_history == [{"step": 3, "loss": 2.5}]


def test_z_loss_split_is_kept_beside_the_loss(monkeypatch):
    monkeypatch.setattr(zloss, "_ACTIVE", None)  # the loss below registers itself
    loss_fn = zloss.ZLossCrossEntropy.Config(z_loss_weight=1e-2).build()
    pred, labels = torch.randn(1, 3, 5), torch.tensor([[1, 2, 3]])
    loss, _ = loss_fn(pred, labels, torch.tensor(3))
    p = processor(zloss.ZLossMetricsProcessor, 1)
    log(p, 1, float(loss), 3)
    z = float(loss_fn.train_z)
    assert p.history[-1]["z_loss"] == pytest.approx(z) and p.last_z_loss == pytest.approx(z)
    assert p.history[-1]["ce_loss"] == pytest.approx(float(loss_fn.train_ce), rel=1e-5)
    ce_sum, _ = loss_fn(pred, labels)  # validation: CE only, z kept apart
    p.log_validation(float(ce_sum) / 3, 1)
    assert p.val_history == [{"step": 1, "loss": pytest.approx(float(ce_sum) / 3)}]
    assert 0 < p.last_val_z_loss == pytest.approx(z, rel=1e-5)
