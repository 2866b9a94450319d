"""Eager inference calls the ops' implementation without the dispatcher (``api._route``): the
same numbers as the registered op, bit for bit, and the op still runs whenever autograd, a
trace or a dispatch mode needs it."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

import custom_ops
from custom_ops import api
from tests.custom_ops.cases import Seen


def _direct(*tensors) -> bool:
    """Whether a call with these tensors runs the op's implementation without the dispatcher or
    autograd."""
    return api._route(tensors) == "direct"


def _inputs(projected: bool, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(2, 3, 16, generator=g, dtype=dtype) for _ in range(3)]
    keys = [torch.randn(2, 3, 4, generator=g) for _ in range(3)] if projected else None
    return values, keys, torch.randn(2, 4, generator=g), torch.randn(4, generator=g)


@pytest.mark.parametrize("projected", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_equals_the_op(projected, dtype):
    values, keys, bank, q = _inputs(projected, dtype)
    with torch.no_grad():
        assert _direct(*values, bank)
        out, lse = custom_ops.block_read(values, keys, bank)
        h, lse1 = custom_ops.depth_read_lse(values, keys, q)
        pk = None if keys is None else keys[0]
        m, norm = custom_ops.merge_partial(out[0], lse[0], values[0], pk, q, emit_norm=True)
    name = "block_read" if projected else "block_read_sliced"
    op = getattr(torch.ops.lrattnres, name)
    args = (values, keys, bank) if projected else (values, bank)
    ref_out, ref_lse = op(*args, api.DEFAULT_EPS, "compiled")
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    name = "depth_read" if projected else "depth_read_sliced"
    args = (values, keys, q) if projected else (values, q)
    ref_h, ref_l = getattr(torch.ops.lrattnres, name)(*args, api.DEFAULT_EPS, "compiled")
    assert torch.equal(h, ref_h) and torch.equal(lse1, ref_l)
    ref_m, ref_n = torch.ops.lrattnres.merge_partial(
        out[0], lse[0], values[0], pk, q, api.DEFAULT_EPS, True, "compiled"
    )
    assert torch.equal(m, ref_m) and torch.equal(norm, ref_n)


def test_the_op_runs_when_needed():
    values, keys, bank, q = _inputs(False)
    assert not _direct(*values, bank.requires_grad_())  # autograd must record the op
    with torch.no_grad():
        assert _direct(*values, bank)
        with Seen() as mode:  # a dispatch mode (as export and FSDP use) must see the op
            assert not _direct(*values, bank)
            custom_ops.block_read(values, keys, bank)
    assert "lrattnres.block_read_sliced.default" in mode.ops
    with torch.no_grad(), TorchFunctionMode():  # a function mode (SPMD type checking) too
        assert not _direct(*values, bank)
    out, _ = custom_ops.block_read(values, keys, bank)
    assert out.grad_fn is not None  # with grad: the registered op's autograd


def _grads(fn, leaves):
    for t in leaves:
        t.grad = None
    outs = fn()
    g = torch.Generator().manual_seed(1)
    loss = sum((o.float() * torch.randn(o.shape, generator=g)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs], [t.grad for t in leaves]


def _leaves(projected: bool, dtype):
    values, keys, bank, q = _inputs(projected, dtype)
    for t in (*values, *(keys or ()), bank, q):
        t.requires_grad_()
    return values, keys, bank, q


@pytest.mark.parametrize("projected", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("call", ["depth_read", "block_read", "merge_partial"])
def test_eager_autograd_twin_equals_the_op(projected, dtype, call):
    """With autograd, plain eager tensors take the ops' ``torch.autograd.Function`` twin (no
    dispatcher); under a dispatch mode the registered op and its backward op run. Same numbers,
    forward and every gradient, bit for bit."""
    values, keys, bank, q = _leaves(projected, dtype)
    if call == "merge_partial":
        with torch.no_grad():
            out, lse = custom_ops.block_read(values, keys, bank)
        out1, lse1 = out[0].requires_grad_(), lse[0].requires_grad_()
        pk = None if keys is None else keys[1]
        leaves = [out1, lse1, values[1], *([] if pk is None else [pk]), q]

        def fn():
            return custom_ops.merge_partial(out1, lse1, values[1], pk, q, emit_norm=True)

        twin_name, op_names = "merge_partial_eager", ["merge_partial", "merge_partial_backward"]
    else:
        query = bank if call == "block_read" else q
        read = custom_ops.block_read if call == "block_read" else custom_ops.depth_read_lse
        leaves = [*values, *(keys or ()), query]

        def fn():
            return read(values, keys, query)

        sliced = "" if projected else "_sliced"
        twin_name = f"{call}{sliced}_eager"
        op_names = [f"{call}{sliced}", "read_backward"]
    assert type(fn()[0].grad_fn).__name__.startswith(twin_name)
    twin_out, twin_grads = _grads(fn, leaves)
    with Seen() as mode:
        op_out, op_grads = _grads(fn, leaves)
    for name in op_names:
        assert f"lrattnres.{name}.default" in mode.ops
    for a, b in zip(twin_out + twin_grads, op_out + op_grads, strict=True):
        assert a is not None and torch.equal(a, b)


def test_the_twin_refuses_a_double_backward_as_the_op_does():
    values, keys, bank, q = _leaves(False, torch.float32)
    h, _ = custom_ops.depth_read_lse(values, keys, q)
    (g,) = torch.autograd.grad(h.sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula"):
        g.sum().backward()
