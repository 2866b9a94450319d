"""The paper's optimiser recipe as torchtitan components.

- :class:`MuonOptimizersContainer`: torchtitan 0.3.0's ``OptimizersContainer`` knows only Adam,
  AdamW and DistMuon; this one adds ``"Muon"`` (:class:`titan_lrattnres.components.muon.Muon`) and
  lets a group claim only parameters of at least ``min_ndim`` dimensions (:class:`ParamGroup`).
- :func:`recipe_param_groups`: the paper's routing. Muon (lr 1e-3, cautious wd 0.1) for every
  >= 2-D weight but the embedding, the LM head and the depth queries -- the fused
  ``[W^O; W^K]`` projections and the embedding's key ``embedding_key`` included, and each MLP's
  ``w1`` / ``w3`` orthogonalised as one matrix ``[w1; w3]`` (the paper's fused ``fc1``;
  ``fuse_mlp_input``); AdamW (lr 3e-4, betas (0.9, 0.95), wd 0) for the embedding, the LM head,
  the depth queries (each layer's ``queries [n, r]``, :data:`QUERIES`: AdamW in the paper, in a
  group of their own ahead of Muon's, which would otherwise take them as matrices) and any 1-D
  parameter.
- :class:`MomentumLRSchedulers`: torchtitan's LR schedule (the same lambda for both optimisers,
  as in the paper) plus Muon's momentum schedule: warmup 0.85 -> 0.95 over the first steps,
  cooldown back to 0.85 over the last ones (the paper: 300 and 100 steps).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from torch import nn
from torchtitan.components.checkpointer.utils import canonical_fqn
from torchtitan.components.optimizer import LRSchedulersContainer, OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from titan_lrattnres import torchtitan_internals as internals
from titan_lrattnres.components.muon import Muon

MUON_LR, ADAMW_LR = 1e-3, 3e-4
QUERIES = r"(^|\.)queries$"
"""The param-group pattern of the depth queries: each layer's ``layers.{i}.queries [n, r]``."""
MLP_INPUT = (("feed_forward.w1.weight", "feed_forward.w3.weight"),)
"""``Muon(fuse=...)`` for the paper's ``fc1 = [W1; W3]``: each MLP's gate and up projections."""


@dataclass(kw_only=True, slots=True)
class ParamGroup(ParamGroupConfig):
    min_ndim: int = 0
    """Only parameters with at least this many dimensions join the group (Muon: 2)."""

    optional: bool = False
    """Matching no parameter is allowed (a fallback for 1-D parameters the model may lack)."""


class MuonOptimizersContainer(OptimizersContainer):
    """``OptimizersContainer`` with ``"Muon"`` and :class:`ParamGroup` routing (first match wins,
    as in torchtitan; a group that matches nothing raises unless ``optional`` or the model is a
    pipeline stage)."""

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        pass

    # torchtitan's private hooks, called by its __init__ (titan_lrattnres/torchtitan_internals.py)
    @staticmethod
    def _resolve_optimizer_factory(name: str):
        if name == "Muon":
            return Muon
        return internals.stock_optimizer_factory(name)

    @staticmethod
    def _build_param_groups(
        model: nn.Module, param_group_configs: list[ParamGroupConfig], impl_kwargs: dict[str, Any]
    ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[str]]]:
        groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
        patterns: dict[str, list[str]] = defaultdict(list)
        claimed: set[str] = set()
        for pg in param_group_configs:
            pattern, min_ndim = re.compile(pg.pattern), getattr(pg, "min_ndim", 0)
            params, names = [], []
            for name, p in model.named_parameters():
                if (
                    p.requires_grad
                    and name not in claimed
                    and p.ndim >= min_ndim
                    and pattern.search(name)
                ):
                    params.append(p)
                    names.append(canonical_fqn(name))
                    claimed.add(name)
            if not params:
                # a pipeline stage (titan_lrattnres.parallel.pipeline) lacks the embedding, head or
                # other stages' queries: their groups are another stage's
                if getattr(pg, "optional", False) or getattr(model, "plan", None) is not None:
                    continue
                raise ValueError(
                    f"Optimizer param_groups pattern '{pg.pattern}' matched no parameters"
                )
            kwargs = dict(impl_kwargs)
            if pg.optimizer_name == "Muon":
                kwargs = {}  # no fused / foreach variants
            groups[pg.optimizer_name].append(
                {"params": params, "param_names": names, **kwargs, **pg.optimizer_kwargs}
            )
            patterns[pg.optimizer_name].append(pg.pattern)
        return groups, patterns


def recipe_param_groups(
    variant: str,
    *,
    muon_lr: float = MUON_LR,
    adamw_lr: float = ADAMW_LR,
    weight_decay: float = 0.1,
    ortho_dtype: str = "bfloat16",
    implementation: str = "fused",
    fuse_mlp_input: bool = True,
) -> MuonOptimizersContainer.Config:
    """The paper's Muon / AdamW split (docs/training.md). ``fuse_mlp_input``: Muon treats each
    MLP's ``[w1; w3]`` as one matrix, as the paper's fused ``fc1`` (a Muon constructor argument,
    so the optimiser's checkpoint is the same either way)."""

    def adamw(pattern: str, **extra) -> ParamGroup:
        kwargs = {"lr": adamw_lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
        return ParamGroup(pattern=pattern, optimizer_name="AdamW", optimizer_kwargs=kwargs, **extra)

    groups = [adamw(QUERIES)] if variant != "baseline" else []
    groups += [
        adamw(r"tok_embeddings\."),
        adamw(r"lm_head\."),
        ParamGroup(
            pattern=r".*",
            optimizer_name="Muon",
            min_ndim=2,
            optimizer_kwargs={
                "lr": muon_lr,
                "weight_decay": weight_decay,
                "momentum": 0.95,
                "nesterov": True,
                "beta2": 0.95,
                "ortho_dtype": ortho_dtype,
            },
        ),
        adamw(r".*", optional=True),  # 1-D parameters (none in this model: norms have no gain)
    ]
    return MuonOptimizersContainer.Config(
        param_groups=groups,
        implementation=implementation,
        optimizer_factory_kwargs_by_name={"Muon": {"fuse": MLP_INPUT}} if fuse_mlp_input else {},
    )


def muon_momentum(step: int, total: int, warmup: int, cooldown: int, lo: float, hi: float) -> float:
    """Momentum at 0-based optimiser step ``step`` of ``total`` (the LR-AttnRes ``train.py``
    ``get_muon_momentum``): ``lo -> hi`` linearly over ``warmup`` steps, ``hi``, then back
    towards ``lo`` over the last ``cooldown`` steps."""
    start = total - cooldown
    if step < warmup:
        return lo + step / warmup * (hi - lo)
    if step > start:
        return hi - (step - start) / cooldown * (hi - lo)
    return hi


class MomentumLRSchedulers(LRSchedulersContainer):
    """torchtitan's LR schedulers plus Muon's momentum schedule, set on every Muon group before
    each step. Checkpoints as the LR schedulers do (``last_epoch``); the momentum value also
    travels in the optimiser's param groups."""

    @dataclass(kw_only=True, slots=True)
    class Config(LRSchedulersContainer.Config):
        momentum_warmup_steps: int = 300
        momentum_cooldown_steps: int = 100
        momentum_min: float = 0.85
        momentum_max: float = 0.95

        def build(self, *, optimizers, training_steps):  # pyrefly: ignore [bad-override]
            base = LRSchedulersContainer.Config.build(
                self, optimizers=optimizers, training_steps=training_steps
            )
            total = self.total_steps if self.total_steps is not None else training_steps
            return MomentumLRSchedulers(base, total, self)

    def __init__(self, base: LRSchedulersContainer, total_steps: int, config: Config):
        self.schedulers = base.schedulers
        self.total_steps = total_steps
        self.config = config
        self._set_momentum()

    def momentum(self, step: int) -> float:
        c = self.config
        return muon_momentum(
            step,
            self.total_steps,
            c.momentum_warmup_steps,
            c.momentum_cooldown_steps,
            c.momentum_min,
            c.momentum_max,
        )

    def _set_momentum(self) -> None:
        value = self.momentum(self.schedulers[0].last_epoch)
        for s in self.schedulers:
            if isinstance(s.optimizer, Muon):
                for group in s.optimizer.param_groups:
                    group["momentum"] = value

    def step(self) -> None:
        super().step()
        self._set_momentum()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._set_momentum()

    def get_metrics(self) -> dict[str, float]:
        metrics = super().get_metrics()
        metrics["momentum/Muon"] = self.momentum(self.schedulers[0].last_epoch)
        return metrics


def routing(optimizers: OptimizersContainer) -> dict[str, str]:
    """Parameter FQN -> the optimiser class name that updates it."""
    return {
        name: type(opt).__name__
        for opt in optimizers
        for group in opt.param_groups
        for name in group["param_names"]
    }


__all__ = [
    "MLP_INPUT",
    "MomentumLRSchedulers",
    "MuonOptimizersContainer",
    "ParamGroup",
    "QUERIES",
    "muon_momentum",
    "recipe_param_groups",
    "routing",
]
