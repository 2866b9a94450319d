"""Properties of the eager reference read (SPEC §2, §7)."""

import pytest
import torch
from hypothesis import given, settings
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


def _close(a, b, tol=1e-5):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


@settings(max_examples=60, deadline=None)
@given(reads(), st.floats(-50, 50))
def test_constant_logit_shift_changes_nothing(read, c):
    values, keys, query = read
    # Shifting every logit by c: append a constant key dim whose query weight is c/scale.
    h = ref.depth_read(values, keys, query)
    logits = ref.depth_logits(keys, query)
    alpha = torch.softmax(logits + c, dim=0)
    h_shift = (alpha.unsqueeze(-1) * torch.stack(values).float()).sum(0)
    _close(h, h_shift)


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
    if len(values) < 2:
        return
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
