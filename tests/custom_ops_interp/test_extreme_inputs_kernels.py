"""The Triton kernels (backend="triton", under TRITON_INTERPRET=1) on extreme inputs, against the
float64 oracle: the same domains, bounds and non-finite contract as the CPU backends in
``tests/custom_ops/test_extreme_inputs.py``, with fewer examples (the interpreter is slow)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import custom_ops
from tests.custom_ops.cases import ReadCase, make_read
from tests.custom_ops.extreme import Extreme, extremes
from tests.custom_ops.test_extreme_inputs import (
    DOMAINS,
    check_confined,
    check_dominating_partial,
    check_norm_policy,
    merge_call,
    read_call,
    run_merge,
    run_read,
)

TRITON = ("triton", True)
SETTINGS = settings(deadline=None, max_examples=6)
# the interpreter's numpy reports the overflows these inputs are made of (a key's plain Σk² is
# meant to overflow; inf and NaN inputs propagate), none of which reaches a checked result
pytestmark = pytest.mark.filterwarnings(
    "ignore:(overflow|invalid value) encountered:RuntimeWarning"
)


@pytest.mark.parametrize("domain", list(DOMAINS))
@SETTINGS
@given(data=st.data())
def test_read_kernels_on_extreme_inputs(domain, data):
    dtype, (low, top), with_grads = DOMAINS[domain]
    case = data.draw(extremes(dtype, low, top), label="case")
    n_queries = data.draw(st.sampled_from([None, 3]), label="n_queries")
    run_read(case, *TRITON, n_queries, with_grads)


@pytest.mark.parametrize("domain", list(DOMAINS))
@SETTINGS
@given(data=st.data())
def test_merge_kernels_on_extreme_inputs(domain, data):
    dtype, (low, top), with_grads = DOMAINS[domain]
    case = data.draw(extremes(dtype, low, top, min_sources=2), label="case")
    run_merge(case, *TRITON, data.draw(st.booleans(), label="emit_norm"), with_grads)


# Drawn by hypothesis outside CI: the merge backward took the lse1 / logit gradients as
# w·(dw - D), which is w1·w2·(dw1 - dw2) only while w1 + w2 == 1 and lost a small share's
# gradient (fp32: a 1e-33 partial-key gradient came out 0; bf16: an lse1 gradient 30x off).
SMALL_SHARE = {
    "fp32": Extreme(3, 8, 2, (0.0, 0.0, 0.0), False, torch.float32, 100.0, None, 0),
    "bf16": Extreme(2, 8, 3, (0.0, 0.0), False, torch.bfloat16, 10.0, None, 1),
}


@pytest.mark.parametrize("dtype", list(SMALL_SHARE))
def test_merge_gradients_of_a_small_share(dtype):
    run_merge(SMALL_SHARE[dtype], *TRITON, False, True)


@pytest.mark.parametrize("sliced", [True, False], ids=["sliced", "projected"])
def test_bf16_at_its_largest_values(sliced):
    """Every value and key within a factor 2 of bf16's largest (3.4e38), one source leading:
    the key norms' squares and the forward's weighted sum would overflow fp32 without the
    kernels' scaling."""
    top = DOMAINS["bf16-near-max"][1][1]
    case = Extreme(5, 33, 8, (top, top - 0.2, top - 0.3), sliced, torch.bfloat16, 3.0, 0, 7)
    run_read(case, *TRITON, 3, with_grads=False)
    run_merge(case, *TRITON, True, with_grads=False)


@pytest.mark.parametrize("sliced", [True, False], ids=["sliced", "projected"])
@pytest.mark.parametrize("lead", [20.0, 1e4])
def test_merge_kernels_with_a_dominating_partial(sliced, lead):
    check_dominating_partial(*TRITON, sliced, lead)


@pytest.mark.parametrize("sliced", [True, False], ids=["sliced", "projected"])
def test_non_finite_inputs_stay_in_their_tokens(sliced):
    """NaN / inf in one token's values, keys, out1, lse1 or partial: every other token's outputs
    and per-token gradients are bit for bit those of the clean call (the query gradient, a sum
    over tokens, is not checked)."""
    case = ReadCase((5,), 12, 4, 3, sliced, torch.float32, seed=17)
    values, keys, queries = make_read(case, n_queries=2)
    inputs = [*values, *(keys or []), queries]
    check_confined(read_call(*TRITON, len(values), sliced), inputs, len(inputs) - 1, seed=17)
    with torch.no_grad():
        out1, lse1 = custom_ops.block_read(
            values[:-1], keys and keys[:-1], queries[:1], backend="triton"
        )
    inputs = [out1[0].requires_grad_(), lse1[0].requires_grad_(), values[-1]]
    inputs += ([] if sliced else [keys[-1]]) + [queries[0].detach().requires_grad_()]
    check_confined(merge_call(*TRITON, sliced), inputs, len(inputs) - 1, seed=17)


@pytest.mark.parametrize("sliced", [False, True], ids=["projected", "sliced"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernels_follow_the_norm_policy(dtype, sliced):
    """``test_extreme_inputs.test_norm_policy`` for the Triton kernels."""
    check_norm_policy(*TRITON, dtype, sliced)
