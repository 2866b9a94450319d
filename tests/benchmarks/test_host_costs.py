"""``benchmarks.host_costs``: a step's top-level host events per variant, beside torchtitan's
decoder's: the compiled calls are one per layer in every variant, the plain residual's step is
torchtitan's event for event, a routed step adds its queries' gradient accumulation; the tables
and the JSON show each."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import host_costs
from benchmarks.overhead import Shape

SHAPE = Shape(layers=2, dim=32, seq=8, heads=2, vocab=64, hidden=64)
REGION = "Torch-Compiled Region: *"


@pytest.fixture(scope="module")
def result():
    torch._dynamo.reset()
    try:
        variants = ["torchtitan", "baseline", "sliced2_r8"]
        yield host_costs.measure(SHAPE, variants, steps=2, warmup=2, backend="aot_eager",
                                 guard_pairs=3, progress=lambda _: None)  # fmt: skip
    finally:
        torch._dynamo.reset()


def test_event_names_leave_out_compile_ids_and_hashes():
    assert host_costs.event_name("Torch-Compiled Region: 3/0") == REGION
    assert host_costs.event_name("## Call CompiledFxGraph fdhnzks ##") == (
        "## Call CompiledFxGraph * ##"
    )
    assert host_costs.event_name("aten::mm") == "aten::mm"


def test_every_variant_calls_one_compiled_unit_per_layer(result):
    for name, row in result.items():
        assert row["events"][REGION]["count"] == SHAPE.layers, name
        backward = row["events"]["autograd::engine::evaluate_function: CompiledFunctionBackward"]
        assert backward["count"] == SHAPE.layers, name
        assert row["top_level_per_step"] == sum(e["count"] for e in row["events"].values())
        assert 0 < row["top_level_us"] and row["outside_us"] >= 0


def test_guard_cost_is_the_difference_of_steps_checked_and_skipped(result):
    for row in result.values():
        assert row["guarded_step_us"] > 0 and row["unguarded_step_us"] > 0
        assert row["guards_us"] == row["guarded_step_us"] - row["unguarded_step_us"]
    skipped = []  # the stance each timed step ran under (torch has no public getter for it)

    def step():
        skipped.append(torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe)

    costs = host_costs.guard_cost(step, 2)
    assert skipped == [False, True, False, True]
    assert set(costs) == {"guarded_step_us", "unguarded_step_us", "guards_us"}


def test_differences_to_torchtitans_decoder(result):
    counts = {n: {e: d["count"] for e, d in r["events"].items()} for n, r in result.items()}
    assert counts["baseline"] == counts["torchtitan"]  # the same step, event for event
    diff = result["sliced2_r8"]["over_torchtitan"]["events"]
    changed = {e: d["count"] for e, d in diff.items() if d["count"]}
    # the layers' queries [n, r]: one more gradient accumulated per layer
    assert changed == {"autograd::engine::evaluate_function: torch::autograd::AccumulateGrad": 2}
    assert result["torchtitan"]["over_torchtitan"]["top_level_us"] == 0


def test_table_and_json(result, tmp_path, monkeypatch):
    text = host_costs.table(result)
    assert "| sliced2_r8 | autograd::engine::evaluate_function: torch::autograd::AccumulateGrad" \
        " | 14 | +2 |" in text  # fmt: skip
    assert "| baseline | " in text.split("events over torchtitan")[1]
    assert "guards ms / step |" in text.splitlines()[0]
    monkeypatch.setattr(host_costs, "measure", lambda *a, **k: result)
    path = tmp_path / "h.json"
    args = [
        "--variants",
        "torchtitan,baseline,sliced2_r8",
        "--ac",
        "selective",
        "--json",
        str(path),
    ]
    assert host_costs.main(args) == 0
    saved = json.loads(path.read_text())
    assert saved["config"]["ac"] == "selective" and "torch" in saved["config"]
    assert set(saved["result"]) == {"torchtitan", "baseline", "sliced2_r8"}


def test_a_bad_variant_is_refused_in_one_line(capsys):
    assert host_costs.main(["--variants", "baseline,nope"]) == 2
    assert capsys.readouterr().err.strip().startswith("host_costs: unknown variant 'nope'")
