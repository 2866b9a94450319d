"""Named experiments: ``CONFIGS[name]()`` returns a ``Trainer.Config``.

Run one with ``python -m titan_lrattnres.train NAME [overrides]`` or
``torchrun --nproc_per_node=N -m torchtitan.train --module titan_lrattnres --config NAME``.
"""

from __future__ import annotations

from train_configs import cpu, paper_grid, tiny

CONFIGS = {**cpu.CONFIGS, **paper_grid.CONFIGS, **tiny.CONFIGS}


def get_config(name: str):
    if name not in CONFIGS:
        raise KeyError(f"unknown config {name!r}. Available: {', '.join(sorted(CONFIGS))}")
    return CONFIGS[name]()
