"""Public depth-read API (docs/method.md §2, §7). Shapes and dtypes follow ``custom_ops.reference``.

``backend``: ``"reference"`` (eager reference, plain autograd), ``"inductor"`` (aten ops with a
hand-written backward, ``custom_ops.graph``: traced into the caller's compiled graph, where
Inductor fuses them), ``"compiled"`` (the ``lrattnres::`` ops with the plain-PyTorch kernel),
``"triton"`` (the ops with the Triton kernels; CPU tensors need ``TRITON_INTERPRET=1``),
``"auto"`` (triton on CUDA tensors, compiled elsewhere).
``keys=None`` (or ``partial_key=None``) means sliced keys: the last ``r = query.shape[-1]`` dims of
each value, read in place, never copied.

Range (``tests/custom_ops/test_extreme_inputs.py``, every backend): values and keys of any
magnitude from 1e-30 to 1e4 in fp32 and up to the largest finite value in fp16 / bf16, query
norms from 1e-2 to 1e3 (1e5 to give one source a lead of 1e4 in logit): h, lse and RMSNorm(h)
are finite and within the dtype's tolerance of the float64 maths (the key and h norms cannot
overflow: one policy on every backend, ``reference.key_rmsnorm``; keys are tested to the largest
fp32 value). So are the gradients while ``<dh, v>`` fits fp32 (bf16 values up to ~1e30). A
routing weight below fp32's smallest normal (2^-126) is 0, and so is all it carries. The fused
CPU kernels (fp32 only) square h for RMSNorm(h) in fp32 (values up to ~1e19 there), and their key
gradients reach fp32 keys up to ~1e18.

Non-finite inputs: a NaN or inf in one token's values, keys, ``out1``, ``lse1`` or partial stays
in that token. Every other token's outputs and value / key / out1 / lse1 gradients are bit for
bit those of the same call without it. The query's gradient, a sum over tokens, is then not
finite, and a non-finite query reaches every token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from custom_ops import graph, ops, reference
from custom_ops.reference import DEFAULT_EPS, _eps

BACKENDS = ops.BACKENDS


def _backend(backend: str, like: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if like.is_cuda else "compiled"
    return backend


def _validate(values, keys, query, query_dim: int):
    if len(values) == 0:
        raise ValueError("depth_read needs at least one source")
    if query.dim() != query_dim:
        want = "[r]" if query_dim == 1 else "[c, r]"
        raise ValueError(f"query must be {want}, got shape {tuple(query.shape)}")
    if query.shape[-1] < 1:
        raise ValueError("query rank r must be >= 1")
    v0 = values[0]
    if v0.dim() < 1:
        raise ValueError("values must have a feature dim [..., d]")
    for i, v in enumerate(values):
        if v.dtype != v0.dtype or v.device != v0.device:
            raise ValueError(
                f"value {i} is {v.dtype} on {v.device}, value 0 is {v0.dtype} on {v0.device}"
            )
    if keys is None:
        r, d = query.shape[-1], v0.shape[-1]
        if r > d:
            raise ValueError(f"sliced keys need rank r <= d, got r={r}, d={d}")
    else:
        for i, k in enumerate(keys):
            if k.device != v0.device:
                raise ValueError(f"key {i} is on {k.device}, values on {v0.device}")
            # one dtype per call, as for values: the same answer on every backend (the Triton
            # launchers alone could promote mixed keys; the CPU kernels take fp32 only)
            if k.dtype != keys[0].dtype:
                raise ValueError(
                    f"key {i} is {k.dtype}, key 0 is {keys[0].dtype}: keys must share one dtype"
                )
    reference._check(values, keys, query)
    if query.device != v0.device:
        raise ValueError(f"query is on {query.device}, values on {v0.device}")


def _reference_keys(values, keys, query):
    """The keys the eager reference reads (sliced: views of the values' tails)."""
    return reference.sliced_keys(values, query.shape[-1]) if keys is None else keys


def depth_read_lse(
    values: Sequence[torch.Tensor],
    keys: Sequence[torch.Tensor] | None,
    query: torch.Tensor,
    eps: float | None = None,
    *,
    backend: str = "auto",
):
    """``(h [..., d] values dtype, lse [...] fp32)`` of one read site with query ``[r]``."""
    values = list(values)
    keys = None if keys is None else list(keys)
    _validate(values, keys, query, 1)
    impl = _backend(backend, values[0])
    if impl == "reference":
        ref_keys = _reference_keys(values, keys, query)
        return reference.depth_read_with_lse(values, ref_keys, query, eps)
    if impl == "inductor":
        out, lse = graph.block_read(values, keys, query[None], eps)
        return out[0].to(values[0].dtype), lse[0]
    if keys is None:
        return torch.ops.lrattnres.depth_read_sliced(values, query, _eps(eps), impl)
    return torch.ops.lrattnres.depth_read(values, keys, query, _eps(eps), impl)


def depth_read(values, keys, query, eps=None, *, backend: str = "auto") -> torch.Tensor:
    """``h = Σ_s softmax_s(<q, RMSNorm(k_s)>) v_s`` in the values' dtype (docs/method.md §2)."""
    return depth_read_lse(values, keys, query, eps, backend=backend)[0]


def block_read(values, keys, queries, eps=None, *, backend: str = "auto"):
    """Phase 1 of docs/method.md §7: a query bank ``[c, r]`` against the completed sources.

    Each source is read once for all c read sites. Returns ``(out [c, ..., d] FP32, lse [c, ...]
    fp32)``; out is kept in fp32 (not the values' dtype) so the phase-2 merge loses nothing.
    """
    values = list(values)
    keys = None if keys is None else list(keys)
    _validate(values, keys, queries, 2)
    impl = _backend(backend, values[0])
    if impl == "reference":
        ref_keys = _reference_keys(values, keys, queries)
        fp32 = [v.float() for v in values]
        return reference.depth_read_with_lse(fp32, ref_keys, queries, eps)
    if impl == "inductor":
        return graph.block_read(values, keys, queries, eps)
    if keys is None:
        return torch.ops.lrattnres.block_read_sliced(values, queries, _eps(eps), impl)
    return torch.ops.lrattnres.block_read(values, keys, queries, _eps(eps), impl)


def _merge_reference(out1, lse1, partial_value, partial_key, query, eps, emit_norm):
    pk = partial_key
    if pk is None:
        pk = reference.sliced_keys([partial_value], query.shape[-1])[0]
    logit = reference.depth_logits([pk], query, eps)[0]
    h = reference.merge_reads(out1.float(), lse1, partial_value.float(), logit)[0]
    h = h.to(partial_value.dtype)
    if not emit_norm:
        return h
    return h, reference.key_rmsnorm(h, DEFAULT_EPS).to(h.dtype)


def merge_partial(
    out1: torch.Tensor,
    lse1: torch.Tensor,
    partial_value: torch.Tensor,
    partial_key: torch.Tensor | None,
    query: torch.Tensor,
    eps: float | None = None,
    *,
    emit_norm: bool = False,
    backend: str = "auto",
):
    """Phase 2 (docs/method.md §7): merge one site's phase-1 ``(out1 [..., d], lse1 [...])`` with
    the live partial source ``partial_value [..., d]`` (key ``partial_key [..., r]``, or None =
    sliced tail).

    Returns h ``[..., d]`` in partial_value's dtype, or ``(h, RMSNorm(h))`` when ``emit_norm``:
    parameter-free, computed in fp32, returned in h's dtype, with the key norm's eps
    ``finfo(fp32).eps`` (1.19e-7, fixed; the ``eps`` argument is the depth keys' eps). This is not
    the model's sublayer RMSNorm (learned weight, eps 1e-5), which the model applies itself.
    """
    if out1.shape != partial_value.shape:
        raise ValueError(
            f"out1 has shape {tuple(out1.shape)}, partial_value {tuple(partial_value.shape)}"
        )
    if lse1.shape != out1.shape[:-1]:
        raise ValueError(f"lse1 has shape {tuple(lse1.shape)}, expected {tuple(out1.shape[:-1])}")
    _validate([partial_value], None if partial_key is None else [partial_key], query, 1)
    impl = _backend(backend, partial_value)
    if impl == "reference":
        return _merge_reference(out1, lse1, partial_value, partial_key, query, eps, emit_norm)
    if impl == "inductor":
        pk = None if partial_key is None else [partial_key]
        h = graph.merge_read(out1, lse1, [partial_value], pk, query, eps)[0]
        h = h.to(partial_value.dtype)
        return (h, reference.key_rmsnorm(h, DEFAULT_EPS).to(h.dtype)) if emit_norm else h
    args = (out1, lse1, partial_value, partial_key, query, _eps(eps), emit_norm, impl)
    h, norm = torch.ops.lrattnres.merge_partial(*args)
    return (h, norm) if emit_norm else h
