"""Pipeline parallel: stage plans, the stage forward, and the cross-stage source cache.

``pipeline_lrattnres`` is the model spec's ``pipelining_fn``: torchtitan's ``pipeline_llm``
(its stage split of ``model.layers`` by layer name, ``PipelineStage`` and schedules) with three
additions.

- **Ownership.** Each layer holds its own ``queries``, so a stage owns the queries of its
  layers; the projected root ``embedding_key`` is kept on the first stage only (the only one
  that calls ``model.start``). A checkpoint saved by any split therefore holds every parameter
  exactly once, and loads in one process.
- **The stage forward** (:class:`LRAttnResStage`) is the model's own depth loop: the first stage
  runs the embedding, ``model.start`` and ``run_layers``; a later stage rebuilds the stream
  ``(h, values, keys, partial, partial_key)`` from what it receives and runs ``run_layers``; the
  last stage ends with the norm and the head. A stage boundary after ``cut`` layers carries, as
  a tuple whose layout is fixed by the static block schedule: the running partial of the
  current block when the cut falls inside a block (and its key), then the completed sources --
  the embedding and block sums (Full: every sublayer output) -- the receiving rank does not
  hold yet (values; projected: each with its key). No ``h``: each layer reads its own input
  from these (the baseline's boundary carries ``h`` alone). Everything sent is contiguous. The
  receiving layers read every source in their own phase 1, as in one process.
- **The cross-stage source cache** (:class:`SourceCache`). With several stages per rank
  (Interleaved1F1B, LoopedBFS), a rank keeps the sources its earlier stage already received or
  produced, and a hop into a later stage on that rank ships only the sources completed since.
  The later stage reads the cached sources through detached leaves; their gradients are handed
  to the earlier stage's backward by a pass-through node on its first sent tensor
  (:class:`_Tap`), so every
  source's gradient reaches its producer exactly once, and no backward runs through another
  stage's graph (the "backward through the graph a second time" of naive caching).

Schedules: 1F1B, GPipe, Interleaved1F1B and LoopedBFS. The zero-bubble schedules compute input
gradients with ``autograd.grad`` over the received tensors only, which does not reach the
cache's leaves: they are refused (README "Parallelism").

The static plan (stage spans in layers, hops, schedules) is
:mod:`titan_lrattnres.parallel.pipeline_plan`.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict, deque

import torch

from custom_ops.schedule import schedule_ends
from titan_lrattnres import torchtitan_internals as internals
from titan_lrattnres.model.model import LRAttnResModel, Stream
from titan_lrattnres.parallel.pipeline_plan import (
    StagePlan,
    check_schedule,
    plan_stages,
    stage_spans,
)


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
    """Identity on ``x`` (a tensor the stage sends); its backward gives each deposited source the
    gradient the later stage accumulated into its leaf (that stage's backward has run: it is
    downstream)."""

    @staticmethod
    def forward(ctx, slot: _Slot, x: torch.Tensor, *sources: torch.Tensor):
        ctx.slot, ctx.n = slot, len(sources)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x):
        leaves = ctx.slot.leaves
        grads = [leaf.grad for leaf in leaves] if leaves is not None else [None] * ctx.n
        ctx.slot.leaves = None
        return None, grad_x, *grads


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
        plan = self.plan
        if plan.recv is None:
            (tokens,) = inputs
            stream = self.start(self.tok_embeddings(tokens))
        else:
            stream = self._receive(inputs)

        def call(layer, *stream):
            return layer(*stream, attention_masks, positions)

        stream = self.run_layers(stream, call)
        if plan.send is None:
            h = self.norm(stream[0])
            return h if self._skip_lm_head else self.lm_head(h)
        return self._send(stream)

    def _receive(self, inputs: tuple) -> Stream:
        router, hop = self.router, self.plan.recv
        projected = router.projected
        if len(inputs) != hop.tensors(projected, not router.routed):
            raise RuntimeError(f"stage {self.plan.index}: {len(inputs)} inputs, plan {hop}")
        it = iter(inputs)
        if not router.routed:
            return next(it), None, None, None, None
        partial = next(it) if hop.partial else None
        partial_key = next(it) if hop.partial and projected else None
        values, keys = [], []
        if hop.first_source:
            cached = self.cache.take(self.plan.take_from)
            values = cached[: hop.first_source]
            keys = cached[hop.first_source :]
        for _ in range(hop.first_source, hop.n_sources):
            values.append(next(it))
            if projected:
                keys.append(next(it))
        return None, values, keys if projected else None, partial, partial_key

    def _send(self, stream: Stream) -> tuple[torch.Tensor, ...]:
        router, plan, hop = self.router, self.plan, self.plan.send
        h, values, keys, partial, partial_key = stream
        if not router.routed:
            return (h.contiguous(),)
        if len(values) != hop.n_sources or (partial is not None) != hop.partial:
            raise RuntimeError(
                f"stage {plan.index}: {len(values)} sources, partial {partial is not None}, "
                f"plan {hop}"
            )
        out = []
        if hop.partial:
            out.append(partial)
            if router.projected:
                out.append(partial_key)
        for i in range(hop.first_source, hop.n_sources):
            out.append(values[i])
            if router.projected:
                out.append(keys[i])
        out = [t.contiguous() for t in out]  # never empty: a stage ends a block or a partial
        if plan.deposit:
            deposit = [*values, *keys] if router.projected else list(values)
            out[0] = _Tap.apply(self.cache.put(plan.index, deposit), out[0], *deposit)
        return tuple(out)


def attach(model: LRAttnResModel, plan: StagePlan, cache: SourceCache) -> None:
    """Make ``model`` (a stage's split copy, holding layers ``plan.first .. plan.last``) the
    stage ``plan``: the root ``embedding_key`` dropped unless it is the first stage, and the
    stage forward."""
    held = [int(k) for k in model.layers.keys()]
    if held != list(range(plan.first, plan.last + 1)):
        raise ValueError(f"stage {plan.index} holds layers {held}, plan {plan}")
    if plan.recv is not None:
        model.embedding_key = None
    model.__class__ = LRAttnResStage
    model.plan, model.cache = plan, cache


# -- the schedule --------------------------------------------------------------------------------
def _schedule_class(base: type) -> type:
    """``base`` (the torch schedule class ``pipeline_llm`` picked) with two additions: every
    ``step`` (``eval`` runs one too) starts with an empty source cache and must leave it
    drained; during torch's first-step shape inference, which runs the stages and the loss on
    placeholder tensors, the losses are told so (``in_shape_inference``: a loss that keeps
    statistics, :mod:`titan_lrattnres.components.zloss`, leaves those calls out). Made per
    class, as a subclass of it: a mixin cannot join torch's ABC-based schedules on an instance."""

    def step(self, *args, **kwargs):
        self.source_cache.reset()
        out = base.step(self, *args, **kwargs)
        self.source_cache.check_drained()
        return out

    def _initialize_pp_stages(self, *args, **kwargs):
        # torch's private hook (titan_lrattnres.torchtitan_internals)
        for loss in self.shape_losses:
            loss.in_shape_inference = True
        try:
            return internals.initialize_pp_stages(self, *args, **kwargs)
        finally:
            for loss in self.shape_losses:
                loss.in_shape_inference = False

    methods = {"step": step, "_initialize_pp_stages": _initialize_pp_stages}
    return type(f"LRAttnRes{base.__name__}", (base,), methods)


def _adopt(schedule, cache: SourceCache, loss_fn) -> None:
    """Give ``schedule`` (built by ``pipeline_llm``) the class :func:`_schedule_class` makes."""
    schedule.__class__ = _schedule_class(type(schedule))
    schedule.source_cache, schedule.shape_losses = cache, []
    while loss_fn is not None:  # the loss and the losses it wraps (e.g. ChunkedLossWrapper's)
        schedule.shape_losses.append(loss_fn)
        loss_fn = getattr(loss_fn, "loss_fn", None)


# -- torchtitan's pipelining_fn -------------------------------------------------------------------
def _module_names(parallel_dims, parallelism, model_config) -> list[list[str]]:
    if parallelism.module_fqns_per_model_part is not None:
        return [list(names) for names in parallelism.module_fqns_per_model_part]
    metadata = internals.pipeline_metadata(parallel_dims, parallelism, model_config)
    return internals.llm_module_names(*metadata)


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
        for s in internals.stages_of_pp_rank(r, degree, schedule, len(names)):
            ranks[s] = r
    router = model_config.router
    ends = schedule_ends(router.num_sublayers, router.blocks, router.block_layers)
    plans = {(p.first, p.last): p for p in plan_stages(spans, ranks, ends)}
    cache = SourceCache()

    def parallelize_stage(part, **kwargs):
        layers = [int(k) for k in part.layers.keys()]
        attach(part, plans[(min(layers), max(layers))], cache)
        return parallelize_fn(part, **kwargs)

    names = [list(n) for n in names]
    if model_config.embedding_key is not None and "embedding_key" not in names[0]:
        names[0].append("embedding_key")  # the first stage's (pipeline_llm drops the rest)
    parallelism = dataclasses.replace(parallelism, module_fqns_per_model_part=names)
    schedule_, parts, has_first, has_last = pp.pipeline_llm(
        model,
        parallel_dims=parallel_dims,
        parallelism=parallelism,
        model_config=model_config,
        parallelize_fn=parallelize_stage,
        **kw,
    )
    _adopt(schedule_, cache, kw.get("loss_fn"))
    return schedule_, parts, has_first, has_last
