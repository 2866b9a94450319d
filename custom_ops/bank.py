"""``SourceBank``: one forward's completed sources as its phase-1 reads take them.

A read site's phase 1 (docs/method.md §7) reads the completed sources so far: with the router's
source sets, each read takes the first n sources of one growing list (a block's, or every
site's under Full, whose sources grow one per sublayer). The bank holds that list and, for the
backward, one fp32 sum of gradients per source, which each read adds its share into, in place
(the fused kernels add as they go), where autograd would sum one gradient tensor per read and
source in the source's dtype (Full at L=24: ~1,200 additions a step). A source's sum leaves the
bank with the read that hands it on (:meth:`SourceBank.read_backward`'s ``hand_from``).

On CPU, for fp32 sources, each source is checked once when it joins (``cpu.SourceTables``); a
read then passes the C kernels tables of addresses, with no per-source work in Python. Every
other case (another dtype or device, the Triton kernels, traces and modes) reads through
``custom_ops.block_read`` / ``block_read_backward``: the same numbers.
"""

from __future__ import annotations

import torch

from custom_ops import api, cpu, ops
from custom_ops.reference import _eps


class SourceBank:
    """A growing list of sources ``values[i] [..., d]`` (with projected ``keys[i] [..., r]``;
    None: sliced keys) and the fp32 sums of their gradients over the reads that take them.

    ``extend`` adds sources (the list so far, the held ones first); ``read(n, queries)`` is
    ``block_read`` of the first n; ``read_backward`` adds that read's gradients into the first
    n sums and hands on those from ``hand_from`` on. The sums are exact in any order of reads a
    backward runs: a source's sum is written by the first read that gives it a gradient and
    added to by every later one (fp32: ``held + fresh``, the additions autograd made).

    The bank keeps its sources detached (the autograd graph, whose reads hold the bank, must not
    be reachable from it: that would be a reference cycle through the graph, never freed), and
    lets a source go once a read has handed its sum on: every read that takes it has run its
    backward then (the router's order, ``titan_lrattnres.model.depth``). A backward that finds
    one gone (a retained graph's second) gives the read's own saved sources back
    (``read_backward``'s ``sources``)."""

    __slots__ = (
        "eps", "backend", "values", "keys", "value_sums", "key_sums", "_tables", "_ids", "_gone",
    )  # fmt: skip

    def __init__(self, eps: float | None = None, backend: str = "auto"):
        if backend not in api.BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected one of {api.BACKENDS}")
        self.eps, self.backend = _eps(eps), backend
        self.values: list[torch.Tensor | None] = []
        self.keys: list[torch.Tensor | None] | None = None
        self.value_sums: list[torch.Tensor | None] = []
        self.key_sums: list[torch.Tensor | None] = []
        self._tables: cpu.SourceTables | None = None  # while every source suits the C kernels
        self._ids: list[int] = []  # id() of each source given, to check the next extend's prefix
        self._gone: set[int] = set()  # sources let go after a backward handed them on

    def __len__(self) -> int:
        return len(self.values)

    def extend(self, values, keys=None) -> None:
        """Takes the sources of ``values`` (and ``keys``) past those it holds; the held ones
        must come first, as they were given (a ValueError otherwise)."""
        held = len(self.values)
        if len(values) < held or list(map(id, values[:held])) != self._ids:
            raise ValueError(f"the bank's {held} sources must be the first of the values given")
        if held and (keys is None) != (self.keys is None):
            raise ValueError("keys must be given for every source or for none (sliced)")
        if keys is not None and len(keys) != len(values):
            raise ValueError(f"got {len(values)} values but {len(keys)} keys")
        if len(values) == held:
            return
        if not held:
            self.keys = None if keys is None else []
            if self._fast_backend(values[0]):
                self._tables = cpu.SourceTables(values[0], None if keys is None else keys[0])
        for i in range(held, len(values)):
            self._put(None, values[i], None if keys is None else keys[i])
            self.value_sums.append(None)
            self.key_sums.append(None)
        self._ids += map(id, values[held:])

    def _put(self, i: int | None, value, key) -> None:
        """Holds source i (None: a new one) and its key, detached."""
        if self._tables is not None and not self._tables.fits(value, key):
            self._tables = None
        if i is None:
            self.values.append(value.detach())
            if key is not None:
                self.keys.append(key.detach())
        else:
            self.values[i] = value.detach()
            if key is not None:
                self.keys[i] = key.detach()

    def _fast_backend(self, like: torch.Tensor) -> bool:
        return api._backend(self.backend, like) == "compiled" and like.device.type == "cpu"

    def _tables_for(self, *tensors) -> cpu.SourceTables | None:
        """The CPU tables when this call may use them: plain eager tensors outside any trace or
        mode (``ops.plain``), which a dispatch mode (FakeTensor, the memory tracker) must see."""
        return self._tables if self._tables is not None and ops.plain(*tensors) else None

    def _first(self, n: int, sources=None) -> tuple[list, list | None]:
        """The first n sources and keys; those let go are taken back from ``sources``."""
        if not 1 <= n <= len(self.values):
            raise ValueError(f"a read of {n} sources from a bank of {len(self.values)}")
        gone = [i for i in self._gone if i < n] if self._gone else ()
        if gone:
            if sources is None:
                raise ValueError(f"the bank let sources {sorted(gone)} go; give them back")
            for i in gone:
                self._put(i, sources[0][i], None if sources[1] is None else sources[1][i])
                self._gone.discard(i)
        return self.values[:n], None if self.keys is None else self.keys[:n]

    def read(self, n: int, queries: torch.Tensor, sources=None) -> tuple:
        """``block_read`` of the first ``n`` sources with ``queries [c, r]``: ``(out [c, ...,
        d] fp32, lse [c, ...] fp32)``. ``sources``: as for :meth:`read_backward`."""
        values, keys = self._first(n, sources)
        tables = self._tables_for(queries)
        if tables is not None and queries.dim() == 2:
            found = tables.read_fwd(values, keys, queries, self.eps)
            if found is not None:
                return found
        return api.block_read(values, keys, queries, self.eps, backend=self.backend)

    def read_backward(
        self, n, queries, lse, grad_out, grad_lse, hand_from: int = 0, sources=None
    ) -> tuple:  # fmt: skip
        """One read's backward (``block_read_backward``'s arguments; ``grad_out`` the c sites'
        list or a tensor, None: zero), its sources' gradients added into their sums. Returns
        ``(value_grads, key_grads or None, grad_queries [c, r] or None)``: the sums of the
        sources from ``hand_from`` on, which leave the bank (in each source's dtype; None where
        no read gave one), None before. ``sources``: the read's ``(values, keys or None)``, for
        any the bank let go."""
        values, keys = self._first(n, sources)
        gq = None
        if grad_out is not None or grad_lse is not None:
            add = self._sums_for(n)
            vsums, ksums = self.value_sums[:n], None if keys is None else self.key_sums[:n]
            tables = self._tables_for(queries, lse)
            if tables is not None:
                gq = tables.read_bwd(
                    values, keys, queries, lse, grad_out, grad_lse, self.eps, vsums, ksums, add
                )
            if gq is None:
                _, _, gq = api.block_read_backward(
                    values, keys, queries, lse, grad_out, grad_lse, self.eps,
                    backend=self.backend, out=(vsums, ksums), accumulate=add,
                )  # fmt: skip
        value_grads = self._hand(self.value_sums, values, hand_from)
        key_grads = None if keys is None else self._hand(self.key_sums, keys, hand_from)
        for i in range(hand_from, n):  # every read taking them has run its backward
            self.values[i] = None
            if self.keys is not None:
                self.keys[i] = None
            self._gone.add(i)
        return value_grads, key_grads, gq

    def _sums_for(self, n: int) -> bool:
        """Makes a sum for each of the first n sources that has none; True when the read adds
        into them (some were held: the new ones start at zero), False when it writes them."""
        missing = [i for i in range(n) if self.value_sums[i] is None]
        if not missing:
            return True
        make = torch.empty if len(missing) == n else torch.zeros
        for store, like in ((self.value_sums, self.values), (self.key_sums, self.keys)):
            if like is not None:
                for i in missing:
                    store[i] = make(like[i].shape, dtype=torch.float32, device=like[i].device)
        return len(missing) < n

    @staticmethod
    def _hand(store: list, sources: list, start: int) -> list:
        handed = [None] * start
        for i in range(start, len(sources)):
            g, store[i] = store[i], None
            if g is not None and g.dtype != sources[i].dtype:
                g = g.to(sources[i].dtype)
            handed.append(g)
        return handed
