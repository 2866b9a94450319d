"""docs/method.md §5: the paper's added-FLOPs table to 6 decimals, and the closed forms."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from titan_lrattnres.model.flops import added_flops_percent, core_flops, routing_flops

PAPER = dict(num_layers=24, dim=1024, hidden=2816)


def test_core():
    assert core_flops(24, 1024, 2816) == 616_562_688


@pytest.mark.parametrize(
    "variant,rank,blocks,expected",
    [
        ("attnres", None, None, 0.813138),
        ("sliced", 64, 8, 0.093172),
        ("projected", 32, 8, 1.057694),
        ("baseline", None, None, 0.0),
    ],
)
def test_spec_check_values(variant, rank, blocks, expected):
    assert round(added_flops_percent(variant, rank=rank, blocks=blocks, **PAPER), 6) == expected


def test_paper_table_standard_block8():
    # docs/method.md §6 table: Standard Block N=8 adds 0.175 %.
    assert round(added_flops_percent("attnres", blocks=8, **PAPER), 3) == 0.175


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 30), st.integers(1, 512), st.integers(1, 64), st.data())
def test_closed_forms(n_layers, dim, rank, data):
    rank = min(rank, dim)
    n = data.draw(st.sampled_from([b for b in range(1, 2 * n_layers + 1) if 2 * n_layers % b == 0]))
    assert routing_flops("sliced", n_layers, dim, 7, rank, None) == 2 * (dim + rank) * n_layers * (
        2 * n_layers + 3
    )
    assert routing_flops("sliced", n_layers, dim, 7, rank, n) == 2 * (dim + rank) * n_layers * (
        n + 3
    )


def test_unknown_variant():
    with pytest.raises(ValueError, match="variant"):
        added_flops_percent("nope", **PAPER)
