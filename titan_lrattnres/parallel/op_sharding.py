"""DTensor sharding rules for the ``lrattnres::`` forward ops (``--debug.spmd_typechecking``),
and the ``inductor`` read (``custom_ops.graph.Read``) registered with spmd_types' checker as
local: per token, no collective, so replicated queries and varying sources give varying outputs.

Every depth read is per token: the sources ``[..., d]`` (keys ``[..., r]``, phase-1 results,
partials) may be sharded on any token dim (batch, sequence) as long as all of them share it, the
queries are replicated, and the outputs are sharded on the same token dim (``block_read`` puts
its sites first: ``[c, ...]``, so there it is the next dim). Replicated in, replicated out.
Partial inputs are refused (softmax is not linear). spmd_types' checker asks DTensor for these
rules on every mesh axis where an activation carries a shard (sequence parallel, data parallel).
"""

from __future__ import annotations

import spmd_types as spmd
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

import custom_ops  # noqa: F401  (registers torch.ops.lrattnres)
from custom_ops import graph


def _token_dims(x) -> range:
    return range(len(x.shape) - 1)  # every dim but the feature dim


def _read_rules(bank: bool, sliced: bool):
    def rules(values, *rest):
        keys = [] if sliced else list(rest[0])
        tensors = len(values) + len(keys)
        shardings = [([Replicate(), Replicate()], [Replicate()] * (tensors + 1))]
        for k in _token_dims(values[0]):
            out = Shard(k + 1) if bank else Shard(k)
            shardings.append(([out, out], [Shard(k)] * tensors + [Replicate()]))
        return shardings

    return rules


def _merge_rules(out1, lse1, partial_value, partial_key, query, eps, emit_norm, impl):
    tensors = 4 if partial_key is not None else 3
    shardings = [([Replicate(), Replicate()], [Replicate()] * (tensors + 1))]
    for k in _token_dims(partial_value):
        norm = Shard(k) if emit_norm else Shard(0)  # no norm: an empty [0] tensor
        shardings.append(([Shard(k), norm], [Shard(k)] * tensors + [Replicate()]))
    return shardings


def register() -> None:
    """Register the rules (idempotent: a later registration replaces the earlier one)."""
    ops = torch.ops.lrattnres
    for name, bank, sliced in (
        ("depth_read", False, False),
        ("depth_read_sliced", False, True),
        ("block_read", True, False),
        ("block_read_sliced", True, True),
    ):
        register_sharding(getattr(ops, name).default)(_read_rules(bank, sliced))
    register_sharding(ops.merge_partial.default)(_merge_rules)
    spmd.register_local_autograd_function(graph.Read)


register()
