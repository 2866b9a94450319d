"""The overhead benchmark's statistics: bootstrap interval of the median, rounds needed for
+-2 points, machine-noise summary, and pooling saved runs (refusing different configurations)."""

from __future__ import annotations

import json
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks import overhead

ratios = st.lists(st.floats(-50, 50, allow_nan=False), min_size=3, max_size=40)


@settings(max_examples=40, deadline=None)
@given(ratios)
def test_interval_holds_the_median_and_is_deterministic(values):
    lo, hi = overhead.median_interval(values)
    assert min(values) <= lo <= statistics.median(values) <= hi <= max(values)
    assert overhead.median_interval(values) == (lo, hi)


def test_interval_narrows_with_rounds_and_rounds_for_two_points():
    wide = [(-1) ** i * (i % 7) * 3.0 for i in range(10)]
    lo1, hi1 = overhead.median_interval(wide)
    lo4, hi4 = overhead.median_interval(wide * 4)
    assert hi4 - lo4 < hi1 - lo1
    need = overhead.rounds_for(len(wide), (lo1, hi1))
    assert need == pytest.approx(10 * ((hi1 - lo1) / 4) ** 2, abs=1)
    flat = [5.0] * 9
    assert overhead.rounds_for(9, overhead.median_interval(flat)) is None  # no scatter


def test_noise_is_the_robust_spread_of_the_fixed_workload():
    n = overhead.noise([1.0, 1.0, 1.1, 0.9, 1.0])
    assert n["median_s"] == 1.0
    assert n["robust_sd_pct"] == pytest.approx(0.0)
    assert n["min_pct"] == pytest.approx(-10) and n["max_pct"] == pytest.approx(10)


def _run(path, steps, **config):
    shape = dict(layers=2, dim=8, seq=4, heads=1, batch=1, vocab=16, hidden=64)
    shape.update(config)
    result = {name: {"step_s": s} for name, s in steps.items()}
    path.write_text(json.dumps({"config": shape, "result": result}))
    return str(path)


def test_saved_runs_pool_their_rounds(tmp_path, capsys):
    a = _run(tmp_path / "a.json", {"baseline": [1.0, 1.0], "sliced8_r64": [1.1, 1.2]})
    b = _run(tmp_path / "b.json", {"baseline": [2.0], "sliced8_r64": [2.2]})
    pooled = overhead.rescore([a, b])
    assert pooled["sliced8_r64"]["overhead_pct"] == pytest.approx([10, 20, 10])
    assert pooled["sliced8_r64"]["median_overhead_pct"] == pytest.approx(10)
    assert overhead.main(["--from-json", a, b]) == 0
    assert "sliced8_r64" in capsys.readouterr().out
    c = _run(tmp_path / "c.json", {"baseline": [1.0], "sliced8_r64": [1.0]}, seq=8)
    with pytest.raises(ValueError, match="seq"):
        overhead.rescore([a, c])
    assert overhead.main(["--from-json", a, c]) == 2
    assert "not a run of" in capsys.readouterr().err


def test_flex_attention_steps_get_the_causal_block_mask():
    """On GPU the benchmark's model uses FlexAttention, which needs its BlockMask: with it, the
    forward equals the SDPA model's from the same weights (causal, one document per row)."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    shape = overhead.Shape(2, 64, 64, heads=4, vocab=256)
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    logits = {}
    for attn in ("sdpa", "flex"):
        model = overhead.build("sliced2_r16", shape, "cpu", torch.float32, False, attn=attn)
        kwargs = overhead.attention_kwargs(model, tokens)
        if attn == "flex":
            assert isinstance(kwargs["attention_masks"], BlockMask)
        else:
            assert kwargs == {}
        with torch.no_grad():  # FlexAttention has no backward on CPU
            logits[attn] = model(tokens, **kwargs)
    torch.testing.assert_close(logits["flex"], logits["sdpa"], rtol=1e-4, atol=1e-4)


def test_rounds_run_with_the_collector_off_as_the_trainer_runs(monkeypatch):
    """Each timed step runs with Python's cyclic collector off (torchtitan's Trainer turns it
    off and collects every ``gc_freq`` steps); it is back on after the run."""
    import gc

    seen, timed = [], overhead._timed
    monkeypatch.setattr(overhead, "_timed", lambda step, dev: seen.append(gc.isenabled()) or
                        timed(step, dev))  # fmt: skip
    shape = overhead.Shape(1, 16, 4, heads=2, vocab=64)
    overhead.measure(shape, variants=("baseline", "sliced2_r8"), rounds=2, compile_=False,
                     progress=lambda _: None)  # fmt: skip
    # per round: the two steps, then the fixed workload with the collector back on
    assert seen == [False, False, True] * 2 and gc.isenabled()


def test_table_gives_each_variant_over_torchtitan_and_over_the_baseline():
    times = {"torchtitan": [1.0, 1.0, 1.0], "baseline": [1.0, 1.1, 1.0],
             "sliced8_r64": [1.2, 1.21, 1.1]}  # fmt: skip
    shape = overhead.Shape(2, 8, 4)
    result = overhead.summarize(times, list(times), shape)
    assert result["sliced8_r64"]["median_overhead_vs_torchtitan_pct"] == pytest.approx(20)
    assert result["sliced8_r64"]["median_overhead_pct"] == pytest.approx(10)
    header, *rows = overhead.table(result).splitlines()
    assert "over torchtitan" in header and "over baseline" in header
    row = next(r for r in rows if r.startswith("sliced8_r64"))
    assert "1.200x" in row and "1.100x" in row
    del times["torchtitan"]
    rows = overhead.table(overhead.summarize(times, list(times), shape)).splitlines()[1:]
    row = next(r for r in rows if r.startswith("sliced8_r64"))
    assert "1.100x" in row and " - " in row  # over the baseline only: torchtitan's is '-'


@pytest.mark.parametrize("name", ["block8:layer", "sliced", "projected8_x", "torchtitan2"])
def test_unknown_variant_names_are_refused(name):
    with pytest.raises(ValueError, match="unknown variant"):
        overhead.parse_variant(name)
