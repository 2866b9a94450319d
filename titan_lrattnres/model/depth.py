"""The depth router: read sites, source bookkeeping and the query bank (docs/method.md §1-4, §7).

Design: the transformer's 2L sublayers are the units that torchtitan compiles, checkpoints and
shards (``model.layers``); every depth read runs between them in the root forward, so each
compiled graph has one fixed signature (one graph per sublayer kind, no recompiles) and the read
can be a hand-fused op. The query of read site t is the root parameter ``router.query_<t>``
(``[r]``, fp32 master weights; t = 1..2L), gathered once per step by the root FSDP unit: one
parameter per site, so a pipeline stage owns exactly the queries of its own sites and a
checkpoint written by any split keeps every one (``titan_lrattnres.parallel.pipeline``; checkpoints
with the earlier ``router.query_bank [2L, r]`` convert with ``titan_lrattnres.components.convert``).

Bookkeeping per sequence (``DepthState``): the embedding and its key, the completed sources
(block sums, or single outputs for Full), and the running partial of the current block, which
INCLUDES the output just written. Full AttnRes is Block AttnRes with N = 2L.

Two read paths give the same numbers (tested):
- ``reference``: one pass per site over all its sources, ``custom_ops.reference.depth_read``;
- fused (``compiled`` / ``triton`` / ``auto``): at each block end one batched phase-1 read of the
  completed sources for every site of the coming block, then per site the exact LSE merge with
  the partial (phase 2).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint
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
    running: torch.Tensor | None = None  # baseline residual stream


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
        # recompute each site's phase-1 read in the backward instead of keeping it (fp32 [T, d]
        # per site); the model config sets it when activation checkpointing is on
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

    # -- bookkeeping ------------------------------------------------------------------------
    def start(self, embedding: torch.Tensor) -> DepthState:
        """Site 0: one source (the embedding), the read is the identity."""
        if self.variant == "baseline":
            return DepthState(embedding=embedding, running=embedding)
        key = None
        if self.projected:
            key = reference.key_rmsnorm(self.embedding_key(embedding), self.eps)
        state = DepthState(embedding=embedding, embedding_key=key)
        if self.backend != "reference":
            self._phase1(state, 0)
        return state

    def step(self, state: DepthState, j: int, out) -> torch.Tensor:
        """Sublayer j (1-based) wrote ``out``; return ``h_j``, the read of site j."""
        if self.variant == "baseline":
            state.running = state.running + out
            return state.running
        o, k = out if self.projected else (out, None)
        state.partial = o if state.partial is None else state.partial + o
        if k is not None:  # block key = sum of emission-normalised member keys
            state.partial_key = k if state.partial_key is None else state.partial_key + k
        if j in self._end_set:
            state.values.append(state.partial)
            state.keys.append(state.partial_key)
            state.partial, state.partial_key = None, None
        if self.backend == "reference":
            return self._read_one_pass(state, j)
        return self._read_two_phase(state, j)

    def query(self, t: int) -> torch.Tensor:
        return getattr(self, query_name(t))

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
    def _read_one_pass(self, state: DepthState, t: int) -> torch.Tensor:
        values, keys = self.sources(state)
        if keys is None:
            keys = reference.sliced_keys(values, self.rank)
        return reference.depth_read(values, keys, self.query(t), self.eps)

    def _phase1(self, state: DepthState, t: int, first: int | None = None) -> None:
        """At a completion point t: phase 1 for sites ``first``..(next end - 1) (default
        ``first`` = t, site 0 excluded), up to this module's last site; with
        ``recompute_reads`` for site t alone (the others read under a checkpoint)."""
        nxt = min(next((e for e in self.ends if e > t), self.num_sublayers + 1), self.site_stop)
        if self.recompute_reads:
            nxt = min(nxt, max(t, 1) + 1)
        first = max(t, 1) if first is None else first
        if nxt <= first:
            state.phase1 = None
            return
        values = [state.embedding, *state.values]
        keys = [state.embedding_key, *state.keys] if self.projected else None
        queries = torch.stack([self.query(site) for site in range(first, nxt)])
        # split: each site's own view; the backward then reads each site's gradient where it
        # lies (out[i] would zero-fill and add a whole [c, ..., d] buffer per site)
        out, lse = custom_ops.block_read(
            values, keys, queries, self.eps, backend=self.backend, split=True
        )
        state.phase1 = (out, lse.unbind(0), first)

    def _read_two_phase(self, state: DepthState, t: int) -> torch.Tensor:
        if state.partial is None:  # t is a block end: completed sources only
            self._phase1(state, t)
            out, _, first = state.phase1
            assert first == t
            return out[0].to(state.embedding.dtype)
        partial_key = state.partial_key if self.projected else None
        if self.recompute_reads:
            values = [state.embedding, *state.values]
            keys = [state.embedding_key, *state.keys] if self.projected else None
            return checkpoint(self._site_read, values, keys, state.partial, partial_key,
                              self.query(t), use_reentrant=False)  # fmt: skip
        out, lse, first = state.phase1
        i = t - first
        return custom_ops.merge_partial(
            out[i], lse[i], state.partial, partial_key, self.query(t), self.eps,
            backend=self.backend,
        )  # fmt: skip

    def _site_read(self, values, keys, partial, partial_key, query) -> torch.Tensor:
        """Site t's two phases alone: what ``recompute_reads`` runs again in the backward, so
        only its inputs (the sources and the partial, kept anyway) are saved."""
        out, lse = custom_ops.block_read(
            values, keys, query[None], self.eps, backend=self.backend, split=True
        )
        return custom_ops.merge_partial(
            out[0], lse[0], partial, partial_key, query, self.eps, backend=self.backend
        )
