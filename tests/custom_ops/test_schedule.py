"""Schedule properties (docs/method.md §3) over random L and N."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from custom_ops.schedule import (
    block_ends,
    check_schedule,
    schedule_ends,
    site_sources,
    source_counts,
)

layers = st.integers(1, 40)


@st.composite
def layers_and_blocks(draw):
    n_layers = draw(layers)
    return n_layers, draw(st.integers(1, 2 * n_layers))


@settings(max_examples=200, deadline=None)
@given(layers_and_blocks())
def test_block_ends_increasing_and_last_is_m(lb):
    n_layers, n = lb
    m = 2 * n_layers
    ends = block_ends(m, n)
    assert len(ends) == n
    assert all(a < b for a, b in zip(ends, ends[1:]))
    assert ends[-1] == m
    assert ends == [math.ceil(m * i / n) for i in range(1, n + 1)]


@settings(max_examples=200, deadline=None)
@given(layers_and_blocks())
def test_source_counts_match_source_sets(lb):
    n_layers, n = lb
    m = 2 * n_layers
    counts = source_counts(n_layers, n)
    assert counts == [len(site_sources(t, m, n)) for t in range(1, m + 1)]
    ends = set(block_ends(m, n))
    for t, c in zip(range(1, m + 1), counts):
        completed = sum(1 for e in ends if e <= t)
        assert c == 1 + completed + (t not in ends)
    assert counts[-1] == n + 1  # the final read sees e and every block, no partial


@settings(max_examples=100, deadline=None)
@given(layers)
def test_full_closed_form(n_layers):
    assert sum(source_counts(n_layers, None)) == n_layers * (2 * n_layers + 3)
    assert source_counts(n_layers, None) == source_counts(n_layers, 2 * n_layers)


@settings(max_examples=200, deadline=None)
@given(layers_and_blocks())
def test_block_closed_form_when_n_divides_2l(lb):
    n_layers, n = lb
    if (2 * n_layers) % n == 0:
        assert sum(source_counts(n_layers, n)) == n_layers * (n + 3)


def test_spec_worked_example_l24_n8():
    m = 48
    names = lambda t: [
        k[0][0] + (str(k[1]) if k[0] != "embedding" else "") for k in site_sources(t, m, 8)
    ]
    assert names(0) == ["e"]
    assert all(names(t) == ["e", "p1"] for t in range(1, 6))
    assert names(6) == ["e", "b1"]
    assert all(names(t) == ["e", "b1", "p2"] for t in range(7, 12))
    assert names(12) == ["e", "b1", "b2"]
    assert names(48) == ["e"] + [f"b{i}" for i in range(1, 9)]


def test_block_boundary_inside_a_layer_l24_n16():
    ends = block_ends(48, 16)
    assert 3 in ends  # between layer 2's attention (j=3) and its MLP (j=4)


def test_bad_arguments():
    import pytest

    with pytest.raises(ValueError, match="num_blocks"):
        block_ends(8, 9)
    with pytest.raises(ValueError, match="num_blocks"):
        block_ends(8, 0)
    with pytest.raises(ValueError, match="read site"):
        site_sources(9, 8, 2)


def test_check_schedule_names_the_field_and_its_range():
    """The one check of a schedule's fields: the ops' names by default, the caller's on request
    (the model config's ``blocks``); an explicit None count given with a size is refused."""
    import pytest

    check_schedule(8)  # Full
    check_schedule(8, 8)
    check_schedule(8, None, 4)
    for bad in (0, 9, 2.0):
        with pytest.raises(
            ValueError, match=r"^num_blocks must be None \(Full\) or an int in \[1, 8\]"
        ):
            check_schedule(8, bad)
    with pytest.raises(ValueError, match=r"^blocks must be None \(Full\) or an int in \[1, 8\]"):
        check_schedule(8, 9, count_field="blocks")
    for bad in (0, 5, 1.5):
        with pytest.raises(ValueError, match=r"^block_layers must be an int in \[1, 4\] \(= L\)"):
            check_schedule(8, None, bad)
    with pytest.raises(ValueError, match=r"give blocks \(a count, got 2\) or block_layers"):
        check_schedule(8, 2, 1)
    with pytest.raises(ValueError, match=r"got None\) or block_layers .* not both"):
        check_schedule(8, None, 1, count_given=True)
    with pytest.raises(ValueError, match="num_sublayers must be 2L"):
        check_schedule(7, None, 1)
    assert block_ends(6, None) == schedule_ends(6) == [1, 2, 3, 4, 5, 6]  # None = Full
