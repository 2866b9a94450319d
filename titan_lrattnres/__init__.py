"""torchtitan 0.3.0 plug-in for LR-AttnRes: ``--module titan_lrattnres --config NAME``."""

from titan_lrattnres.flops import added_flops_percent
from titan_lrattnres.registry import FLAVORS, build_model_config, model_registry

__all__ = ["FLAVORS", "added_flops_percent", "build_model_config", "model_registry"]
