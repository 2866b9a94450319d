"""The ``compiled`` backend of every op (the registered ops: fused C kernels, plain-PyTorch
composite) and the ``inductor`` read (aten ops with a written-out backward, here run eagerly),
forward and every gradient, against the eager reference over hypothesis-generated shapes,
ranks, source counts and dtypes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import custom_ops
from custom_ops import composite, reference
from tests.custom_ops.cases import ReadCase, grads_of, leaves, make_read, read_cases
from tests.custom_ops.tolerances import assert_close, rank_one_cancellation

BACKEND = "compiled"
FAST = ["compiled", "inductor"]  # every backend tested here against the reference


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


@pytest.mark.parametrize("backend", FAST)
@settings(deadline=None, max_examples=40)
@given(case=read_cases())
def test_depth_read_matches_reference(backend, case):
    check_depth_read(case, backend)


@pytest.mark.parametrize("backend", FAST)
@settings(deadline=None, max_examples=25)
@given(case=read_cases(max_sources=12), n_queries=st.integers(1, 6))
def test_block_read_matches_per_query_reference(backend, case, n_queries):
    check_block_read(case, n_queries, backend)


@pytest.mark.parametrize("backend", FAST)
@settings(deadline=None, max_examples=25)
@given(case=read_cases(max_sources=12).filter(lambda c: c.sources >= 2), emit_norm=st.booleans())
def test_merge_partial_matches_one_pass_read(backend, case, emit_norm):
    check_merge_partial(case, emit_norm, backend)


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("sliced", [True, False])
def test_129_sources(dtype, sliced, backend):
    check_depth_read(ReadCase((3,), 9, 4, 129, sliced, dtype, seed=7), backend)


@pytest.mark.parametrize("backend", FAST)
def test_single_source_is_identity(backend):
    case = ReadCase((4,), 33, 5, 1, True, torch.float32, seed=1)
    values, keys, query = make_read(case)
    out, lse = custom_ops.depth_read_lse(values, keys, query, backend=backend)
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


@pytest.mark.parametrize("backend", FAST)
def test_eps_is_used(backend):
    """A huge eps flattens the key norm; the ops must honour the argument, not a constant."""
    case = ReadCase((5,), 16, 16, 3, False, torch.float32, seed=4)
    values, keys, query = make_read(case)
    ref_keys = keys
    a = custom_ops.depth_read(values, keys, query, eps=10.0, backend=backend)
    b = reference.depth_read(values, ref_keys, query, eps=10.0)
    c = reference.depth_read(values, ref_keys, query)
    assert_close("eps=10", a, b, torch.float32)
    assert (a - c).abs().max() > 1e-3


def _strided(tokens, width, dtype, g, scale=1.0):
    """Every other column of a ``[tokens, 2·width]`` tensor: a non-contiguous source."""
    return (torch.randn(tokens, 2 * width, generator=g) * scale).to(dtype)[:, ::2].requires_grad_()


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("sliced", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_sources_read_correctly(sliced, dtype, backend):
    g = torch.Generator().manual_seed(3)
    values = [_strided(64, 1024, dtype, g, 0.5 + s) for s in range(5)]
    r = 24
    keys = None if sliced else [_strided(64, r, dtype, g) for _ in values]
    query = (2 * torch.randn(r, generator=g)).requires_grad_()
    assert not values[0].is_contiguous()
    inputs = leaves(values, keys, query)
    ref_keys = keys if keys is not None else reference.sliced_keys(values, r)
    got, got_g = grads_of(
        lambda: custom_ops.depth_read_lse(values, keys, query, backend=backend), inputs
    )
    want, want_g = grads_of(lambda: reference.depth_read_with_lse(values, ref_keys, query), inputs)
    assert_close("out", got[0], want[0], dtype)
    for i, (a, b) in enumerate(zip(got_g, want_g, strict=True)):
        assert_close(f"grad of input {i}", a, b, dtype)


@pytest.mark.parametrize("backend", ["reference", *FAST])
def test_mixed_key_dtypes_are_refused_by_name(backend):
    case = ReadCase((7,), 16, 8, 3, False, torch.float32, seed=5)
    values, keys, query = make_read(case)
    keys = [keys[0], keys[1].bfloat16(), keys[2].half()]
    with pytest.raises(ValueError, match=r"key 1 is torch.bfloat16, key 0 is torch.float32"):
        custom_ops.depth_read(values, keys, query, backend=backend)
    with pytest.raises(ValueError, match=r"key 1 is torch.bfloat16"):
        custom_ops.block_read(values, keys, query[None], backend=backend)


@pytest.mark.parametrize("sliced", [True, False])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_inductor_read_traces_under_no_grad(sliced, n):
    """Traced by dynamo without autograd (an evaluation pass), for every count of source
    tensors: dynamo decides from ``forward``'s signature whether to pass the ctx."""
    case = ReadCase((6,), 16, 8, n, sliced, torch.float32, seed=n)
    values, keys, query = make_read(case)

    def read(values, keys, queries):
        return custom_ops.block_read(values, keys, queries, backend="inductor")

    torch._dynamo.reset()
    traced = torch.compile(read, backend="eager", fullgraph=True)
    with torch.no_grad():
        got = traced(values, keys, query[None])
        want = read(values, keys, query[None])
    torch.testing.assert_close(got, want, rtol=0, atol=0)
