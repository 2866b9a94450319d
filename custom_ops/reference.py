"""Eager reference of the LR-AttnRes depth read (docs/method.md §2 and §7), written to be read.

Every fast path in this project is tested against these functions.

    k̄_s = RMSNorm(k_s)          over the r key dims, no gain, fp32, eps = finfo(fp32).eps
    ℓ_s = <q, k̄_s>               logit scale 1, one routing head
    α   = softmax_s(ℓ)           per token, fp32
    h   = Σ_s α_s v_s            full width d, returned in the values' dtype

Shapes: ``values`` is a sequence of S tensors ``[..., d]`` (same shape and dtype), ``keys`` a
sequence of S RAW (not yet normalised) tensors ``[..., r]``, ``query`` is ``[r]`` (or ``[c, r]``
for the batched phase-1 read of a block).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

# custom_ops' one fp32 norm eps (the keys' default, the merge's RMSNorm(h)); others import it
DEFAULT_EPS = torch.finfo(torch.float32).eps
# The RMSNorms' overflow policy, followed by every backend (see ``key_rmsnorm``)
NORM_HUGE_SUMSQ = 2.0**120  # a row whose fp32 sum of squares reaches this ...
NORM_DOWN = 2.0**-72  # ... is normalised from x·NORM_DOWN: (2^128·2^-72)²·4096 < 2^127


def _eps(eps: float | None) -> float:
    return DEFAULT_EPS if eps is None else float(eps)


def _check(
    values: Sequence[torch.Tensor], keys: Sequence[torch.Tensor] | None, query: torch.Tensor
):
    """Shapes of a read's operands; ``keys`` None: sliced (the values' own tails)."""
    if len(values) == 0:
        raise ValueError("depth_read needs at least one source")
    if keys is not None and len(values) != len(keys):
        raise ValueError(f"got {len(values)} values but {len(keys)} keys")
    shape = values[0].shape
    for i, v in enumerate(values):
        if v.shape != shape:
            raise ValueError(f"value {i} has shape {tuple(v.shape)}, expected {tuple(shape)}")
    for i, k in enumerate(keys or ()):
        if k.shape[:-1] != shape[:-1]:
            raise ValueError(
                f"key {i} has shape {tuple(k.shape)}, leading dims must be {tuple(shape[:-1])}"
            )
        if k.shape[-1] != query.shape[-1]:
            raise ValueError(f"key {i} has rank {k.shape[-1]}, query has rank {query.shape[-1]}")


def key_rmsnorm(key: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """Parameter-free RMSNorm over the last dim, ``k / sqrt(mean(k²) + eps)``, computed (and
    returned) in fp32.

    The overflow policy of every RMSNorm in custom_ops (keys on every backend, and the merge's
    RMSNorm(h)): k² overflows fp32 from |k| ~ 2^64 (fp32 and bf16 reach 2^128). A row whose fp32
    sum of squares reaches ``NORM_HUGE_SUMSQ`` = 2^120 (inf included) is normalised from
    k·``NORM_DOWN`` = k·2^-72 instead, without eps (below 2^-90 of its mean square there): the
    same norm (scaling by a power of two is exact), no square above 2^124. Every other row, tiny
    ones included, is normalised as it is, with eps. The test holding each backend to it:
    ``tests/custom_ops/test_extreme_inputs.py`` (``test_norm_policy``).

    Written as ``k / hypot(rms(k), sqrt(eps))`` from the row's norm, not
    ``k·rsqrt(mean(k²) + eps)``: autograd then never forms rstd³, which underflows fp32 from
    |k| ~ 2^42 (the kernels write their backward with k̄ = k·rstd for the same reason).
    """
    k = key.float()
    with torch.no_grad():  # the policy's per-row choice: no gradient of its own
        big = k.pow(2).sum(-1, keepdim=True) >= NORM_HUGE_SUMSQ
        scale = torch.where(big, NORM_DOWN, 1.0).to(k.dtype)
        root_eps = torch.where(big, 0.0, _eps(eps) ** 0.5).to(k.dtype)
    k = k * scale
    rms = torch.linalg.vector_norm(k, dim=-1, keepdim=True) / k.shape[-1] ** 0.5
    return k / torch.hypot(rms, root_eps)


def sliced_keys(values: Sequence[torch.Tensor], rank: int) -> list[torch.Tensor]:
    """S-LR keys: the last ``rank`` dims of each raw value (views, no copy)."""
    return [v[..., v.shape[-1] - rank :] for v in values]


def _logits(keys, query: torch.Tensor, eps, normalised: bool) -> list[torch.Tensor]:
    """Per source: fp32 logits ``[...]`` for a query ``[r]``, ``[c, ...]`` for ``[c, r]``."""
    q = query.float()
    out = []
    for key in keys:
        k = key if normalised else key_rmsnorm(key, eps)
        out.append((k * q).sum(-1) if q.dim() == 1 else torch.einsum("...r,cr->c...", k, q))
    return out


def depth_logits(keys: Sequence[torch.Tensor], query: torch.Tensor, eps: float | None = None):
    """Routing logits (fp32): ``[S, ...]`` for a query ``[r]``, ``[c, S, ...]`` for ``[c, r]``."""
    return torch.stack(_logits(keys, query, eps, normalised=False), dim=query.dim() - 1)


def depth_read_with_lse(values, keys, query, eps=None, *, normalised=False):
    """The read and its per-token log-sum-exp. ``normalised``: the keys are already
    ``key_rmsnorm``'s output (a caller that reads the same sources at many sites normalises each
    once).

    Returns ``(h, lse)``: h ``[..., d]`` in the values' dtype (``[c, ..., d]`` for a ``[c, r]``
    query bank), lse fp32 ``[...]`` (``[c, ...]``).

    Written source by source (no ``[S, ..., d]`` stack of the values): the softmax is
    ``w_s = exp(ℓ_s - max ℓ)``, ``α_s = w_s / Σ w``, ``lse = max ℓ + log Σ w``, and a compiler
    fuses the whole read into passes over the sources as they lie.
    """
    _check(values, keys, query)
    logits = _logits(keys, query, eps, normalised)
    top = functools.reduce(torch.maximum, logits)
    weights = [torch.exp(logit - top) for logit in logits]
    total = functools.reduce(torch.add, weights)
    h = functools.reduce(
        torch.add, [(w / total).unsqueeze(-1) * v.float() for w, v in zip(weights, values)]
    )
    return h.to(values[0].dtype), top + torch.log(total)


def depth_read(values, keys, query, eps=None, *, normalised=False) -> torch.Tensor:
    """``h = Σ_s softmax_s(<q, RMSNorm(k_s)>) v_s`` (docs/method.md §2), in the values' dtype."""
    return depth_read_with_lse(values, keys, query, eps, normalised=normalised)[0]


def merge_reads(out1, lse1, out2, lse2):
    """Exact merge of two disjoint reads by their LSEs (docs/method.md §7, online-softmax rule).

    ``m = max(m1, m2); Z = e^{m1-m} + e^{m2-m}; o = (e^{m1-m} o1 + e^{m2-m} o2) / Z``, with
    ``lse_i = log Z_i`` so the ``Z_i`` factors are already inside the exponent. Returns
    ``(out, lse)`` with out in ``out1``'s dtype and lse fp32.
    """
    lse1, lse2 = lse1.float(), lse2.float()
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    z = w1 + w2
    # normalised weights first: w1·o1 + w2·o2 (z up to 2) could overflow for |o| near 3e38
    out = (w1 / z).unsqueeze(-1) * out1.float() + (w2 / z).unsqueeze(-1) * out2.float()
    return out.to(out1.dtype), m + torch.log(z)


def depth_read_two_phase(values, keys, query, split: int, eps=None):
    """The same read computed in two phases: sources ``[:split]`` then ``[split:]``, merged."""
    if not 0 < split < len(values):
        raise ValueError(f"split must be in [1, {len(values) - 1}], got {split}")
    o1, l1 = depth_read_with_lse(values[:split], keys[:split], query, eps)
    o2, l2 = depth_read_with_lse(values[split:], keys[split:], query, eps)
    return merge_reads(o1.float(), l1, o2.float(), l2)[0].to(values[0].dtype)


__all__ = [
    "DEFAULT_EPS",
    "NORM_DOWN",
    "NORM_HUGE_SUMSQ",
    "key_rmsnorm",
    "sliced_keys",
    "depth_logits",
    "depth_read",
    "depth_read_with_lse",
    "merge_reads",
    "depth_read_two_phase",
]
