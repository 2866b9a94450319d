"""The depth read as aten ops with a hand-written backward, for the caller's compiled graph.

``inductor`` backend (``custom_ops.api``): where the registered ``lrattnres::`` ops are one
opaque call each, this read is traced into the graph of whatever calls it (the model's layer),
and Inductor generates and fuses its kernels with the layer's own. The sources are stacked
(one ``[S, tokens, d]`` operand), so the graph and its kernels are the same size for any
number of sources: the norms and logits of every site in one pass, the mix in another, the
same in the backward. The backward is written out (:class:`Read`), so autograd keeps the
inputs and the log-sum-exp, not a normalised key or a weight per source; what the compiled
graph keeps for its backward beyond that is Inductor's choice (small per-token statistics).

One function covers phase 1 and the merges (docs/method.md §7): a read of C sites over S keyed
sources, optionally with one more source per site whose logit is given, the phase-1 result
``(out1, lse1)`` merged with what came since. Same maths as ``custom_ops.reference``, the
norms' overflow policy included (``reference.key_rmsnorm``). Accumulates in fp32 (float64 for
float64 queries).
"""

from __future__ import annotations

import torch

from custom_ops.reference import NORM_DOWN, NORM_HUGE_SUMSQ, _eps


def _acc(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _unpack(queries, sliced, given, tensors, backward: bool = False):
    """``tensors`` = ``[out1, lse1,] values..., [keys...]`` as ``(given, values, keys, V, K)``:
    the sources stacked, ``V [S, n, d]`` and their keys ``K [S, n, r]`` (sliced: V's last r
    dims), in the accumulation dtype.

    The backward stacks with ``cat``, the forward with ``stack``: the same values, but not the
    same graph node, so the compiled graph's common-subexpression pass does not merge them and
    the backward stacks again from the sources it keeps anyway, instead of keeping the forward's
    ``[S, n, d]`` copy (S more activations a layer)."""
    acc, r = _acc(queries), queries.shape[-1]
    rest = tensors[2:] if given else tensors
    s = len(rest) if sliced else len(rest) // 2
    values, keys = rest[:s], rest[s:]
    d = values[0].shape[-1]

    def stack(xs, w):
        if backward:
            return torch.cat([x.reshape(1, -1, w) for x in xs]).to(acc)
        return torch.stack([x.reshape(-1, w) for x in xs]).to(acc)

    v = stack(values, d)
    k = v[..., d - r :] if sliced else stack(keys, r)
    return tensors[:2] if given else (), values, keys, v, k


def _logits(k, queries, eps: float):
    """``(ℓ [S, C, n], k·scale [S, n, r], rstd [S, n], scale [S, n])`` of raw keys ``k``: the
    scale is ``NORM_DOWN`` for a row whose sum of squares reaches ``NORM_HUGE_SUMSQ``, else 1
    (exact), and RMSNorm(key) = k·scale·rstd (such a row takes no eps)."""
    big = (k * k).sum(-1) >= NORM_HUGE_SUMSQ
    scale = torch.where(big, NORM_DOWN, 1.0).to(k.dtype)
    k = k * scale.unsqueeze(-1)
    rstd = torch.rsqrt((k * k).mean(-1) + torch.where(big, 0.0, eps).to(k.dtype))
    q = queries.to(k.dtype)
    dots = (k.unsqueeze(1) * q[None, :, None, :]).sum(-1)  # [S, C, n]: no matmul
    return dots * rstd.unsqueeze(1), k, rstd, scale


def _all_logits(given, logits):
    """The given source's logit (phase 1's lse) first, then the keyed sources'."""
    if not given:
        return logits
    lse1 = given[1].reshape(1, logits.shape[1], -1).to(logits.dtype)
    return torch.cat([lse1, logits])


class Read(torch.autograd.Function):
    """``Read.apply(queries [C, r], eps, sliced, given, *tensors)`` -> ``(out [C, ..., d],
    lse [C, ...])`` in the accumulation dtype. ``tensors``: ``out1 [C, ..., d], lse1 [C, ...]``
    first when ``given``, then the S values ``[..., d]``, then (unless ``sliced``: the values'
    last r dims) their S raw keys ``[..., r]``. The sources are stacked, so the graph is the
    same size for every S."""

    @staticmethod
    def forward(ctx, *args):
        # one varargs parameter: dynamo traces a Function under no_grad without its ctx when
        # ``forward``'s parameter count equals apply's argument count, which a signature
        # ``(ctx, queries, eps, sliced, given, *tensors)`` meets for exactly two tensors
        queries, eps, sliced, given, *tensors = args
        given_t, values, _, v, k = _unpack(queries, sliced, given, tensors)
        logits = _all_logits(given_t, _logits(k, queries, eps)[0])
        lse = torch.logsumexp(logits, 0)  # [C, n]
        alpha = torch.exp(logits - lse)
        c, d = queries.shape[0], v.shape[-1]
        out = (alpha[-v.shape[0] :].unsqueeze(-1) * v.unsqueeze(1)).sum(0)  # [C, n, d]
        if given:
            out = out + alpha[0].unsqueeze(-1) * given_t[0].reshape(c, -1, d).to(out.dtype)
        ctx.save_for_backward(queries, lse, *tensors)
        ctx.eps, ctx.sliced, ctx.given = eps, sliced, given
        lead = values[0].shape[:-1]
        return out.view(c, *lead, d), lse.view(c, *lead)

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        queries, lse, *tensors = ctx.saved_tensors
        given_t, values, keys, v, k = _unpack(queries, ctx.sliced, ctx.given, tensors, True)
        logit, k, rstd, scale = _logits(k, queries, ctx.eps)
        (c, r), (n, d) = queries.shape, v.shape[1:]
        logits = _all_logits(given_t, logit)
        alpha = torch.exp(logits - lse)
        # e^{ℓ-lse} sums to 1 only up to rounding, and dα - Σα·dα amplifies that error for a
        # dominant source: renormalised, the gradients are as exact as the eager softmax's.
        alpha = alpha / alpha.sum(0)
        dh = grad_out.reshape(c, n, d).to(v.dtype)
        dalpha = (dh.unsqueeze(0) * v.unsqueeze(1)).sum(-1)  # [S, C, n]
        grads = []
        if ctx.given:
            out1, lse1 = given_t
            dalpha = torch.cat([(dh * out1.reshape(c, n, d).to(dh.dtype)).sum(-1)[None], dalpha])
        # softmax backward α_s (dα_s - Σ_t α_t dα_t), except for each token's top source: there
        # α rounds to 1 and the difference cancels, so it takes minus the others' sum (the
        # terms sum to 0), as the two-way merge's σ(a)σ(b)(db - da) does
        dlogit = alpha * (dalpha - (alpha * dalpha).sum(0))
        top = (
            logits.argmax(0, keepdim=True)
            == torch.arange(len(logits), device=lse.device)[:, None, None]
        )
        dlogit = torch.where(top, -dlogit.masked_fill(top, 0).sum(0), dlogit)
        dlogit = dlogit + alpha * grad_lse.reshape(c, n).to(v.dtype)
        if ctx.given:
            d_out1 = (alpha[0].unsqueeze(-1) * dh).view(out1.shape).to(out1.dtype)
            grads += [d_out1, dlogit[0].view(lse1.shape).to(lse1.dtype)]
            alpha, dlogit = alpha[1:], dlogit[1:]
        dv = (alpha.unsqueeze(-1) * dh.unsqueeze(0)).sum(1)  # [S, n, d]
        # RMSNorm backward (docs/method.md §2): dk = scale·(rstd·dℓᵀq - k̄·g), k̄ = k·rstd,
        # g = rstd·Σ_c dℓ_c ℓ_c / r; k̄·g, not k·rstd²: rstd² underflows for huge keys
        scaled = dlogit * rstd.unsqueeze(1)  # [S, C, n]
        q = queries.to(v.dtype)
        dk = (scaled.unsqueeze(-1) * q[None, :, None, :]).sum(1) * scale.unsqueeze(-1)
        g = (dlogit * logit).sum(1) * rstd / r * scale  # [S, n]
        dk = dk - (k * rstd.unsqueeze(-1)) * g.unsqueeze(-1)
        d_q = (scaled.unsqueeze(-1) * k.unsqueeze(1)).sum((0, 2))  # [C, r]
        if ctx.sliced:
            dv = dv + dk if r == d else torch.cat([dv[..., : d - r], dv[..., d - r :] + dk], -1)
            d_keys = []
        else:
            d_keys = [g_.view(x.shape).to(x.dtype) for g_, x in zip(dk.unbind(0), keys)]
        d_values = [g_.view(x.shape).to(x.dtype) for g_, x in zip(dv.unbind(0), values)]
        return (d_q.to(queries.dtype), None, None, None, *grads, *d_values, *d_keys)


def block_read(values, keys, queries, eps=None):
    """Phase 1: ``(out [C, ..., d], lse [C, ...])`` of ``queries [C, r]`` against the sources
    (``keys`` None: sliced), fp32."""
    sliced = keys is None
    return Read.apply(queries, _eps(eps), sliced, False, *values, *(() if sliced else keys))


def merge_read(out1, lse1, extras, extra_keys, query, eps=None):
    """One site's read: phase 1 ``(out1 [..., d], lse1 [...])`` merged with the sources
    ``extras`` (keys ``extra_keys``, None: sliced) for ``query [r]``: ``(h, lse)``, fp32."""
    sliced = extra_keys is None
    keys = () if sliced else extra_keys
    out, lse = Read.apply(query[None], _eps(eps), sliced, True, out1[None], lse1[None],
                          *extras, *keys)  # fmt: skip
    return out[0], lse[0]
