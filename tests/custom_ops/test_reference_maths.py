"""Properties of the eager reference read (docs/method.md §2, §7)."""

import pytest
import torch
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from custom_ops import reference as ref


@st.composite
def reads(draw, max_sources=9):
    s = draw(st.integers(1, max_sources))
    tokens = draw(st.integers(1, 7))
    d = draw(st.integers(1, 40))
    r = draw(st.integers(1, d))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    values = [torch.randn(tokens, d, generator=g, dtype=torch.float64) for _ in range(s)]
    keys = [torch.randn(tokens, r, generator=g, dtype=torch.float64) * 3 for _ in range(s)]
    query = torch.randn(r, generator=g, dtype=torch.float64)
    return values, keys, query


def _fixed_read(s=4, tokens=3, d=6, r=4):
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(tokens, d, generator=g, dtype=torch.float64) for _ in range(s)]
    keys = [torch.randn(tokens, r, generator=g, dtype=torch.float64) * 3 for _ in range(s)]
    return values, keys, torch.randn(r, generator=g, dtype=torch.float64)


_FIXED_READ = _fixed_read()


def _close(a, b, tol=1e-5):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


def _on_grid(logits: torch.Tensor) -> torch.Tensor:
    """Logits rounded to multiples of 2^-10 in [-31, 31]: then ``ℓ + c`` is exact in fp32 for an
    integer |c| <= 2^12 (13 + 10 bits), so the shifted read must equal the plain one exactly."""
    return torch.round(logits.clamp(-31, 31) * 1024) / 1024


@settings(max_examples=60, deadline=None)
@given(reads(), st.integers(-4096, 4096), st.booleans())
@example(read=_FIXED_READ, c=4096, bank=False)  # e^(ℓ+c) overflows without max-subtraction
@example(read=_FIXED_READ, c=-4096, bank=True)  # ... and underflows to 0/0
def test_constant_logit_shift_changes_nothing(read, c, bank):
    """Adding c to every logit the reference computes (its own ``_logits``, patched) leaves
    h unchanged and moves lse by c: the read's softmax and logsumexp subtract the max. A read
    that exponentiated the raw logits would give inf/inf or 0/0 at |c| = 4096."""
    values, keys, query = read
    if bank:
        query = torch.stack([query, -query, 0.5 * query])
    plain_logits = ref._logits

    def read_shifted(shift: float):
        def logits(*args, **kwargs):
            return [_on_grid(logit) + shift for logit in plain_logits(*args, **kwargs)]

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ref, "_logits", logits)
            return ref.depth_read_with_lse(values, keys, query)

    h, lse = read_shifted(0.0)
    h_shift, lse_shift = read_shifted(float(c))
    assert torch.isfinite(h_shift).all() and torch.isfinite(lse_shift).all()
    _close(h_shift, h, tol=1e-12)
    # lse + c: a few fp32 roundings at the magnitude of |lse| + |c|
    atol = 2**-21 * (abs(c) + lse.abs().max().item())
    torch.testing.assert_close(lse_shift, lse + c, rtol=0, atol=atol)
    # the two-phase merge: shifting both partial reads' lses by c changes nothing
    if len(values) >= 2:
        o1, l1 = ref.depth_read_with_lse(values[:1], keys[:1], query)
        o2, l2 = ref.depth_read_with_lse(values[1:], keys[1:], query)
        l1, l2 = _on_grid(l1), _on_grid(l2)  # exact shifts again
        merged = ref.merge_reads(o1, l1, o2, l2)[0]
        _close(ref.merge_reads(o1, l1 + c, o2, l2 + c)[0], merged, tol=1e-12)


@settings(max_examples=60, deadline=None)
@given(reads())
def test_zero_query_is_mean_of_values(read):
    values, keys, query = read
    h = ref.depth_read(values, keys, torch.zeros_like(query))
    _close(h, torch.stack(values).mean(0))


@settings(max_examples=60, deadline=None)
@given(reads(max_sources=1))
def test_one_source_is_identity(read):
    values, keys, query = read
    _close(ref.depth_read(values, keys, query), values[0])


@settings(max_examples=60, deadline=None)
@given(reads(), st.randoms(use_true_random=False))
def test_permuting_sources_permutes_nothing(read, rnd):
    values, keys, query = read
    perm = list(range(len(values)))
    rnd.shuffle(perm)
    h = ref.depth_read(values, keys, query)
    hp = ref.depth_read([values[i] for i in perm], [keys[i] for i in perm], query)
    _close(h, hp)


@settings(max_examples=40, deadline=None)
@given(reads())
def test_large_logits_stay_finite(read):
    values, keys, query = read
    h, lse = ref.depth_read_with_lse(values, keys, query * 1e30)
    assert torch.isfinite(h).all() and torch.isfinite(lse).all()
    hb = ref.depth_read([v.bfloat16() for v in values], keys, query.float() * 1e4)
    assert torch.isfinite(hb).all() and hb.dtype == torch.bfloat16


@settings(max_examples=80, deadline=None)
@given(reads(max_sources=12), st.data())
def test_two_phase_merge_equals_one_pass_for_any_split(read, data):
    values, keys, query = read
    assume(len(values) >= 2)
    split = data.draw(st.integers(1, len(values) - 1))
    one = ref.depth_read(values, keys, query)
    two = ref.depth_read_two_phase(values, keys, query, split)
    _close(one, two)
    # and the merged LSE is the LSE of the union
    o1, l1 = ref.depth_read_with_lse(values[:split], keys[:split], query)
    o2, l2 = ref.depth_read_with_lse(values[split:], keys[split:], query)
    _, lse = ref.merge_reads(o1, l1, o2, l2)
    _close(lse, ref.depth_read_with_lse(values, keys, query)[1])


def test_averaging_without_lse_is_wrong():
    """Seed 001's pitfall: averaging separately normalised batches is not the read."""
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(4, 8, generator=g) for _ in range(3)]
    keys = [torch.randn(4, 8, generator=g) for _ in range(3)]
    q = torch.randn(8, generator=g) * 3
    naive = (ref.depth_read(values[:1], keys[:1], q) + ref.depth_read(values[1:], keys[1:], q)) / 2
    assert not torch.allclose(naive, ref.depth_read(values, keys, q), atol=1e-3)


@settings(max_examples=40, deadline=None)
@given(reads())
def test_batched_queries_equal_single_queries(read):
    values, keys, _ = read
    bank = torch.randn(3, keys[0].shape[-1], dtype=torch.float64)
    out, lse = ref.depth_read_with_lse(values, keys, bank)
    for c in range(3):
        o, lse_c = ref.depth_read_with_lse(values, keys, bank[c])
        _close(out[c], o)
        _close(lse[c], lse_c)


def test_key_norm_is_fp32_with_default_eps():
    k = torch.zeros(2, 4, dtype=torch.bfloat16)
    out = ref.key_rmsnorm(k)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert ref.DEFAULT_EPS == torch.finfo(torch.float32).eps


def test_output_keeps_value_dtype():
    v = [torch.randn(3, 5, dtype=torch.bfloat16) for _ in range(2)]
    k = [torch.randn(3, 2) for _ in range(2)]
    assert ref.depth_read(v, k, torch.randn(2)).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "values,keys,query,match",
    [
        ([], [], torch.zeros(2), "at least one source"),
        ([torch.zeros(2, 3)], [], torch.zeros(2), "values but"),
        ([torch.zeros(2, 3), torch.zeros(2, 4)], [torch.zeros(2, 2)] * 2, torch.zeros(2), "shape"),
        ([torch.zeros(2, 3)], [torch.zeros(2, 2)], torch.zeros(3), "rank"),
    ],
)
def test_bad_inputs_are_clear_errors(values, keys, query, match):
    with pytest.raises(ValueError, match=match):
        ref.depth_read(values, keys, query)
