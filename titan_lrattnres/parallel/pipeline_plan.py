"""Pipeline parallel's static plan: which layers each stage holds and what every stage boundary
carries (the depth stream a later read needs, fixed by the block schedule). Pure Python: no model,
no torchtitan; :mod:`titan_lrattnres.parallel.pipeline` builds the stages from it.

Stages are cut between layers (torchtitan's ``pipeline_llm`` splits ``model.layers`` by layer
name): a boundary after ``cut`` layers falls after sublayer 2·cut of the block schedule, in a
block (a running partial crosses it) or at a block end (none does).

``python -m benchmarks.pipeline_hops`` prints the bytes per hop (:func:`hop_table`), naive vs
cached, for the paper's shape.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from custom_ops.schedule import schedule_ends

SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS")


# -- the static plan ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hop:
    """What the boundary after ``cut`` layers (after sublayer 2·cut) carries: the partial (when
    ``partial``), then sources ``first_source .. n_sources - 1`` (0 = the embedding, i = block i;
    Full: sublayer output i). No ``h``: the next layer reads its own input from these. The
    baseline's boundary carries ``h`` alone."""

    cut: int
    partial: bool
    first_source: int
    n_sources: int

    @property
    def shipped(self) -> int:
        """Depth-stream values sent: the partial and the uncached sources."""
        return int(self.partial) + self.n_sources - self.first_source

    def tensors(self, projected: bool, baseline: bool = False) -> int:
        if baseline:
            return 1
        return (2 if projected else 1) * self.shipped


@dataclass(frozen=True)
class StagePlan:
    index: int
    first: int  # first layer (0-based, as in ``layers.<i>``)
    last: int  # last layer (inclusive)
    rank: int
    recv: Hop | None  # None: the first stage (tokens in)
    send: Hop | None  # None: the last stage (logits out)
    take_from: int | None  # the earlier stage on this rank whose cached sources this one reads
    deposit: bool  # a later stage on this rank reads this stage's sources from the cache


def stage_spans(module_names: list[list[str]], num_layers: int) -> list[tuple[int, int]]:
    """``(first, last)`` layer (0-based, inclusive) of every stage; checks that the stages cover
    the layers in order, each at least one, with the embedding (and the projected embedding
    key) first and norm + head last."""
    spans, expect = [], 0
    last_stage = len(module_names) - 1
    for s, names in enumerate(module_names):
        layers = []
        allowed = {"tok_embeddings", "embedding_key"} if s == 0 else set()
        allowed |= {"norm", "lm_head"} if s == last_stage else set()
        for name in names:
            if name.startswith("layers."):
                layers.append(int(name.split(".", 1)[1]))
            elif name not in allowed:
                raise ValueError(
                    f"pipeline stage {s} lists {name!r}: a stage holds layers.<i> (in order), the "
                    "first also tok_embeddings (and embedding_key), the last also norm and lm_head"
                )
        if not layers or layers != list(range(expect, expect + len(layers))):
            raise ValueError(
                f"pipeline stage {s} must hold the next layers in order from layers.{expect} "
                f"(at least one; got {sorted(layers) or 'none'}): every stage reads across depth"
            )
        spans.append((expect, expect + len(layers) - 1))
        expect += len(layers)
    if expect != num_layers or "tok_embeddings" not in module_names[0]:
        raise ValueError(f"pipeline stages must hold all {num_layers} layers and the embedding")
    if not {"norm", "lm_head"} <= set(module_names[-1]):
        raise ValueError("the last pipeline stage must hold norm and lm_head")
    return spans


def plan_stages(
    spans: list[tuple[int, int]], ranks: list[int], ends: list[int], *, cache: bool = True
) -> list[StagePlan]:
    """The plan of every stage: ``spans`` from :func:`stage_spans` (layers), ``ranks[s]`` the PP
    rank of stage s, ``ends`` the block schedule (sublayers); ``cache=False`` plans the naive
    hops."""
    end_set = frozenset(ends)

    def n_sources(cut: int) -> int:  # completed after `cut` layers, the embedding included
        return 1 + sum(1 for e in ends if e <= 2 * cut)

    plans: list[StagePlan] = []
    for s, (first, last) in enumerate(spans):
        earlier = [p for p in range(s) if ranks[p] == ranks[s]] if cache else []
        later = any(ranks[p] == ranks[s] for p in range(s + 1, len(spans))) if cache else False
        take_from = earlier[-1] if earlier else None
        recv = None
        if s > 0:
            cut = first
            known = n_sources(spans[take_from][1] + 1) if take_from is not None else 0
            recv = Hop(cut, 2 * cut not in end_set, known, n_sources(cut))
        plans.append(StagePlan(s, first, last, ranks[s], recv, None, take_from, later))
    return [
        dataclasses.replace(p, send=plans[p.index + 1].recv if p.index + 1 < len(plans) else None)
        for p in plans
    ]


def check_schedule(name: str) -> None:
    if name.lower() not in {s.lower() for s in SCHEDULES}:
        raise NotImplementedError(
            f"LR-AttnRes pipeline parallel supports the schedules {', '.join(SCHEDULES)}; "
            f"parallelism.pipeline_parallel_schedule={name!r} is not one: the zero-bubble "
            "schedules split the backward and compute input gradients for the received tensors "
            "only, which misses the sources a rank reads from its cross-stage cache"
        )


# -- bytes per hop --------------------------------------------------------------------------------
def hop_table(
    layers: int, dim: int, blocks: int | None, rank: int, variant: str, stages: int, per_rank: int
) -> dict:
    """Per token, bytes of every hop (bf16 values, fp32 keys), naive and cached, for ``stages``
    ranks with ``per_rank`` stages each (loop placement) over an even split of the layers
    (``cut``: layers before the hop)."""
    m, n = 2 * layers, stages * per_rank
    if n > layers:
        raise ValueError(f"{n} stages need at least {n} layers, got {layers}")
    cuts = [round(layers * (s + 1) / n) for s in range(n)]
    spans = [(a, b - 1) for a, b in zip([0, *cuts[:-1]], cuts, strict=True)]
    ranks = [s % stages for s in range(n)]
    ends = schedule_ends(m, blocks)
    projected = variant == "projected"
    key_bytes = 4 * rank if projected else 0

    def nbytes(hop: Hop) -> int:
        return hop.shipped * (2 * dim + key_bytes)

    rows = []
    for naive, cached in zip(
        plan_stages(spans, ranks, ends, cache=False), plan_stages(spans, ranks, ends), strict=True
    ):
        if naive.send is not None:
            rows.append({"cut": naive.send.cut, "naive": nbytes(naive.send),
                         "cached": nbytes(cached.send)})  # fmt: skip
    total = {k: sum(r[k] for r in rows) for k in ("naive", "cached")}
    return {"stages": stages, "per_rank": per_rank, "hops": rows, "total": total,
            "h_only": 2 * dim * len(rows)}  # fmt: skip
