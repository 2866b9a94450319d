"""torchtitan's Trainer with what our runs add: a model fingerprint beside the checkpoints,
a per-checkpoint finite-loss guard, an ETA line, and a run summary (JSON + loss curve).

``LRAttnResTrainer.Config`` is a ``Trainer.Config``; ``config.build()`` builds this trainer, so
``python -m torchtitan.train --module titan_lrattnres --config NAME`` gets the same behaviour.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.components.validate import Validator
from torchtitan.tools import filesystem
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from titan_lrattnres.components import convert, integrity

FINGERPRINT_FILE = "model_fingerprint.json"


class CheckpointMismatchError(RuntimeError):
    """A checkpoint was written by a model with a different architecture."""


class NonFiniteLossError(RuntimeError):
    """Training stopped on a NaN/inf loss; the last good checkpoint is kept."""


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


def _fmt_time(s: float) -> str:
    s = int(max(s, 0))
    return (
        f"{s // 3600}h{s // 60 % 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"
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


class LRAttnResTrainer(Trainer):
    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        run_name: str = ""
        """Name of the experiment (the config function); recorded in summary.json."""

    def __init__(self, config: Config):
        self._t0 = time.perf_counter()
        super().__init__(config)
        self.history: list[dict] = []
        self.val_history: list[dict] = []
        self._last_loss: torch.Tensor | None = None
        self._train_t0: float | None = None
        self._first_step: int = 0
        self._unrecorded: str | None = None  # a save not yet recorded (async)
        self._after_record: list = []  # torchtitan's purge, deferred until the record is written
        self._wrap_metrics()
        if config.validator.enable and isinstance(self.validator, EndValidator):
            self.validator.final_step = config.training.steps
        if config.checkpoint.enable:
            self._wrap_checkpointer()

    # --- progress and history -------------------------------------------------------

    def _wrap_metrics(self) -> None:
        mp = self.metrics_processor
        log, log_validation = mp.log, mp.log_validation

        def log_train(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
            log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)
            now = time.perf_counter()
            if self._train_t0 is None:
                self._train_t0, self._first_step = now, step
            tokens = (extra_metrics or {}).get("n_tokens_seen", self.ntokens_seen)
            self.history.append(
                {
                    "step": step,
                    "loss": float(global_avg_loss),
                    "grad_norm": float(grad_norm),
                    "tokens": int(tokens),
                    "time_s": now - self._t0,
                }
            )
            z = getattr(self.metrics_processor, "last_z_loss", None)
            if z is not None:  # z-loss on (titan_lrattnres.components.zloss): the CE part beside it
                self.history[-1].update(z_loss=z, ce_loss=float(global_avg_loss) - z)
            total = self.config.training.steps
            done = step - self._first_step
            rate = done / (now - self._train_t0) if done > 0 else 0.0
            eta = (total - step) / rate if rate > 0 else float("nan")
            tok_s = (self.history[-1]["tokens"] - self.history[0]["tokens"]) / max(
                now - self._train_t0, 1e-9
            )
            if integrity.rank() == 0:
                logger.info(
                    f"[progress] step {step}/{total} ({100 * step / total:.0f}%)  "
                    f"loss {global_avg_loss:.4f}  {tok_s:,.0f} tok/s  "
                    f"elapsed {_fmt_time(now - self._t0)}  "
                    f"ETA {_fmt_time(eta) if eta == eta else '?'}"
                )

        def log_val(loss, step, extra_metrics=None):
            if self.parallel_dims.pp_enabled:  # as for training: the last stage's loss
                loss = float(self._pipeline_loss(torch.tensor(float(loss))))
            log_validation(loss, step, extra_metrics=extra_metrics)
            self.val_history.append({"step": step, "loss": float(loss)})

        mp.log, mp.log_validation = log_train, log_val

    # --- checkpoints: fingerprint and finite-loss guard -------------------------------

    def _fingerprint(self) -> dict:
        return model_fingerprint(self.model_config)

    def forward_backward_step(self, **kwargs) -> torch.Tensor:
        loss = super().forward_backward_step(**kwargs)
        if self.parallel_dims.pp_enabled:
            loss = self._pipeline_loss(loss)
        self._last_loss = loss.detach()
        return loss

    def _pipeline_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss of the rank holding the last stage, on every pipeline rank (torchtitan
        reports -1 elsewhere): the log, the history, the summary and the finite-loss guard of
        rank 0 see it."""
        mine = loss.detach().reshape(()) if self.pp_has_last_stage else torch.zeros(())
        mine = mine.to(device=self.device, dtype=torch.float32, copy=True)
        dist.all_reduce(mine, group=self.parallel_dims.get_mesh("pp").get_group())
        return mine

    def _wrap_checkpointer(self) -> None:
        """Around torchtitan's checkpointer: the finite-loss guard before a save, and
        :meth:`_wrap_integrity` (checksums) for a local checkpoint folder."""
        ckpt = self.checkpointer
        if filesystem.is_remote(ckpt.folder):
            logger.warning(f"{ckpt.folder} is remote: checkpoints are saved without checksums")
            save = ckpt.save
        else:
            save = self._wrap_integrity()

        def guarded_save(curr_step: int, last_step: bool = False) -> bool:
            if not ckpt._should_save(curr_step, last_step):
                return False
            if self._last_loss is not None:
                finite = torch.isfinite(self._last_loss).all().to(torch.int32).reshape(1)
                if dist.is_initialized():
                    dist.all_reduce(finite, op=dist.ReduceOp.MIN)
                if not bool(finite.item()):
                    raise NonFiniteLossError(self._nan_message(curr_step))
            return save(curr_step, last_step=last_step)

        ckpt.save = guarded_save

    def _wrap_integrity(self):
        """``titan_lrattnres.components.integrity`` in torchtitan's checkpointer: every save is
        recorded once it has finished on all ranks (an async one at the next save or the end of
        training), and only then are older checkpoints purged; a resume takes the newest intact
        checkpoint, and every folder DCP loads is verified first. Returns the recording save."""
        ckpt = self.checkpointer
        save, load, dcp_load = ckpt.save, ckpt.load, ckpt.dcp_load
        purge = ckpt._purge_stale_checkpoints
        ckpt._purge_stale_checkpoints = lambda: self._after_record.append(purge)
        distributed = dist.is_initialized()
        resumed: Path | None = None  # verified by resume_folder

        def recorded_save(curr_step: int, last_step: bool = False) -> bool:
            self._record_last_save()
            folder = ckpt._create_checkpoint_id(curr_step)
            integrity.begin(folder)
            saved = save(curr_step, last_step=last_step)
            self._unrecorded = folder
            if ckpt.save_future is None:
                self._record_last_save()
            return saved

        def verified_load(step: int = -1) -> bool:
            nonlocal resumed
            if step == -1:
                resumed = integrity.resume_folder(ckpt.folder, distributed=distributed)
            return load(step)

        def verified_dcp_load(state_dict, checkpoint_id, from_hf, from_quantized):
            # HF safetensors are no pickle and carry no record: only DCP folders are checked
            if not from_hf and Path(checkpoint_id) != resumed:
                integrity.check(checkpoint_id, distributed=distributed)
            if not from_hf:
                convert.refuse_old_layout(checkpoint_id)
            dcp_load(state_dict, checkpoint_id, from_hf=from_hf, from_quantized=from_quantized)

        ckpt.load, ckpt.dcp_load = verified_load, verified_dcp_load
        return recorded_save

    def _record_last_save(self) -> None:
        """Record the last save (waiting for it when async); then purge older checkpoints if
        torchtitan asked to: never before the newer checkpoint is complete."""
        if self._unrecorded is not None:
            self.checkpointer.maybe_wait_for_saving()
            integrity.record(self._unrecorded)
            self._unrecorded = None
        while self._after_record:
            self._after_record.pop()()

    def _last_checkpoint(self) -> str | None:
        ckpt = self.checkpointer
        if not getattr(ckpt, "enable", False):
            return None
        step = ckpt._find_load_step()
        return ckpt._create_checkpoint_id(step) if step >= 0 else None

    def _nan_message(self, step: int) -> str:
        last = self._last_checkpoint()
        keep = f"the last good checkpoint is kept: {last}" if last else "no checkpoint was saved"
        return (
            f"loss is not finite (NaN/inf) at step {step}; training stopped and nothing was "
            f"saved for this step; {keep}. Lower the learning rate or check the data."
        )

    def save_seed_checkpoint(self) -> None:
        """``--checkpoint.create_seed_checkpoint``: save the initial weights as step 0 and stop
        (torchtitan's own ``main`` does the same; one process, so the save is unsharded)."""
        self._write_fingerprint()
        self.checkpointer.save(curr_step=0, last_step=True)
        logger.info(f"seed checkpoint: {self.checkpointer._create_checkpoint_id(0)}")

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
        config = self.config
        if config.checkpoint.enable:
            self._write_fingerprint()
        try:
            super().train()
        except RuntimeError as e:
            if "Loss is not finite" in str(e) and not isinstance(e, NonFiniteLossError):
                raise NonFiniteLossError(self._nan_message(self.step)) from e
            raise
        self._record_last_save()
        if integrity.rank() == 0:
            from titan_lrattnres.training.summary import write_summary

            write_summary(self)
