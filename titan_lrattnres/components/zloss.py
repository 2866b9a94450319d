"""Cross-entropy plus z-loss (the paper's loss; weight 1e-5), as torchtitan's loss hook.

Per valid token (label != -100), with ``lse = logsumexp(logits)`` in fp32:

    ce = lse - logits[label]        z = lse^2        loss = sum(ce + weight * z) / global_tokens

as in the LR-AttnRes code's ``criterion.py`` (``z_loss_weight * mean(lse^2)`` added to the mean
CE). Training returns CE + z; validation (torchtitan calls the loss without
``global_valid_tokens``) returns CE alone, so the validation loss is comparable across runs with
and without z-loss. The z part is kept apart and logged by :class:`ZLossMetricsProcessor`:
``loss_metrics/z_loss`` and ``loss_metrics/ce_loss`` on every logged training step,
``validation_metrics/z_loss`` and ``validation_metrics/ce_plus_z_loss`` at validation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.loss import IGNORE_INDEX, BaseLoss
from torchtitan.config import CompileConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.tools.logging import logger

from titan_lrattnres.components.metrics import RunMetricsProcessor
from titan_lrattnres.training import torchtitan_internals as internals


def ce_and_z(pred: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``pred [B, L, V]``, ``labels [B, L]`` -> (sum of CE, sum of lse^2) over valid tokens."""
    logits = pred.flatten(0, 1).float()
    labels = labels.flatten(0, 1)
    valid = labels != IGNORE_INDEX
    lse = torch.logsumexp(logits, dim=-1)
    target = logits.gather(-1, torch.where(valid, labels, 0).unsqueeze(-1)).squeeze(-1)
    zero = torch.zeros_like(lse)
    return torch.where(valid, lse - target, zero).sum(), torch.where(
        valid, lse.square(), zero
    ).sum()


class ZLossCrossEntropy(BaseLoss):
    """CE + ``z_loss_weight`` * z (see the module docstring); FSDP / HSDP (plain local logits)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        z_loss_weight: float = 1e-5
        """Weight of mean(logsumexp(logits)^2); the paper: 1e-5."""

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        self.weight = config.z_loss_weight
        self.fn = ce_and_z
        internals.compile_loss(self, compile_config)
        self._step_tokens: torch.Tensor | None = None  # identifies the training step
        self.train_z = self.train_ce = None
        self.val_z = self.val_tokens = None
        global _ACTIVE
        _ACTIVE = self

    def __call__(
        self,
        pred: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        del kwargs
        if not isinstance(pred, torch.Tensor) or hasattr(pred, "device_mesh"):
            raise NotImplementedError("z-loss takes plain local logits (FSDP / HSDP only)")
        ce, z = self.fn(pred, labels)
        z = self.weight * z
        if getattr(self, "in_shape_inference", False):  # set by titan_lrattnres.parallel.pipeline
            return ce + z, {}  # the schedule's first-step metadata pass: no statistics
        if global_valid_tokens is None:  # validation: CE only; z kept for the report
            n = (labels != IGNORE_INDEX).sum()
            self.val_z = z.detach() if self.val_z is None else self.val_z + z.detach()
            self.val_tokens = n if self.val_tokens is None else self.val_tokens + n
            return ce, {}
        if global_valid_tokens is not self._step_tokens:  # a new step (one tensor per step)
            self._step_tokens, self.train_z, self.train_ce = global_valid_tokens, 0.0, 0.0
        z, ce = z / global_valid_tokens, ce / global_valid_tokens
        self.train_z = self.train_z + z.detach()
        self.train_ce = self.train_ce + ce.detach()
        return ce + z, {"z_loss/mean": z.detach()}


_ACTIVE: ZLossCrossEntropy | None = None


class ZLossMetricsProcessor(RunMetricsProcessor):
    """The run's metrics processor plus the z-loss / CE split of the loss (all ranks log
    together, so the cross-rank sums are safe). ``last_z_loss`` / ``last_val_z_loss`` hold the
    latest values."""

    last_z_loss: float | None = None
    last_val_z_loss: float | None = None

    @dataclass(kw_only=True, slots=True)
    class Config(RunMetricsProcessor.Config):
        pass

    def _global_sum(self, x) -> float:
        if not isinstance(x, torch.Tensor):
            return float(x)
        if self.parallel_dims.dp_cp_enabled:
            return dist_utils.dist_sum(x, self.parallel_dims.get_optional_mesh("loss"))
        return float(x.item())

    def _from_last_stage(self, z: float | None) -> float | None:
        """Under pipeline parallel only the last stage computes the loss: its value on every
        pipeline rank (all of them log together)."""
        if not self.parallel_dims.pp_enabled:
            return z
        t = torch.tensor([z or 0.0, z is not None], dtype=torch.float64)
        dist.all_reduce(t, group=self.parallel_dims.get_mesh("pp").get_group())
        return float(t[0]) if t[1] else None

    def training_extras(self, step, loss):
        zl = _ACTIVE
        train_z = zl.train_z if zl is not None else None
        z = self._from_last_stage(None if train_z is None else self._global_sum(train_z))
        if z is None:
            return {}
        self.last_z_loss = z
        logger.info(f"step: {step:2}  ce: {loss - z:8.5f}  z_loss: {z:.3e}")
        return {"loss_metrics/z_loss": z, "loss_metrics/ce_loss": loss - z}

    def validation_extras(self, step, loss):
        zl = _ACTIVE
        z = None
        if zl is not None and zl.val_z is not None:
            z = self._global_sum(zl.val_z) / self._global_sum(zl.val_tokens)
            zl.val_z = zl.val_tokens = None
        z = self._from_last_stage(z)
        if z is None:
            return {}
        self.last_val_z_loss = z
        logger.info(f"validate step: {step:2}  ce: {loss:7.4f}  ce + z: {loss + z:7.4f}")
        return {"validation_metrics/z_loss": z, "validation_metrics/ce_plus_z_loss": loss + z}
