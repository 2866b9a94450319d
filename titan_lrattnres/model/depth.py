"""The depth router: read sites, source bookkeeping and the query bank (docs/method.md §1-4, §7).

Design: the transformer's 2L sublayers are the units that torchtitan compiles, checkpoints and
shards (``model.layers``); the router runs between them in the root forward and hands each
sublayer its input in one of three fixed forms, so each compiled graph keeps one signature per
form (no recompiles): ``h`` itself, or a phase-1 read with what finishes it (the cast of a block
end's read, or the phase-2 merge with the partial), which the sublayer runs inside its own
graph, where Inductor fuses it with the partial's update and the next RMSNorm
(``Sublayer.read_input`` / ``write``). The query of read site t is the root
parameter ``router.query_<t>`` (``[r]``, fp32 master weights; t = 1..2L), gathered once per step
by the root FSDP unit: one parameter per site, so a pipeline stage owns exactly the queries of
its own sites and a checkpoint written by any split keeps every one
(``titan_lrattnres.parallel.pipeline``; checkpoints with the earlier ``router.query_bank [2L, r]``
convert with ``titan_lrattnres.components.convert``).

Bookkeeping per sequence (``DepthState``): the embedding and its key, the completed sources
(block sums, or single outputs for Full), and the running partial of the current block, which
INCLUDES the output just written. Full AttnRes is Block AttnRes with N = 2L.

Two read paths give the same numbers (tested):
- ``reference``: one pass per site over all its sources, ``custom_ops.reference.depth_read``, each
  completed source's key normalised once per forward (what compiled decoding traces);
- fused (``compiled`` / ``triton`` / ``auto``): at each block end one batched phase-1 read of the
  completed sources for every site of the coming block (one op), then per site the exact LSE
  merge with the partial (phase 2), run by the sublayer that reads it (on plain tensors; under
  tensor parallel or the SPMD type checker the merge op, between the sublayers). Full reads in
  pairs of sites (``state.paired``): phase 1 at each even site for it and the next, which
  merges its own sublayer's output in as the partial; that output then joins the completed
  sources as itself, not summed with the next (docs/method.md §7).

With activation checkpointing (``recompute_reads``, set by the model config) the reads are
recomputed in the backward instead (:class:`_RecomputedRead`), keeping only their inputs -- the
completed sources and the partial, kept anyway as later reads' inputs --, and what they made
keeps no memory once the sublayers reading it ran (:class:`_GivenBack`): the next read's
backward, which runs before theirs, fills it again from those inputs. Block source sets on the
fused backends recompute per block: each block's phase-1 read once (for all its sites), the
merges inside the sublayers' checkpointed graphs; Full, read in pairs, per pair. Tensor
parallel and the reference backend recompute per site: each site's whole read. A recomputed
read of completed sources only (a block's phase 1; a Full pair's) runs again without autograd
and its backward is the op's (``custom_ops.block_read_backward``); one with a merge (reference
backend, tensor parallel) rebuilds its autograd graph.

The completed sources' gradients (fused backends, plain tensors): each phase-1 read adds its
share into one fp32 buffer per source, in place (``custom_ops.SourceBank``, which on CPU also
checks each source once, not at every read), and a source's first read
hands the sum to autograd, which so sums no gradient per read and source (Full: O(L²) of them).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torchtitan.models.common.linear import Linear
from torchtitan.protocols.module import Module

import custom_ops
from custom_ops import reference
from custom_ops.schedule import schedule_ends


def query_name(t: int) -> str:
    """Parameter name of read site t's query (``router.<name>``)."""
    return f"query_{t}"


def query_names(num_sublayers: int) -> list[str]:
    """The query names of read sites 1..M."""
    return [query_name(t) for t in range(1, num_sublayers + 1)]


@dataclass
class DepthState:
    """Sources of one forward pass. Values ``[B, T, d]``; projected keys ``[B, T, r]`` fp32."""

    embedding: torch.Tensor
    embedding_key: torch.Tensor | None = None
    values: list[torch.Tensor] = field(default_factory=list)  # completed sources after e
    keys: list[torch.Tensor] = field(default_factory=list)
    partial: torch.Tensor | None = None
    partial_key: torch.Tensor | None = None
    phase1: tuple | None = None  # (per-site outs [..., d], per-site lses, first site)
    normed: list[torch.Tensor] = field(default_factory=list)  # reference: RMSNorm'd keys, in order
    running: torch.Tensor | None = None  # baseline residual stream
    handed_partial: bool = False  # the last read handed to a sublayer brought the partial
    # recompute_reads: the outputs of the last read made by _RecomputedRead (h; a block's phase-1
    # (out, lse)), while the sublayers reading them run
    recomputed: _GivenBack | None = None
    per_block: bool | None = None  # recompute_reads: per block (else per site); set on first use
    bank: custom_ops.SourceBank | None = None  # the sources as reads take them, their gradients
    taken: int = 0  # sources (from the embedding on) that a read with the bank has taken
    paired: bool = False  # Full on the fused backends: phase 1 once per pair of sites


class _RecomputedRead(torch.autograd.Function):
    """``read(*inputs)`` (one tensor, or a tuple of them) keeping only the inputs for the
    backward, which runs the read again with autograd on, or takes the graph :meth:`rebuild`
    already made for the sublayers reading its outputs (one recomputation serves all). A
    ``read`` with a ``backward(inputs, outputs, grads)`` method (:class:`_BankRead`) is run
    again without autograd instead, and its backward gives the inputs' gradients directly; a
    block's phase 1 (``read.split``) comes out as its c sites' outputs and LSEs, as from
    :class:`_KeptRead`."""

    @staticmethod
    def forward(ctx, read, *inputs):
        ctx.read, ctx.graph, ctx.given_back = read, None, None
        ctx.save_for_backward(*inputs)
        if getattr(read, "split", False):
            ctx.set_materialize_grads(False)
            return read.sites(*read(*inputs))
        return read(*inputs)

    @staticmethod
    def rebuild(ctx):
        """The read run again on detached copies of its inputs, kept on ``ctx`` until its
        backward; returns its output(s)."""
        if ctx.graph is None:
            if hasattr(ctx.read, "backward"):
                with torch.no_grad():
                    ctx.graph = (None, ctx.read(*ctx.saved_tensors))
                return ctx.graph[1]
            needs = ctx.needs_input_grad[1:]
            leaves = [x.detach().requires_grad_(n) for x, n in zip(ctx.saved_tensors, needs)]
            with torch.enable_grad():
                ctx.graph = (leaves, ctx.read(*leaves))
        return ctx.graph[1]

    @staticmethod
    def backward(ctx, *grads):
        found = _RecomputedRead._gradients(ctx, grads)
        # the read before this one, given back (_GivenBack): filled again once this read's own
        # work is done and gone, before any sublayer reading it runs its backward
        given_back, ctx.given_back = ctx.given_back, None
        if given_back is not None:
            given_back()
        return found

    @staticmethod
    def _gradients(ctx, grads) -> tuple:
        outs = _RecomputedRead.rebuild(ctx)
        leaves, ctx.graph = ctx.graph[0], None
        needs = ctx.needs_input_grad[1:]
        if leaves is None:  # the read's own backward (with a bank, the sums it holds too)
            if all(g is None for g in grads) and getattr(ctx.read, "bank", None) is None:
                return None, *(None for _ in needs)
            if getattr(ctx.read, "split", False):
                grads = ctx.read.site_grads(grads, outs[1])
            found = ctx.read.backward(ctx.saved_tensors, outs, grads)
            return None, *(g if n else None for g, n in zip(found, needs, strict=True))
        outs = outs if isinstance(outs, tuple) else (outs,)
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [x for x, n in zip(leaves, needs) if n]
        if not pairs:
            return None, *(None for _ in needs)
        found = torch.autograd.grad(
            [o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True
        )
        found = iter(found)
        return None, *(next(found) if n else None for n in needs)


class _BankRead:
    """Phase 1 as :class:`_RecomputedRead` and :class:`_KeptRead` run it: ``n`` sources, their
    keys when ``projected``, then ``c`` queries ``[r]`` in; ``(out [c, ..., d] fp32, lse [c,
    ...])`` out. Its backward is the op's (``custom_ops.block_read_backward``): no graph of the
    read is rebuilt and no nested backward pass runs, once per block. With a ``bank``
    (``custom_ops.SourceBank``, holding the same sources first) the read is the bank's: the
    sources' gradients are summed there, and the read gives autograd those of the sources from
    ``fresh`` on, which no earlier read of the forward took. ``held``: the first sources (and
    keys), which the read holds itself instead of taking them in (:meth:`taken`)."""

    __slots__ = ("n", "c", "projected", "eps", "backend", "bank", "fresh", "held")
    split = True  # its outputs go to the sublayers as the c sites' own tensors (:meth:`sites`)

    def __init__(
        self, n: int, c: int, projected: bool, eps: float | None, backend: str,
        bank: custom_ops.SourceBank | None = None, fresh: int = 0, held: tuple = ((), None),
    ):  # fmt: skip
        self.n, self.c, self.projected, self.eps, self.backend = n, c, projected, eps, backend
        self.bank, self.fresh, self.held = bank, fresh, held

    @staticmethod
    def taken(values, keys, fresh: int) -> tuple[tuple, list]:
        """``(held, inputs)`` of a bank's read: it takes in the sources from the first it hands
        on (``fresh``; the last one at least) and their keys, and holds the others itself. Their
        gradients stay in the bank, so autograd needs no edge to them (Full at L=24: one source
        a read, not up to 48); the last source's edge orders the read's backward before those of
        the reads that hand the earlier ones on. Without a bank (``fresh`` 0) it takes them all."""
        lo = min(fresh, len(values) - 1)
        held = (values[:lo], None if keys is None else keys[:lo])
        return held, [*values[lo:], *(keys[lo:] if keys is not None else ())]

    def _split(self, tensors):
        values, keys = self._sources(tensors)
        return list(values), None if keys is None else list(keys), torch.stack(tensors[-self.c :])

    def _sources(self, tensors) -> tuple:
        """All n sources (and keys): those held, then those among ``tensors``."""
        held, held_keys = self.held
        m = self.n - len(held)
        values = (*held, *tensors[:m]) if held else tensors[:m]
        if not self.projected:
            return values, None
        return values, (*held_keys, *tensors[m : 2 * m]) if held else tensors[m : 2 * m]

    def __call__(self, *tensors: torch.Tensor):
        if self.bank is not None:
            queries = torch.stack(tensors[-self.c :])
            return self.bank.read(self.n, queries, self._sources(tensors))
        values, keys, queries = self._split(tensors)
        return custom_ops.block_read(values, keys, queries, self.eps, backend=self.backend)

    @staticmethod
    def sites(out: torch.Tensor, lse: torch.Tensor) -> tuple:
        """The read's ``(out, lse)`` as its c sites' outputs, then their LSEs (views): each
        site's gradient then comes back where it lies, where ``out[i]`` would zero-fill and add
        a whole ``[c, ..., d]`` buffer per site (autograd's backward of a view)."""
        return (*out.unbind(0), *lse.unbind(0))

    def site_grads(self, grads: tuple, lse: torch.Tensor) -> tuple:
        """``(grad_out, grad_lse)`` for :meth:`backward` from the gradients of :meth:`sites`'
        2c outputs (None: zero): the sites' list (None when all are), the LSEs' ``[c, ...]``."""
        sites, lses = grads[: self.c], grads[self.c :]
        grad_out = list(sites) if any(g is not None for g in sites) else None
        grad_lse = None
        if any(g is not None for g in lses):
            grad_lse = torch.stack([torch.zeros_like(lse[0]) if g is None else g for g in lses])
        return grad_out, grad_lse

    def backward(self, tensors, outputs, grads) -> tuple:
        """The inputs' gradients, given the outputs' ``grads`` (``(out [c, ..., d] or its c
        sites' list, lse [c, ...])``, None: zero) and the forward's ``outputs`` (its lse)."""
        if self.bank is not None:
            queries = torch.stack(tensors[-self.c :])
            gv, gk, gq = self.bank.read_backward(
                self.n, queries, outputs[1], *grads, self.fresh, self._sources(tensors)
            )
        else:
            values, keys, queries = self._split(tensors)
            gv, gk, gq = custom_ops.block_read_backward(
                values, keys, queries, outputs[1], *grads, self.eps, backend=self.backend
            )
        lo = len(self.held[0])
        return (
            *gv[lo:], *(gk[lo:] if gk is not None else ()),
            *(gq.unbind(0) if gq is not None else (None,) * self.c),
        )  # fmt: skip


class _KeptRead(torch.autograd.Function):
    """A block's phase 1 (a :class:`_BankRead`) run without autograd, keeping its inputs and
    LSEs for the backward, which is the read's own. Its c sites' outputs and LSEs come out as
    separate tensors (:meth:`_BankRead.sites`), and the backward reads each site's gradient
    where it lies."""

    @staticmethod
    def forward(ctx, read, *inputs):
        out, lse = read(*inputs)
        ctx.read = read
        ctx.save_for_backward(*inputs, lse)
        ctx.set_materialize_grads(False)
        return read.sites(out, lse)

    @staticmethod
    def backward(ctx, *grads):
        *inputs, lse = ctx.saved_tensors
        found = ctx.read.backward(inputs, (None, lse), ctx.read.site_grads(grads, lse))
        return None, *found


class _SiteRead(_BankRead):
    """One site's read of completed sources only (a block end; every site of Full) as
    :class:`_RecomputedRead` runs it: phase 1 with its one query, cast to the values' dtype.
    Its backward is the op's, given the ``lse`` of the read's last run (kept: ``[...]`` fp32,
    1/d of h)."""

    __slots__ = ("lse",)
    split = False

    def __init__(
        self, n: int, projected: bool, eps: float | None, backend: str,
        bank: custom_ops.SourceBank | None = None, fresh: int = 0, held: tuple = ((), None),
    ):  # fmt: skip
        super().__init__(n, 1, projected, eps, backend, bank, fresh, held)
        self.lse = None

    def __call__(self, *tensors: torch.Tensor):
        out, self.lse = super().__call__(*tensors)
        return out[0].to(tensors[0].dtype)

    def backward(self, tensors, outputs, grads) -> tuple:
        lse, self.lse = self.lse, None
        grad = None if grads[0] is None else grads[0].float()[None]
        return super().backward(tensors, (None, lse), (grad, None))


def _local(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a DTensor's local shard (on its storage)."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


class _GivenBack:
    """The outputs of a :class:`_RecomputedRead` (h; a block's phase-1 ``(out, lse)``, which
    its sites' views share) from the forward of the sublayers reading them to their backwards.

    Once they all ran, the next read takes this object (:meth:`DepthRouter._recomputed`):
    :meth:`give_back` frees the outputs' storages: the tensors, and every view of them those
    sublayers saved (a checkpoint's input, a first op's, FSDP2's aliases of a module's inputs),
    stay, without memory. The next read's backward fills them again, once, from
    :meth:`_RecomputedRead.rebuild` (this object is called). It runs before the backwards of
    the sublayers reading them: the next read takes in what the last of them wrote (the block
    sum it completed, a Full pair's two outputs, or the partial holding it), and each of them
    takes the one before it in through its input (Block's partial; a Full pair's odd site
    merges its own sublayer's output). A read with its own backward then keeps the refilled
    outputs, not the rebuilt copies. (A Python pre-hook on the last sublayer's compiled node,
    which did this before, cost 1.4-1.9 % of a host-bound step under selective AC.)"""

    __slots__ = ("node", "outputs", "sizes")

    def __init__(self, node, outputs: tuple):
        # the read's node; the tensors holding its outputs (a block's phase 1: the two its
        # sites' views share)
        self.node, self.outputs = node, outputs
        self.sizes = None  # the freed storages' bytes, while they are given back

    def give_back(self) -> None:
        storages = [_local(t).untyped_storage() for t in self.outputs]
        self.sizes = tuple(s.nbytes() for s in storages)
        for storage in storages:
            storage.resize_(0)

    def __call__(self) -> None:
        sizes, self.sizes = self.sizes, None
        if sizes is None:  # not given back, or filled again already
            return
        ctx, outputs = self.node, self.outputs
        fresh = _RecomputedRead.rebuild(ctx)
        for t, f, n in zip(outputs, fresh if isinstance(fresh, tuple) else (fresh,), sizes):
            t, f = _local(t), _local(f)
            t.untyped_storage().resize_(n)
            # .data: the same storage, and a version counter of its own, so the views autograd
            # saved stay at their versions
            t.data.copy_(f.detach())
        if ctx.graph[0] is None:
            detached = tuple(t.detach() for t in outputs)
            ctx.graph = (None, detached if len(detached) > 1 else detached[0])


def _merge_in_sublayer(query: torch.Tensor) -> bool:
    """Whether a phase-2 merge may run inside the sublayer that reads it: not under tensor
    parallel (DTensor) or, outside a trace (export's own modes), under the SPMD type checker (a
    torch-function mode): they keep the merge op, whose sharding rules they know."""
    if isinstance(query, DTensor):
        return False
    return torch.compiler.is_compiling() or not torch._C._len_torch_function_stack()


def finish_read(h: torch.Tensor, read: tuple, eps: float | None) -> torch.Tensor:
    """``h`` (a phase-1 read) finished as ``read = (lse1, partial, partial_key, query, backend,
    dtype, add)`` says: cast to ``dtype`` (no partial: a block end), or merged with the partial
    (key eps ``eps``; ``add`` is for the sublayer's output, ``Sublayer.write``). Traced by
    torch.compile the merge is the reference's maths, which Inductor fuses with the code around
    it; eager, the ``backend``'s merge op."""
    lse1, partial, partial_key, query, backend, dtype, _ = read
    if partial is None:
        return h.to(dtype)
    if torch.compiler.is_compiling():
        backend = "reference"
    return custom_ops.merge_partial(h, lse1, partial, partial_key, query, eps, backend=backend)


class DepthRouter(Module):
    """Owns the routing parameters and performs every read site's read."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        variant: str  # baseline | attnres | sliced | projected
        dim: int
        rank: int  # key rank r (= dim for attnres; unused for baseline)
        num_sublayers: int  # M = 2L
        blocks: int | None = None  # None (and block_layers None) = Full
        block_layers: int | None = None  # Block by size: an end every 2k sublayers
        eps: float | None = None  # key RMSNorm eps; None = custom_ops.reference.DEFAULT_EPS
        backend: str = "auto"  # one of custom_ops.BACKENDS (passed to its ops as it is)
        embedding_key: Linear.Config | None = None  # projected: W_0^K [r, d]
        # recompute each read in the backward instead of keeping what it saves (phase 1's LSEs,
        # the merge's fp32 [T, d] and h) and, in the sublayer reading it, h; the model config
        # sets it when activation checkpointing is on
        recompute_reads: bool = False

    def __init__(self, config: Config):
        super().__init__()
        self.variant = config.variant
        self.rank = config.rank
        self.eps = config.eps
        self.backend = config.backend
        self.recompute_reads = config.recompute_reads
        m = config.num_sublayers
        self.num_sublayers = m
        self.block_layers = config.block_layers
        # step() walks the source sets of custom_ops.schedule.source_sets with tensors, from
        # the ends computed here once
        self.ends = schedule_ends(m, config.blocks, config.block_layers)
        self._end_set = frozenset(self.ends)
        if self.variant != "baseline":  # read sites 1..M (site 0 is the identity)
            for name in query_names(m):
                q = nn.Parameter(torch.zeros(config.rank, dtype=torch.float32))
                self.register_parameter(name, q)
        self.site_stop = m + 1  # one past this module's last read site (a pipeline stage's)
        self.embedding_key = (
            config.embedding_key.build() if config.embedding_key is not None else None
        )

    @property
    def projected(self) -> bool:
        return self.variant == "projected"

    @property
    def reads_pairs(self) -> bool:
        """Whether a forward reads phase 1 in pairs of sites (``DepthState.paired``): Full on
        the fused backends, at each even site t for sites t and t + 1, site t + 1 merging its
        own sublayer's output in (:meth:`step`)."""
        return (
            len(self.ends) == self.num_sublayers
            and self.backend != "reference"
            and self.variant != "baseline"
        )

    # -- bookkeeping ------------------------------------------------------------------------
    def start(self, embedding: torch.Tensor) -> DepthState:
        """Site 0: one source (the embedding), the read is the identity."""
        if self.variant == "baseline":
            return DepthState(embedding=embedding, running=embedding)
        key = None
        if self.projected:
            key = reference.key_rmsnorm(self.embedding_key(embedding), self.eps)
        state = DepthState(embedding=embedding, embedding_key=key, paired=self.reads_pairs)
        if self.backend != "reference":
            self._phase1(state, 0)
        return state

    @staticmethod
    def _recomputed(state: DepthState, node, outputs: tuple) -> None:
        """A new :class:`_RecomputedRead` (``node``; None: no graph recorded) made ``outputs``
        (h, or a block's phase-1 ``(out, lse)``): the sublayers reading the last one's all ran,
        so its storages are given back, and this read's backward fills them again
        (:class:`_GivenBack`)."""
        made = None if node is None else _GivenBack(node, outputs)
        last, state.recomputed = state.recomputed, made
        if last is not None and node is not None:
            last.give_back()
            node.given_back = last

    def _per_block(self, state: DepthState) -> bool:
        """With ``recompute_reads``: whether this forward recomputes its reads per block (phase 1
        once per block, recomputed once in the backward; each merge inside the checkpointed graph
        of the sublayer reading it) rather than per site. Block source sets on the fused
        backends, with the merges in the sublayers, and Full read in pairs (``state.paired``)."""
        if state.per_block is None:
            queries = self.query_params()
            state.per_block = (
                self.backend != "reference"
                and (len(self.ends) < self.num_sublayers or state.paired)
                and bool(queries)
                and _merge_in_sublayer(queries[0])
            )
        return state.per_block

    def step(self, state: DepthState, j: int, out) -> tuple[torch.Tensor, tuple | None]:
        """Sublayer j (1-based) wrote ``out`` (``Sublayer.write``); return site j's read as the
        next sublayer's input ``(h, read)``: ``h_j`` and None, or the phase-1 read and the rest
        of its merge, which that sublayer finishes (:meth:`finish` does it elsewhere)."""
        if self.variant == "baseline":
            state.running = out  # the sublayer added its input
            return out, None
        o, k = out if self.projected else (out, None)
        # Full read in pairs: an odd site's output is the partial its own read merges in, then
        # a source of its own (not summed with the next); the even sites are ends as in Block
        self.complete_pair(state)
        if state.paired or state.handed_partial or state.partial is None:  # out is the partial
            state.partial, state.partial_key = o, k
        else:  # block key = sum of emission-normalised member keys
            state.partial = state.partial + o
            if k is not None:
                state.partial_key = state.partial_key + k
        state.handed_partial = False
        if j in self._end_set and not (state.paired and j % 2):
            self._complete(state)
        if self.recompute_reads and not self._per_block(state):
            return self._recomputed_read(state, j), None
        if self.backend == "reference":
            return self._read_normalised_once(state, j), None
        return self._read_two_phase(state, j)

    def resume(self, state: DepthState, cut: int) -> None:
        """A state received at a pipeline cut after sublayer ``cut``: phase 1 of the block (or
        Full pair) in progress, for this module's sites from cut + 1 on (the fused backends; the
        reference reads each site as it comes)."""
        if self.backend != "reference":
            last_end = max((e for e in self.ends if e <= cut), default=0)
            self._phase1(state, last_end, first=cut + 1)

    @classmethod
    def complete_pair(cls, state: DepthState) -> None:
        """Full read in pairs: the odd site's sublayer output, merged in as the partial, joins
        the completed sources as itself (at the next site, or at a pipeline cut after it)."""
        if state.paired and state.partial is not None:
            cls._complete(state)

    @staticmethod
    def _complete(state: DepthState) -> None:
        """The partial (and its key) joins the completed sources."""
        state.values.append(state.partial)
        state.keys.append(state.partial_key)
        state.partial, state.partial_key = None, None

    def finish(self, h: torch.Tensor, read: tuple | None) -> torch.Tensor:
        """``h`` of a :meth:`step` result that no sublayer consumes (the final read, a pipeline
        stage's last), finished here as ``read`` says: the cast, or the merge."""
        return h if read is None else finish_read(h, read, self.eps)

    def query(self, t: int) -> torch.Tensor:
        # where getattr finds it too (FSDP2 and tensor parallel swap parameters there), without
        # nn.Module.__getattr__'s detour: ~100 queries a step
        return self._parameters[query_name(t)]

    def query_params(self) -> list[nn.Parameter]:
        """The queries this module holds, in site order (a pipeline stage: its own sites)."""
        return [p for name, p in self.named_parameters(recurse=False) if name.startswith("query_")]

    def sources(self, state: DepthState) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Values and (projected) keys of the current source set; keys None = sliced tails."""
        values = [state.embedding, *state.values]
        keys = [state.embedding_key, *state.keys] if self.projected else None
        if state.partial is not None:
            values.append(state.partial)
            if keys is not None:
                keys.append(state.partial_key)
        return values, keys

    # -- the two read paths -----------------------------------------------------------------
    def _read_one_pass(self, values, keys, query) -> torch.Tensor:
        if keys is None:
            keys = reference.sliced_keys(values, self.rank)
        return reference.depth_read(values, keys, query, self.eps)

    def _read_normalised_once(self, state: DepthState, t: int) -> torch.Tensor:
        """The one-pass read of site t with each completed source's key normalised once per
        forward (kept in ``state.normed``; sources received by a pipeline stage on its first
        read), only the partial's at every site: the numbers of :meth:`_read_one_pass`."""
        values, keys = self.sources(state)
        raw = keys if keys is not None else reference.sliced_keys(values, self.rank)
        done = 1 + len(state.values)  # the embedding and the completed sources
        for i in range(len(state.normed), done):
            state.normed.append(reference.key_rmsnorm(raw[i], self.eps))
        normed = state.normed
        if state.partial is not None:
            normed = [*normed, reference.key_rmsnorm(raw[done], self.eps)]
        return reference.depth_read(values, normed, self.query(t), self.eps, normalised=True)

    def _phase1(self, state: DepthState, t: int, first: int | None = None) -> None:
        """At a completion point t: phase 1 for sites ``first``..(next end - 1) (default
        ``first`` = t, site 0 excluded), up to this module's last site; none when
        ``recompute_reads`` reads per site. Recomputed reads: through :class:`_RecomputedRead`
        (its outputs keep no memory once its sites' sublayers ran, :class:`_GivenBack`)."""
        if state.paired:  # the next even site
            nxt = min(t + 2 - t % 2, self.num_sublayers + 1, self.site_stop)
        else:
            nxt = min(next((e for e in self.ends if e > t), self.num_sublayers + 1), self.site_stop)
        first = max(t, 1) if first is None else first
        state.phase1 = None
        if nxt <= first or (self.recompute_reads and not self._per_block(state)):
            return
        values = [state.embedding, *state.values]
        keys = [state.embedding_key, *state.keys] if self.projected else None
        queries = [self.query(site) for site in range(first, nxt)]
        bank = self._bank(state, values, keys, queries)
        if bank[0] is not None or self.recompute_reads:  # the query parameters go in, not a stack
            held, inputs = _BankRead.taken(values, keys, bank[1])
            n, c = len(values), len(queries)
            read = _BankRead(n, c, self.projected, self.eps, self.backend, *bank, held)
            inputs += queries
        if self.recompute_reads:
            found, c = _RecomputedRead.apply(read, *inputs), len(queries)
            self._recomputed(state, found[0].grad_fn, (found[0]._base, found[c]._base))
            state.phase1 = (found[:c], found[c:], first)
            return
        if bank[0] is not None:
            found = _KeptRead.apply(read, *inputs)
            state.phase1 = (found[: len(queries)], found[len(queries) :], first)
            return
        queries = torch.stack(queries)
        # split: each site's own view; the backward then reads each site's gradient where it
        # lies (out[i] would zero-fill and add a whole [c, ..., d] buffer per site)
        out, lse = custom_ops.block_read(
            values, keys, queries, self.eps, backend=self.backend, split=True
        )
        state.phase1 = (out, lse.unbind(0), first)

    def _bank(self, state: DepthState, values, keys, queries) -> tuple:
        """``(bank, fresh)`` for a read of the state's ``values`` (``keys``) so far: the state's
        ``custom_ops.SourceBank`` holding them, and how many of them earlier reads took, when
        the read records a graph of local tensors, eagerly (dispatch modes included: the memory
        tracker sees the sums training makes); else ``(None, 0)`` and autograd sums the sources'
        gradients: under tensor parallel (DTensor), a function mode (the SPMD type checker) or a
        trace.

        Why the read may hand on a source's whole sum (``fresh`` on): a source's first read in
        the forward runs its backward after every later read's, since each later read depends
        on it through the sublayers its outputs feed and the source they make, whose gradient
        that first read hands on. So the latest read (the first backward) writes every source's
        sum, each earlier one adds into them, and a source's first read adds its share last and
        hands the sum to autograd. In fp32 that is the sum autograd made, bit for bit (the same
        terms in the same order; under Block, sublayer 1's gradient of the embedding, which it
        reads itself, is added after the reads' sum, not before block 1's share); in bf16 one
        rounding where autograd rounded once a read."""
        if not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return None, 0
        if torch._C._len_torch_function_stack():
            return None, 0
        if isinstance(values[0], DTensor) or isinstance(queries[-1], DTensor):
            return None, 0
        if not any(t.requires_grad for t in (*values, *(keys or ()), *queries)):
            return None, 0
        if state.bank is None:
            state.bank = custom_ops.SourceBank(self.eps, self.backend)
        state.bank.extend(values, keys)
        fresh, state.taken = state.taken, max(state.taken, len(values))
        return state.bank, fresh

    def _read_two_phase(self, state: DepthState, t: int) -> tuple[torch.Tensor, tuple | None]:
        """Site t's phase-1 read and what the sublayer reading it finishes it with: the cast to
        the activations' dtype (a block end: completed sources only), or the merge with the
        partial. Under tensor parallel or the SPMD type checker, h itself (the merge op)."""
        dtype, partial = state.embedding.dtype, state.partial
        if partial is None:  # t is a block end
            self._phase1(state, t)
            read = (None, None, None, None, self.backend, dtype, False)
        out, lse, first = state.phase1
        i, query = t - first, self.query(t)
        if partial is not None:
            partial_key = state.partial_key if self.projected else None
            read = (lse[i], partial, partial_key, query, self.backend, dtype, not state.paired)
        if not _merge_in_sublayer(query):
            return self.finish(out[i], read), None
        state.handed_partial = partial is not None
        return out[i], read

    def _recomputed_read(self, state: DepthState, t: int) -> torch.Tensor:
        """Site t's read (:meth:`_site_read`) through :class:`_RecomputedRead` (its output
        keeps no memory once its sublayer ran, :class:`_GivenBack`)."""
        values, keys = self.sources(state)
        tensors = [*values, *(keys or []), self.query(t)]
        if state.partial is None and self.backend != "reference":  # a block end
            bank = self._bank(state, values, keys, [tensors[-1]])
            held, tensors[:-1] = _BankRead.taken(values, keys, bank[1])
            read = _SiteRead(len(values), self.projected, self.eps, self.backend, *bank, held)
        else:
            read = functools.partial(self._site_read, len(values))
        h = _RecomputedRead.apply(read, *tensors)
        self._recomputed(state, h.grad_fn, (h,))
        return h

    def _site_read(self, n: int, *tensors: torch.Tensor) -> torch.Tensor:
        """One site's read of its ``n`` sources, their keys when projected, then the query: the
        numbers of the two paths above. On the fused backends the last source is the running
        partial (a read of completed sources only is :class:`_SiteRead`)."""
        values, query = list(tensors[:n]), tensors[-1]
        keys = list(tensors[n:-1]) if self.projected else None
        if self.backend == "reference":
            return self._read_one_pass(values, keys, query)
        m = n - 1  # completed sources
        out, lse = custom_ops.block_read(
            values[:m], keys and keys[:m], query[None], self.eps, backend=self.backend, split=True
        )
        return custom_ops.merge_partial(
            out[0], lse[0], values[m], keys and keys[m], query, self.eps, backend=self.backend
        )
