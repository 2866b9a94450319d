"""``custom_ops.SourceBank``: the reads of prefixes of one growing list of sources give
``block_read``'s numbers, and the gradient sums over a backward's reads give the sums of
``block_read_backward``'s gradients in the order the reads run (fp32: bit for bit; on CPU the
fused kernels through the bank's checked-once tables); sources let go after they are handed on
come back from the read's own; wrong use is refused in one line."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import custom_ops
from custom_ops import cpu
from tests.custom_ops.cases import ReadCase, make_read, read_cases
from tests.custom_ops.tolerances import assert_close


def _inputs(case: ReadCase, c: int):
    values, keys, queries = make_read(case, c)
    values = [v.detach() for v in values]
    keys = None if keys is None else [k.detach() for k in keys]
    return values, keys, queries.detach()


def _bank(values, keys, chunks: int) -> custom_ops.SourceBank:
    bank = custom_ops.SourceBank(None, "auto")
    s = len(values)
    for stop in sorted({max(1, s * (i + 1) // chunks) for i in range(chunks)}):
        bank.extend(values[:stop], None if keys is None else keys[:stop])
    return bank


def _equal(name, got, want, dtype):
    if dtype == torch.float32:
        assert torch.equal(got, want), f"{name}: max diff {(got - want).abs().max()}"
    else:
        assert_close(name, got, want, dtype)


@settings(deadline=None, max_examples=25)
@given(read_cases(max_sources=9), st.integers(1, 4), st.integers(1, 3), st.data())
def test_reads_and_summed_gradients_are_block_reads(case, c, chunks, data):
    """Reads of n = S, S-1, ..., 1 sources (as a backward runs a forward's phase-1 reads, the
    latest first), each handing on its last source: every handed sum is the sum, in that
    order, of the reads' gradients from ``block_read_backward``; the queries' too."""
    values, keys, queries = _inputs(case, c)
    bank = _bank(values, keys, chunks)
    assert (bank._tables is not None) == (case.dtype == torch.float32)
    s, g = len(values), torch.Generator().manual_seed(case.seed + 1)
    want_v, want_k = [None] * s, [None] * s
    for n in range(s, 0, -1):
        ks = None if keys is None else keys[:n]
        out, lse = bank.read(n, queries)
        out0, lse0 = custom_ops.block_read(values[:n], ks, queries)
        assert torch.equal(out, out0) and torch.equal(lse, lse0), n
        grad_out = [torch.randn(out[0].shape, generator=g) for _ in range(c)]
        if data.draw(st.booleans(), label="one site without a gradient") and c > 1:
            grad_out[0] = None
        grad_lse = torch.randn(lse.shape, generator=g) if n % 2 else None
        gv0, gk0, gq0 = custom_ops.block_read_backward(
            values[:n], ks, queries, lse, grad_out, grad_lse
        )
        for i in range(n):
            want_v[i] = gv0[i].float() if want_v[i] is None else want_v[i] + gv0[i].float()
            if keys is not None:
                want_k[i] = gk0[i].float() if want_k[i] is None else want_k[i] + gk0[i].float()
        gv, gk, gq = bank.read_backward(n, queries, lse, grad_out, grad_lse, hand_from=n - 1)
        assert torch.equal(gq, gq0), n
        assert gv[: n - 1] == [None] * (n - 1) and (gk is None) == (keys is None)
        _equal(f"value {n - 1}", gv[n - 1].float(), want_v[n - 1], case.dtype)
        assert gv[n - 1].dtype == case.dtype
        if keys is not None:
            _equal(f"key {n - 1}", gk[n - 1].float(), want_k[n - 1], case.dtype)
        assert bank.values[n - 1] is None  # let go: every read taking it has run


def test_the_fused_kernels_serve_fp32_cpu_reads(monkeypatch):
    """fp32 CPU sources: the reads go to the C kernels through the bank's tables, not the ops."""
    values, keys, queries = _inputs(ReadCase((2, 5), 16, 4, 3, False, torch.float32, 0), 2)
    bank = _bank(values, keys, 2)
    monkeypatch.setattr(custom_ops.api, "block_read", None)
    monkeypatch.setattr(custom_ops.api, "block_read_backward", None)
    out, lse = bank.read(3, queries)
    bank.read_backward(3, queries, lse, list(out), None, hand_from=3)
    assert bank.value_sums[0] is not None and bank.key_sums[2] is not None


def test_a_source_let_go_comes_back_from_the_read():
    """A retained graph's second backward finds the sources handed on gone: the read's own
    saved sources take their place; without them, a one-line refusal."""
    values, keys, queries = _inputs(ReadCase((4,), 8, 8, 2, True, torch.float32, 1), 1)
    bank = _bank(values, keys, 1)
    out, lse = bank.read(2, queries)
    first = bank.read_backward(2, queries, lse, [out[0]], None, hand_from=0)
    with pytest.raises(ValueError, match=r"let sources \[0, 1\] go; give them back"):
        bank.read_backward(2, queries, lse, [out[0]], None)
    again = bank.read_backward(2, queries, lse, [out[0]], None, sources=(values, None))
    assert all(torch.equal(a, b) for a, b in zip(first[0], again[0], strict=True))
    assert torch.equal(first[2], again[2])


def test_the_bank_keeps_no_graph():
    """Its sources are held detached: the graph that holds the bank is not reachable from it."""
    x = torch.randn(3, 4, requires_grad=True)
    bank = custom_ops.SourceBank()
    bank.extend([x * 2, x + 1])
    assert all(v.grad_fn is None and not v.requires_grad for v in bank.values)


def test_wrong_use_is_refused():
    values = [torch.randn(2, 4) for _ in range(3)]
    bank = custom_ops.SourceBank()
    bank.extend(values[:2])
    for call, message in [
        (lambda: bank.extend([torch.randn(2, 4), *values[1:]]), "must be the first of the values"),
        (lambda: bank.extend(values, [torch.randn(2, 2)] * 3), "every source or for none"),
        (lambda: bank.read(3, torch.randn(1, 2)), "a read of 3 sources from a bank of 2"),
        (lambda: bank.read(0, torch.randn(1, 2)), "a read of 0 sources"),
        (lambda: custom_ops.SourceBank(backend="cuda"), "unknown backend 'cuda'"),
    ]:
        with pytest.raises(ValueError, match=message) as e:
            call()
        assert "\n" not in str(e.value)


def test_the_direct_calls_check_what_the_sources_do_not():
    """A bank's reads call the kernels directly (``SourceTables``): queries or gradients the
    kernels cannot take leave the call to the op (None), a strided gradient is read as its
    copy, one site's gradient of another size is refused in one line."""
    values, _, queries = _inputs(ReadCase((2, 5), 16, 8, 3, True, torch.float32, 3), 2)
    tables = cpu.SourceTables(values[0], None)
    assert tables.read_fwd(values, None, queries.t().contiguous().t(), 1e-6) is None
    assert tables.read_fwd(values, None, torch.randn(2, 17), 1e-6) is None  # sliced r > d
    out, lse = tables.read_fwd(values, None, queries, 1e-6)
    g = torch.Generator().manual_seed(4)
    grads = [torch.randn(out[0].shape, generator=g) for _ in range(2)]

    def backward(grad_out, grad_lse=None):
        sums = [torch.empty(values[0].shape) for _ in values]
        found = tables.read_bwd(values, None, queries, lse, grad_out, grad_lse, 1e-6, sums, None,
                                False)  # fmt: skip
        return None if found is None else (found, sums)

    dq, sums = backward(grads)
    for same in ([g.transpose(0, 1).contiguous().transpose(0, 1) for g in grads],
                 torch.stack(grads)):  # fmt: skip
        dq2, sums2 = backward(same)
        assert torch.equal(dq, dq2) and all(map(torch.equal, sums, sums2))
    assert backward([grads[0].bfloat16(), grads[1]]) is None
    assert backward(grads, lse.double()) is None
    for wrong, message in [
        (lambda: backward([grads[0][:1], grads[1]]), "of 80 elements, where it takes 160"),
        (
            lambda: tables.read_bwd(
                values, None, queries, lse, grads, None, 1e-6, sums[:2], None, False
            ),
            "3 sources need 3 gradient sums",
        ),  # fmt: skip
        (
            lambda: tables.read_bwd(
                values, None, queries, lse, grads, None, 1e-6, sums, sums, False
            ),
            "3 sources need 3 gradient sums",
        ),  # fmt: skip
    ]:
        with pytest.raises(ValueError, match=message) as e:
            wrong()
        assert "\n" not in str(e.value)
