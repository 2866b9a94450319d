"""Pipeline parallel's static plan: which sublayers each stage holds and what every stage boundary
carries (the depth state a later read needs, fixed by the block schedule). Pure Python: no model,
no torchtitan; :mod:`titan_lrattnres.parallel.pipeline` builds the stages from it.

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
    """What the boundary after sublayer ``cut`` carries: ``h``, the partial (when ``partial``),
    then sources ``first_source .. n_sources - 1`` (0 = the embedding, i = block i)."""

    cut: int
    partial: bool
    first_source: int
    n_sources: int

    @property
    def shipped(self) -> int:
        """Depth-state values sent besides ``h``: the partial and the uncached sources."""
        return int(self.partial) + self.n_sources - self.first_source

    def tensors(self, projected: bool, baseline: bool = False) -> int:
        if baseline:
            return 1
        return 1 + (2 if projected else 1) * self.shipped


@dataclass(frozen=True)
class StagePlan:
    index: int
    first: int  # first sublayer (1-based); its read sites are first..last
    last: int
    rank: int
    recv: Hop | None  # None: the first stage (tokens in)
    send: Hop | None  # None: the last stage (logits out)
    take_from: int | None  # the earlier stage on this rank whose cached sources this one reads
    deposit: bool  # a later stage on this rank reads this stage's sources from the cache


def stage_spans(module_names: list[list[str]], num_sublayers: int) -> list[tuple[int, int]]:
    """``(first, last)`` sublayer (1-based) of every stage; checks that the stages cover the
    sublayers in order, each at least one, with the embedding first and norm + head last."""
    spans, expect = [], 0
    last_stage = len(module_names) - 1
    for s, names in enumerate(module_names):
        layers = []
        allowed = {"router"} | ({"tok_embeddings"} if s == 0 else set())
        allowed |= {"norm", "lm_head"} if s == last_stage else set()
        for name in names:
            if name.startswith("layers."):
                layers.append(int(name.split(".", 1)[1]))
            elif name not in allowed:
                raise ValueError(
                    f"pipeline stage {s} lists {name!r}: a stage holds layers.<i> (in order), the "
                    "first also tok_embeddings, the last also norm and lm_head"
                )
        if not layers or layers != list(range(expect, expect + len(layers))):
            raise ValueError(
                f"pipeline stage {s} must hold the next sublayers in order from layers.{expect} "
                f"(at least one; got {sorted(layers) or 'none'}): every stage reads across depth"
            )
        spans.append((expect + 1, expect + len(layers)))
        expect += len(layers)
    if expect != num_sublayers or "tok_embeddings" not in module_names[0]:
        raise ValueError(
            f"pipeline stages must hold all {num_sublayers} sublayers and the embedding"
        )
    if not {"norm", "lm_head"} <= set(module_names[-1]):
        raise ValueError("the last pipeline stage must hold norm and lm_head")
    return spans


def plan_stages(
    spans: list[tuple[int, int]], ranks: list[int], ends: list[int], *, cache: bool = True
) -> list[StagePlan]:
    """The plan of every stage: ``spans`` from :func:`stage_spans`, ``ranks[s]`` the PP rank of
    stage s, ``ends`` the block schedule; ``cache=False`` plans the naive hops."""
    end_set = frozenset(ends)

    def n_sources(cut: int) -> int:
        return 1 + sum(1 for e in ends if e <= cut)

    plans: list[StagePlan] = []
    for s, (first, last) in enumerate(spans):
        earlier = [p for p in range(s) if ranks[p] == ranks[s]] if cache else []
        later = any(ranks[p] == ranks[s] for p in range(s + 1, len(spans))) if cache else False
        take_from = earlier[-1] if earlier else None
        recv = None
        if s > 0:
            cut = first - 1
            known = n_sources(spans[take_from][1]) if take_from is not None else 0
            recv = Hop(cut, cut not in end_set, known, n_sources(cut))
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
    ranks with ``per_rank`` stages each (loop placement) over an even split of the sublayers."""
    m, n = 2 * layers, stages * per_rank
    cuts = [round(m * (s + 1) / n) for s in range(n)]
    spans = [(a + 1, b) for a, b in zip([0, *cuts[:-1]], cuts, strict=True)]
    ranks = [s % stages for s in range(n)]
    ends = schedule_ends(m, blocks)
    projected = variant == "projected"
    key_bytes = 4 * rank if projected else 0

    def nbytes(hop: Hop) -> int:
        return 2 * dim + hop.shipped * (2 * dim + key_bytes)

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
