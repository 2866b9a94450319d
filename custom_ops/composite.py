"""Plain-PyTorch depth read: the CPU kernel of the ``lrattnres::`` ops and the ``compiled`` backend.

Same maths as ``custom_ops.reference`` (SPEC §2, §7), organised like the Triton kernels:

- forward: one pass over the sources with an online softmax (running max ``m``, normaliser ``z``,
  fp32 accumulator), so no ``torch.stack`` copy of the values is ever made;
- backward: recomputes the logits from the saved log-sum-exp (no fp32 copies of the sources),
  ``dα_s = <dh, v_s>``, ``dℓ_s = α_s (dα_s - Σ_s' α_s' dα_s' + dlse)``, then the key gradient
  through the parameter-free RMSNorm and ``dq = Σ_tokens Σ_s dℓ_s k̄_s``.

Every function takes a query BANK ``queries [C, r]`` (C = 1 for a single read site) and returns
fp32 results shaped ``[C, ...]``; ``custom_ops.ops`` reshapes and casts. ``keys=None`` means sliced
keys: the last r dims of each value, read in place.
"""

from __future__ import annotations

import torch

NORM_EPS = torch.finfo(torch.float32).eps


def _key(values, keys, s: int, rank: int) -> torch.Tensor:
    v = values[s]
    return v[..., v.shape[-1] - rank :] if keys is None else keys[s]


def _logits(key: torch.Tensor, q: torch.Tensor, eps: float):
    """``(ℓ [C, ...], k̄ [..., r], rstd [..., 1])`` in fp32 for one source."""
    k = key.float()
    rstd = torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps)
    kbar = k * rstd
    return torch.einsum("...r,cr->c...", kbar, q), kbar, rstd


def _bcast(x: torch.Tensor) -> torch.Tensor:
    return x.unsqueeze(-1)


def read_fwd(values, keys, queries, eps: float):
    """Online-softmax read of a query bank: ``(out [C, ..., d] fp32, lse [C, ...] fp32)``."""
    q = queries.float()
    rank = q.shape[-1]
    m = z = acc = None
    for s, v in enumerate(values):
        logit, _, _ = _logits(_key(values, keys, s, rank), q, eps)
        if m is None:
            m, z = logit, torch.ones_like(logit)
            acc = v.float().unsqueeze(0).expand(q.shape[0], *v.shape).clone()
            continue
        m_new = torch.maximum(m, logit)
        scale, p = torch.exp(m - m_new), torch.exp(logit - m_new)
        acc = acc * _bcast(scale) + _bcast(p) * v.float()
        z = z * scale + p
        m = m_new
    return acc / _bcast(z), m + torch.log(z)


def _key_grad(dlogit, kbar, rstd, q):
    """Gradient of ``ℓ_c = <q_c, RMSNorm(k)>`` w.r.t. the raw key k, summed over the bank."""
    dkbar = torch.einsum("c...,cr->...r", dlogit, q)
    return rstd * (dkbar - kbar * (dkbar * kbar).mean(-1, keepdim=True))


def read_bwd(values, keys, queries, lse, grad_out, grad_lse, eps: float):
    """Backward of :func:`read_fwd`. ``grad_out [C, ..., d]`` / ``grad_lse [C, ...]`` may be None.

    Returns fp32 ``(grad_values list, grad_keys list or None, grad_queries [C, r])``; for sliced
    keys the key gradient is already added into the tail of each value gradient.
    """
    q = queries.float()
    rank = q.shape[-1]
    dh = None if grad_out is None else grad_out.float()
    # pass 1: logits and dα_s per source (O(S) floats per token), then D = Σ α dα
    cache, big_d, z = [], 0.0, 0.0
    for s, v in enumerate(values):
        logit, kbar, rstd = _logits(_key(values, keys, s, rank), q, eps)
        alpha = torch.exp(logit - lse)
        dalpha = torch.zeros_like(alpha) if dh is None else (dh * v.float()).sum(-1)
        big_d = big_d + alpha * dalpha
        z = z + alpha
        cache.append((alpha, dalpha, kbar, rstd))
    # e^{ℓ-lse} sums to 1 only up to rounding, and dα - D amplifies that error for a dominant
    # source: renormalised, the gradients are as exact as the eager softmax's.
    big_d = big_d / z
    grad_values, grad_keys, grad_q = [], [], torch.zeros_like(q)
    for s, v in enumerate(values):
        alpha, dalpha, kbar, rstd = cache[s]
        alpha = alpha / z
        dlogit = alpha * (dalpha - big_d)
        if grad_lse is not None:
            dlogit = dlogit + alpha * grad_lse.float()
        if dh is None:
            dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
        else:
            dv = torch.einsum("c...,c...d->...d", alpha, dh)
        dk = _key_grad(dlogit, kbar, rstd, q)
        grad_q += torch.einsum("c...,...r->cr", dlogit, kbar)
        if keys is None:
            dv[..., v.shape[-1] - rank :] += dk
        else:
            grad_keys.append(dk)
        grad_values.append(dv)
    return grad_values, (None if keys is None else grad_keys), grad_q


def rmsnorm_fp32(h: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMSNorm of the (already rounded) h, fp32, eps = finfo(fp32).eps."""
    x = h.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS)


def merge_fwd(out1, lse1, partial_value, partial_key, query, eps: float, emit_norm: bool):
    """Phase 2 (SPEC §7): merge a phase-1 read ``(out1, lse1)`` with the single partial source.

    Returns ``(h, norm)``: h ``[..., d]`` in partial_value's dtype, norm = RMSNorm(h) in the same
    dtype when ``emit_norm`` else an empty tensor.
    """
    q = query.float().unsqueeze(0)
    rank = q.shape[-1]
    pk = (
        partial_value[..., partial_value.shape[-1] - rank :] if partial_key is None else partial_key
    )
    logit = _logits(pk, q, eps)[0][0]
    lse1 = lse1.float()
    m = torch.maximum(lse1, logit)
    w1, w2 = torch.exp(lse1 - m), torch.exp(logit - m)
    z = w1 + w2
    h = (_bcast(w1 / z) * out1.float() + _bcast(w2 / z) * partial_value.float()).to(
        partial_value.dtype
    )
    norm = rmsnorm_fp32(h).to(h.dtype) if emit_norm else h.new_empty(0)
    return h, norm


def merge_bwd(out1, lse1, partial_value, partial_key, query, h, grad_h, grad_norm, eps: float):
    """Backward of :func:`merge_fwd` (``h`` is its saved output). Returns fp32 gradients
    ``(d_out1, d_lse1, d_partial_value, d_partial_key or None, d_query)``."""
    q = query.float().unsqueeze(0)
    rank = q.shape[-1]
    pv = partial_value
    pk = pv[..., pv.shape[-1] - rank :] if partial_key is None else partial_key
    logit, kbar, rstd = _logits(pk, q, eps)
    logit = logit[0]
    lse1 = lse1.float()
    m = torch.maximum(lse1, logit)
    w1, w2 = torch.exp(lse1 - m), torch.exp(logit - m)
    z = w1 + w2
    w1, w2 = w1 / z, w2 / z
    dh = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
    if grad_h is not None:
        dh = dh + grad_h.float()
    if grad_norm is not None and grad_norm.numel() > 0:
        hf = h.float()
        hrstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + NORM_EPS)
        y, gy = hf * hrstd, grad_norm.float()
        dh = dh + hrstd * (gy - y * (gy * y).mean(-1, keepdim=True))
    dw1, dw2 = (dh * out1.float()).sum(-1), (dh * pv.float()).sum(-1)
    big_d = w1 * dw1 + w2 * dw2
    d_lse1, dlogit = w1 * (dw1 - big_d), w2 * (dw2 - big_d)
    d_out1, d_pv = _bcast(w1) * dh, _bcast(w2) * dh
    dk = _key_grad(dlogit.unsqueeze(0), kbar, rstd, q)
    d_q = torch.einsum("...,...r->r", dlogit, kbar)
    if partial_key is None:
        d_pv[..., pv.shape[-1] - rank :] += dk
        dk = None
    return d_out1, d_lse1, d_pv, dk, d_q
