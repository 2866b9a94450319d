"""``lrattnres::`` ops: registration, fake impls, autograd, and the public Python API.

Ops (one name on every machine; the backward of every op is itself an op):

    lrattnres::depth_read(Tensor[] values, Tensor[] keys, Tensor query, float eps, str impl)
        -> (Tensor out, Tensor lse)                      query [r]; out [..., d] values dtype
    lrattnres::depth_read_sliced(Tensor[] values, Tensor query, float eps, str impl)
        -> (Tensor out, Tensor lse)                      keys = last r dims of each value
    lrattnres::block_read(Tensor[] values, Tensor[] keys, Tensor queries, float eps, str impl)
        -> (Tensor out, Tensor lse)                      queries [c, r]; out [c, ..., d] FP32
    lrattnres::block_read_sliced(Tensor[] values, Tensor queries, float eps, str impl)
    lrattnres::read_backward(Tensor[] values, Tensor[] keys, Tensor queries, Tensor lse,
        Tensor? grad_out, Tensor? grad_lse, float eps, str impl) -> (Tensor[], Tensor[], Tensor)
                                                         keys == [] means sliced
    lrattnres::merge_partial(Tensor out1, Tensor lse1, Tensor partial_value, Tensor? partial_key,
        Tensor query, float eps, bool emit_norm, str impl) -> (Tensor h, Tensor norm)
                                                         norm is empty unless emit_norm
    lrattnres::merge_partial_backward(..., Tensor h, Tensor? grad_h, Tensor? grad_norm, ...)
        -> (d_out1, d_lse1, d_partial_value, d_partial_key (empty if sliced), d_query)

``impl`` is ``"compiled"`` (on CPU the fused C kernels of ``custom_ops.cpu`` for fp32, the eager
``custom_ops.composite`` otherwise; on CUDA the composite through torch.compile) or ``"triton"``
(``custom_ops.kernels``; on CPU tensors only under ``TRITON_INTERPRET=1``).

All ops are registered with ``torch.library.custom_op`` (opaque to compile/export), on CPU and on
CUDA. Not ``triton_op``: the kernels take the sources as a bucket-padded tuple of tensors, and
torch.compile mis-traces a ``triton_op`` whose kernel gets a tuple built from a ``list[Tensor]``
(members frozen as constants, writes dropped; docs/ops.md). Inductor would
not fuse into a user kernel anyway; it launches the whole read as one opaque call.

Autograd: every call goes through the registered op, whose backward formula calls the backward
op (``lrattnres::read_backward``, ``lrattnres::merge_partial_backward``), so that a trace sees
it and a double backward is refused.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import types

import torch

from custom_ops import composite, cpu

BACKENDS = ("reference", "inductor", "compiled", "triton", "auto")


# --------------------------------------------------------------------------- kernels per impl


_instances = itertools.count()


def own_code(fn):
    """``fn`` as a function with a code object of its own.

    Dynamo keeps compiled graphs per code object, and a call walks their guards until one set
    passes; after the cache limit (8 graphs) every new function or shape runs uncompiled. A
    decorator's wrapper has one code object for every function it decorates, and one function
    compiled twice (a model's forward, once per model) shares its code object with itself: each
    compiled copy from ``own_code`` keeps its own graphs and checks only its own guards."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_instances)}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def compile_own(fn, **options):
    """``torch.compile`` of a ``torch.no_grad``-decorated function (``read_fwd``, ``read_bwd``
    and the rest): the undecorated function, from its own code (``own_code``), called under
    ``no_grad``."""
    compiled = torch.compile(own_code(inspect.unwrap(fn)), **options)

    @functools.wraps(fn)
    def call(*args):
        with torch.no_grad():
            return compiled(*args)

    return call


@functools.cache
def _compiled(fn):
    return compile_own(fn, dynamic=False)


def _compiled_impl(name: str, device: torch.device, *args):
    """``compiled`` impl: on CPU the fused C kernel (fp32) else the eager composite; on CUDA the
    composite through torch.compile."""
    if device.type == "cuda":
        return _compiled(getattr(composite, name))(*args)
    if device.type == "cpu":
        result = getattr(cpu, name)(*args)
        if result is not None:
            return result
    return getattr(composite, name)(*args)


def _read_fwd(values, keys, queries, eps, impl, out_dtype):
    if impl == "triton":
        from custom_ops.kernels import read_fwd

        return read_fwd.read_fwd(values, keys, queries, eps, out_dtype)
    return _compiled_impl("read_fwd", queries.device, values, keys, queries, eps)


def _read_bwd(values, keys, queries, lse, grad_out, grad_lse, eps, impl):
    if impl == "triton":
        from custom_ops.kernels import read_bwd

        return read_bwd.read_bwd(values, keys, queries, lse, grad_out, grad_lse, eps)
    args = (values, keys, queries, lse, grad_out, grad_lse, eps)
    return _compiled_impl("read_bwd", queries.device, *args)


def _fresh(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in ``dtype``, contiguous: x itself when it is already (no dispatcher calls)."""
    if x.dtype == dtype and x.is_contiguous():
        return x
    return x.to(dtype).contiguous()


def _empty(x: torch.Tensor, shape=None, dtype=None) -> torch.Tensor:
    shape = x.shape if shape is None else shape
    return x.new_empty(shape, dtype=x.dtype if dtype is None else dtype)


# --------------------------------------------------------------------------- read ops


def read(values, keys, query, eps: float, impl: str, bank: bool):
    """What every read op computes (``keys`` None = sliced): ``(out, lse)``, see the schema."""
    queries = query if bank else query.unsqueeze(0)
    out_dtype = torch.float32 if bank else values[0].dtype
    out, lse = _read_fwd(values, keys, queries, eps, impl, out_dtype)
    if bank:
        return _fresh(out, torch.float32), _fresh(lse, torch.float32)
    return _fresh(out[0], values[0].dtype), _fresh(lse[0], torch.float32)


def _read_op(name: str, sliced: bool, bank: bool):
    """Registers one forward read op (``torch.ops.lrattnres.<name>``). Every variant shares the
    generic query-bank kernels."""

    def run(values, keys, query, eps, impl):
        return read(values, None if sliced else keys, query, eps, impl, bank)

    def fake(values, keys, query, eps, impl):
        v = values[0]
        lead = (query.shape[0],) if bank else ()
        out_dtype = torch.float32 if bank else v.dtype
        return _empty(v, lead + v.shape, out_dtype), _empty(v, lead + v.shape[:-1], torch.float32)

    if sliced:

        def fn(
            values: list[torch.Tensor], query: torch.Tensor, eps: float, impl: str
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return run(values, None, query, eps, impl)

        def fake_fn(values, query, eps, impl):
            return fake(values, None, query, eps, impl)
    else:

        def fn(
            values: list[torch.Tensor],
            keys: list[torch.Tensor],
            query: torch.Tensor,
            eps: float,
            impl: str,
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return run(values, keys, query, eps, impl)

        fake_fn = fake

    op = torch.library.custom_op(f"lrattnres::{name}", fn, mutates_args=())
    op.register_fake(fake_fn)

    def setup_context(ctx, inputs, output):
        values, keys, query = inputs[0], ([] if sliced else inputs[1]), inputs[-3]
        ctx.eps, ctx.impl, ctx.n = inputs[-2], inputs[-1], len(values)
        ctx.save_for_backward(*values, *keys, query, output[1])

    def backward(ctx, grad_out, grad_lse):
        saved = ctx.saved_tensors
        values, keys, query, lse = saved[: ctx.n], saved[ctx.n : -2], saved[-2], saved[-1]
        if not bank:
            query, lse = query.unsqueeze(0), lse.unsqueeze(0)
            grad_out = None if grad_out is None else grad_out.unsqueeze(0)
            grad_lse = None if grad_lse is None else grad_lse.unsqueeze(0)
        gv, gk, gq = torch.ops.lrattnres.read_backward(
            list(values), list(keys), query, lse, grad_out, grad_lse, ctx.eps, ctx.impl
        )
        gq = gq if bank else gq[0]
        if sliced:
            return list(gv), gq, None, None
        return list(gv), list(gk), gq, None, None

    op.register_autograd(backward, setup_context=setup_context)


def _read_backward_impl(
    values: list[torch.Tensor],
    keys: list[torch.Tensor],
    queries: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor | None,
    grad_lse: torch.Tensor | None,
    eps: float,
    impl: str,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """``read_backward``'s implementation (``keys == []``: sliced)."""
    ks = keys if len(keys) else None
    gv, gk, gq = _read_bwd(values, ks, queries, lse, grad_out, grad_lse, eps, impl)
    gv = [_fresh(g, v.dtype) for g, v in zip(gv, values, strict=True)]
    gk = [] if gk is None else [_fresh(g, k.dtype) for g, k in zip(gk, keys, strict=True)]
    return gv, gk, _fresh(gq, queries.dtype)


_read_backward = torch.library.custom_op("lrattnres::read_backward", mutates_args=())(
    _read_backward_impl
)


@_read_backward.register_fake
def _(values, keys, queries, lse, grad_out, grad_lse, eps, impl):
    return [_empty(v) for v in values], [_empty(k) for k in keys], _empty(queries)


_read_op("depth_read", sliced=False, bank=False)
_read_op("depth_read_sliced", sliced=True, bank=False)
_read_op("block_read", sliced=False, bank=True)
_read_op("block_read_sliced", sliced=True, bank=True)


# --------------------------------------------------------------------------- merge ops


def _merge_fwd(out1, lse1, pv, pk, query, eps, emit_norm, impl):
    if impl == "triton":
        from custom_ops.kernels import merge

        return merge.merge_fwd(out1, lse1, pv, pk, query, eps, emit_norm)
    return _compiled_impl("merge_fwd", pv.device, out1, lse1, pv, pk, query, eps, emit_norm)


def _merge_bwd(out1, lse1, pv, pk, query, h, grad_h, grad_norm, eps, impl):
    if impl == "triton":
        from custom_ops.kernels import merge

        return merge.merge_bwd(out1, lse1, pv, pk, query, h, grad_h, grad_norm, eps)
    args = (out1, lse1, pv, pk, query, h, grad_h, grad_norm, eps)
    return _compiled_impl("merge_bwd", pv.device, *args)


def merge(out1, lse1, partial_value, partial_key, query, eps: float, emit_norm: bool, impl: str):
    """What ``lrattnres::merge_partial`` computes: ``(h, norm)``, see the schema."""
    h, norm = _merge_fwd(out1, lse1, partial_value, partial_key, query, eps, emit_norm, impl)
    dtype = partial_value.dtype
    return _fresh(h, dtype), _fresh(norm, dtype)


@torch.library.custom_op("lrattnres::merge_partial", mutates_args=())
def _merge_partial(
    out1: torch.Tensor,
    lse1: torch.Tensor,
    partial_value: torch.Tensor,
    partial_key: torch.Tensor | None,
    query: torch.Tensor,
    eps: float,
    emit_norm: bool,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return merge(out1, lse1, partial_value, partial_key, query, eps, emit_norm, impl)


@_merge_partial.register_fake
def _(out1, lse1, partial_value, partial_key, query, eps, emit_norm, impl):
    h = _empty(partial_value)
    return h, (_empty(h) if emit_norm else _empty(h, (0,)))


def _merge_setup(ctx, inputs, output):
    out1, lse1, pv, pk, query, eps, emit_norm, impl = inputs
    ctx.eps, ctx.impl, ctx.sliced = eps, impl, pk is None
    ctx.save_for_backward(out1, lse1, pv, pv if pk is None else pk, query, output[0])


def _merge_backward(ctx, grad_h, grad_norm):
    out1, lse1, pv, pk, query, h = ctx.saved_tensors
    pk = None if ctx.sliced else pk
    g = torch.ops.lrattnres.merge_partial_backward(
        out1, lse1, pv, pk, query, h, grad_h, grad_norm, ctx.eps, ctx.impl
    )
    return g[0], g[1], g[2], (None if ctx.sliced else g[3]), g[4], None, None, None


_merge_partial.register_autograd(_merge_backward, setup_context=_merge_setup)


def _merge_partial_backward_impl(
    out1: torch.Tensor,
    lse1: torch.Tensor,
    partial_value: torch.Tensor,
    partial_key: torch.Tensor | None,
    query: torch.Tensor,
    h: torch.Tensor,
    grad_h: torch.Tensor | None,
    grad_norm: torch.Tensor | None,
    eps: float,
    impl: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    pv, pk = partial_value, partial_key
    d1, dl, dv, dk, dq = _merge_bwd(out1, lse1, pv, pk, query, h, grad_h, grad_norm, eps, impl)
    dk = pv.new_empty(0) if pk is None else _fresh(dk, pk.dtype)
    return (
        _fresh(d1, out1.dtype),
        _fresh(dl, lse1.dtype),
        _fresh(dv, pv.dtype),
        dk,
        _fresh(dq, query.dtype),
    )


_merge_partial_backward = torch.library.custom_op(
    "lrattnres::merge_partial_backward", mutates_args=()
)(_merge_partial_backward_impl)


@_merge_partial_backward.register_fake
def _(out1, lse1, partial_value, partial_key, query, h, grad_h, grad_norm, eps, impl):
    dk = partial_value.new_empty(0) if partial_key is None else _empty(partial_key)
    return _empty(out1), _empty(lse1), _empty(partial_value), dk, _empty(query)
