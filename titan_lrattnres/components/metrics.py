"""torchtitan's metrics processor keeping the run's record, as a ``MetricsProcessor`` subclass
built from its config (``metrics=RunMetricsProcessor.Config(...)``).

It logs what torchtitan logs and also keeps every logged step (loss, gradient norm, tokens, time;
with z-loss the CE part) and every validation loss for ``summary.json`` and the loss curve
(:mod:`titan_lrattnres.training.summary`), and prints a progress line with an ETA.

Training time: each step's ``train_s`` counts the seconds since the first logged step (whose
compile it leaves out) without the pauses between steps that are not training: validation and
checkpoint saves run inside :meth:`RunMetricsProcessor.paused`, which the validator and the
checkpointer enter. Under pipeline
parallel only the last stage computes the loss (torchtitan reports -1 elsewhere): the validation
loss of the last stage is logged on every rank, as the trainer does for training losses.

Subclasses add metrics through :meth:`RunMetricsProcessor.training_extras` /
:meth:`RunMetricsProcessor.validation_extras`, which see the loss already taken from the last
stage (:class:`titan_lrattnres.components.zloss.ZLossMetricsProcessor`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger


def last_stage_loss(
    loss: torch.Tensor, parallel_dims, has_last_stage: bool, device
) -> torch.Tensor:
    """The loss of the pipeline rank holding the last stage, on every pipeline rank (a 0-d
    float32 tensor on ``device``)."""
    mine = loss.detach().reshape(()) if has_last_stage else torch.zeros(())
    mine = mine.to(device=device, dtype=torch.float32, copy=True)
    dist.all_reduce(mine, group=parallel_dims.get_mesh("pp").get_group())
    return mine


def _fmt_time(s: float) -> str:
    s = int(max(s, 0))
    return (
        f"{s // 3600}h{s // 60 % 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
    )


class RunMetricsProcessor(MetricsProcessor):
    """``MetricsProcessor`` plus the run's record and progress line (see the module docstring).

    The trainer sets ``t0``, ``total_steps`` and, under pipeline parallel, ``pp_has_last_stage``
    and ``device`` once built (as torchtitan sets ``num_flops_per_token``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        pass

    total_steps: int = 0
    pp_has_last_stage: bool = False
    device: torch.device | None = None

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.t0 = time.perf_counter()  # what time_s counts from
        self.train_t0: float | None = None  # at the first logged step
        self.first_step = 0
        self.history: list[dict] = []
        self.val_history: list[dict] = []
        self.paused_s = 0.0  # validation and saves since the first logged step

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time inside is not training time (``train_s``, the summary's tokens/s)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.train_t0 is not None:
                self.paused_s += time.perf_counter() - start

    def train_seconds(self, now: float | None = None) -> float:
        """Training seconds since the first logged step, pauses left out."""
        if self.train_t0 is None:
            return 0.0
        return (time.perf_counter() if now is None else now) - self.train_t0 - self.paused_s

    def training_extras(self, step: int, loss: float) -> dict[str, Any]:
        """More metrics for training step ``step`` (every rank calls it, in step)."""
        return {}

    def validation_extras(self, step: int, loss: float) -> dict[str, Any]:
        """More metrics for the validation at ``step`` (every rank calls it, in step)."""
        return {}

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        extra = {**(extra_metrics or {}), **self.training_extras(step, global_avg_loss)}
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra)
        self._record_step(step, global_avg_loss, grad_norm, extra)

    def log_validation(self, loss, step, extra_metrics=None):
        if self.parallel_dims.pp_enabled:
            mine = torch.tensor(float(loss))
            loss = float(
                last_stage_loss(mine, self.parallel_dims, self.pp_has_last_stage, self.device)
            )
        extra = {**(extra_metrics or {}), **self.validation_extras(step, loss)}
        super().log_validation(loss, step, extra_metrics=extra)
        self.val_history.append({"step": step, "loss": float(loss)})

    def _record_step(self, step: int, loss: float, grad_norm: float, extra: dict) -> None:
        now = time.perf_counter()
        if self.train_t0 is None:
            self.train_t0, self.first_step = now, step
        entry = {
            "step": step,
            "loss": float(loss),
            "grad_norm": float(grad_norm),
            "tokens": int(extra["n_tokens_seen"]),  # torchtitan's train_step passes it
            "time_s": now - self.t0,
            "train_s": self.train_seconds(now),
        }
        z = extra.get("loss_metrics/z_loss")
        if z is not None:  # z-loss on (titan_lrattnres.components.zloss): the CE part beside it
            entry.update(z_loss=z, ce_loss=float(loss) - z)
        self.history.append(entry)
        total, done = self.total_steps, step - self.first_step
        rate = done / (now - self.train_t0) if done > 0 else 0.0
        eta = (total - step) / rate if rate > 0 else float("nan")
        tok_s = (entry["tokens"] - self.history[0]["tokens"]) / max(entry["train_s"], 1e-9)
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.info(
                f"[progress] step {step}/{total} ({100 * step / max(total, 1):.0f}%)  "
                f"loss {loss:.4f}  {tok_s:,.0f} tok/s  "
                f"elapsed {_fmt_time(now - self.t0)}  "
                f"ETA {_fmt_time(eta) if eta == eta else '?'}"
            )
