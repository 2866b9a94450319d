"""The fused CPU kernels (``custom_ops.cpu``, serving the ``compiled`` impl for fp32 on CPU)
against the eager composite they replace and the reference: they must build here (a missing
compiler would silently fall back), agree on every output and gradient, and leave 16-bit inputs
to the composite."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from custom_ops import composite, cpu
from tests.custom_ops.cases import ReadCase, make_read, read_cases
from tests.custom_ops.test_custom_ops_read import (
    check_block_read,
    check_depth_read,
    check_merge_partial,
)
from tests.custom_ops.tolerances import assert_close, rank_one_cancellation


def test_library_builds():
    assert cpu.ENABLED, "LRATTNRES_CPU_KERNELS=0 is set: the fused CPU kernels are not tested"
    assert cpu.library() is not None


def test_a_library_of_another_abi_is_refused(tmp_path, monkeypatch):
    """``benchmarks.cpu_kernels`` builds other revisions' depth_read.c: one whose contract with
    the wrapper differs (``lrattnres_cpu_abi``) must not be called with this one's arguments."""
    monkeypatch.setenv("LRATTNRES_CPU_CACHE", str(tmp_path / "cache"))
    line = f"int lrattnres_cpu_abi(void) {{ return {cpu.ABI}; }}"
    source = cpu._SOURCE.read_text()
    assert source.count(line) == 1
    other = tmp_path / "depth_read.c"
    other.write_text(
        source.replace(line, f"int lrattnres_cpu_abi(void) {{ return {cpu.ABI - 1}; }}")
    )
    with pytest.warns(UserWarning, match=f"ABI {cpu.ABI - 1}, this wrapper {cpu.ABI}"):
        assert cpu.build(other) is None
    older = tmp_path / "older.c"  # revisions before the ABI number: no such function
    older.write_text(source.replace(line, ""))
    with pytest.warns(UserWarning, match=f"ABI None, this wrapper {cpu.ABI}"):
        assert cpu.build(older) is None


def test_sixteen_bit_inputs_are_left_to_the_composite():
    values, keys, query = make_read(ReadCase((5,), 8, 4, 3, False, torch.bfloat16, seed=1))
    assert cpu.read_fwd(values, keys, query[None], 1e-6) is None


def _detached(case: ReadCase, n_queries: int):
    values, keys, queries = make_read(case, n_queries)
    return (
        [v.detach() for v in values],
        None if keys is None else [k.detach() for k in keys],
        (queries.detach()),
    )


def _assert_read_grads_close(a, b, keys):
    """Two ``read_bwd`` results ``(grad values, grad keys or None, grad queries)`` agree."""
    for i, (x, y) in enumerate(zip(a[0], b[0], strict=True)):
        assert_close(f"grad value {i}", x, y, torch.float32)
    for i, (x, y) in enumerate(zip(a[1] or [], b[1] or [], strict=True)):
        cond = rank_one_cancellation(keys[i], 1e-6)
        assert_close(f"grad key {i}", x, y, torch.float32, conditioning=cond)
    assert_close("grad queries", a[2], b[2], torch.float32)


@settings(deadline=None, max_examples=20)
@given(read_cases(max_sources=10, max_tokens=300), st.integers(1, 5), st.booleans())
def test_read_matches_composite(case, n_queries, with_lse_grad):
    case = ReadCase(case.lead, case.d, case.r, case.sources, case.sliced, torch.float32, case.seed)
    values, keys, queries = _detached(case, n_queries)
    got, want = (
        cpu.read_fwd(values, keys, queries, 1e-6),
        composite.read_fwd(values, keys, queries, 1e-6),
    )
    assert_close("out", got[0], want[0], torch.float32)
    assert_close("lse", got[1], want[1], torch.float32)
    g = torch.Generator().manual_seed(case.seed)
    dout = torch.randn(got[0].shape, generator=g)
    dlse = torch.randn(got[1].shape, generator=g) if with_lse_grad else None
    a = cpu.read_bwd(values, keys, queries, want[1], dout, dlse, 1e-6)
    b = composite.read_bwd(values, keys, queries, want[1], dout, dlse, 1e-6)
    _assert_read_grads_close(a, b, keys)


@pytest.mark.parametrize("enabled", [True, False], ids=["fused", "composite"])
@pytest.mark.parametrize("sliced", [True, False])
def test_both_cpu_paths_match_the_reference(monkeypatch, enabled, sliced):
    """fp32 through the public ops, with the fused kernels and with the eager composite."""
    monkeypatch.setattr(cpu, "ENABLED", enabled)
    case = ReadCase((3, 70), 40, 12, 6, sliced, torch.float32, seed=9)  # several token chunks
    check_depth_read(case)
    check_block_read(case, 4)
    for emit_norm in (False, True):
        check_merge_partial(case, emit_norm)


@pytest.mark.parametrize("n_queries", [8, 9, 12])
@pytest.mark.parametrize("sliced", [True, False])
def test_read_backward_past_its_one_pass_rows(n_queries, sliced):
    """The read backward takes up to 8 sites' gradient rows in one pass over them (the dots and
    the value gradient together) and more in two: both agree with the composite, zero
    gradients among them; odd d and r so that every column tail runs."""
    case = ReadCase((2, 37), 43, 11, 4, sliced, torch.float32, seed=3)
    values, keys, queries = _detached(case, n_queries)
    lse = cpu.read_fwd(values, keys, queries, 1e-6)[1]
    g = torch.Generator().manual_seed(6)
    dout = torch.randn((n_queries, 2, 37, 43), generator=g)
    dout[0] = dout[-2] = 0
    dlse = torch.randn(lse.shape, generator=g)
    a = cpu.read_bwd(values, keys, queries, lse, dout, dlse, 1e-6)
    b = composite.read_bwd(values, keys, queries, lse, dout, dlse, 1e-6)
    _assert_read_grads_close(a, b, keys)


def test_subnormal_weights_carry_nothing():
    """A source whose logit trails by 95 (weight e^-95 ~ 5e-42, below 2^-126) adds nothing: out,
    its value gradient and the merge's share of it are exactly 0 where the lead source is 0 (the
    kernels flush such weights, as the contract allows: a subnormal weight costs x86 assists on
    every element it multiplies). The eager composite keeps the subnormal there."""
    d, r, n = 16, 8, 5
    values = [torch.zeros(n, d), torch.zeros(n, d)]
    values[0][:, d - r] = 1.0  # sliced keys: e_0 and -e_0, normalised to +-sqrt(r)
    values[1][:, d - r] = -1.0
    values[1][:, : d - r] = 1.0  # the trailing source's value, where the lead's is 0
    q = torch.zeros(1, r)
    q[0, 0] = 95.0 / (2 * r**0.5)
    out, lse = cpu.read_fwd(values, None, q, 1e-6)
    eager = composite.read_fwd(values, None, q, 1e-6)[0]
    assert torch.all(eager[0, :, : d - r] > 0) and torch.all(eager[0, :, : d - r] < 2.0**-126)
    assert torch.all(out[0, :, : d - r] == 0)
    gv = cpu.read_bwd(values, None, q, lse, torch.ones(1, n, d), None, 1e-6)[0]
    assert torch.all(gv[1] == 0) and torch.all(gv[0][:, : d - r] == 1)
    # the merge: out1 with lse1 = 47.5 against a partial of logit -47.5
    h = cpu.merge_fwd(values[0], torch.full((n,), 47.5), values[1], None, q[0], 1e-6, False)[0]
    assert torch.all(h[:, : d - r] == 0)
