"""torchtitan 0.3.0 plug-in for LR-AttnRes: ``--module titan_lrattnres --config NAME``."""

from titan_lrattnres.evaluation.inference import load_model
from titan_lrattnres.model.flops import added_flops_percent
from titan_lrattnres.model.registry import FLAVORS, Flavor, build_model_config, model_registry

__all__ = [
    "FLAVORS",
    "Flavor",
    "added_flops_percent",
    "build_model_config",
    "load_model",
    "model_registry",
]
