"""Hypothesis strategies and input builders shared by the op tests (CPU and interpreter)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from tests.custom_ops.tolerances import DTYPES


class Seen(TorchDispatchMode):
    """Records the name of every op dispatched under it (``aten.mul.Tensor``, ...) in ``ops``."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@dataclass(frozen=True)
class ReadCase:
    lead: tuple[int, ...]  # token dims, e.g. (batch, seq)
    d: int
    r: int
    sources: int
    sliced: bool
    dtype: torch.dtype
    seed: int

    def __repr__(self):  # readable failing case
        kind = "sliced" if self.sliced else "projected"
        dt = str(self.dtype).removeprefix("torch.")
        return f"ReadCase(lead={self.lead}, d={self.d}, r={self.r}, S={self.sources}, {kind}, {dt})"


@st.composite
def read_cases(draw, max_sources: int = 20, widths=(1, 7, 33, 64, 100), max_tokens: int = 24):
    d = draw(st.sampled_from(widths))
    lead = draw(
        st.one_of(
            st.tuples(st.integers(1, max_tokens)),
            st.tuples(st.integers(1, 3), st.integers(1, max_tokens // 3)),
        )
    )
    return ReadCase(
        lead=lead,
        d=d,
        r=draw(st.integers(1, d)),
        sources=draw(st.integers(1, max_sources)),
        sliced=draw(st.booleans()),
        dtype=draw(st.sampled_from(DTYPES)),
        seed=draw(st.integers(0, 2**16)),
    )


def make_read(case: ReadCase, n_queries: int | None = None):
    """``(values, keys or None, query)`` leaf tensors with requires_grad.

    Values carry a per-source scale and the query is O(1), so the routing is far from uniform
    and a wrong logit, norm or softmax changes the result.
    """
    g = torch.Generator().manual_seed(case.seed)
    values = []
    for s in range(case.sources):
        v = torch.randn(*case.lead, case.d, generator=g) * (0.5 + s % 3)
        values.append(v.to(case.dtype).requires_grad_())
    keys = None
    if not case.sliced:
        keys = [
            torch.randn(*case.lead, case.r, generator=g).to(case.dtype).requires_grad_()
            for _ in range(case.sources)
        ]
    qshape = (case.r,) if n_queries is None else (n_queries, case.r)
    query = (2.0 * torch.randn(*qshape, generator=g)).requires_grad_()
    return values, keys, query


def leaves(values, keys, query, *more):
    return [*values, *(keys or []), query, *more]


def grads_of(fn, inputs, seed: int = 0):
    """Runs ``fn()`` (a tuple of outputs), backprops a fixed random projection of every output,
    returns ``(outputs, grads of inputs)``; grads are cleared afterwards."""
    outs = fn()
    g = torch.Generator().manual_seed(seed + 1)
    loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs)
    loss.backward()
    grads = [x.grad.clone() for x in inputs]
    for x in inputs:
        x.grad = None
    return [o.detach() for o in outs], grads
