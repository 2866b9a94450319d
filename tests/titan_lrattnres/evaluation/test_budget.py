"""The matched-budget comparison: the report from synthetic runs, and a tiny real budget run
(points recorded, training time without validation, report written, reuse and refusals)."""

import json

import pytest

from titan_lrattnres import sweep as sweep_command
from titan_lrattnres.evaluation import budget


def _run(config, seed, variant, losses, tok_s, batch_offset=0.0, step_tokens=100):
    points = [
        {
            "step": 10 * (i + 1),
            "tokens": step_tokens * 10 * (i + 1),
            "train_s": 10 * (i + 1) * step_tokens / tok_s,
            "loss": loss,
            "batch_losses": [loss - 0.1 + batch_offset, loss + 0.1 + batch_offset],
        }
        for i, loss in enumerate(losses)
    ]
    for p in points:  # the point's loss is its batches' mean
        p["loss"] = sum(p["batch_losses"]) / 2
    return {
        "config": config,
        "seed": seed,
        "lr": 3e-3,
        "variant": variant,
        "blocks": None if variant == "baseline" else 4,
        "block_layers": None,
        "rank": None if variant == "baseline" else 32,
        "tokens_per_s": tok_s,
        "points": points,
        "other_cores": 0.0,
    }


def test_crossing_interpolates_between_points_and_says_never():
    pts = [{"loss": 5.0, "tokens": 100}, {"loss": 4.0, "tokens": 200}, {"loss": 3.0, "tokens": 300}]
    assert budget.crossing(pts, 3.5, "tokens") == pytest.approx(250)
    assert budget.crossing(pts, 5.5, "tokens") == 100  # already below at the first point
    assert budget.crossing(pts, 2.9, "tokens") is None


def test_summary_picks_the_best_baseline_and_pairs_seeds():
    runs = []
    for seed in (0, 1):
        off = 0.05 * seed
        runs += [
            _run("base", seed, "baseline", [5.0, 4.5, 4.0], 1000.0, off),
            _run("base_lr", seed, "baseline", [5.0, 4.6, 4.2], 1000.0, off),
            # reaches 4.0 (+off) halfway between its 2nd and 3rd point, 20 % slower
            _run("fast", seed, "sliced", [4.8, 4.2, 3.8], 800.0, off),
            _run("slow", seed, "attnres", [5.2, 4.8, 4.1], 1000.0, off),
        ]
    rows, ref = budget.summarize(runs)
    by = {r["config"]: r for r in rows}
    assert ref == "base"
    assert by["base"]["delta"] == pytest.approx(0.0) and by["base"]["tokens_per_s_ratio"] == 1.0
    assert by["fast"]["delta"] == pytest.approx(-0.2)
    assert by["base_lr"]["delta"] == pytest.approx(0.2)
    assert by["fast"]["final_loss_per_seed"] == pytest.approx([3.8, 3.85])
    assert by["fast"]["final_loss"] == pytest.approx(3.825)
    assert by["fast"]["tokens_per_s_ratio"] == pytest.approx(0.8)
    assert by["fast"]["reach_tokens_frac"] == pytest.approx(2.5 / 3)
    assert by["fast"]["reach_train_s_frac"] == pytest.approx(2.5 / 3 / 0.8)
    assert by["slow"]["reach_tokens_frac"] is None and by["slow"]["reached_seeds"] == 0
    meta = {"machine": "m", "steps": 30, "tokens": 3000.0, "val_every": 10, "val_batches": 2,
            "seeds": [0, 1]}  # fmt: skip
    md = budget.markdown(rows, ref, meta)
    assert "not reached (0/2 seeds)" in md and "0.83×" in md and "Throughput not alone" not in md
    runs[-1]["other_cores"] = 0.9
    rows, ref = budget.summarize(runs)
    assert "Throughput not alone" in budget.markdown(rows, ref, meta)
    # a run started on a busy machine (--allow-busy) is flagged too, idle as it ran
    runs[-1].update(other_cores=0.0, busy_cores_before=1.0)
    rows, ref = budget.summarize(runs)
    assert (
        "not alone**: other processes used more than 0.25 cores before or during runs of "
        "slow;" in budget.markdown(rows, ref, meta)
    )


def test_a_busy_machine_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(budget, "busy_cores", lambda seconds=2.0: 1.5)
    args = ["--budget", "--configs", "tiny_baseline", "--steps", "2", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="busy: other processes use 1.50 cores"):
        sweep_command.main(args)
    assert not any(tmp_path.iterdir())
    with pytest.raises(SystemExit):
        sweep_command.main(["--budget", "--configs", "no_such_config", "--out", str(tmp_path)])
    assert "not train_configs names: no_such_config" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_budget_run_records_points_and_time_without_validation(tmp_path, env, monkeypatch):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    out = tmp_path / "budget"
    args = ["--budget", "--configs", "tiny_baseline,tiny_sliced", "--steps", "4",
            "--val-every", "2", "--seeds", "0", "--out", str(out), "--allow-busy"]  # fmt: skip
    assert sweep_command.main(args) == 0
    body = json.loads((out / "budget.json").read_text())
    assert (out / "budget.md").is_file() and (out / "budget.png").stat().st_size > 0
    assert [r["config"] for r in body["runs"]] == ["tiny_baseline", "tiny_sliced"]
    for run in body["runs"]:
        assert [p["step"] for p in run["points"]] == [2, 4]
        assert [p["tokens"] for p in run["points"]] == [2 * 4 * 64, 4 * 4 * 64]
        assert all(len(p["batch_losses"]) == 2 for p in run["points"])
        summary = json.loads((out / f"{run['config']}_seed0" / "summary.json").read_text())
        steps = {h["step"]: h for h in json.loads(
            (out / f"{run['config']}_seed0" / "loss_history.json").read_text())}  # fmt: skip
        val = {v["step"]: v for v in summary["val_history"]}
        # the step-2 validation ran between steps 2 and 4: wall time has it, training time not
        wall = steps[4]["time_s"] - steps[1]["time_s"]
        assert val[2]["val_s"] > 0 and wall - steps[4]["train_s"] >= val[2]["val_s"]
        assert run["points"][-1]["train_s"] == steps[4]["train_s"]
        assert run["tokens_per_s"] == pytest.approx(3 * 4 * 64 / steps[4]["train_s"])
    assert body["reference"] == "tiny_baseline"
    # a finished run is reused; another length in the same folder is refused
    assert sweep_command.main(args) == 0
    with pytest.raises(SystemExit, match="holds another run"):
        sweep_command.main([*args[:4], "6", *args[5:]])
