"""Extreme inputs for the depth-read ops and a float64 oracle to judge them (shared by the CPU
test and the interpreter test).

Inputs (``extremes``): per-source value (and key) magnitudes 10^e for e in a given range, query
norms from 1e-2 to 1e3, and optionally one source whose key points along the query, the query
lengthened (up to 1e5) until that source leads every other by 1e4 in logit.

The oracle is the maths of docs/method.md §2 / §7 in float64 (no fp32 step: k² cannot overflow),
written independently of ``custom_ops.reference``; its gradients come from float64 autograd. The
allowed error is a forward error bound (``|fl(Σ ab) - Σ ab| <= γ_n Σ |a||b|``): the result dtype's
tolerance relative to the exact value, plus ``κ = 8·(n + 8)·2^-24·(1 + L)`` times the same sums
taken over the ABSOLUTE values of their terms (``read_bounds`` / ``merge_bounds``), where ``L = max
Σ_j |q_j k̄_j|`` bounds the logits: fp32 logits of size L carry an absolute error ~L·2^-24, which
moves every routing weight by that relative amount. So an exactly-cancelling gradient (a single
source, r = 1, a dominating source) may carry fp32 rounding noise, and nothing larger. Two more
allowances: what a weight below fp32's smallest normal carries (fp32 flushes it), and the spacing of
the smallest subnormals.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from custom_ops.reference import DEFAULT_EPS
from tests.custom_ops.tolerances import TOLERANCES

U32 = 2.0**-24  # fp32 unit roundoff
DOMINANCE = 1e4  # logit lead of the dominating source
MAX_QUERY_NORM = 1e5  # the dominant source's lead may need more than the drawn 1e3
TINY = torch.finfo(torch.float32).smallest_normal  # 2^-126


@dataclass(frozen=True)
class Extreme:
    tokens: int
    d: int
    r: int
    exponents: tuple[float, ...]  # per-source log10 of the largest |value| (and |key|)
    sliced: bool
    dtype: torch.dtype
    query_norm: float
    dominant: int | None  # this source's key points along the query, leading by >= DOMINANCE
    seed: int

    def __repr__(self):
        kind = "sliced" if self.sliced else "projected"
        exps = ", ".join(f"{e:.3g}" for e in self.exponents)
        return (
            f"Extreme(T={self.tokens}, d={self.d}, r={self.r}, 10^[{exps}], {kind}, "
            f"{str(self.dtype).removeprefix('torch.')}, |q|={self.query_norm:.3g}, "
            f"dominant={self.dominant}, seed={self.seed})"
        )


def max_exponent(dtype: torch.dtype) -> float:
    """log10 of the dtype's largest finite value."""
    return math.log10(torch.finfo(dtype).max)


@st.composite
def extremes(draw, dtype, low: float, top: float, min_sources: int = 1, max_sources: int = 5):
    """Cases whose per-source largest |value| is 10^e, e in [low, top]."""
    s = draw(st.integers(min_sources, max_sources))
    d = draw(st.sampled_from([8, 33]))
    return Extreme(
        tokens=draw(st.integers(1, 6)),
        d=d,
        r=draw(st.integers(1, d)),
        exponents=tuple(draw(st.floats(low, top)) for _ in range(s)),
        sliced=draw(st.booleans()),
        dtype=dtype,
        query_norm=10 ** draw(st.floats(-2, 3)),
        dominant=draw(st.one_of(st.none(), st.integers(0, s - 1))) if s > 1 else None,
        seed=draw(st.integers(0, 2**16)),
    )


def _scaled(shape, exponent: float, dtype: torch.dtype, g) -> torch.Tensor:
    """Gaussian entries scaled so the largest magnitude is 10^exponent (finite in ``dtype``)."""
    x = torch.randn(*shape, generator=g, dtype=torch.float64)
    x = x / x.abs().max().clamp_min(1e-300) * 10**exponent
    big = torch.finfo(dtype).max
    return x.clamp(-big, big).to(dtype)


def make(case: Extreme, n_queries: int | None = None):
    """``(values, keys or None, query)`` leaves with requires_grad, in ``case.dtype`` (query fp32,
    ``[r]`` or ``[n_queries, r]``)."""
    g = torch.Generator().manual_seed(case.seed)
    t, d, r = case.tokens, case.d, case.r
    values = [_scaled((t, d), e, case.dtype, g) for e in case.exponents]
    keys = None if case.sliced else [_scaled((t, r), e, case.dtype, g) for e in case.exponents]
    q = torch.randn(*((r,) if n_queries is None else (n_queries, r)), generator=g).double()
    q = q / q.norm(dim=-1, keepdim=True) * case.query_norm
    if case.dominant is not None:
        # the dominant source's key along the (first) query: its logit is |q|·√r. The query is
        # then lengthened until that logit leads every other by DOMINANCE.
        i = case.dominant
        q0 = q if q.dim() == 1 else q[0]
        along = ((q0 / q0.norm()).expand(t, r) * 10 ** case.exponents[i]).to(case.dtype)
        if case.sliced:
            values[i] = values[i].clone()
            values[i][:, d - r :] = along
        else:
            keys[i] = along
        ell = logits(keys if keys is not None else sliced_keys(values, r), q0)
        gap = (ell[i] - torch.cat([ell[:i], ell[i + 1 :]]).amax(0)).amin().item()
        if gap > 0:  # at most to |q| = MAX_QUERY_NORM (r = 1 keys may tie: no lead to grow)
            q = q * min(max(1.0, DOMINANCE / gap), MAX_QUERY_NORM / case.query_norm)
    keys = None if keys is None else [k.requires_grad_() for k in keys]
    return [v.requires_grad_() for v in values], keys, q.float().requires_grad_()


def policy_sizes(dtype: torch.dtype, r: int = 4) -> list[float]:
    """Largest |entries| of key rows that span the RMSNorm policy (``custom_ops.reference.
    key_rmsnorm``) in ``dtype``: from 1e-40 to its largest value, with 2^60/√r (rows of r such
    entries have a sum of squares of 2^120, where the policy rescales) just below and above."""
    edge = 2.0**60 / math.sqrt(r)
    sizes = [1e-40, 1e-30, 1e-20, 1e-3, 1.0, 1e10, 1e18, edge * 0.999, edge * 1.001, 1e20, 1e30]
    return sizes + [1e38, torch.finfo(dtype).max]


def policy_inputs(dtype, size: float, sliced: bool, n_queries: int | None, r: int = 4):
    """``(values, keys or None, query)`` of one source, two tokens whose key rows' largest
    |entry| is ``size`` (see ``policy_sizes``): one of r equal entries, one random; values
    (projected keys) ordinary, d = 2r. Leaves with requires_grad."""
    top = torch.finfo(dtype).max
    g = torch.Generator().manual_seed(r)
    x = torch.randn(2, r, generator=g, dtype=torch.float64)
    x[0] = 1.0
    keys = (x / x.abs().amax(-1, keepdim=True) * size).clamp(-top, top).to(dtype)
    d = 2 * r
    values = torch.randn(2, d, generator=g, dtype=torch.float64).to(dtype)
    if sliced:
        values[:, d - r :] = keys
    q = torch.randn(*((r,) if n_queries is None else (n_queries, r)), generator=g).float()
    keys = None if sliced else [keys.requires_grad_()]
    return [values.requires_grad_()], keys, q.requires_grad_()


def sliced_keys(values, r: int):
    return [v[..., v.shape[-1] - r :] for v in values]


def cotangents(outs, seed: int):
    """Fixed random weights for a scalar loss ``Σ <out, w>`` (float64)."""
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in outs]


def grads(outs, ws, inputs):
    loss = sum((o.double() * w).sum() for o, w in zip(outs, ws, strict=True))
    got = torch.autograd.grad(loss, inputs, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(got, inputs, strict=True)]


# --------------------------------------------------------------------------- float64 oracle


def rmsnorm(x: torch.Tensor, eps: float = DEFAULT_EPS):
    """``(x · rstd, rstd)`` in float64. One cast: with two, autograd rounds each path's gradient
    to x's dtype before adding them, and for a 16-bit x whose two paths nearly cancel (r = 1:
    rstd and -x²·rstd³) the oracle's gradient came out 0 in bf16 instead of ~rstd·eps/(x²+eps)."""
    xd = x.double()
    rstd = torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)
    return xd * rstd, rstd


def logits(keys, query):
    """``[S, T]`` for a query ``[r]``, ``[C, S, T]`` for ``[C, r]``, float64."""
    k = torch.stack([rmsnorm(x)[0] for x in keys])
    q = query.double()
    return (k * q).sum(-1) if q.dim() == 1 else torch.einsum("str,cr->cst", k, q)


def read(values, keys, query):
    """``(h, lse)`` of a query or a bank (``h [C, T, d]``), float64."""
    ell = logits(keys, query)
    sdim = 0 if query.dim() == 1 else 1
    alpha = torch.softmax(ell, sdim).unsqueeze(-1)
    v = torch.stack([x.double() for x in values])
    h = (alpha * v).sum(0) if query.dim() == 1 else (alpha * v.unsqueeze(0)).sum(1)
    return h, torch.logsumexp(ell, sdim)


def merge(out1, lse1, partial_value, partial_key, query):
    """Phase 2 (docs/method.md §7), float64: ``(h, RMSNorm(h))``."""
    lead = (logits([partial_key], query)[0] - lse1.double()).unsqueeze(-1)
    # σ(x) as exp(-softplus(-x)): autograd then differentiates it as σ(x)·σ(-x), exact for
    # either share; sigmoid's own backward, σ·(1 - σ), loses a share below 2^-53 (1 - σ = 0)
    w1, w2 = torch.exp(-F.softplus(lead)), torch.exp(-F.softplus(-lead))
    h = w1 * out1.double() + w2 * partial_value.double()
    return h, rmsnorm(h)[0]


# --------------------------------------------------------------------------- error bounds


def _max_logit(keys, queries) -> float:
    """``L = max_c,s,t Σ_j |q_cj k̄_stj|``: a bound on every logit's terms."""
    kbar = torch.stack([rmsnorm(k.detach())[0] for k in keys]).abs()
    return torch.einsum("str,cr->cst", kbar, queries.detach().double().abs()).max().item()


def _key_terms(keys, queries, dlogit):
    """``(|dk| bound [S, T, r], |dq| bound [C, r])`` for ``dlogit [C, S, T]`` magnitudes,
    through the RMSNorm backward ``dk = rstd·(g - k̄·mean(g·k̄))``, ``g = Σ_c dℓ_c q_c``, and
    ``dq_c = Σ dℓ_c k̄``."""
    kbar, rstd = zip(*(rmsnorm(k.detach()) for k in keys))
    kbar, rstd = torch.stack(kbar).abs(), torch.stack(rstd)
    g = torch.einsum("cst,cr->str", dlogit, queries.detach().double().abs())
    dk = rstd * (g + kbar * (g * kbar).mean(-1, keepdim=True))
    return dk, torch.einsum("cst,str->cr", dlogit, kbar)


def _weights(ell, dim: int, max_logit: float):
    """``(weights, lost)`` for the magnitudes. weights: the exact routing weights, each grown by
    the factor e^{2δ} that a logit error δ = 16·2^-24·(1 + L) allows (capped at 1), so a source
    fp32 cannot tell from the leader (logits of 1e5 a few units apart) counts with the weight
    it may get. lost: those weights where they are below fp32's smallest normal 2^-126 (fp32
    flushes them, and with them everything they carry, however large), else 0."""
    delta = 16 * U32 * (1.0 + max_logit)
    w = (torch.softmax(ell, dim) * math.exp(min(2 * delta, 700.0))).clamp(max=1.0)
    return w, torch.where(w < TINY, w, 0.0)


def kappa(max_logit: float, length: int) -> float:
    """fp32 rounding allowed per unit of magnitude: ``γ_n = n·2^-24`` for sums of ``length``
    terms (a few such steps in a row), times the logits' condition ``1 + L``."""
    return 8 * (length + 8) * U32 * (1.0 + max_logit)


def read_bounds(values, keys, query, ws):
    """``(magnitudes, lost, L)``: the magnitudes of every result of a read (``[out, lse,
    *grad values, *grad keys, grad q]``; ``ws`` are the cotangents of (out, lse)), the part of
    them carried by flushed weights (see ``_weights``), and the logit bound L."""
    bank = query.dim() == 2
    q = query if bank else query[None]
    w_out, w_lse = (ws[0], ws[1]) if bank else (ws[0][None], ws[1][None])
    sliced = keys is None
    keys = sliced_keys(values, q.shape[-1]) if sliced else keys
    with torch.no_grad():
        max_logit = _max_logit(keys, q)
        alpha, lost = _weights(logits(keys, q), 1, max_logit)  # [C, S, T]
        v = torch.stack([x.double() for x in values]).abs()  # [S, T, d]
        dh = w_out.abs()
        dalpha = torch.einsum("ctd,std->cst", dh, v)
        big_d = (alpha * dalpha).sum(1, keepdim=True) + w_lse.abs()[:, None]

        def terms(a):
            dk, dq = _key_terms(keys, q, a * (dalpha + big_d))
            h = torch.einsum("cst,std->ctd", a, v)
            dv = torch.einsum("cst,ctd->std", a, dh)
            if sliced:
                dv[..., dv.shape[-1] - q.shape[-1] :] += dk
            lse = torch.full(w_lse.shape, 1.0 + max_logit, dtype=torch.float64)
            outs = [h, lse] if bank else [h[0], lse[0]]
            return [*outs, *dv, *([] if sliced else dk), dq if bank else dq[0]]

        return terms(alpha), terms(lost), max_logit


def merge_bounds(out1, lse1, partial_value, partial_key, query, ws, emit_norm: bool):
    """``(magnitudes, lost, L)`` of ``[h, (norm), grad out1, grad lse1, grad pv, (grad pk),
    grad q]`` as ``read_bounds``; L: the partial's logit bound, or |lse1|."""
    sliced = partial_key is None
    pk = sliced_keys([partial_value], query.shape[-1])[0] if sliced else partial_key
    with torch.no_grad():
        max_logit = max(_max_logit([pk], query[None]), lse1.detach().abs().max().item())
        ell = logits([pk], query)[0]
        w, lost = _weights(torch.stack([lse1.double(), ell]), 0, max_logit)
        o1, pv = out1.double().abs(), partial_value.double().abs()
        dh = ws[0].abs()
        y = None
        if emit_norm:  # RMSNorm backward: hr·(gy - y·mean(gy·y))
            y, hr = rmsnorm(merge(out1, lse1, partial_value, pk, query)[0])
            gy, y = ws[1].abs(), y.abs()
            dh = dh + hr * (gy + y * (gy * y).mean(-1, keepdim=True))
        both = w[0] * w[1]  # dℓ's weight, lost if either share is flushed
        both_lost = torch.where((lost[0] > 0) | (lost[1] > 0), both, 0.0)

        def terms(w1, w2, ww, norm):
            w1, w2 = w1.unsqueeze(-1), w2.unsqueeze(-1)
            dlogit = ww * ((dh * o1).sum(-1) + (dh * pv).sum(-1))
            dk, dq = _key_terms([pk], query[None], dlogit[None, None])
            d_pv = w2 * dh
            if sliced:
                d_pv[..., d_pv.shape[-1] - query.shape[-1] :] += dk[0]
            outs = [w1 * o1 + w2 * pv] + ([norm] if emit_norm else [])
            return [*outs, w1 * dh, dlogit, d_pv, *([] if sliced else [dk[0]]), dq[0]]

        mags = terms(w[0], w[1], both, y)
        lost = terms(lost[0], lost[1], both_lost, None if y is None else torch.zeros_like(y))
        return mags, lost, max_logit


def _subnormal(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps


# Absolute resolution at the bottom of the range: fp32 intermediates (a product of two weights,
# a gradient of 1e-40) lose their bits below fp32's smallest normal 1.2e-38, and the result's
# dtype rounds to its own subnormal spacing.
FLOOR32 = 64 * torch.finfo(torch.float32).smallest_normal


def assert_matches(name: str, actual, expected, allowance, dtype_rel: float):
    """Where ``expected`` is finite in ``actual``'s dtype: ``actual`` is finite there, and
    ``||actual - expected|| <= dtype_rel·||expected|| + ||allowance|| + floor·√n`` over those n
    entries, ``floor = FLOOR32 +`` the result dtype's subnormal spacing; ``allowance`` is the
    rounding allowed elementwise (κ·magnitude + what flushed weights carry)."""
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} vs {expected.shape}"
    a, e = actual.detach().double(), expected.detach().double()
    ok = torch.isfinite(e.to(actual.dtype))
    bad = ok & ~torch.isfinite(a)
    assert not bad.any(), f"{name}: {int(bad.sum())} non-finite where the oracle is finite"
    a, e, m = a[ok], e[ok], allowance.double().expand(ok.shape)[ok]
    diff = (a - e).norm().item()
    floor = FLOOR32 + _subnormal(actual.dtype)
    bound = dtype_rel * e.norm().item() + m.norm().item() + floor * e.numel() ** 0.5
    assert diff <= bound, (
        f"{name}: ||diff|| {diff:.3g} > {bound:.3g} (||expected|| {e.norm().item():.3g}, "
        f"||allowance|| {m.norm().item():.3g})"
    )


def tolerance(*dtypes: torch.dtype) -> float:
    """The relative tolerance of the least precise of ``dtypes``."""
    return max(TOLERANCES[dt][0] for dt in dtypes)
