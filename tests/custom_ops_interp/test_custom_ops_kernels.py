"""The Triton kernels (forward and backward, through the ops with backend="triton") against the
eager reference, on CPU tensors under TRITON_INTERPRET=1 (see conftest.py).

The interpreter costs ~1-2 ms per program instance, so shapes are small and tiles large; the
interpreter block sizes keep BLOCK_D = 64 so widths above 64 exercise the loop over d tiles.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from custom_ops.kernels import common
from tests.custom_ops.cases import ReadCase, read_cases
from tests.custom_ops.test_custom_ops_read import (
    check_block_read,
    check_depth_read,
    check_merge_partial,
)

# bf16 tl.dot is wrong in the interpreter; these kernels use no tl.dot, so every dtype is valid.
WIDTHS = (1, 33, 100, 130)


def test_interpreter_is_on():
    assert common.INTERPRET, "TRITON_INTERPRET=1 must be set before custom_ops.kernels loads"


@settings(deadline=None, max_examples=12)
@given(read_cases(max_sources=9, widths=WIDTHS, max_tokens=40))
def test_depth_read_kernels(case):
    check_depth_read(case, backend="triton")


@settings(deadline=None, max_examples=8)
@given(read_cases(max_sources=6, widths=WIDTHS, max_tokens=40), st.integers(1, 5))
def test_block_read_kernels(case, n_queries):
    check_block_read(case, n_queries, backend="triton")


@settings(deadline=None, max_examples=8)
@given(
    read_cases(max_sources=6, widths=WIDTHS, max_tokens=40).filter(lambda c: c.sources >= 2),
    st.booleans(),
)
def test_merge_partial_kernels(case, emit_norm):
    check_merge_partial(case, emit_norm, backend="triton")


@pytest.mark.parametrize("sliced", [True, False])
def test_65_sources_kernels(sliced):
    """Past the 64-source bucket (Full AttnRes at L = 24 reads up to 49): the 128-entry tuples.
    The interpreter runs the whole select chain per pick, so 129 sources cost 4x as much."""
    check_depth_read(ReadCase((3,), 9, 4, 65, sliced, torch.bfloat16, seed=5), backend="triton")


def test_many_token_blocks_and_d_tiles():
    """More than one program along tokens (BLOCK_T) and along d (BLOCK_D) in the forward."""
    check_depth_read(ReadCase((300,), 200, 150, 4, True, torch.float32, seed=9), backend="triton")
    check_block_read(ReadCase((150,), 130, 20, 3, False, torch.float16, seed=8), 3, "triton")
