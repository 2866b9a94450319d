"""Plain-PyTorch depth read: the ``compiled`` impl on CUDA (through torch.compile) and, on CPU,
for 16-bit inputs and wherever the fused C kernels (``custom_ops.cpu``) are unavailable.

Same maths as ``custom_ops.reference`` (docs/method.md §2, §7), laid out for few eager passes: every
large tensor (values, outputs, their gradients: ``[tokens, d]``) is touched by a few whole-tensor
elementwise passes, and everything per source and per token is computed on small ``[S, C, tokens]``
tensors with 2-D matmuls over the r key dims. No per-token batched matmul (an ``einsum`` over
``...`` becomes one ``bmm`` per token, and CPU ``bmm`` loops over the batch in C++ with a ``select``
per token) and no stacking copy of the values.

- forward: logits of every source (``[C, r] @ [r, tokens]``), softmax over the S sources on the
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

from custom_ops.reference import DEFAULT_EPS, NORM_DOWN, NORM_HUGE_SUMSQ


def _key(values, keys, s: int, rank: int) -> torch.Tensor:
    v = values[s]
    return v[..., v.shape[-1] - rank :] if keys is None else keys[s]


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _prescaled(x: torch.Tensor):
    """``(x·scale, scale [n, 1])`` for rows ``x [n, w]`` fp32, the norms' overflow policy
    (``reference.key_rmsnorm``): ``scale`` is ``NORM_DOWN`` (2^-72) for a row whose sum of
    squares reaches ``NORM_HUGE_SUMSQ`` (2^120), else 1. The callers add eps·scale², which is
    0 in fp32 for a scaled row: such a row takes no eps, as the policy says."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    scale = torch.where(norm * norm >= NORM_HUGE_SUMSQ, NORM_DOWN, 1.0).to(x.dtype)
    return x * scale, scale


def _key_rstd(key: torch.Tensor, eps: float):
    """``(k [n, r] fp32, rstd [n], scale [n])``: one source's key times ``scale`` (a power of
    two, see ``_prescaled``) and k's RMSNorm scale, so RMSNorm(key) = k·rstd and the gradient of
    the raw key is ``scale`` times k's. k̄ is never materialised: the logits are scaled after the
    matmul instead."""
    k, scale = _prescaled(_rows(key).float())
    scale = scale[:, 0]
    norm = torch.linalg.vector_norm(k, dim=-1)  # one fused reduction, no [n, r] temporary
    return k, torch.rsqrt(norm * norm / k.shape[-1] + eps * scale * scale), scale


def _logits(values, keys, q, eps: float):
    """``(ℓ [S, C, n], keys, rstds, scales)``: every source's logits against the bank, fp32,
    with each source's ``_key_rstd``."""
    rank = q.shape[-1]
    logits = q.new_empty(len(values), q.shape[0], _rows(values[0]).shape[0])
    ks, rstds, scales = [], [], []
    for s in range(len(values)):
        k, rstd, scale = _key_rstd(_key(values, keys, s, rank), eps)
        logits[s] = (q @ k.t()) * rstd
        ks.append(k)
        rstds.append(rstd)
        scales.append(scale)
    return logits, ks, rstds, scales


@torch.no_grad()
def read_fwd(values, keys, queries, eps: float):
    """Read of a query bank: ``(out [C, ..., d] fp32, lse [C, ...] fp32)``."""
    q = queries.float()
    lead, d, nc = values[0].shape[:-1], values[0].shape[-1], q.shape[0]
    logits = _logits(values, keys, q, eps)[0]
    lse = torch.logsumexp(logits, 0)  # [C, n]
    alpha = torch.exp(logits - lse).unsqueeze(-1)  # [S, C, n, 1]
    out = alpha[0] * _rows(values[0])  # type promotion: fp32 without a copy of v
    for s in range(1, len(values)):
        out.addcmul_(_rows(values[s]), alpha[s])
    return out.view(nc, *lead, d), lse.view(nc, *lead)


def _add_key_grad(target, dlogit, logit, k, rstd, scale, q):
    """``target += ∂(Σ_c dℓ_c ℓ_c)/∂key`` for ``ℓ_c = <q_c, k·rstd>``, ``k = key·scale``
    (``dlogit, logit [C, n]``, ``k [n, r]``, ``target [n, r]``, in place), returns ``dq [C, r]``.
    RMSNorm backward with ``Σ_r (Σ_c dℓ_c q_c) k̄ = Σ_c dℓ_c ℓ_c``:
    ``dk = rstd·dℓᵀq - k̄·g`` with ``k̄ = k·rstd``, ``g = rstd·Σ_c dℓ_c ℓ_c / r``, times
    ``scale`` for the raw key (the kernels' ``common.key_grad``)."""
    scaled = dlogit * rstd  # [C, n]
    target.addmm_((scaled * scale).t(), q)
    coef = (dlogit * logit).sum(0) * rstd / k.shape[-1] * scale
    # k̄·g, not k·(rstd²·...): rstd² underflows for |k| from ~2^63
    target.addcmul_(k * rstd.unsqueeze(-1), coef.unsqueeze(-1), value=-1)
    return scaled @ k


@torch.no_grad()
def read_bwd(values, keys, queries, lse, grad_out, grad_lse, eps: float):
    """Backward of :func:`read_fwd`. ``grad_out [C, ..., d]`` / ``grad_lse [C, ...]`` may be None.

    Returns fp32 ``(grad_values list, grad_keys list or None, grad_queries [C, r])``; for sliced
    keys the key gradient is already added into the tail of each value gradient.
    """
    q = queries.float()
    nc, rank = q.shape
    shape, d = values[0].shape, values[0].shape[-1]
    logits, ks, rstds, scales = _logits(values, keys, q, eps)
    alpha = torch.exp(logits - lse.reshape(nc, -1).float())  # [S, C, n]
    # e^{ℓ-lse} sums to 1 only up to rounding, and dα - D amplifies that error for a dominant
    # source: renormalised, the gradients are as exact as the eager softmax's.
    alpha = alpha / alpha.sum(0)
    # fp32 dh (a copy only for 16-bit grads): the products below must not round to 16 bits
    dh = None if grad_out is None else grad_out.reshape(nc, -1, d).float()
    dalpha = torch.zeros_like(alpha)
    if dh is not None:  # <dh_c, v_s> per token: one product (into a reused buffer) and a row sum
        work = torch.empty_like(dh)
        for s, v in enumerate(values):
            torch.sum(torch.mul(dh, _rows(v), out=work), -1, out=dalpha[s])
    dlogit = alpha * (dalpha - (alpha * dalpha).sum(0))
    if grad_lse is not None:
        dlogit += alpha * grad_lse.reshape(nc, -1).float()
    grad_values, grad_keys, grad_q = [], [], torch.zeros_like(q)
    for s in range(len(values)):
        if dh is None:
            dv = torch.zeros(_rows(values[s]).shape, dtype=torch.float32, device=q.device)
        else:
            dv = alpha[s, 0].unsqueeze(-1) * dh[0]
            for c in range(1, nc):
                dv.addcmul_(dh[c], alpha[s, c].unsqueeze(-1))
        key_terms = (dlogit[s], logits[s], ks[s], rstds[s], scales[s], q)
        if keys is None:
            grad_q += _add_key_grad(dv[:, d - rank :], *key_terms)
        else:
            dk = torch.zeros_like(ks[s])
            grad_q += _add_key_grad(dk, *key_terms)
            grad_keys.append(dk.view(keys[s].shape))
        grad_values.append(dv.view(shape))
    return grad_values, (None if keys is None else grad_keys), grad_q


def rmsnorm_fp32(h: torch.Tensor) -> torch.Tensor:
    """Parameter-free RMSNorm of the (already rounded) h, fp32, eps = finfo(fp32).eps, under the
    keys' overflow policy (``_prescaled``)."""
    x, scale = _prescaled(_rows(h).float())
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + DEFAULT_EPS * scale * scale)
    return x.view(h.shape)


def _merge_weights(lse1, pk, q, eps: float):
    """``(w1, w2 [n], ℓ [1, n], k [n, r], rstd [n], scale [n])``: the two-way softmax of
    ``(lse1, ℓ)``, each share from its own sigmoid (``1 - w2`` would round a share below 2^-24
    to nothing: the out1 term of h and its gradients), with the partial's ``_key_rstd``."""
    k, rstd, scale = _key_rstd(pk, eps)
    logit = (q @ k.t()) * rstd  # [1, n]
    lse1 = lse1.reshape(-1).float()
    return torch.sigmoid(lse1 - logit[0]), torch.sigmoid(logit[0] - lse1), logit, k, rstd, scale


def _partial_key(partial_value, partial_key, rank: int):
    pv = partial_value
    return pv[..., pv.shape[-1] - rank :] if partial_key is None else partial_key


@torch.no_grad()
def merge_fwd(out1, lse1, partial_value, partial_key, query, eps: float, emit_norm: bool):
    """Phase 2 (docs/method.md §7): merge a phase-1 read ``(out1, lse1)`` with the partial source.

    Returns ``(h, norm)``: h ``[..., d]`` in partial_value's dtype, norm = RMSNorm(h) in the same
    dtype when ``emit_norm`` else an empty tensor.
    """
    q = query.float().unsqueeze(0)
    pv = partial_value
    w1, w2 = _merge_weights(lse1, _partial_key(pv, partial_key, q.shape[-1]), q, eps)[:2]
    # not lerp(out1, pv, w2) = out1 + w2·(pv - out1): that cancels out1 where w1 << 1
    h = _rows(out1).float() * w1.unsqueeze(-1)
    h = h.addcmul_(_rows(pv), w2.unsqueeze(-1)).to(pv.dtype).view(pv.shape)
    norm = rmsnorm_fp32(h).to(h.dtype) if emit_norm else h.new_empty(0)
    return h, norm


@torch.no_grad()
def merge_bwd(out1, lse1, partial_value, partial_key, query, h, grad_h, grad_norm, eps: float):
    """Backward of :func:`merge_fwd` (``h`` is its saved output). Returns fp32 gradients
    ``(d_out1, d_lse1, d_partial_value, d_partial_key or None, d_query)``."""
    q = query.float().unsqueeze(0)
    rank = q.shape[-1]
    pv = partial_value
    w1, w2, logit, k, rstd, scale = _merge_weights(
        lse1, _partial_key(pv, partial_key, rank), q, eps
    )
    dh = None if grad_h is None else _rows(grad_h).float()  # read-only: no copy when fp32
    if grad_norm is not None and grad_norm.numel() > 0:
        hf, hscale = _prescaled(_rows(h).float())
        hrstd = torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + DEFAULT_EPS * hscale * hscale)
        y, gy = hf * hrstd, _rows(grad_norm).float()
        dnorm = (hscale * hrstd) * (gy - y * (gy * y).mean(-1, keepdim=True))
        dh = dnorm if dh is None else dh + dnorm
    if dh is None:
        dh = torch.zeros(_rows(h).shape, dtype=torch.float32, device=h.device)
    work = torch.empty_like(dh)
    dw1 = torch.mul(dh, _rows(out1), out=work).sum(-1)
    dw2 = torch.mul(dh, _rows(pv), out=work).sum(-1)
    # two-way softmax backward: dℓ = w1·w2·(dw2 - dw1) = -d_lse1
    dlogit = w1 * w2 * (dw2 - dw1)
    d_out1, d_pv = w1.unsqueeze(-1) * dh, w2.unsqueeze(-1) * dh
    if partial_key is None:
        dk = None
        d_q = _add_key_grad(d_pv[:, pv.shape[-1] - rank :], dlogit[None], logit, k, rstd, scale, q)
    else:
        dk = torch.zeros_like(k)
        d_q = _add_key_grad(dk, dlogit[None], logit, k, rstd, scale, q)
        dk = dk.view(partial_key.shape)
    return d_out1.view(pv.shape), (-dlogit).view(lse1.shape), d_pv.view(pv.shape), dk, d_q[0]
