"""Pipeline parallel: stage plans, the stage forward, and the cross-stage source cache.

``pipeline_lrattnres`` is the model spec's ``pipelining_fn``: torchtitan's ``pipeline_llm``
(its stage split, ``PipelineStage`` and schedules) with three additions.

- **Ownership.** Every stage keeps the ``router``, pruned to what it owns: the queries of its
  own read sites (``router.query_<t>``, one parameter per site) and, on the first stage only,
  the projected embedding key. A checkpoint saved by any split therefore holds every parameter
  exactly once, and loads in one process.
- **The stage forward** (:class:`LRAttnResStage`). A stage boundary after sublayer c carries the
  depth state a later read needs, as a tuple whose layout is fixed by the static block schedule:
  ``h_c`` (the read of site c), the running partial of the current block when c is no block end
  (and its key), then the completed sources -- the embedding and block sums -- the receiving rank
  does not hold yet (values; projected: each with its key). Everything sent is contiguous. The
  receiver rebuilds the state and recomputes phase 1 (the batched read of the completed
  sources) for its own sites of the current block.
- **The cross-stage source cache** (:class:`SourceCache`). With several stages per rank
  (Interleaved1F1B, LoopedBFS), a rank keeps the sources its earlier stage already received or
  produced, and a hop into a later stage on that rank ships only the blocks completed since.
  The later stage reads the cached sources through detached leaves; their gradients are handed
  to the earlier stage's backward by a pass-through node on its output (:class:`_Tap`), so every
  source's gradient reaches its producer exactly once, and no backward runs through another
  stage's graph (the "backward through the graph a second time" of naive caching).

Schedules: 1F1B, GPipe, Interleaved1F1B and LoopedBFS. The zero-bubble schedules compute input
gradients with ``autograd.grad`` over the received tensors only, which does not reach the
cache's leaves: they are refused (README "Parallelism").

``python -m benchmarks.pipeline_hops`` prints the bytes per hop (:func:`hop_table`), naive vs
cached, for the paper's shape.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict, deque
from dataclasses import dataclass

import torch

from custom_ops.schedule import schedule_ends
from titan_lrattnres.depth import DepthState, query_name
from titan_lrattnres.model import LRAttnResModel

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


# -- the cache ------------------------------------------------------------------------------------
class _Slot:
    """One microbatch's sources deposited by one stage, and the leaves its reader made."""

    def __init__(self, tensors: list[torch.Tensor]):
        self.tensors = tensors
        self.leaves: list[torch.Tensor] | None = None

    def take(self) -> list[torch.Tensor]:
        self.leaves = [t.detach().requires_grad_(t.requires_grad) for t in self.tensors]
        self.tensors = []
        return self.leaves


class _Tap(torch.autograd.Function):
    """Identity on ``h``; its backward gives each deposited source the gradient the later stage
    accumulated into its leaf (that stage's backward has run: it is downstream)."""

    @staticmethod
    def forward(ctx, slot: _Slot, h: torch.Tensor, *sources: torch.Tensor):
        ctx.slot, ctx.n = slot, len(sources)
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad_h):
        leaves = ctx.slot.leaves
        grads = [leaf.grad for leaf in leaves] if leaves is not None else [None] * ctx.n
        ctx.slot.leaves = None
        return None, grad_h, *grads


class SourceCache:
    """Per rank: the sources each stage deposits, one FIFO per depositing stage (every schedule
    runs a stage's microbatches in order, and a later stage on the rank after its earlier one)."""

    def __init__(self):
        self.slots: dict[int, deque[_Slot]] = defaultdict(deque)

    def put(self, stage: int, tensors: list[torch.Tensor]) -> _Slot:
        slot = _Slot(tensors)
        self.slots[stage].append(slot)
        return slot

    def take(self, stage: int) -> list[torch.Tensor]:
        if not self.slots[stage]:
            raise RuntimeError(f"source cache: stage {stage} deposited nothing for this microbatch")
        return self.slots[stage].popleft().take()

    def reset(self) -> None:
        self.slots.clear()

    def check_drained(self) -> None:
        left = {s: len(q) for s, q in self.slots.items() if q}
        if left:
            raise RuntimeError(f"source cache: deposits never read (stage: count) {left}")


# -- the stage forward ----------------------------------------------------------------------------
class LRAttnResStage(LRAttnResModel):
    """One pipeline stage of the model (its class is set by :func:`attach`)."""

    plan: StagePlan
    cache: SourceCache

    def forward(self, *inputs, positions=None, attention_masks=None):
        router, plan = self.router, self.plan
        if plan.recv is None:
            (tokens,) = inputs
            state = router.start(self.tok_embeddings(tokens))
            h = state.embedding
        else:
            h, state = self._receive(inputs)
        for key, layer in self.layers.items():
            h = router.step(state, int(key) + 1, layer(h, attention_masks, positions))
        if plan.send is None:
            h = self.norm(h)
            return h if self._skip_lm_head else self.lm_head(h)
        return self._send(state, h)

    def _receive(self, inputs: tuple) -> tuple[torch.Tensor, DepthState]:
        router, hop = self.router, self.plan.recv
        if len(inputs) != hop.tensors(router.projected, router.variant == "baseline"):
            raise RuntimeError(f"stage {self.plan.index}: {len(inputs)} inputs, plan {hop}")
        it = iter(inputs)
        h = next(it)
        if router.variant == "baseline":
            return h, DepthState(embedding=None, running=h)
        partial = next(it) if hop.partial else None
        partial_key = next(it) if hop.partial and router.projected else None
        values, keys = [], []
        if hop.first_source:
            cached = self.cache.take(self.plan.take_from)
            values = cached[: hop.first_source]
            keys = cached[hop.first_source :] if router.projected else [None] * len(values)
        for _ in range(hop.first_source, hop.n_sources):
            values.append(next(it))
            keys.append(next(it) if router.projected else None)
        state = DepthState(
            embedding=values[0],
            embedding_key=keys[0],
            values=values[1:],
            keys=keys[1:],
            partial=partial,
            partial_key=partial_key,
        )
        if router.backend != "reference":  # phase 1 of the current block, for this stage's sites
            last_end = max((e for e in router.ends if e <= hop.cut), default=0)
            router._phase1(state, last_end, first=hop.cut + 1)
        return h, state

    def _send(self, state: DepthState, h: torch.Tensor) -> tuple[torch.Tensor, ...]:
        router, plan, hop = self.router, self.plan, self.plan.send
        if router.variant == "baseline":
            return (h.contiguous(),)
        values = [state.embedding, *state.values]
        keys = [state.embedding_key, *state.keys]
        if len(values) != hop.n_sources:
            raise RuntimeError(f"stage {plan.index}: {len(values)} sources, plan {hop}")
        out = []
        if hop.partial:
            out.append(state.partial)
            if router.projected:
                out.append(state.partial_key)
        for i in range(hop.first_source, hop.n_sources):
            out.append(values[i])
            if router.projected:
                out.append(keys[i])
        if plan.deposit:
            deposit = values + keys if router.projected else values
            h = _Tap.apply(self.cache.put(plan.index, deposit), h, *deposit)
        return tuple(t.contiguous() for t in (h, *out))


def attach(model: LRAttnResModel, plan: StagePlan, cache: SourceCache) -> None:
    """Make ``model`` (a stage's split copy) the stage ``plan``: prune the router to the stage's
    own parameters and switch to the stage forward."""
    router = model.router
    if router.variant != "baseline":
        for t in range(1, router.num_sublayers + 1):
            if not plan.first <= t <= plan.last:
                delattr(router, query_name(t))
    if plan.recv is not None:
        router.embedding_key = None
    router.site_stop = plan.last + 1
    model.__class__ = LRAttnResStage
    model.plan, model.cache = plan, cache


# -- torchtitan's pipelining_fn -------------------------------------------------------------------
def _module_names(parallel_dims, parallelism, model_config) -> list[list[str]]:
    from torchtitan.distributed import pipeline_parallel as pp

    if parallelism.module_fqns_per_model_part is not None:
        return [list(names) for names in parallelism.module_fqns_per_model_part]
    stages, layers, input_weight, output_weight = pp._get_pipeline_metadata(
        parallel_dims, parallelism, model_config
    )
    return pp._generate_llm_fqn_per_model_part(stages, layers, input_weight, output_weight)


def check_schedule(name: str) -> None:
    if name.lower() not in {s.lower() for s in SCHEDULES}:
        raise NotImplementedError(
            f"LR-AttnRes pipeline parallel supports the schedules {', '.join(SCHEDULES)}; "
            f"parallelism.pipeline_parallel_schedule={name!r} is not one: the zero-bubble "
            "schedules split the backward and compute input gradients for the received tensors "
            "only, which misses the sources a rank reads from its cross-stage cache"
        )


def pipeline_lrattnres(model, *, parallel_dims, parallelism, model_config, parallelize_fn, **kw):
    """``pipeline_llm`` for LR-AttnRes (see the module docstring); same arguments and return."""
    from torchtitan.distributed import pipeline_parallel as pp

    check_schedule(parallelism.pipeline_parallel_schedule)
    if parallelism.pipeline_parallel_schedule_csv:
        raise NotImplementedError("LR-AttnRes pipeline parallel does not take a schedule CSV")
    names = _module_names(parallel_dims, parallelism, model_config)
    spans = stage_spans(names, len(model_config.layers))
    degree, schedule = parallel_dims.pp, parallelism.pipeline_parallel_schedule
    ranks = [0] * len(names)
    for r in range(degree):
        for s in pp._get_pp_rank_to_stage_indices_mapping(r, degree, schedule, len(names)):
            ranks[s] = r
    router = model_config.router
    ends = schedule_ends(router.num_sublayers, router.blocks, router.block_layers)
    plans = {(p.first, p.last): p for p in plan_stages(spans, ranks, ends)}
    cache = SourceCache()

    def parallelize_stage(part, **kwargs):
        sites = [int(k) + 1 for k in part.layers.keys()]
        attach(part, plans[(min(sites), max(sites))], cache)
        return parallelize_fn(part, **kwargs)

    with_router = [[*n, "router"] for n in names]
    parallelism = dataclasses.replace(parallelism, module_fqns_per_model_part=with_router)
    schedule_, parts, has_first, has_last = pp.pipeline_llm(
        model,
        parallel_dims=parallel_dims,
        parallelism=parallelism,
        model_config=model_config,
        parallelize_fn=parallelize_stage,
        **kw,
    )
    step = schedule_._step_microbatches

    def step_with_cache(*args, **kwargs):
        cache.reset()
        out = step(*args, **kwargs)
        cache.check_drained()
        return out

    schedule_._step_microbatches = step_with_cache
    # torch runs the stages once on the first step to infer shapes, the loss included: a loss
    # that keeps statistics (titan_lrattnres.zloss) is told to leave those calls out
    init, losses = getattr(schedule_, "_initialize_pp_stages", None), []
    loss = kw.get("loss_fn")
    while loss is not None:  # the loss and the losses it wraps (e.g. ChunkedLossWrapper's)
        losses.append(loss)
        loss = getattr(loss, "loss_fn", None)
    if init is not None:

        def init_stages(*args, **kwargs):
            for loss in losses:
                loss.in_shape_inference = True
            try:
                return init(*args, **kwargs)
            finally:
                for loss in losses:
                    loss.in_shape_inference = False

        schedule_._initialize_pp_stages = init_stages
    return schedule_, parts, has_first, has_last


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
