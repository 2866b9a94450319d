"""The paper's training recipe on top of a ``make_config`` result (docs/training.md).

``with_paper_recipe(config, variant=...)`` swaps in: Muon (Polar Express, NorMuon, cautious wd
0.1, lr 1e-3) for every >= 2-D weight but the embedding and the LM head, each MLP's ``[w1; w3]``
one matrix as the paper's fused ``fc1`` (``fuse_mlp_input``), AdamW (lr 3e-4, betas
(0.9, 0.95), wd 0) for those, the depth queries and 1-D parameters; Muon's momentum schedule
(0.85 -> 0.95 over 300 steps, back over the last 100) beside the existing LR schedule; and
cross-entropy + z-loss (1e-5), with the z part logged apart and validation reporting CE.
Gradient clipping (1.0) and the WSD schedule are already ``make_config``'s.
"""

from __future__ import annotations

from dataclasses import asdict

from torchtitan.components.loss import ChunkedLossWrapper

from titan_lrattnres.components.optimizers import MomentumLRSchedulers, recipe_param_groups
from titan_lrattnres.components.zloss import ZLossCrossEntropy, ZLossMetricsProcessor


def with_paper_recipe(
    config,
    *,
    variant: str,
    muon_lr: float = 1e-3,
    adamw_lr: float = 3e-4,
    weight_decay: float = 0.1,
    z_loss_weight: float = 1e-5,
    momentum_warmup_steps: int = 300,
    momentum_cooldown_steps: int = 100,
    ortho_dtype: str = "bfloat16",
    fuse_mlp_input: bool = True,
):
    """``config`` (a ``make_config`` result) with the paper's optimiser and loss."""
    config.optimizer = recipe_param_groups(
        variant,
        muon_lr=muon_lr,
        adamw_lr=adamw_lr,
        weight_decay=weight_decay,
        ortho_dtype=ortho_dtype,
        implementation=config.optimizer.implementation,
        fuse_mlp_input=fuse_mlp_input,
    )
    lr = {k: v for k, v in asdict(config.lr_scheduler).items() if not k.startswith("_")}
    config.lr_scheduler = MomentumLRSchedulers.Config(
        **lr,
        momentum_warmup_steps=momentum_warmup_steps,
        momentum_cooldown_steps=momentum_cooldown_steps,
    )
    if z_loss_weight:
        num_chunks = getattr(config.loss, "num_chunks", 8)
        config.loss = ChunkedLossWrapper.Config(
            num_chunks=num_chunks, loss_fn=ZLossCrossEntropy.Config(z_loss_weight=z_loss_weight)
        )
        metrics = {k: v for k, v in asdict(config.metrics).items() if not k.startswith("_")}
        config.metrics = ZLossMetricsProcessor.Config(**metrics)
    return config
