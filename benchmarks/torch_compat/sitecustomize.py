"""torchtitan 0.3.0 (written against torch 2.14) on an older torch, e.g. 2.11.

Python imports ``sitecustomize`` at start-up from the first folder on ``sys.path`` that has one,
so the patches below are in place before anything imports torchtitan, in every process the GPU
check starts (the Trainer subprocess and inductor's compile workers too). ``gpu_check.sh`` puts
this folder on ``PYTHONPATH`` only when torch is older than 2.14; it is no package and nothing
imports it otherwise. Each patch also checks that the piece is missing, so on torch 2.14.1 the
module changes nothing. The three gaps and their verbatim errors: ``docs/gpu-check.md`` (checked
on CPU under torch 2.11: losses bit-identical to 2.14.1).

Not patched: ``fully_shard(dp_mesh_dims=...)`` (reached only at >= 2 ranks with the default
``spmd_types`` backend; the GPU check runs one process).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import sys
from dataclasses import dataclass

APPLIED: list[str] = []  # what was patched in this process, for the check's JSON


def _data_parallel_mesh_dims(fsdp) -> None:
    # torchtitan/distributed/fsdp.py imports the name at module level (an ImportError on 2.11
    # that blocks `import titan_lrattnres`); a copy of 2.14's dataclass, fields and properties.
    if hasattr(fsdp, "DataParallelMeshDims"):
        return

    @dataclass
    class DataParallelMeshDims:
        shard: str | tuple[str, ...] | None = None
        replicate: str | tuple[str, ...] | None = None

        def __post_init__(self):
            if self.shard is None and self.replicate is None:
                raise ValueError(
                    "At least one of shard or replicate must be set in DataParallelMeshDims"
                )

        @staticmethod
        def _names(x) -> tuple[str, ...]:
            return () if x is None else (x,) if isinstance(x, str) else tuple(x)

        @property
        def shard_names(self) -> tuple[str, ...]:
            return self._names(self.shard)

        @property
        def replicate_names(self) -> tuple[str, ...]:
            return self._names(self.replicate)

    DataParallelMeshDims.__module__ = fsdp.__name__
    fsdp.DataParallelMeshDims = DataParallelMeshDims
    APPLIED.append("torch.distributed.fsdp.DataParallelMeshDims")


def _set_timeout(dist) -> None:
    # torchtitan/distributed/utils.py calls dist.set_timeout(timeout, group); 2.11 has the same
    # function under its older private name.
    if hasattr(dist, "set_timeout") or not hasattr(dist.distributed_c10d, "_set_pg_timeout"):
        return
    dist.set_timeout = dist.distributed_c10d._set_pg_timeout
    APPLIED.append("torch.distributed.set_timeout")


def _create_block_mask(flex) -> None:
    # torchtitan/models/common/decoder.py passes separate_full_blocks (used only by its
    # batch-invariant mode); attention.py binds create_block_mask at import, hence patch early.
    original = flex.create_block_mask
    if "separate_full_blocks" in inspect.signature(original).parameters:
        return

    @functools.wraps(original)
    def create_block_mask(*args, separate_full_blocks=True, **kwargs):
        return original(*args, **kwargs)

    flex.create_block_mask = create_block_mask
    APPLIED.append("torch.nn.attention.flex_attention.create_block_mask(separate_full_blocks)")


def _apply() -> None:
    import torch

    if torch.distributed.is_available():
        import torch.distributed as dist
        import torch.distributed.fsdp as fsdp

        _data_parallel_mesh_dims(fsdp)
        _set_timeout(dist)
    import torch.nn.attention.flex_attention as flex

    _create_block_mask(flex)
    if APPLIED and os.environ.get("LRATTNRES_COMPAT_VERBOSE"):
        print(f"[torch_compat] torch {torch.__version__}: {', '.join(APPLIED)}", file=sys.stderr)


def _chain_next_sitecustomize() -> None:
    # Being first on sys.path hides any sitecustomize the environment has further down: run it too.
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        path = os.path.join(entry or os.getcwd(), "sitecustomize.py")
        if os.path.abspath(entry or os.getcwd()) == here or not os.path.isfile(path):
            continue
        spec = importlib.util.spec_from_file_location("_site_sitecustomize", path)
        if spec is not None and spec.loader is not None:
            spec.loader.exec_module(importlib.util.module_from_spec(spec))
        return


try:
    _apply()
except Exception as e:  # noqa: BLE001 (start-up must not fail; the check reports what is missing)
    print(f"[torch_compat] not applied: {type(e).__name__}: {e}", file=sys.stderr)
try:
    _chain_next_sitecustomize()
except Exception as e:  # noqa: BLE001
    print(f"[torch_compat] the next sitecustomize failed: {type(e).__name__}: {e}", file=sys.stderr)
