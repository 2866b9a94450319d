"""Cross-entropy plus z-loss (the paper's loss; weight 1e-5), as torchtitan's loss hook.

Per valid token (label != -100), with ``lse = logsumexp(logits)`` in fp32:

    ce = lse - logits[label]        z = lse^2        loss = sum(ce + weight * z) / global_tokens

as in the LR-AttnRes code's ``criterion.py`` (``z_loss_weight * mean(lse^2)`` added to the mean
CE). Training returns CE + z; validation (torchtitan calls the loss without
``global_valid_tokens``) returns CE alone, so the validation loss is comparable across runs with
and without z-loss. The z part is kept apart and logged by :class:`ZLossMetricsProcessor`:
``loss_metrics/z_loss`` and ``loss_metrics/ce_loss`` on every logged training step,
``validation_metrics/z_loss`` and ``validation_metrics/ce_plus_z_loss`` at validation.

Under tensor parallel (torchtitan's spmd_types backend) each TP rank holds a contiguous
vocabulary shard of the logits as a plain local tensor: :func:`vocab_parallel_ce_and_z` takes
the logsumexp over the whole vocabulary with one max and one sum all-reduce over the TP group
(the target logit, from the shard that owns the label, rides in the sum), and has an explicit
backward without collectives. ``global_vocab_size`` (the head's padded rows, set by
``titan_lrattnres.parallel.sharding.set_tensor_parallel``) gives each rank's shard.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import spmd_types as spmd
import torch
import torch.distributed as dist
from torchtitan.components.loss import IGNORE_INDEX, BaseLoss
from torchtitan.config import CompileConfig
from torchtitan.distributed import utils as dist_utils
from torchtitan.distributed.spmd_types import current_spmd_mesh, spmd_mesh_size
from torchtitan.tools.logging import logger

from titan_lrattnres import torchtitan_internals as internals
from titan_lrattnres.components.metrics import RunMetricsProcessor


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


def _all_reduce(t: torch.Tensor, op: str, group) -> torch.Tensor:
    """``t`` (a fresh tensor, reduced in place) reduced elementwise (``op``: "max" or "sum") over
    the ranks of ``group``."""
    dist.all_reduce(t, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return t


@spmd.register_autograd_function
class _VocabParallelCEAndZ(torch.autograd.Function):
    """(sum of CE, sum of lse^2) over valid tokens from this rank's vocabulary shard of the
    logits (columns ``vocab_start ..``): one max and one sum all-reduce in the forward, none in
    the backward (``d/dx (g_ce * ce + g_z * z) = (g_ce + 2 g_z lse) softmax - g_ce onehot``)."""

    @staticmethod
    def typecheck_forward(logits, labels, vocab_start, group):
        """SPMD types: logits S(-1) and labels I on TP -> both sums I on TP (other axes kept)."""
        spmd.assert_type(logits, {group: spmd.S(logits.dim() - 1)})
        spmd.assert_type(labels, {group: spmd.I})
        ce, z = _VocabParallelCEAndZ.apply(logits, labels, vocab_start, group)
        out = dict(spmd.get_local_type(logits))
        out[spmd.normalize_axis(group)] = spmd.I
        spmd.assert_type(ce, out)
        spmd.assert_type(z, out)
        return ce, z

    @staticmethod
    def forward(ctx, logits, labels, vocab_start, group):
        x = logits.flatten(0, -2).float()
        labels = labels.flatten()
        valid = labels != IGNORE_INDEX
        local = labels - vocab_start
        mine = valid & (local >= 0) & (local < x.shape[-1])  # this shard owns the label
        local = torch.where(mine, local, 0)
        target = torch.where(mine, x.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
        top = _all_reduce(x.amax(-1), "max", group)
        sumexp = torch.exp(x - top.unsqueeze(-1)).sum(-1)
        sums = _all_reduce(torch.stack([sumexp, target], -1), "sum", group)
        lse = top + torch.log(sums[:, 0])
        zero = torch.zeros_like(lse)
        ce = torch.where(valid, lse - sums[:, 1], zero).sum()
        z = torch.where(valid, lse.square(), zero).sum()
        ctx.save_for_backward(x, lse, valid, mine, local)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return ce, z

    @staticmethod
    def backward(ctx, g_ce, g_z):
        x, lse, valid, mine, local = ctx.saved_tensors
        coef = torch.where(valid, g_ce + 2 * g_z * lse, 0.0)
        grad = torch.exp(x - lse.unsqueeze(-1)) * coef.unsqueeze(-1)
        grad.scatter_add_(-1, local.unsqueeze(-1), torch.where(mine, -g_ce, 0.0).unsqueeze(-1))
        return grad.reshape(ctx.shape).to(ctx.dtype), None, None, None


def vocab_parallel_ce_and_z(
    pred: torch.Tensor, labels: torch.Tensor, vocab_start: int, group
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ce_and_z` of the whole vocabulary from ``pred [B, L, V_local]``, this rank's
    columns ``vocab_start .. vocab_start + V_local`` of the logits (the other shards on the
    other ranks of ``group``); ``labels [B, L]`` the same on every rank. Both sums are the same
    on every rank."""
    return _VocabParallelCEAndZ.apply(pred, labels, vocab_start, group)


def _loss_sums(pred, labels, shard):
    """``ce_and_z``, or ``vocab_parallel_ce_and_z`` when ``shard = (vocab_start, group)``."""
    if shard is None:
        return ce_and_z(pred, labels)
    return vocab_parallel_ce_and_z(pred, labels, *shard)


class ZLossCrossEntropy(BaseLoss):
    """CE + ``z_loss_weight`` * z (see the module docstring): plain local logits, the whole
    vocabulary (FSDP / HSDP / PP) or this rank's vocabulary shard (tensor parallel)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        z_loss_weight: float = 1e-5
        """Weight of mean(logsumexp(logits)^2); the paper: 1e-5."""

        global_vocab_size: int | None = None
        """The logits' full width (the head's padded rows); needed under tensor parallel."""

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        self.weight = config.z_loss_weight
        self.global_vocab_size = config.global_vocab_size
        self.fn = _loss_sums
        internals.compile_loss(self, compile_config)
        self._step_tokens: torch.Tensor | None = None  # identifies the training step
        self.train_z = self.train_ce = None
        self.val_z = self.val_tokens = None
        global _ACTIVE
        _ACTIVE = self

    def _shard(self, pred: torch.Tensor):
        """``(vocab_start, TP group)`` when ``pred`` holds a vocabulary shard, else None."""
        if not isinstance(pred, torch.Tensor) or hasattr(pred, "device_mesh"):
            raise NotImplementedError(
                "z-loss takes plain local logits (torchtitan's spmd_types backend), "
                f"not {type(pred).__name__}"
            )
        width, vocab = pred.shape[-1], self.global_vocab_size
        tp = spmd_mesh_size("tp")
        if tp == 1:
            if vocab is not None and width != vocab:
                raise ValueError(
                    f"z-loss: logits of width {width} outside a tensor-parallel mesh, "
                    f"global_vocab_size {vocab}"
                )
            return None
        if vocab is None or width * tp != vocab:
            raise ValueError(
                f"z-loss under tensor parallel {tp}: logits of width {width} are not a 1/{tp} "
                f"shard of global_vocab_size {vocab} (set_tensor_parallel sets it)"
            )
        group = current_spmd_mesh().get_group("tp")
        return dist.get_rank(group) * width, group

    def __call__(
        self,
        pred: torch.Tensor,
        labels: torch.Tensor,
        global_valid_tokens: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        del kwargs
        ce, z = self.fn(pred, labels, self._shard(pred))
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
        # as torchtitan's CrossEntropyLoss: spmd_types has no rule for a sum over the batch (P on
        # DP / CP, I on TP) divided by the untyped token count; the quotients keep that type
        checking = spmd.is_type_checking()
        with spmd.no_typecheck():
            z, ce = z / global_valid_tokens, ce / global_valid_tokens
            loss = ce + z
        if checking:
            spmd.assert_type([loss, z, ce], {"dp": spmd.P, "cp": spmd.P, "tp": spmd.I})
        self.train_z = self.train_z + z.detach()
        self.train_ce = self.train_ce + ce.detach()
        return loss, {"z_loss/mean": z.detach()}


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
