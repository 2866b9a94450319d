"""``parallel_worker.py`` with the z-loss: ``python zloss_worker.py MODEL [trainer CLI ...]``
runs the registered ``tp_<MODEL>`` config (``cpu_smoke`` with another model) with the paper
recipe's loss and metrics (``train_configs.recipe.with_paper_recipe``: the chunked z-loss, the
z part logged apart) and its own optimizer and LR schedule (AdamW), so that only the loss
differs from the cross-entropy runs. The z-loss weight is ``WEIGHT``, not the paper's 1e-5: at
1e-5 the z part of the loss and of every gradient would sit below the parity tolerance."""

from __future__ import annotations

import sys

from tests.titan_lrattnres import parallel_worker as worker  # first: it sets up the CPU backend

WEIGHT = 1e-2


def register(model: str) -> str:
    import titan_lrattnres.config_registry as registry
    from train_configs import CONFIGS
    from train_configs.recipe import with_paper_recipe

    name = worker_register(model)
    base = CONFIGS[name]

    def config():
        c = base()
        optimizer, lr_scheduler = c.optimizer, c.lr_scheduler
        c = with_paper_recipe(c, variant=c.model_spec.model.router.variant, z_loss_weight=WEIGHT)
        c.optimizer, c.lr_scheduler = optimizer, lr_scheduler
        return c

    CONFIGS[name] = config
    setattr(registry, name, config)
    return name


worker_register, worker.register = worker.register, register

if __name__ == "__main__":
    sys.exit(worker.main(sys.argv[1:]))
