"""torchtitan's DCP checkpoint manager with what our runs add, as a ``CheckpointManager``
subclass built from its config (``checkpoint=LRAttnResCheckpointManager.Config(...)``).

- **Checksums** (:mod:`titan_lrattnres.components.integrity`, local folders): every save is
  recorded once it has finished on all ranks (an async one at the next save or at the end of
  training, :meth:`~LRAttnResCheckpointManager.wait_and_record`), and only then are older
  checkpoints purged; a resume takes the newest intact checkpoint, and every folder DCP loads is
  verified first (and refused in an old parameter layout:
  :mod:`titan_lrattnres.components.convert`).
- **No save after a non-finite loss**: the trainer hands over each step's finiteness
  (``loss_finite``); a save that would follow a NaN/inf loss raises :class:`NonFiniteLossError`
  instead, naming the last good checkpoint.
- **Write faults in one line**: a save that fails for want of space or permission raises
  :class:`~titan_lrattnres.components.faults.WriteFaultError` naming the folder and the last
  complete checkpoint (the interrupted one stays marked unfinished).
- **A save now** (:meth:`~LRAttnResCheckpointManager.save_now`): a full synchronous save of any
  step, for preemption (:mod:`titan_lrattnres.components.preemption`).

All of it runs inside torchtitan's own save and load (``dcp_save``, ``dcp_load``, ``load``),
so its decisions (when to save, what, async or not, HF format) stay torchtitan's.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torchtitan.components.checkpointer import AsyncMode, CheckpointManager
from torchtitan.tools import filesystem
from torchtitan.tools.logging import logger

from titan_lrattnres import torchtitan_internals as internals
from titan_lrattnres.components import convert, faults, integrity


class NonFiniteLossError(RuntimeError):
    """Training stopped on a NaN/inf loss; the last good checkpoint is kept."""


def newest_checkpoint(folder: str) -> str | None:
    """The newest ``step-N`` folder of ``folder`` holding a finished save, or None. Local
    folders: :func:`integrity.interrupted` decides (a record marked incomplete is no checkpoint);
    remote ones: a DCP ``.metadata`` or an HF index, as torchtitan's resume looks for."""
    if not filesystem.isdir(folder):
        return None
    names = filesystem.listdir(folder)
    steps = [(int(m[1]), n) for n in names if (m := re.fullmatch(r"step-(\d+)", n))]
    for _, name in sorted(steps, reverse=True):
        path = filesystem.join(folder, name)
        if filesystem.is_remote(path):
            marks = (".metadata", integrity.HF_INDEX)
            finished = any(filesystem.isfile(filesystem.join(path, f)) for f in marks)
        else:
            finished = integrity.interrupted(path) is None
        if finished:
            return path
    return None


class LRAttnResCheckpointManager(CheckpointManager):
    """``CheckpointManager`` with checksums, purges after the record, and the finite-loss
    guard (see the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        def __post_init__(self) -> None:
            # torchtitan warns that its own default, a model-only initial load, has no effect
            # without an initial_load_path: true of every run that starts from scratch, so
            # its checks run here as if that default were off, and the value is kept
            model_only = self.initial_load_model_only
            if not self.initial_load_path:
                self.initial_load_model_only = False
            try:
                CheckpointManager.Config.__post_init__(self)
            finally:
                self.initial_load_model_only = model_only

    loss_finite: torch.Tensor | None = None
    """Whether the last training step's loss was finite (a bool tensor; set by the trainer)."""

    last_saved: str | None = None
    """The folder of the last save this manager started."""

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self._step = 0  # of the save under way: for the error message
        self._unrecorded: str | None = None  # a save not yet recorded (async)
        self._purge_due = False  # torchtitan asked to purge while a save was unrecorded
        self._resumed: Path | None = None  # verified by resume_folder
        self.checksums = self.enable and not filesystem.is_remote(self.folder)
        if self.enable and not self.checksums:
            logger.warning(f"{self.folder} is remote: checkpoints are saved without checksums")

    # --- saving ------------------------------------------------------------------------------

    pause: Callable[[], AbstractContextManager] = contextlib.nullcontext
    """Entered around every save: the trainer sets the metrics processor's ``paused``, so that
    saves do not count as training time."""

    def save(self, curr_step: int, last_step: bool = False) -> bool:
        self._step = curr_step
        with self.pause():
            return super().save(curr_step, last_step)

    def dcp_save(
        self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False
    ):
        """torchtitan's DCP save, refused after a non-finite loss, recorded once complete."""
        self._refuse_nonfinite_loss()
        self.wait_and_record()
        with faults.writing("checkpoint", checkpoint_id, self._last_complete):
            if self.checksums:
                integrity.begin(checkpoint_id)
            result = super().dcp_save(
                state_dict,
                checkpoint_id,
                async_mode,
                enable_garbage_collection=enable_garbage_collection,
                to_hf=to_hf,
            )
        self.last_saved = checkpoint_id
        if self.checksums:
            self._unrecorded = checkpoint_id
            if AsyncMode(async_mode) == AsyncMode.DISABLED:  # complete on every rank already
                self.wait_and_record()
        return result

    def wait_and_record(self) -> None:
        """Record the last save (waiting for it when async), then run the purge torchtitan asked
        for meanwhile: older checkpoints never go before the newer one is complete. Every rank
        calls it (the record is a collective)."""
        if self._unrecorded is not None:
            pending, self._unrecorded = self._unrecorded, None  # a failed save stays unrecorded
            with faults.writing("checkpoint", pending, self._last_complete):
                self.maybe_wait_for_saving()
                integrity.record(pending)
        if self._purge_due:
            self._purge_due = False
            internals.purge_stale_checkpoints(self)

    def _last_complete(self) -> str | None:
        return newest_checkpoint(self.folder)

    def save_now(self, step: int) -> str | None:
        """A full checkpoint of ``step``, synchronous, through torchtitan's own save (as if the
        interval were 1 and async off for this call); a save under way is finished and recorded
        first. Returns its folder (already there when the interval saved this step), or None
        when nothing can be saved (``load_only``). Every rank calls it."""
        self.wait_and_record()
        path = filesystem.join(self.folder, f"step-{step}")
        if self.last_saved == path:
            return path
        interval, mode = self.interval, self.async_mode
        self.interval, self.async_mode = 1, AsyncMode.DISABLED
        try:
            saved = self.save(step)
        finally:
            self.interval, self.async_mode = interval, mode
        return path if saved else None

    def _purge_stale_checkpoints(self) -> None:
        # torchtitan's hook right after each interval save (torchtitan_internals)
        if self._unrecorded is not None:
            self._purge_due = True
            return
        internals.purge_stale_checkpoints(self)

    # --- the finite-loss guard ---------------------------------------------------------------

    def _refuse_nonfinite_loss(self) -> None:
        if self.loss_finite is None:
            return
        finite = self.loss_finite.to(torch.int32).reshape(1)
        if dist.is_initialized():  # every rank saves: all of them stop, or none
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not bool(finite.item()):
            raise self.nonfinite_loss_error(self._step)

    def nonfinite_loss_error(self, step: int) -> NonFiniteLossError:
        """The error for a non-finite loss at ``step``, naming the checkpoint that is kept (an
        async save still under way is waited for and recorded first; every rank calls this)."""
        self.wait_and_record()
        last = newest_checkpoint(self.folder) if self.enable else None
        keep = f"the last good checkpoint is kept: {last}" if last else "no checkpoint was saved"
        return NonFiniteLossError(
            f"loss is not finite (NaN/inf) at step {step}; training stopped and nothing was "
            f"saved for this step; {keep}. Lower the learning rate or check the data."
        )

    # --- loading -----------------------------------------------------------------------------

    def load(self, step: int = -1) -> bool:
        """A resume (``step=-1``) first moves the newer damaged or interrupted step folders
        aside (:func:`integrity.resume_folder`), so torchtitan loads the newest intact one."""
        if self.checksums and step == -1:
            self._resumed = integrity.resume_folder(self.folder, distributed=dist.is_initialized())
        return super().load(step)

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized) -> None:
        # HF safetensors are no pickle and carry no record: only DCP folders are checked
        if self.checksums and not from_hf:
            if Path(checkpoint_id) != self._resumed:
                integrity.check(checkpoint_id, distributed=dist.is_initialized())
            convert.refuse_old_layout(checkpoint_id)
        super().dcp_load(state_dict, checkpoint_id, from_hf=from_hf, from_quantized=from_quantized)
