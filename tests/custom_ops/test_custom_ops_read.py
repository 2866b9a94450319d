"""The ``compiled`` (plain-PyTorch) backend of every op, forward and every gradient, against the
eager reference over hypothesis-generated shapes, ranks, source counts and dtypes."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import custom_ops
from custom_ops import composite, reference
from tests.custom_ops.cases import ReadCase, grads_of, leaves, make_read, read_cases
from tests.custom_ops.tolerances import assert_close, rank_one_cancellation

BACKEND = "compiled"


def assert_grads_close(got, want, keys, dtype):
    """Gradients of ``leaves(values, keys, query)`` agree; a key's (r = 1) scaled by how much
    its two terms cancel (``tolerances.rank_one_cancellation``)."""
    n = len(got) - 1 - len(keys or ())  # the values
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype, f"grad {i} dtype {a.dtype} vs {b.dtype}"
        key = keys[i - n] if keys and n <= i < len(got) - 1 else None
        cond = rank_one_cancellation(key, reference.DEFAULT_EPS)
        assert_close(f"grad of input {i}", a, b, dtype, conditioning=cond)


def check_depth_read(case: ReadCase, backend: str = BACKEND):
    values, keys, query = make_read(case)
    inputs = leaves(values, keys, query)
    got, got_g = grads_of(
        lambda: custom_ops.depth_read_lse(values, keys, query, backend=backend), inputs, case.seed
    )
    ref_keys = keys if keys is not None else reference.sliced_keys(values, case.r)
    want, want_g = grads_of(
        lambda: reference.depth_read_with_lse(values, ref_keys, query), inputs, case.seed
    )
    assert got[0].dtype == case.dtype and got[1].dtype == torch.float32
    assert_close("out", got[0], want[0], case.dtype)
    assert_close("lse", got[1], want[1], torch.float32)
    assert_grads_close(got_g, want_g, keys, case.dtype)


def check_block_read(case: ReadCase, n_queries: int, backend: str = BACKEND):
    values, keys, queries = make_read(case, n_queries)
    inputs = leaves(values, keys, queries)
    got, got_g = grads_of(
        lambda: custom_ops.block_read(values, keys, queries, backend=backend), inputs, case.seed
    )
    ref_keys = keys if keys is not None else reference.sliced_keys(values, case.r)
    fp32 = [v.float() for v in values]
    assert got[0].dtype == torch.float32
    for c in range(n_queries):  # phase 1 == c independent single-query reads
        out, lse = reference.depth_read_with_lse(fp32, ref_keys, queries[c])
        assert_close(f"out[{c}]", got[0][c], out, torch.float32)
        assert_close(f"lse[{c}]", got[1][c], lse, torch.float32)
    want, want_g = grads_of(
        lambda: reference.depth_read_with_lse(fp32, ref_keys, queries), inputs, case.seed
    )
    assert_grads_close(got_g, want_g, keys, case.dtype)


class _NoOpFunctionMode(torch.overrides.TorchFunctionMode):
    """Any function mode sends the public API to the registered ops (``api._route``: "op")."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def check_split_block_read(case: ReadCase, n_queries: int, unused: list[bool], route: str,
                           backend: str = BACKEND):  # fmt: skip
    """``block_read(split=True)`` == ``block_read`` then ``unbind``, bit for bit: outputs and
    every gradient, with the sites in ``unused`` left out of the loss (no gradient: the kernels'
    zero rows). ``route``: "twin" (the split autograd twin, per-site gradients read in place),
    "double" (the twin with create_graph: its gradients stacked for the op), "op" (a function
    mode: the registered op, then unbind)."""
    values, keys, queries = make_read(case, n_queries)
    inputs = leaves(values, keys, queries)
    g = torch.Generator().manual_seed(case.seed)
    weights = [torch.randn(values[0].shape, generator=g) for _ in range(n_queries)]
    w_lse = torch.randn(values[0].shape[:-1], generator=g)

    def run(split: bool):
        with _NoOpFunctionMode() if route == "op" else contextlib.nullcontext():
            out, lse = custom_ops.block_read(values, keys, queries, backend=backend, split=split)
        assert isinstance(out, list) == split
        sites = out if split else out.unbind(0)
        loss = (lse[0] * w_lse).sum()
        for site, w, skip in zip(sites, weights, unused, strict=True):
            if not skip:
                loss = loss + (site * w).sum()
        grads = torch.autograd.grad(loss, inputs, create_graph=route == "double")
        return [o.detach() for o in sites], lse.detach(), [x.detach() for x in grads]

    got, want = run(True), run(False)
    for i, (a, b) in enumerate(zip(got[0], want[0], strict=True)):
        assert torch.equal(a, b), f"out[{i}]"
    assert torch.equal(got[1], want[1]), "lse"
    for i, (a, b) in enumerate(zip(got[2], want[2], strict=True)):
        assert torch.equal(a, b), f"grad of input {i}: max diff {(a - b).abs().max()}"


def check_block_read_backward(case: ReadCase, n_queries: int, wanted: str, route: str,
                              backend: str = BACKEND):  # fmt: skip
    """``block_read_backward`` (what a recomputing caller runs: the forward again without
    autograd, then the backward directly) == autograd through ``block_read``, bit for bit, with
    gradients of ``out``, ``lse`` or both (``wanted``). ``route``: "direct" (plain tensors: the
    implementation) or "op" (a function mode: the registered backward op)."""
    values, keys, queries = make_read(case, n_queries)
    inputs = leaves(values, keys, queries)
    g = torch.Generator().manual_seed(case.seed + 1)
    out, lse = custom_ops.block_read(values, keys, queries, backend=backend)
    grad_out = torch.randn(out.shape, generator=g) if wanted != "lse" else None
    grad_lse = torch.randn(lse.shape, generator=g) if wanted != "out" else None
    pairs = [(o, w) for o, w in ((out, grad_out), (lse, grad_lse)) if w is not None]
    outs, weights = zip(*pairs)
    want = torch.autograd.grad(outs, inputs, weights, allow_unused=True)
    detached = [x.detach() for x in inputs]
    n, m = case.sources, (0 if keys is None else case.sources)
    with torch.no_grad():
        _, lse2 = custom_ops.block_read(detached[:n], detached[n : n + m] if m else None,
                                        detached[-1], backend=backend)  # fmt: skip
        assert torch.equal(lse2, lse.detach())
        with _NoOpFunctionMode() if route == "op" else contextlib.nullcontext():
            gv, gk, gq = custom_ops.block_read_backward(
                detached[:n], detached[n : n + m] if m else None, detached[-1], lse2,
                grad_out, grad_lse, backend=backend,
            )  # fmt: skip
    assert (gk is None) == (keys is None)
    got = [*gv, *(gk or []), gq]
    for i, (a, b, x) in enumerate(zip(got, want, inputs, strict=True)):
        b = torch.zeros_like(x) if b is None else b
        assert a.dtype == x.dtype and a.shape == x.shape, f"grad of input {i}"
        if backend == "reference":
            assert_close(f"grad of input {i}", a, b, case.dtype)
        else:
            assert torch.equal(a, b), f"grad of input {i}: max diff {(a - b).abs().max()}"


def check_block_read_backward_into(case: ReadCase, n_queries: int, accumulate: bool,
                                   per_site: bool, backend: str = BACKEND):  # fmt: skip
    """``block_read_backward(out=..., accumulate=...)`` writes into (adds to) the fp32 buffers it
    is given and returns them: in fp32 bit for bit the gradients it returns without ``out`` (plus
    what the buffers held), in 16 bits those gradients before their rounding. Written buffers
    start as NaN, so a column left unwritten fails; ``per_site``: ``grad_out`` as the sites'
    list."""
    values, keys, queries = make_read(case, n_queries)
    values, queries = [v.detach() for v in values], queries.detach()
    keys = None if keys is None else [k.detach() for k in keys]
    g = torch.Generator().manual_seed(case.seed + 1)
    with torch.no_grad():
        out, lse = custom_ops.block_read(values, keys, queries, backend=backend)
        grad_out = torch.randn(out.shape, generator=g)
        grad_lse = torch.randn(lse.shape, generator=g)
        if per_site:
            grad_out = [None if c % 2 else grad_out[c] for c in range(n_queries)]
        gv, gk, gq = custom_ops.block_read_backward(
            values, keys, queries, lse, grad_out, grad_lse, backend=backend
        )
        sources = [("value", values, gv)] + ([("key", keys, gk)] if keys is not None else [])
        held = {kind: [torch.randn(x.shape, generator=g) for x in xs] for kind, xs, _ in sources}
        bufs = {
            kind: [h.clone() if accumulate else torch.full_like(h, float("nan")) for h in hs]
            for kind, hs in held.items()
        }
        got = custom_ops.block_read_backward(
            values, keys, queries, lse, grad_out, grad_lse, backend=backend,
            out=(bufs["value"], bufs.get("key")), accumulate=accumulate,
        )  # fmt: skip
    assert torch.equal(got[2], gq), "the queries' gradient"
    for (kind, _, fresh), mine in zip(sources, got[:2]):
        for i, (buf, f, h) in enumerate(zip(mine, fresh, held[kind], strict=True)):
            assert buf is bufs[kind][i] and buf.dtype == torch.float32, f"{kind} {i}: not out's"
            want = h + f.float() if accumulate else f.float()
            if case.dtype == torch.float32:
                assert torch.equal(buf, want), f"{kind} {i}: max diff {(buf - want).abs().max()}"
            else:  # (Triton's interpreter truncates a 16-bit store, a GPU rounds it)
                assert_close(f"{kind} gradient {i}", buf, want, case.dtype)


def check_merge_partial(case: ReadCase, emit_norm: bool, backend: str = BACKEND):
    """Phase 1 on sources[:-1] + phase 2 with the last source == the one-pass read
    (docs/method.md §7)."""
    values, keys, query = make_read(case)
    inputs = leaves(values, keys, query)
    done_keys = None if keys is None else keys[:-1]
    pk = None if keys is None else keys[-1]

    def two_phase():
        out1, lse1 = custom_ops.block_read(values[:-1], done_keys, query[None], backend=backend)
        res = custom_ops.merge_partial(
            out1[0], lse1[0], values[-1], pk, query, emit_norm=emit_norm, backend=backend
        )
        return res if emit_norm else (res,)

    def one_pass():
        ref_keys = keys if keys is not None else reference.sliced_keys(values, case.r)
        h32 = reference.depth_read([v.float() for v in values], ref_keys, query)
        # the op's contract: RMSNorm of the ROUNDED h (forward), the gradients of h and of
        # RMSNorm(h) added in fp32 (backward); autograd through an fp16 h would round the norm's
        # gradient and the sum to 16 bits first, an error of the reference's own (measured 2.8e-3
        # relative on a query gradient, the fused path 1.9e-3, the float64 maths the truth)
        h = h32 + (h32.to(case.dtype).float() - h32).detach()  # rounded, identity backward
        out = h.to(case.dtype)
        return (out, reference.key_rmsnorm(h).to(case.dtype)) if emit_norm else (out,)

    got, got_g = grads_of(two_phase, inputs, case.seed)
    want, want_g = grads_of(one_pass, inputs, case.seed)
    assert got[0].dtype == case.dtype
    assert_close("h", got[0], want[0], case.dtype)
    if emit_norm:
        assert got[1].dtype == case.dtype
        assert_close("RMSNorm(h)", got[1], want[1], case.dtype)
    for i, (a, b) in enumerate(zip(got_g, want_g, strict=True)):
        assert_close(f"grad of input {i}", a, b, case.dtype)


@settings(deadline=None, max_examples=40)
@given(read_cases())
def test_depth_read_matches_reference(case):
    check_depth_read(case)


@settings(deadline=None, max_examples=25)
@given(read_cases(max_sources=12), st.integers(1, 6))
def test_block_read_matches_per_query_reference(case, n_queries):
    check_block_read(case, n_queries)


@settings(deadline=None, max_examples=25)
@given(
    read_cases(max_sources=12),
    st.lists(st.booleans(), min_size=1, max_size=6),
    st.sampled_from(["twin", "double", "op"]),
)
def test_split_block_read_is_the_unsplit_one(case, unused, route):
    check_split_block_read(case, len(unused), unused, route)


@settings(deadline=None, max_examples=25)
@given(
    read_cases(max_sources=12),
    st.integers(1, 6),
    st.sampled_from(["out", "lse", "both"]),
    st.sampled_from(["direct", "op"]),
)
def test_block_read_backward_is_block_reads_own(case, n_queries, wanted, route):
    check_block_read_backward(case, n_queries, wanted, route)


@settings(deadline=None, max_examples=10)
@given(read_cases(max_sources=6), st.integers(1, 4), st.sampled_from(["out", "lse", "both"]))
def test_block_read_backward_reference(case, n_queries, wanted):
    check_block_read_backward(case, n_queries, wanted, "direct", backend="reference")


def test_block_read_backward_refuses_a_wrong_lse():
    values, keys, queries = make_read(ReadCase((2, 3), 8, 4, 3, True, torch.float32, 0), 2)
    with pytest.raises(ValueError, match=r"lse has shape \(2, 3\), the read's is \(2, 2, 3\)"):
        custom_ops.block_read_backward(values, keys, queries, torch.zeros(2, 3), None, None)


@settings(deadline=None, max_examples=25)
@given(read_cases(max_sources=12), st.integers(1, 6), st.booleans(), st.booleans())
def test_block_read_backward_into_buffers(case, n_queries, accumulate, per_site):
    check_block_read_backward_into(case, n_queries, accumulate, per_site)


@settings(deadline=None, max_examples=8)
@given(read_cases(max_sources=6), st.integers(1, 4), st.booleans(), st.booleans())
def test_block_read_backward_into_buffers_reference(case, n_queries, accumulate, per_site):
    check_block_read_backward_into(case, n_queries, accumulate, per_site, backend="reference")


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda v, k: (v[:1], k), r"out has 1 value gradient buffers for 2 values"),
        (lambda v, k: ([v[0].double(), v[1]], k), r"out value gradient 0 is torch.float64"),
        (lambda v, k: (v, None), r"out has none key gradient buffers for 2 keys"),
        (
            lambda v, k: (v, [k[0], k[1].transpose(0, 1).contiguous().transpose(0, 1)]),
            r"out key gradient 1 .*, not contiguous",
        ),
        (lambda v, k: v[0], r"out must be \(value_grads, key_grads or None\)"),
    ],
)
def test_block_read_backward_refuses_wrong_buffers(change, message):
    """A wrong ``out`` is refused in one line before any kernel writes to it."""
    values, keys, queries = make_read(ReadCase((3, 3), 8, 3, 2, False, torch.float32, 0), 2)
    with torch.no_grad():
        _, lse = custom_ops.block_read(values, keys, queries)
    bufs = ([torch.zeros(3, 3, 8) for _ in values], [torch.zeros(3, 3, 3) for _ in keys])
    with pytest.raises(ValueError, match=message) as e:
        custom_ops.block_read_backward(values, keys, queries, lse, None, None, out=change(*bufs))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="accumulate=True needs out"):
        custom_ops.block_read_backward(values, keys, queries, lse, None, None, accumulate=True)
    with pytest.raises(ValueError, match="grad_out has 1 sites' gradients, the read 2"):
        custom_ops.block_read_backward(values, keys, queries, lse, [None], None)


@settings(deadline=None, max_examples=25)
@given(read_cases(max_sources=12).filter(lambda c: c.sources >= 2), st.booleans())
def test_merge_partial_matches_one_pass_read(case, emit_norm):
    check_merge_partial(case, emit_norm)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliced", [True, False])
def test_129_sources(dtype, sliced):
    check_depth_read(ReadCase((3,), 9, 4, 129, sliced, dtype, seed=7))


def test_single_source_is_identity():
    case = ReadCase((4,), 33, 5, 1, True, torch.float32, seed=1)
    values, keys, query = make_read(case)
    out, lse = custom_ops.depth_read_lse(values, keys, query, backend=BACKEND)
    torch.testing.assert_close(out, values[0].detach())
    torch.testing.assert_close(
        lse, reference.depth_logits(reference.sliced_keys(values, 5), query)[0]
    )


def test_auto_backend_on_cpu_is_compiled():
    case = ReadCase((2, 5), 33, 8, 4, False, torch.float32, seed=3)
    values, keys, query = make_read(case)
    a = custom_ops.depth_read(values, keys, query, backend="auto")
    b = custom_ops.depth_read(values, keys, query, backend="compiled")
    assert torch.equal(a, b)


def test_composite_never_stacks_values(monkeypatch):
    def no_stack(*args, **kwargs):
        raise AssertionError("composite must not torch.stack the sources")

    case = ReadCase((6,), 33, 8, 5, True, torch.float32, seed=2)
    values, _, query = make_read(case)
    monkeypatch.setattr(torch, "stack", no_stack)
    out, lse = composite.read_fwd(values, None, query[None].detach(), 1e-6)
    composite.read_bwd(values, None, query[None].detach(), lse, torch.ones_like(out), None, 1e-6)


def test_eps_is_used():
    """A huge eps flattens the key norm; the ops must honour the argument, not a constant."""
    case = ReadCase((5,), 16, 16, 3, False, torch.float32, seed=4)
    values, keys, query = make_read(case)
    ref_keys = keys
    a = custom_ops.depth_read(values, keys, query, eps=10.0, backend=BACKEND)
    b = reference.depth_read(values, ref_keys, query, eps=10.0)
    c = reference.depth_read(values, ref_keys, query)
    assert_close("eps=10", a, b, torch.float32)
    assert (a - c).abs().max() > 1e-3


def _strided(tokens, width, dtype, g, scale=1.0):
    """Every other column of a ``[tokens, 2·width]`` tensor: a non-contiguous source."""
    return (torch.randn(tokens, 2 * width, generator=g) * scale).to(dtype)[:, ::2].requires_grad_()


@pytest.mark.parametrize("sliced", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_sources_read_correctly(sliced, dtype):
    g = torch.Generator().manual_seed(3)
    values = [_strided(64, 1024, dtype, g, 0.5 + s) for s in range(5)]
    r = 24
    keys = None if sliced else [_strided(64, r, dtype, g) for _ in values]
    query = (2 * torch.randn(r, generator=g)).requires_grad_()
    assert not values[0].is_contiguous()
    inputs = leaves(values, keys, query)
    ref_keys = keys if keys is not None else reference.sliced_keys(values, r)
    got, got_g = grads_of(
        lambda: custom_ops.depth_read_lse(values, keys, query, backend=BACKEND), inputs
    )
    want, want_g = grads_of(lambda: reference.depth_read_with_lse(values, ref_keys, query), inputs)
    assert_close("out", got[0], want[0], dtype)
    for i, (a, b) in enumerate(zip(got_g, want_g, strict=True)):
        assert_close(f"grad of input {i}", a, b, dtype)


@pytest.mark.parametrize("backend", ["reference", BACKEND])
def test_mixed_key_dtypes_are_refused_by_name(backend):
    case = ReadCase((7,), 16, 8, 3, False, torch.float32, seed=5)
    values, keys, query = make_read(case)
    keys = [keys[0], keys[1].bfloat16(), keys[2].half()]
    with pytest.raises(ValueError, match=r"key 1 is torch.bfloat16, key 0 is torch.float32"):
        custom_ops.depth_read(values, keys, query, backend=backend)
    with pytest.raises(ValueError, match=r"key 1 is torch.bfloat16"):
        custom_ops.block_read(values, keys, query[None], backend=backend)
