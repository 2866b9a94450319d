"""Plain-PyTorch depth read: the CPU kernel of the ``lrattnres::`` ops and the ``compiled`` backend.

Same maths as ``custom_ops.reference`` (SPEC §2, §7), laid out for a CPU at its memory limit:
every large tensor (values, outputs, their gradients: ``[tokens, d]``) is touched by a few
whole-tensor elementwise passes, and everything per source and per token is computed on small
``[S, tokens, C]`` tensors with 2-D matmuls over the r key dims. No per-token batched matmul (an
``einsum`` over ``...`` becomes one ``bmm`` per token, and CPU ``bmm`` loops over the batch in
C++ with a ``select`` per token) and no stacking copy of the values.

- forward: logits of every source (``[tokens, r] @ [r, C]``), softmax over the S sources on the
  small logits, then ``out_c = Σ_s α_{s,c} v_s`` accumulated in place in fp32 (``addcmul_``);
- backward: recomputes α from the saved log-sum-exp, ``dα_{s,c} = <dh_c, v_s>``,
  ``dℓ = α (dα - Σ_s' α dα + dlse)``, ``dv_s = Σ_c α_{s,c} dh_c``, the key gradient through the
  parameter-free RMSNorm as ``[tokens, C] @ [C, r]`` and ``dq = dℓᵀ k̄`` as ``[C, tokens] @
  [tokens, r]``.

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


def _normed_key(key: torch.Tensor, eps: float):
    """``(k̄ [n, r], rstd [n, 1])`` in fp32 for one source's key ``[..., r]``."""
    k = key.reshape(-1, key.shape[-1]).float()
    rstd = torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + eps)
    return k * rstd, rstd


def _alphas(values, keys, q, eps: float):
    """``(ℓ [S, n, C], k̄ list, rstd list)``: every source's logits against the bank, fp32."""
    rank = q.shape[-1]
    logits = q.new_empty(len(values), _rows(values[0]).shape[0], q.shape[0])
    kbars, rstds = [], []
    for s in range(len(values)):
        kbar, rstd = _normed_key(_key(values, keys, s, rank), eps)
        logits[s] = kbar @ q.t()
        kbars.append(kbar)
        rstds.append(rstd)
    return logits, kbars, rstds


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def read_fwd(values, keys, queries, eps: float):
    """Read of a query bank: ``(out [C, ..., d] fp32, lse [C, ...] fp32)``."""
    q = queries.float()
    lead, d, nc = values[0].shape[:-1], values[0].shape[-1], q.shape[0]
    logits = _alphas(values, keys, q, eps)[0]
    lse = torch.logsumexp(logits, 0)  # [n, C]
    alpha = torch.exp(logits - lse).transpose(1, 2).unsqueeze(-1)  # [S, C, n, 1]
    out = alpha[0] * _rows(values[0])  # type promotion: fp32 without a copy of v
    for s in range(1, len(values)):
        out.addcmul_(_rows(values[s]), alpha[s])
    return out.view(nc, *lead, d), lse.t().reshape(nc, *lead)


def _key_grad(dlogit, kbar, rstd, q):
    """Gradient of ``ℓ_c = <q_c, RMSNorm(k)>`` w.r.t. the raw key ``k`` (``[n, r]``), summed over
    the bank (``dlogit [n, C]``)."""
    dkbar = dlogit @ q
    return rstd * (dkbar - kbar * (dkbar * kbar).mean(-1, keepdim=True))


def read_bwd(values, keys, queries, lse, grad_out, grad_lse, eps: float):
    """Backward of :func:`read_fwd`. ``grad_out [C, ..., d]`` / ``grad_lse [C, ...]`` may be None.

    Returns fp32 ``(grad_values list, grad_keys list or None, grad_queries [C, r])``; for sliced
    keys the key gradient is already added into the tail of each value gradient.
    """
    q = queries.float()
    nc, rank = q.shape
    shape, d = values[0].shape, values[0].shape[-1]
    logits, kbars, rstds = _alphas(values, keys, q, eps)
    alpha = torch.exp(logits - lse.reshape(nc, -1).t().float())  # [S, n, C]
    # e^{ℓ-lse} sums to 1 only up to rounding, and dα - D amplifies that error for a dominant
    # source: renormalised, the gradients are as exact as the eager softmax's.
    alpha = alpha / alpha.sum(0)
    dh = None if grad_out is None else grad_out.reshape(nc, -1, d)
    dalpha = torch.zeros_like(alpha)
    if dh is not None:  # <dh_c, v_s> per token: an elementwise pass and a row sum per (s, c)
        for s, v in enumerate(values):
            for c in range(nc):
                dalpha[s, :, c] = (dh[c] * _rows(v)).sum(-1)
    dlogit = alpha * (dalpha - (alpha * dalpha).sum(0))
    if grad_lse is not None:
        dlogit = dlogit + alpha * grad_lse.reshape(nc, -1).t().float()
    grad_values, grad_keys, grad_q = [], [], torch.zeros_like(q)
    for s in range(len(values)):
        if dh is None:
            dv = torch.zeros(_rows(values[s]).shape, dtype=torch.float32, device=q.device)
        else:
            dv = alpha[s, :, :1] * dh[0]
            for c in range(1, nc):
                dv.addcmul_(dh[c], alpha[s, :, c : c + 1])
        dk = _key_grad(dlogit[s], kbars[s], rstds[s], q)
        grad_q += dlogit[s].t() @ kbars[s]
        if keys is None:
            dv[:, d - rank :] += dk
        else:
            grad_keys.append(dk.view(keys[s].shape))
        grad_values.append(dv.view(shape))
    return grad_values, (None if keys is None else grad_keys), grad_q


def rmsnorm_fp32(h: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMSNorm of the (already rounded) h, fp32, eps = finfo(fp32).eps."""
    x = h.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS)


def _merge_weights(lse1, pk, q, eps: float):
    """``(w1, w2 [n, 1], k̄, rstd)``: the two-way softmax of ``(lse1, ℓ)`` for the partial key."""
    kbar, rstd = _normed_key(pk, eps)
    logit = kbar @ q  # [n]
    w2 = torch.sigmoid(logit - lse1.reshape(-1).float()).unsqueeze(-1)
    return 1 - w2, w2, kbar, rstd


def _partial_key(partial_value, partial_key, rank: int):
    pv = partial_value
    return pv[..., pv.shape[-1] - rank :] if partial_key is None else partial_key


def merge_fwd(out1, lse1, partial_value, partial_key, query, eps: float, emit_norm: bool):
    """Phase 2 (SPEC §7): merge a phase-1 read ``(out1, lse1)`` with the single partial source.

    Returns ``(h, norm)``: h ``[..., d]`` in partial_value's dtype, norm = RMSNorm(h) in the same
    dtype when ``emit_norm`` else an empty tensor.
    """
    q = query.float()
    pv = partial_value
    w1, w2, _, _ = _merge_weights(lse1, _partial_key(pv, partial_key, q.shape[-1]), q, eps)
    h = w2 * _rows(pv)  # fp32 by type promotion
    h.addcmul_(_rows(out1), w1)
    h = h.to(pv.dtype).view(pv.shape)
    norm = rmsnorm_fp32(h).to(h.dtype) if emit_norm else h.new_empty(0)
    return h, norm


def merge_bwd(out1, lse1, partial_value, partial_key, query, h, grad_h, grad_norm, eps: float):
    """Backward of :func:`merge_fwd` (``h`` is its saved output). Returns fp32 gradients
    ``(d_out1, d_lse1, d_partial_value, d_partial_key or None, d_query)``."""
    q = query.float()
    rank = q.shape[-1]
    pv = partial_value
    w1, w2, kbar, rstd = _merge_weights(lse1, _partial_key(pv, partial_key, rank), q, eps)
    dh = None if grad_h is None else _rows(grad_h).float()  # read-only: no copy when fp32
    if grad_norm is not None and grad_norm.numel() > 0:
        hf = _rows(h).float()
        hrstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + NORM_EPS)
        y, gy = hf * hrstd, _rows(grad_norm).float()
        dnorm = hrstd * (gy - y * (gy * y).mean(-1, keepdim=True))
        dh = dnorm if dh is None else dh + dnorm
    if dh is None:
        dh = torch.zeros(_rows(h).shape, dtype=torch.float32, device=h.device)
    dw1, dw2 = (dh * _rows(out1)).sum(-1, keepdim=True), (dh * _rows(pv)).sum(-1, keepdim=True)
    big_d = w1 * dw1 + w2 * dw2
    d_lse1, dlogit = w1 * (dw1 - big_d), w2 * (dw2 - big_d)  # [n, 1]
    d_out1, d_pv = w1 * dh, w2 * dh
    dk = _key_grad(dlogit, kbar, rstd, q.unsqueeze(0))
    d_q = (dlogit.t() @ kbar)[0]
    if partial_key is None:
        d_pv[:, pv.shape[-1] - rank :] += dk
        dk = None
    else:
        dk = dk.view(partial_key.shape)
    return d_out1.view(pv.shape), d_lse1.view(lse1.shape), d_pv.view(pv.shape), dk, d_q
