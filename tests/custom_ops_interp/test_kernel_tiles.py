"""Every Triton kernel over several token tiles, d tiles and r tiles, under TRITON_INTERPRET=1.

The interpreter's own tiles (``common.blocks``: up to 128 tokens, BLOCK_D = 64) would need
hundreds of tokens per case; ``small_tiles`` swaps ``common.blocks`` for 4-token, 16-column,
4-key-column tiles in these tests only (production tiles are untouched), so 9 tokens make three
token programs (the last one partial), d = 40 three d tiles (the last partial) and r = 6 two key
tiles. The sliced key (the last r columns of the value) then straddles a d-tile edge. Every
launch is recorded and its grid checked, so a case that stops covering several tiles fails.

Each case goes through the public ops with backend="triton" (forward and backward) and compares
outputs and every gradient with the eager reference; fresh buffers are NaN-filled (conftest).
The per-program partial dq sums (read and merge backward) need more than one token program.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from custom_ops.kernels import common
from tests.custom_ops.cases import ReadCase
from tests.custom_ops.test_custom_ops_read import (
    check_block_read,
    check_merge_partial,
)

TILE_T, TILE_D, TILE_R = 4, 16, 4
LEAD, D, R = (3, 3), 40, 6  # 9 tokens: 3 token tiles (1 token in the last); 3 d tiles; 2 key tiles
TOKENS = 9


@pytest.fixture
def small_tiles(monkeypatch):
    """``common.blocks`` -> small tiles; returns the list of launches issued (kernel, grid)."""
    launches = []

    def blocks(n_queries, d, rank, budget=None, gpu=None, beside_acc=False):
        return common.pow2(n_queries), TILE_T, TILE_D, TILE_R, 1

    def launch(self):
        launches.append((self.kernel.fn.__name__, self.grid, self.constexprs))
        self.kernel[self.grid](*self.args, **self.constexprs, num_warps=self.num_warps)

    monkeypatch.setattr(common, "blocks", blocks)
    monkeypatch.setattr(common.Launch, "__call__", launch)
    return launches


def _assert_tiled(launches, kernels, tokens, d, rank):
    """Every kernel in ``kernels`` ran, each over > 1 token, d and key tile."""
    assert {name for name, _, _ in launches} == kernels, launches
    assert tokens > TILE_T and d > TILE_D and rank > TILE_R
    for name, grid, constexprs in launches:
        assert constexprs["BLOCK_T"] == TILE_T and constexprs["BLOCK_D"] == TILE_D, name
        assert grid[0] == -(-tokens // TILE_T), (name, grid)
        if name == "_read_fwd_kernel":  # d tiles are programs; elsewhere a loop inside one
            assert grid[1] == -(-d // TILE_D), (name, grid)


def _case(sliced: bool, dtype: torch.dtype, sources: int, seed: int) -> ReadCase:
    return ReadCase(LEAD, D, R, sources, sliced, dtype, seed)


READ = {"_read_fwd_kernel", "_read_bwd_kernel"}
MERGE = READ | {"_merge_fwd_kernel", "_merge_bwd_kernel"}
IDS = {True: "sliced", False: "projected"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("sliced", [True, False], ids=IDS.get)
def test_read_kernels_with_a_query_bank(small_tiles, sliced, dtype):
    """Phase 1: a bank of 3 queries (BLOCK_C = 4, one padded row) over 4 sources."""
    check_block_read(_case(sliced, dtype, 4, seed=21), 3, backend="triton")
    _assert_tiled(small_tiles, READ, TOKENS, D, R)


@pytest.mark.parametrize(
    "sliced, emit_norm, dtype",
    [
        pytest.param(sliced, norm, dtype, id=f"{IDS[sliced]}-{'h+norm' if norm else 'h'}-{name}")
        for sliced, norm, dtype, name in [
            (True, False, torch.float32, "fp32"),
            (True, True, torch.float32, "fp32"),
            (False, False, torch.float32, "fp32"),
            (False, True, torch.float32, "fp32"),
            (False, True, torch.bfloat16, "bf16"),
            (True, False, torch.float16, "fp16"),
        ]
    ],
)
def test_merge_kernels(small_tiles, sliced, emit_norm, dtype):
    """Phase 1 on 2 sources + phase 2 with the 3rd == the one-pass read, with and without the
    fused RMSNorm: h, norm and every gradient (the query's sums the per-program partials)."""
    check_merge_partial(_case(sliced, dtype, 3, seed=23), emit_norm, backend="triton")
    _assert_tiled(small_tiles, MERGE, TOKENS, D, R)


@settings(
    deadline=None, max_examples=3, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    tokens=st.integers(TILE_T + 1, 3 * TILE_T),
    d=st.integers(TILE_D + 1, 3 * TILE_D),
    rank_frac=st.floats(0, 1),
    sources=st.integers(2, 4),
    sliced=st.booleans(),
    emit_norm=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_tiled_kernels_any_shape(
    small_tiles, tokens, d, rank_frac, sources, sliced, emit_norm, seed
):
    """Hypothesis over token counts, widths and ranks around the small tiles' edges."""
    rank = 1 + round(rank_frac * (d - 1))
    case = ReadCase((tokens,), d, rank, sources, sliced, torch.float32, seed)
    check_merge_partial(case, emit_norm, backend="triton")
    assert {name for name, _, _ in small_tiles} == MERGE
