"""``benchmarks.ops``: a one-site read and a bank's phase-1 read, checked and timed on CPU."""

from __future__ import annotations

import pytest
import torch

from benchmarks import ops


@pytest.mark.parametrize("queries", [1, 4])
def test_rows_time_the_read_of_their_shape(queries):
    """c = 1 times ``depth_read`` (out in the values' dtype), c > 1 ``block_read`` (fp32 out):
    both agree with the reference, and the bytes behind each bandwidth are the minimal model's."""
    tokens, d, sources = 16, 24, 3
    rows = ops.bench_shape(
        tokens, d, 8, sources, True, torch.bfloat16, "cpu", ["reference", "compiled"], 1, queries
    )
    assert [(r["backend"], r["c"]) for r in rows] == [("reference", queries), ("compiled", queries)]
    out_size = 2 if queries == 1 else 4
    fwd_bytes = (sources * 2 + queries * out_size) * d * tokens
    for row in rows:
        assert row["max_rel_err"] <= ops.TOL[torch.bfloat16], row
        assert row["fwd_gbps"] * row["fwd_ms"] * 1e6 == pytest.approx(fwd_bytes), row
