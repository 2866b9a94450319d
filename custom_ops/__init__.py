"""Depth-read ops of LR-AttnRes. Importable without torchtitan (also on torch 2.11)."""

from custom_ops import ops, reference, schedule
from custom_ops.api import (
    BACKENDS,
    block_read,
    depth_read,
    depth_read_lse,
    merge_partial,
)
from custom_ops.reference import depth_read as reference_depth_read

__all__ = [
    "BACKENDS",
    "block_read",
    "depth_read",
    "depth_read_lse",
    "merge_partial",
    "ops",
    "reference",
    "reference_depth_read",
    "schedule",
]
