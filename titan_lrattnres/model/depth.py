"""The depth plan and the read of one site (docs/method.md §1-4, §7).

The layer is the unit (``titan_lrattnres.model.model.Layer``): layer i holds sublayers 2i+1
(attention) and 2i+2 (MLP) and the queries of the read sites that feed them, 2i and 2i+1 (layer
0: site 1 only, as site 0 is the embedding itself; the last layer also the final read, site 2L).
It runs in one graph:

1. phase 1: one batched read of the sources completed before the layer (the embedding and the
   block sums; Full: every earlier output) for all of its sites (``custom_ops.block_read``);
2. site 2i's read (phase 1 merged with the running partial), the attention, the partial's update
   (``P + o``), site 2i+1's merge of phase 1 with what came since (the partial; a block
   completed at 2i+1 too), the MLP, and the last layer's final read.

A layer reads its own input, so its input is never a stream of its own: what flows between
layers is the completed sources and the running partial, which later layers read anyway (under
activation checkpointing a layer keeps nothing else). Every site's read is phase 1 merged with
at most two sources by their LSEs: the partial, and a block completed inside the layer. Full
AttnRes is Block with an end after every sublayer. The sources a layer completes go back to the
model, which hands every later layer the list: the Python between the layers appends to two
lists, nothing else (:class:`DepthPlan` fixes which layers complete what when the model is
built).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import custom_ops
from custom_ops import graph, reference
from custom_ops.schedule import schedule_ends

VARIANTS_ROUTED = ("attnres", "sliced", "projected")


def layer_sites(i: int, last: bool) -> tuple[int, ...]:
    """The read sites whose queries layer i holds, in order: 2i (not for layer 0: site 0 is the
    embedding alone, with no query), 2i+1, and for the last layer the final read 2i+2."""
    return (*((2 * i,) if i else ()), 2 * i + 1, *((2 * i + 2,) if last else ()))


@dataclass(frozen=True, kw_only=True)
class LayerPlan:
    """What layer i does with the depth sources, fixed when the model is built."""

    index: int
    sources: int  # completed sources before the layer (the embedding included)
    partial_in: bool  # a running partial comes in (the current block began before the layer)
    ends: tuple[bool, bool]  # whether its attention / its MLP ends a block
    last: bool  # the last layer: it makes the final read (site 2L) too

    @property
    def sites(self) -> tuple[int, ...]:
        return layer_sites(self.index, self.last)

    @property
    def key(self) -> tuple:
        """What the layer's graph depends on: layers with one key share a compiled graph."""
        return self.sources, self.partial_in, self.ends, self.index == 0, self.last


@dataclass(frozen=True, kw_only=True)
class DepthPlan:
    """The depth read of a model: variant, keys, source schedule and backend.

    ``backend``: one of ``custom_ops.BACKENDS`` (``reference``: the eager reference's ops;
    ``inductor``: aten ops with a written-out backward, generated and fused by Inductor in the
    layer's graph; ``compiled`` / ``triton``: phase 1 as the registered ``lrattnres::`` op, a
    fused C kernel on CPU and Triton kernels on CUDA; ``auto``: ``read_backend``)."""

    variant: str  # baseline | attnres | sliced | projected
    dim: int
    rank: int  # key rank r (= dim for attnres; unused for baseline)
    num_sublayers: int  # M = 2L
    blocks: int | None = None  # None (and block_layers None) = Full
    block_layers: int | None = None  # Block by size: an end every 2k sublayers
    eps: float | None = None  # key RMSNorm eps; None = custom_ops.reference.DEFAULT_EPS
    backend: str = "auto"

    @property
    def projected(self) -> bool:
        return self.variant == "projected"

    @property
    def routed(self) -> bool:
        return self.variant != "baseline"

    @property
    def num_layers(self) -> int:
        return self.num_sublayers // 2

    @property
    def ends(self) -> list[int]:
        """Block ends in sublayer units (``custom_ops.schedule``)."""
        return schedule_ends(self.num_sublayers, self.blocks, self.block_layers)

    @property
    def graphs(self) -> int:
        """Compiled graphs of one model: its distinct layer plans (the baseline's layers: one).
        Block and Full: ``num_layers``, as the completed sources grow with depth."""
        if not self.routed:
            return 1
        return len({self.layer(i).key for i in range(self.num_layers)})

    def layer(self, i: int) -> LayerPlan:
        """Layer i's part of the schedule."""
        ends = set(self.ends)
        before = sum(1 for e in ends if e <= 2 * i)
        return LayerPlan(
            index=i,
            sources=1 + before,
            partial_in=i > 0 and 2 * i not in ends,
            ends=(2 * i + 1 in ends, 2 * i + 2 in ends),
            last=i == self.num_layers - 1,
        )


def read_backend(backend: str, like: torch.Tensor) -> str:
    """The backend a layer reads with: ``auto`` is the Triton op on CUDA and the ``inductor``
    read elsewhere (on CPU its kernels, generated inside the layer's graph, cost less than an
    opaque op call: docs/performance.md)."""
    if backend == "auto":
        return "triton" if like.is_cuda else "inductor"
    return backend


def site_read(out1, lse1, extras, extra_keys, query, eps, dtype, backend: str) -> torch.Tensor:
    """One site's read: phase 1 ``(out1 [..., d] fp32, lse1 [...])`` merged with the ``extras``
    (the partial, a block completed since phase 1; keys ``extra_keys``, None = sliced tails)
    by the LSEs (docs/method.md §7), in ``dtype``: the reference's ops for the ``reference``
    backend, else ``custom_ops.graph``'s."""
    if backend != "reference":
        return graph.merge_read(out1, lse1, extras, extra_keys, query, eps)[0].to(dtype)
    if extra_keys is None:
        extra_keys = reference.sliced_keys(extras, query.shape[-1])
    out2, lse2 = reference.depth_read_with_lse([v.float() for v in extras], extra_keys, query, eps)
    return reference.merge_reads(out1, lse1, out2, lse2)[0].to(dtype)


def completed_read(values, keys, queries, eps, backend: str):
    """Phase 1: ``(out [c, ..., d] fp32, lse [c, ...])`` of the completed sources for c sites."""
    return custom_ops.block_read(values, keys, queries, eps, backend=backend)
