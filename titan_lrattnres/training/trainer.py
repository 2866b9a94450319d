"""torchtitan's Trainer with what our runs add: a model fingerprint beside the checkpoints,
a stop with one clear error on a non-finite loss, preemption (a signal saves the step and exits,
:mod:`titan_lrattnres.components.preemption`), a warning before the first save when the disk
has no room for a checkpoint, write faults in one line (:mod:`titan_lrattnres.components.faults`)
and a run summary (JSON + loss curve).

``LRAttnResTrainer.Config`` is a ``Trainer.Config``; ``config.build()`` builds this trainer, so
``python -m torchtitan.train --module titan_lrattnres --config NAME`` gets the same behaviour.
The rest comes in as torchtitan components built from the config: the checkpointer
(:class:`~titan_lrattnres.components.checkpoint.LRAttnResCheckpointManager`: checksums, no save
after a non-finite loss), the metrics processor
(:class:`~titan_lrattnres.components.metrics.RunMetricsProcessor`: the history behind the
summary, the progress line) and :class:`EndValidator`.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.components.validate import Validator
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from titan_lrattnres.components import faults, integrity
from titan_lrattnres.components.checkpoint import LRAttnResCheckpointManager, newest_checkpoint
from titan_lrattnres.components.metrics import RunMetricsProcessor, last_stage_loss
from titan_lrattnres.components.preemption import (
    EXIT_CODE,
    MARKER,
    Preempted,
    PreemptionConfig,
    PreemptionHandler,
    signals_of,
)
from titan_lrattnres.model.registry import ModelIdentity

FINGERPRINT_FILE = "model_fingerprint.json"


class CheckpointMismatchError(RuntimeError):
    """A checkpoint was written by a model with a different architecture."""


def model_fingerprint(model_config) -> dict:
    """The fields that decide parameter shapes and meaning (not kernels or attention backend):
    the shape, and the model's identity (``ModelIdentity.fingerprint``)."""
    return {
        "dim": model_config.dim,
        "vocab_size": model_config.vocab_size,
        "hidden_dim": model_config.hidden_dim,
        "num_layers": len(model_config.layers),
        "n_heads": model_config.first_attention.n_heads,
        **ModelIdentity.of(model_config).fingerprint(),
    }


def check_fingerprint(folder: str, current: dict) -> None:
    """Refuse a checkpoint folder written by another model; names every differing field."""
    path = os.path.join(folder, FINGERPRINT_FILE)
    if not os.path.exists(path):
        return
    with open(path) as f:
        saved = json.load(f)
    diff = {
        k: (saved.get(k), current.get(k))
        for k in current.keys() | saved.keys()
        if saved.get(k) != current.get(k)
    }
    if diff:
        fields = ", ".join(
            f"{k}: checkpoint={a!r} vs this run={b!r}" for k, (a, b) in sorted(diff.items())
        )
        raise CheckpointMismatchError(
            f"checkpoint folder {folder} was written by a different model ({fields}). "
            "Use another --dump_folder / --checkpoint.folder, or the matching config."
        )


class EndValidator(Validator):
    """Validates every ``freq`` steps and at the last step (not at step 1, unlike the stock
    validator); ``final_step`` is set by the trainer from ``training.steps``.

    Each validation is a pause of the training clock (``RunMetricsProcessor.paused``), and its
    record in ``val_history`` also holds the tokens and training seconds of the step it follows
    and the validation's own seconds; on one process (no data or pipeline parallel) also each
    batch's mean loss, so that runs validated on the same batches can be compared pairwise."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        pass

    final_step: int = -1

    def should_validate(self, step: int) -> bool:
        return step % self.config.freq == 0 or step == self.final_step

    def validate(self, model_parts, step: int) -> None:
        mp = self.metrics_processor
        per_batch = not (self.parallel_dims.dp_cp_enabled or self.parallel_dims.pp_enabled)
        sums: list[tuple[torch.Tensor, torch.Tensor]] = []
        loss_fn = self.loss_fn

        def recording(pred, labels, *args, **kwargs):
            out = loss_fn(pred, labels, *args, **kwargs)
            sums.append((out[0].detach().float(), (labels != IGNORE_INDEX).sum()))
            return out

        if per_batch:
            self.loss_fn = recording
        start = time.perf_counter()
        try:
            with mp.paused() if isinstance(mp, RunMetricsProcessor) else contextlib.nullcontext():
                super().validate(model_parts, step)
        finally:
            self.loss_fn = loss_fn
        history = getattr(mp, "val_history", None)
        if not history or history[-1]["step"] != step:
            return
        record = history[-1]
        record["val_s"] = time.perf_counter() - start
        last = mp.history[-1] if mp.history else None
        if last is not None and last["step"] == step:
            record.update(tokens=last["tokens"], train_s=last["train_s"])
        if per_batch and sums:
            loss, n = (torch.stack(x).cpu() for x in zip(*sums))
            record["batch_losses"] = (loss / n).tolist()


def _require(config, field: str, expected: type) -> None:
    """The trainer's additions live in these components: refuse a config without them."""
    got = getattr(config, field)
    if not isinstance(got, expected):
        owner = expected.__qualname__
        raise TypeError(
            f"LRAttnResTrainer needs {field}={owner}(...) (train_configs/common.py), not "
            f"{type(got).__qualname__}"
        )


class LRAttnResTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        run_name: str = ""
        """Name of the experiment (the config function); recorded in summary.json."""

        preemption: PreemptionConfig = field(default_factory=PreemptionConfig)
        """Save and exit on SIGTERM (``--preemption.*``; on whenever checkpointing is)."""

    checkpointer: LRAttnResCheckpointManager
    metrics_processor: RunMetricsProcessor
    _preemption: PreemptionHandler | None = None
    _first_step: int | None = None  # the step this process started from
    _space_checked = False  # the free-space check after this process's first step

    def __init__(self, config: Config):
        self._t0 = time.perf_counter()
        _require(config, "checkpoint", LRAttnResCheckpointManager.Config)
        _require(config, "metrics", RunMetricsProcessor.Config)
        super().__init__(config)
        self._loss_finite: torch.Tensor | None = None  # of the current step, on device
        mp = self.metrics_processor
        mp.t0, mp.total_steps = self._t0, config.training.steps
        self.checkpointer.pause = mp.paused  # saves are not training time
        if self.parallel_dims.pp_enabled:
            mp.pp_has_last_stage, mp.device = self.pp_has_last_stage, self.device
        if config.validator.enable and isinstance(self.validator, EndValidator):
            self.validator.final_step = config.training.steps

    @property
    def history(self) -> list[dict]:
        """Every logged training step (``RunMetricsProcessor.history``)."""
        return self.metrics_processor.history

    @property
    def val_history(self) -> list[dict]:
        return self.metrics_processor.val_history

    # --- the loss: from the last pipeline stage, checked by value ------------------------------

    def forward_backward_step(self, **kwargs) -> torch.Tensor:
        loss = super().forward_backward_step(**kwargs)
        if self.parallel_dims.pp_enabled:  # torchtitan reports -1 off the last stage
            loss = last_stage_loss(loss, self.parallel_dims, self.pp_has_last_stage, self.device)
        finite = torch.isfinite(loss.detach()).all()  # stays on the device: no sync
        if self._loss_finite is not None:
            finite = finite & self._loss_finite
        if self.parallel_dims.dp_cp_enabled and self.metrics_processor.should_log(self.step):
            # torchtitan checks the loss summed over these ranks at a logged step: let every
            # rank see what it sees, before it raises (no rank then waits for another)
            bad = dist_utils.dist_sum_tensor(
                (~finite).to(torch.int32), self.parallel_dims.get_optional_mesh("loss")
            )
            finite = bad == 0
        self._loss_finite = finite
        return loss

    def train_step(self, data_iterator) -> None:
        """torchtitan's step; a non-finite loss (by value) stops with
        :class:`NonFiniteLossError` instead of torchtitan's own error, and the checkpointer
        learns the step's finiteness before it saves."""
        self._loss_finite = None
        try:
            super().train_step(data_iterator)
        except RuntimeError as e:
            if self._loss_finite is None or bool(self._loss_finite):
                raise
            raise self.checkpointer.nonfinite_loss_error(self.step) from e
        self.checkpointer.loss_finite = self._loss_finite
        if not self._space_checked:  # the optimiser state exists now: a checkpoint's size is known
            self._space_checked = True
            self._warn_if_no_room()

    def _warn_if_no_room(self) -> None:
        ckpt = self.checkpointer
        if not (ckpt.enable and ckpt.checksums) or self.config.checkpoint.load_only:
            return
        need = faults.checkpoint_bytes(self.model_parts, self.optimizers)  # every rank
        if integrity.rank() == 0 and (line := faults.low_space_warning(ckpt.folder, need)):
            logger.warning(line)

    # --- checkpoints: the fingerprint --------------------------------------------------------

    def _fingerprint(self) -> dict:
        return model_fingerprint(self.model_config)

    def save_seed_checkpoint(self) -> None:
        """``--checkpoint.create_seed_checkpoint``: save the initial weights as step 0 and stop
        (torchtitan's own ``main`` does the same; one process, so the save is unsharded)."""
        self._write_fingerprint()
        self.checkpointer.save(curr_step=0, last_step=True)
        logger.info(f"seed checkpoint: {self.checkpointer.last_saved}")

    def _write_fingerprint(self) -> None:
        config = self.config
        folder = self.checkpointer.folder
        check_fingerprint(folder, self._fingerprint())
        if config.checkpoint.initial_load_path:
            check_fingerprint(
                os.path.dirname(config.checkpoint.initial_load_path.rstrip("/")),
                self._fingerprint(),
            )
        if integrity.rank() == 0:  # atomically: other ranks may be reading it (check_fingerprint)
            os.makedirs(folder, exist_ok=True)
            integrity.write_json(Path(folder) / FINGERPRINT_FILE, self._fingerprint(), indent=2)

    # --- preemption ------------------------------------------------------------------------

    def _install_preemption(self) -> None:
        config = self.config
        ckpt = config.checkpoint
        if not (config.preemption.enable and ckpt.enable and not ckpt.load_only):
            return
        handler = PreemptionHandler(
            signals_of(config.preemption),
            config.preemption.grace_seconds,
            self._expired_line,
        )
        if handler.install():
            self._preemption = handler
            if integrity.rank() == 0:
                names = ", ".join(s.name for s in handler.signals)
                logger.info(f"preemption: {names} save the step and exit {EXIT_CODE}")

    def _expired_line(self, phase: str) -> str | None:
        if integrity.rank() != 0:
            return None
        last = newest_checkpoint(self.checkpointer.folder)
        keep = f"the last complete checkpoint is {last}" if last else "no checkpoint is complete"
        return (
            f"preempted at step {self.step}: {phase} did not finish within "
            f"{self.config.preemption.grace_seconds:g} s of the signal; exiting without it; "
            f"{keep}; rerun the same command to resume"
        )

    def should_continue_training(self) -> bool:
        """torchtitan asks before each step: here all ranks also agree whether to stop for a
        preemption signal (one collective), and then save and exit."""
        if self._first_step is None:
            self._first_step = self.step
        handler = self._preemption
        if handler is not None and self.step < self.config.training.steps and handler.requested():
            self._preempt(handler)
        return super().should_continue_training()

    def _preempt(self, handler: PreemptionHandler) -> None:
        step, ckpt, rank0 = self.step, self.checkpointer, integrity.rank() == 0
        if rank0:
            logger.warning(
                f"{handler.describe()} received: step {step} has finished; saving it (a second "
                "signal aborts at once)"
            )
        if step > self._first_step:
            handler.phase = f"the save of {ckpt.folder}/step-{step}"
            path = ckpt.save_now(step)
            done = f"saved {path}" if path else "nothing saved (--checkpoint.load_only)"
        else:
            path = newest_checkpoint(ckpt.folder)
            done = f"no step since {path}" if path else "no step trained, nothing to save"
        handler.finish()
        message = f"preempted at step {step}: {done}; rerun the same command to resume"
        if rank0:
            marker = Path(self.config.dump_folder) / MARKER
            body = {"step": step, "checkpoint": path, "signal": handler.describe()}
            with faults.writing("the preemption marker", marker, path):
                integrity.write_json(marker, body, indent=2)
            logger.warning(message)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # no rank exits before the line and the marker are out
        ckpt.close()  # queued purges finish before the process ends
        raise Preempted(message)

    def train(self):
        if integrity.rank() == 0:  # a rerun: the last run's preemption is over
            (Path(self.config.dump_folder) / MARKER).unlink(missing_ok=True)
        if self.config.checkpoint.enable:
            last = lambda: newest_checkpoint(self.checkpointer.folder)  # noqa: E731
            with faults.writing("the model fingerprint into", self.checkpointer.folder, last):
                self._write_fingerprint()
        self._install_preemption()
        try:
            super().train()
        finally:
            if self._preemption is not None:
                self._preemption.uninstall()
        self.checkpointer.wait_and_record()  # an async last interval save
        if integrity.rank() == 0:
            from titan_lrattnres.training.summary import write_summary

            last = newest_checkpoint(self.checkpointer.folder) if self.checkpointer.enable else None
            write_summary(self, last)
