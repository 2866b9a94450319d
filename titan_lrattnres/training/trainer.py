"""torchtitan's Trainer with what our runs add: a model fingerprint beside the checkpoints,
a stop with one clear error on a non-finite loss, and a run summary (JSON + loss curve).

``LRAttnResTrainer.Config`` is a ``Trainer.Config``; ``config.build()`` builds this trainer, so
``python -m torchtitan.train --module titan_lrattnres --config NAME`` gets the same behaviour.
The rest comes in as torchtitan components built from the config: the checkpointer
(:class:`~titan_lrattnres.components.checkpoint.LRAttnResCheckpointManager`: checksums, no save
after a non-finite loss), the metrics processor
(:class:`~titan_lrattnres.components.metrics.RunMetricsProcessor`: the history behind the
summary, the progress line) and :class:`EndValidator`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torchtitan.components.validate import Validator
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from titan_lrattnres.components import integrity
from titan_lrattnres.components.checkpoint import LRAttnResCheckpointManager
from titan_lrattnres.components.metrics import RunMetricsProcessor, last_stage_loss

FINGERPRINT_FILE = "model_fingerprint.json"


class CheckpointMismatchError(RuntimeError):
    """A checkpoint was written by a model with a different architecture."""


def model_fingerprint(model_config) -> dict:
    """The fields that decide parameter shapes and meaning (not kernels or attention backend)."""
    router = model_config.router
    return {
        "dim": model_config.dim,
        "vocab_size": model_config.vocab_size,
        "hidden_dim": model_config.hidden_dim,
        "num_layers": len(model_config.layers) // 2,
        "n_heads": model_config.first_attention.n_heads,
        "variant": router.variant,
        "rank": router.rank if router.variant != "baseline" else None,
        "blocks": router.blocks if router.variant != "baseline" else None,
        "block_layers": router.block_layers,
        "eps": router.eps,
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
    validator); ``final_step`` is set by the trainer from ``training.steps``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        pass

    final_step: int = -1

    def should_validate(self, step: int) -> bool:
        return step % self.config.freq == 0 or step == self.final_step


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

    checkpointer: LRAttnResCheckpointManager
    metrics_processor: RunMetricsProcessor

    def __init__(self, config: Config):
        self._t0 = time.perf_counter()
        _require(config, "checkpoint", LRAttnResCheckpointManager.Config)
        _require(config, "metrics", RunMetricsProcessor.Config)
        super().__init__(config)
        self._loss_finite: torch.Tensor | None = None  # of the current step, on device
        mp = self.metrics_processor
        mp.t0, mp.total_steps = self._t0, config.training.steps
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

    def train(self):
        if self.config.checkpoint.enable:
            self._write_fingerprint()
        super().train()
        self.checkpointer.wait_and_record()  # an async last interval save
        if integrity.rank() == 0:
            from titan_lrattnres.training.summary import write_summary

            write_summary(self)
