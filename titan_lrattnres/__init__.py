"""torchtitan 0.3.0 plug-in for LR-AttnRes: ``--module titan_lrattnres --config NAME``.

The public names load on first use, so importing one submodule does not load the package.
"""

from __future__ import annotations

import importlib

# public name -> the module defining it
_PUBLIC = {
    "FLAVORS": "titan_lrattnres.model.registry",
    "Flavor": "titan_lrattnres.model.registry",
    "added_flops_percent": "titan_lrattnres.model.flops",
    "build_model_config": "titan_lrattnres.model.registry",
    "load_model": "titan_lrattnres.evaluation.inference",
    "model_registry": "titan_lrattnres.spec",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_PUBLIC[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
