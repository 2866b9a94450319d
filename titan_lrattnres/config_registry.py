"""Named experiments for ``--module titan_lrattnres --config NAME`` (defined in train_configs/).

Importing this module (torchtitan's ConfigManager does, before building the Trainer) installs
the CPU patches when no accelerator is present and registers our datasets.
"""

from titan_lrattnres.training import cpu as _cpu

_cpu.apply()

from titan_lrattnres.components.data import register_datasets as _register_datasets  # noqa: E402
from train_configs import CONFIGS as _CONFIGS  # noqa: E402

_register_datasets()
globals().update(_CONFIGS)
__all__ = sorted(_CONFIGS)
