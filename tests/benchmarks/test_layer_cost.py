"""``benchmarks.layer_cost``: every variant timed in each round, a failing one recorded."""

from __future__ import annotations

import pytest
import torch

from benchmarks import layer_cost, overhead

SHAPE = overhead.Shape(layers=4, dim=32, seq=8, heads=2, vocab=64, hidden=64)


@pytest.mark.usefixtures("fresh_dynamo")
def test_rounds_time_every_variant_and_a_failure_is_recorded():
    result = layer_cost.measure(SHAPE, ["torchtitan", "sliced2_r8", "bogus"], index=2,
                                rounds=2, calls=1, warmup=1, backend="eager")  # fmt: skip
    for name in ("torchtitan", "sliced2_r8"):
        row = result[name]
        assert len(row["fwd_us"]) == len(row["fwd_bwd_us"]) == len(row["fwd_unguarded_us"]) == 2
        assert row["median_fwd_bwd_us"] > 0 and row["median_fwd_unguarded_us"] > 0
        assert row["guards_us"] == row["median_fwd_us"] - row["median_fwd_unguarded_us"]
    assert "LayerPlan(index=2" in result["sliced2_r8"]["plan"]
    assert result["bogus"]["error"].startswith("ValueError: unknown variant 'bogus'")
    table = layer_cost.table(result)
    assert "| torchtitan | " in table and "1.00x" in table and "| bogus | - |" in table
    assert table.splitlines()[0].endswith("| guards us |")


def test_the_routed_layer_gets_what_the_model_gives_it():
    """The layer's inputs are the stream the earlier layers make: its final read, at the last
    layer, is the model's own last hidden state."""
    call, plan = layer_cost.layer_call("sliced2_r8", SHAPE, 3, backend="eager")
    assert plan.last
    model = overhead.build("sliced2_r8", SHAPE, "cpu", torch.float32, compile_=False)
    tokens = torch.randint(
        0, SHAPE.vocab, (1, SHAPE.seq), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        want = model.run_layers(model.start(model.tok_embeddings(tokens)))[0]
    assert torch.equal(call.outputs()[0].detach(), want)
