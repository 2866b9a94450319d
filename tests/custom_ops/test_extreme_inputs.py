"""Extreme inputs through the public ops on the CPU backends, against a float64 oracle
(``tests/custom_ops/extreme.py``): the eager reference, the ``inductor`` read (run eagerly), the
compiled impl (the fused C kernels for fp32, the eager composite for 16-bit) and the eager
composite for fp32 (C kernels off). The
contract is stated in ``custom_ops.api``'s docstring:

- finite inputs: fp32 values from 1e-30 to 1e4, fp16 near its largest value, bf16 from 1e-30
  to 1e30, outputs and every gradient finite and within the bound wherever the oracle's value
  is finite in the result's dtype; bf16 values near its largest (3.4e38): the outputs (h, lse,
  RMSNorm(h)), the gradients' <dh, v> overflowing fp32 there;
- non-finite inputs (NaN / inf in one token's values, keys, out1, lse1 or partial): every other
  token's outputs and per-token gradients are bit for bit those of the clean call.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import custom_ops
from custom_ops import cpu
from tests.custom_ops import extreme
from tests.custom_ops.cases import ReadCase, make_read
from tests.custom_ops.extreme import Extreme, assert_matches, extremes

# name -> (backend, fused C kernels on); 16-bit inputs never reach the C kernels (composite)
BACKENDS = {
    "reference": ("reference", True),
    "inductor": ("inductor", True),
    "C": ("compiled", True),
    "eager": ("compiled", False),
}
TOP16, TOPBF = extreme.max_exponent(torch.float16), extreme.max_exponent(torch.bfloat16)
# id -> (dtype, log10 range of the values, gradients checked). Gradients need <dh, v> (d terms)
# within fp32: bf16 values near 3e38 are checked forward only (h, lse, RMSNorm(h)).
DOMAINS = {
    "fp32": (torch.float32, (-30.0, 4.0), True),
    "fp16-near-max": (torch.float16, (TOP16 - 0.6, TOP16), True),
    "bf16": (torch.bfloat16, (-30.0, 30.0), True),
    "bf16-near-max": (torch.bfloat16, (TOPBF - 0.6, TOPBF), False),
}
CASES = [
    pytest.param(dom, backend, id=f"{dom}-{backend}")
    for dom in DOMAINS
    for backend in BACKENDS
    if DOMAINS[dom][0] == torch.float32 or backend != "eager"
]
SETTINGS = settings(deadline=None, max_examples=25)


def _compare(names, got, want, bounds, n_outputs, kap, with_grads):
    """Each result within its dtype's tolerance of the oracle plus κ times its magnitude (plus
    what flushed weights carry); a gradient also within the outputs' tolerance times its
    magnitude (a 16-bit output rounds the gradient that flows back through it, and
    RMSNorm(h)'s backward sees the rounded h)."""
    mags, lost = bounds
    out_rel = extreme.tolerance(*(o.dtype for o in got[:n_outputs]))
    n = len(got) if with_grads else n_outputs
    for i, (name, a, e) in enumerate(zip(names[:n], got[:n], want[:n])):
        allowance = (kap + (out_rel if i >= n_outputs else 0.0)) * mags[i] + lost[i]
        assert_matches(name, a, e, allowance, extreme.tolerance(a.dtype))


def run_read(case: Extreme, backend: str, c_kernels: bool, n_queries, with_grads=True):
    """The public read (one query or a bank) vs the oracle: out, lse, every gradient."""
    values, keys, query = extreme.make(case, n_queries)
    check_read(values, keys, query, backend, c_kernels, case.seed, with_grads)


def check_read(values, keys, query, backend: str, c_kernels: bool, seed: int, with_grads=True):
    """``run_read`` of given leaves: values ``[T, d]``, keys ``[T, r]`` or None, query ``[r]``
    (``depth_read_lse``) or ``[C, r]`` (``block_read``)."""
    inputs = [*values, *(keys or []), query]
    (tokens, d), r = values[0].shape, query.shape[-1]
    oracle_keys = keys if keys is not None else extreme.sliced_keys(values, r)
    want = extreme.read(values, oracle_keys, query)
    ws = extreme.cotangents(want, seed)
    want_g = extreme.grads(want, ws, inputs)
    *bounds, max_logit = extreme.read_bounds(values, keys, query, ws)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu, "ENABLED", c_kernels)
        if query.dim() == 1:
            got = custom_ops.depth_read_lse(values, keys, query, backend=backend)
        else:
            got = custom_ops.block_read(values, keys, query, backend=backend)
        got_g = extreme.grads(got, ws, inputs)
    names = ["out", "lse", *(f"grad of input {i}" for i in range(len(inputs)))]
    kap = extreme.kappa(max_logit, d + r + 3 * len(values) + tokens)
    _compare(names, [*got, *got_g], [*want, *want_g], bounds, 2, kap, with_grads)


def run_merge(case: Extreme, backend: str, c_kernels: bool, emit_norm: bool, with_grads=True):
    """Phase 2 on its own: out1 / lse1 (fp32) from the oracle's read of sources[:-1], merged with
    the last source; vs the oracle's merge: h, RMSNorm(h), every gradient."""
    values, keys, query = extreme.make(case)
    oracle_keys = keys if keys is not None else extreme.sliced_keys(values, case.r)
    with torch.no_grad():
        o1, l1 = extreme.read(values[:-1], oracle_keys[:-1], query)
    out1, lse1 = o1.float().requires_grad_(), l1.float().requires_grad_()
    pv, pk = values[-1], (None if keys is None else keys[-1])
    check_merge(out1, lse1, pv, pk, query, backend, c_kernels, emit_norm, case.seed, with_grads)


def check_merge(out1, lse1, pv, pk, query, backend, c_kernels, emit_norm, seed, with_grads=True):
    """``run_merge`` of given leaves (``pk`` None: sliced)."""
    (tokens, d), r = pv.shape, query.shape[-1]
    inputs = [out1, lse1, pv, *([] if pk is None else [pk]), query]
    oracle_key = extreme.sliced_keys([pv], r)[0] if pk is None else pk
    want = extreme.merge(out1, lse1, pv, oracle_key, query)[: 1 + emit_norm]
    ws = extreme.cotangents(want, seed)
    want_g = extreme.grads(want, ws, inputs)
    *bounds, max_logit = extreme.merge_bounds(out1, lse1, pv, pk, query, ws, emit_norm)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu, "ENABLED", c_kernels)
        got = custom_ops.merge_partial(
            out1, lse1, pv, pk, query, emit_norm=emit_norm, backend=backend
        )
        got = got if emit_norm else (got,)
        got_g = extreme.grads(got, ws, inputs)
    names = ["h", "RMSNorm(h)"][: len(got)] + [f"grad of input {i}" for i in range(len(inputs))]
    kap = extreme.kappa(max_logit, d + r + tokens)
    _compare(names, [*got, *got_g], [*want, *want_g], bounds, len(got), kap, with_grads)


# The C kernels (fp32 only, whose contract stops at 1e4) keep the policy's logits and norms to
# the largest fp32 value, their key gradients to ~1e18 (rstd² of a larger key underflows fp32).
C_KEY_GRADIENTS_UP_TO = 1e18


def check_norm_policy(backend: str, c_kernels: bool, dtype: torch.dtype, sliced: bool):
    """Each size of ``extreme.policy_sizes`` read by one query and by a bank (lse: with one
    source, the logit) and as a merge's partial key: outputs and every gradient vs the float64
    oracle (sliced keys near the largest values: forward only, <dh, v> overflows fp32 there)."""
    for size in extreme.policy_sizes(dtype):
        grads = not (sliced and size > 1e30)
        if c_kernels and backend == "compiled" and dtype == torch.float32:
            grads = grads and size <= C_KEY_GRADIENTS_UP_TO
        for n_queries in (None, 3):
            values, keys, query = extreme.policy_inputs(dtype, size, sliced, n_queries)
            check_read(values, keys, query, backend, c_kernels, 0, with_grads=grads)
        # the merge's partial key, against an ordinary phase-1 read
        (pv,), keys, query = extreme.policy_inputs(dtype, size, sliced, None)
        g = torch.Generator().manual_seed(1)
        out1 = torch.randn(pv.shape, generator=g).requires_grad_()
        lse1 = torch.randn(pv.shape[:-1], generator=g).requires_grad_()
        pk = None if keys is None else keys[0]
        check_merge(out1, lse1, pv, pk, query, backend, c_kernels, False, 0, with_grads=grads)


# bf16 never reaches the C kernels, so "C" runs the composite there: "eager" (the composite)
# would repeat it
NORM_CASES = [
    pytest.param(backend, dtype, id=f"{backend}-{name}")
    for backend in BACKENDS
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))
    if backend != "eager" or dtype == torch.float32
]


@pytest.mark.parametrize("sliced", [False, True], ids=["projected", "sliced"])
@pytest.mark.parametrize("backend, dtype", NORM_CASES)
def test_norm_policy(backend, dtype, sliced):
    """The RMSNorm overflow policy (``custom_ops.reference.key_rmsnorm``) on every CPU backend:
    key rows from 1e-40 to the dtype's largest value, on both sides of the 2^120 sum of squares
    where the policy rescales."""
    check_norm_policy(*BACKENDS[backend], dtype, sliced)


@pytest.mark.parametrize("domain, backend", CASES)
@SETTINGS
@given(data=st.data())
def test_read_of_extreme_inputs(domain, backend, data):
    dtype, (low, top), with_grads = DOMAINS[domain]
    case = data.draw(extremes(dtype, low, top), label="case")
    n_queries = data.draw(st.sampled_from([None, 3]), label="n_queries")
    run_read(case, *BACKENDS[backend], n_queries, with_grads)


@pytest.mark.parametrize("domain, backend", CASES)
@SETTINGS
@given(data=st.data())
def test_merge_of_extreme_inputs(domain, backend, data):
    dtype, (low, top), with_grads = DOMAINS[domain]
    case = data.draw(extremes(dtype, low, top, min_sources=2), label="case")
    emit_norm = data.draw(st.booleans(), label="emit_norm")
    run_merge(case, *BACKENDS[backend], emit_norm, with_grads)


# r = 1 keys in bf16, three equal queries: the key gradient is a near-cancellation of RMSNorm's
# two terms. Once drawn by hypothesis outside CI: the float64 oracle, casting the key twice,
# rounded each term to bf16 before adding them and wanted 0 where every backend gave ~0.12.
R1_BF16 = Extreme(4, 8, 1, (0.0, 0.0, 2.0), False, torch.bfloat16, 1.0, None, 163)


def test_the_oracle_differentiates_a_16_bit_rmsnorm_in_float64():
    x = torch.tensor([[0.88671875], [-0.0194091796875]], dtype=torch.bfloat16).requires_grad_()
    x64 = x.detach().double().requires_grad_()
    (got,) = torch.autograd.grad(extreme.rmsnorm(x)[0].sum(), x)
    (want,) = torch.autograd.grad(extreme.rmsnorm(x64)[0].sum(), x64)
    assert want[1].item() > 0.01  # ~rstd·eps/(x²+eps) = 0.0163: not a cancellation to 0
    torch.testing.assert_close(got, want.to(torch.bfloat16), rtol=0, atol=0)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_rank_one_bf16_key_gradient(backend):
    run_read(R1_BF16, *BACKENDS[backend], 3, True)


@pytest.mark.parametrize("lead", [20.0, 60.0, 1e4])
@pytest.mark.parametrize("sliced", [True, False], ids=["sliced", "projected"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_merge_with_a_dominating_partial(backend, sliced, lead):
    """The partial's logit leads lse1 by ``lead`` while out1 is 1e6 times larger than it: out1's
    share e^-lead (2e-9, 9e-27, 0) must come from its own exponential, not 1 - w2 = 0 in fp32
    (was: the out1 term of h, and out1's and lse1's gradients, lost where that share is tiny
    but its term is not)."""
    check_dominating_partial(*BACKENDS[backend], sliced, lead)


def check_dominating_partial(backend: str, c_kernels: bool, sliced: bool, lead: float):
    g = torch.Generator().manual_seed(5)
    t, d, r = 6, 33, 8
    pv = (1e-2 * torch.randn(t, d, generator=g)).requires_grad_()
    pk = None if sliced else torch.randn(t, r, generator=g).requires_grad_()
    query = (3 * torch.randn(r, generator=g)).requires_grad_()
    ell = extreme.logits(extreme.sliced_keys([pv], r) if sliced else [pk], query)[0]
    out1 = (1e4 * torch.randn(t, d, generator=g)).requires_grad_()
    lse1 = (ell - lead).float().detach().requires_grad_()
    inputs = [out1, lse1, pv, *([] if sliced else [pk]), query]
    want = extreme.merge(out1, lse1, pv, extreme.sliced_keys([pv], r)[0] if sliced else pk, query)
    ws = extreme.cotangents(want, 5)
    want_g = extreme.grads(want, ws, inputs)
    *bounds, max_logit = extreme.merge_bounds(out1, lse1, pv, pk, query, ws, True)
    got = merge_call(backend, c_kernels, sliced)(inputs)
    got_g = extreme.grads(got, ws, inputs)
    names = ["h", "RMSNorm(h)", *(f"grad of input {i}" for i in range(len(inputs)))]
    kap = extreme.kappa(max_logit, d + r + t)
    _compare(names, [*got, *got_g], [*want, *want_g], bounds, 2, kap, True)


# --------------------------------------------------------------------------- non-finite inputs

POISONS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


def read_call(backend: str, c_kernels: bool, n_values: int, sliced: bool):
    """inputs ``[*values, *keys, queries]`` -> ``[out, lse]`` with tokens first (``block_read``)."""

    def call(inputs):
        values, rest = inputs[:n_values], inputs[n_values:]
        keys, queries = (None, rest[0]) if sliced else (rest[:-1], rest[-1])
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cpu, "ENABLED", c_kernels)
            out, lse = custom_ops.block_read(values, keys, queries, backend=backend)
        return [out.transpose(0, 1), lse.t()]

    return call


def merge_call(backend: str, c_kernels: bool, sliced: bool):
    """inputs ``[out1, lse1, pv, (pk), query]`` -> ``[h, RMSNorm(h)]``."""

    def call(inputs):
        out1, lse1, pv, *rest = inputs
        pk, query = (None, rest[0]) if sliced else rest
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cpu, "ENABLED", c_kernels)
            return list(custom_ops.merge_partial(
                out1, lse1, pv, pk, query, emit_norm=True, backend=backend
            ))  # fmt: skip

    return call


def check_confined(call, inputs, per_token: int, seed: int):
    """Each of NaN, inf, -inf, put into token 1 of each per-token input (``inputs[:per_token]``,
    tokens first; its last column, so a sliced key sees it too): the outputs of every other
    token and the gradients of every per-token input at every other token are exactly those
    of the clean call."""
    clean = call(inputs)
    ws = extreme.cotangents(clean, seed)
    clean_g = extreme.grads(clean, ws, inputs)
    keep = [t for t in range(inputs[0].shape[0]) if t != 1]
    for which in range(per_token):
        for name, poison in POISONS.items():
            bad = [x.detach().clone() for x in inputs]
            target = bad[which][1]
            target[..., -1 if target.dim() else ...] = poison
            bad = [x.requires_grad_() for x in bad]
            got = call(bad)
            got_g = extreme.grads(got, ws, bad)
            where = f"{name} in input {which}"
            pairs = [(f"output {i}", a, b) for i, (a, b) in enumerate(zip(got, clean))]
            pairs += [(f"grad {i}", got_g[i], clean_g[i]) for i in range(per_token)]
            for what, a, b in pairs:
                assert torch.equal(a[keep], b[keep]), f"{where}: {what} changed at other tokens"


CONFINED = [
    pytest.param(backend, dtype, sliced, id=f"{backend}-{str(dtype)[6:]}-{kind}")
    for backend in BACKENDS
    for dtype in (torch.float32, torch.bfloat16)
    for sliced, kind in ((True, "sliced"), (False, "projected"))
    if dtype == torch.float32 or backend != "eager"
]


@pytest.mark.parametrize("backend, dtype, sliced", CONFINED)
def test_non_finite_inputs_stay_in_their_tokens(backend, dtype, sliced):
    case = ReadCase((5,), 12, 4, 3, sliced, dtype, seed=17)
    values, keys, queries = make_read(case, n_queries=2)
    inputs = [*values, *(keys or []), queries]
    call = read_call(*BACKENDS[backend], len(values), sliced)
    check_confined(call, inputs, len(inputs) - 1, seed=17)
    # the merge: out1 / lse1 of the first sources, the last one as the partial
    with torch.no_grad():
        out1, lse1 = custom_ops.block_read(values[:-1], keys and keys[:-1], queries[:1])
    inputs = [out1[0].requires_grad_(), lse1[0].requires_grad_(), values[-1]]
    inputs += ([] if sliced else [keys[-1]]) + [queries[0].detach().requires_grad_()]
    check_confined(merge_call(*BACKENDS[backend], sliced), inputs, len(inputs) - 1, seed=17)
