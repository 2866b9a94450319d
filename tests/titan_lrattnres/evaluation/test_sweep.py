"""Sweep report building from fake run summaries (no training)."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_lrattnres.evaluation import sweep
from titan_lrattnres.evaluation.inference import build_model

FAKE = {
    "cpu_default_baseline": dict(variant="baseline", blocks=None, rank=32, val=4.10),
    "cpu_default_attnres": dict(variant="attnres", blocks=4, rank=128, val=4.05),
    "cpu_default_sliced": dict(variant="sliced", blocks=4, rank=32, val=4.01),
    "cpu_default_projected": dict(variant="projected", blocks=4, rank=32, val=4.02),
}


def _summary(variant, blocks, rank, val):
    return {
        "flavor": "cpu_small",
        "variant": variant,
        "blocks": blocks,
        "rank": rank,
        "tokens": 512000,
        "seq_len": 256,
        "local_batch_size": 8,
        "final_val_loss": val,
        "tokens_per_s": 1234.5,
        "peak_rss_mib": 1500.0,
    }


def test_ci95():
    mean, half = sweep.ci95([1.0, 2.0, 3.0, 4.0])
    assert mean == pytest.approx(2.5)
    assert half == pytest.approx(1.96 * math.sqrt((1.25 * 4 / 3) / 4))
    assert math.isnan(sweep.ci95([3.0])[1])


def test_rows_table_and_plot(tmp_path):
    rows = [
        sweep.make_row(
            n,
            _summary(f["variant"], f["blocks"], f["rank"], f["val"]),
            {"val_loss": f["val"] + 0.001, "val_ci95": 0.01, "val_batches": 40, "params": 1000 + i},
        )
        for i, (n, f) in enumerate(FAKE.items())
    ]
    by = {r["config"]: r for r in rows}
    assert by["cpu_default_baseline"]["added_flops_pct"] == 0
    # docs/method.md §5 at cpu_small (L=4, d=128, h=384): core = 4 (8·128² + 6·128·384) = 1,703,936;
    # S-LR Block N=4 r=32: read = 2·160·Σ|S_t| = 2·160·(4·7) = 8,960 -> 0.52584 %
    assert by["cpu_default_sliced"]["added_flops_pct"] == pytest.approx(100 * 8960 / 1703936)
    assert by["cpu_default_attnres"]["rank"] == 128
    assert by["cpu_default_sliced"]["val_loss"] == pytest.approx(4.011)
    assert by["cpu_default_sliced"]["trainer_val_loss"] == pytest.approx(4.01)
    md = sweep.markdown_table(rows)
    assert (
        "| S-LR Block N=4 r=32 | cpu_default_sliced | 0.003 | 4.0110 ± 0.0100 | - | 0.526 |" in md
    )
    assert "| Baseline |" in md and "P-LR Block N=4 r=32" in md and "Standard Block N=4" in md
    sweep.write_report(rows, tmp_path)
    assert json.loads((tmp_path / "sweep.json").read_text())[2]["config"] == "cpu_default_sliced"
    assert (tmp_path / "sweep.png").read_bytes()[:4] == b"\x89PNG"
    assert "± 1.96" in (tmp_path / "sweep.md").read_text()


@pytest.fixture
def predictions(monkeypatch):
    """``benchmarks.memory`` replaced by a stand-in (seconds per shape): the cases it was asked
    for, a peak of 100 MiB x the local batch."""
    asked = []

    def predict(case):
        asked.append(case)
        mib = 100 * 2**20 * case["batch"]
        return {"peak": mib, "at_peak": {}, "max": {}, "optimizer": case["optimizer"]}

    monkeypatch.setattr(sweep, "predict_memory", predict)
    return asked


def test_main_reuses_finished_runs_and_falls_back_to_trainer_loss(tmp_path, capsys, predictions):
    for name, f in FAKE.items():
        (tmp_path / name).mkdir()
        s = _summary(f["variant"], f["blocks"], f["rank"], f["val"])
        (tmp_path / name / "summary.json").write_text(json.dumps(s))
    assert sweep.main(["--out", str(tmp_path), "--configs", ",".join(FAKE)]) == 0
    out = capsys.readouterr().out
    assert out.count("reuse ") == 4  # nothing trained
    rows = json.loads((tmp_path / "sweep.json").read_text())
    assert [r["val_loss"] for r in rows] == [f["val"] for f in FAKE.values()]
    assert all(r["val_ci95"] is None for r in rows)
    # the memory column: the benchmark's prediction (one per distinct case: the variants
    # differ), the process's peak RSS kept under its own name
    assert len(predictions) == 4
    assert all(r["predicted_peak_mib"] == 800 and r["peak_rss_mib"] == 1500.0 for r in rows)
    assert "predicted peak MiB/rank (benchmarks.memory)" in out and "| 800 |" in out


def test_dry_run_prints_train_commands(tmp_path, capsys):
    sweep.main(
        ["--out", str(tmp_path), "--configs", "cpu_default_sliced", "--dry-run", "--nproc", "2"]
    )
    out = capsys.readouterr().out
    assert "--nproc_per_node=2" in out and "titan_lrattnres.train cpu_default_sliced" in out
    assert f"--dump_folder {tmp_path / 'cpu_default_sliced'}" in out


def test_batch_losses_match_direct_cross_entropy():
    torch.manual_seed(0)
    model = build_model(dict(flavor="debug", variant="sliced", blocks=2, rank=16, vocab_size=64))
    tokens = torch.randint(0, 64, (2 * 2 * 9 + 5,))
    losses = sweep.batch_losses(model, tokens, batch=2, seq_len=8, n=10)
    assert len(losses) == 2
    x = tokens[18:36].reshape(2, 9)
    want = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
    assert losses[1] == pytest.approx(want.item(), rel=1e-6)


def test_paired_deltas_use_per_batch_differences():
    rows = [
        {"variant": "baseline", "val_batch_losses": [5.0, 6.0, 7.0]},
        {"variant": "sliced", "val_batch_losses": [4.9, 5.8, 6.9]},
        {"variant": "projected", "val_batch_losses": [4.0, 5.0]},  # other batches: no delta
    ]
    sweep.add_paired_deltas(rows)
    assert rows[0]["delta_vs_baseline"] == 0.0
    assert abs(rows[1]["delta_vs_baseline"] - (-0.4 / 3)) < 1e-12
    diffs = [-0.1, -0.2, -0.1]
    assert abs(rows[1]["delta_ci95"] - sweep.ci95(diffs)[1]) < 1e-12
    assert rows[2]["delta_vs_baseline"] is None


def test_best_learning_rate_table_and_extra_columns(tmp_path, monkeypatch):
    losses = {  # config -> per-batch validation losses (the same 3 held-out batches)
        "cpu_default_baseline": [5.0, 5.2, 5.4],
        "cpu_default_baseline_lr1e-2": [4.6, 4.8, 5.0],  # the baseline's best rate
        "cpu_default_sliced": [4.4, 4.5, 4.6],  # sliced's best rate
        "cpu_default_sliced_lr1e-2": [4.7, 4.9, 5.1],
    }
    rows = []
    for name, ls in losses.items():
        variant = "baseline" if "baseline" in name else "sliced"
        s = _summary(variant, None if variant == "baseline" else 4, 32, sum(ls) / 3)
        rows.append(sweep.make_row(name, s, {"val_loss": sum(ls) / 3, "val_batch_losses": ls}))
    assert [r["lr"] for r in rows] == [3e-3, 1e-2, 3e-3, 1e-2]
    best = {r["config"]: r for r in sweep.best_lr_rows(rows)}
    assert sorted(best) == ["cpu_default_baseline_lr1e-2", "cpu_default_sliced"]
    assert best["cpu_default_sliced"]["delta_vs_baseline"] == pytest.approx(-0.3)  # vs 1e-2 base
    assert sweep.best_lr_rows(rows[::2]) == []  # one rate per model: no such table
    decode = {
        "result": {
            "1": {
                "baseline": {"variant": ["baseline", None, 0], "decode_ratio": 1.0},
                "sliced4_r32": {"variant": ["sliced", 4, 32], "decode_ratio": 1.2},
            }
        }
    }  # noqa: E501
    longctx = {"runs": {"sliced N=4 r=32": {
        "run": "runs/sweep/cpu_default_sliced",
        "loss_by_position": {"1": {"buckets": [5.0, 5.0]},
                             "4": {"buckets": [5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.0, 5.4]}},
        "copy_probe": {"0": {"first_loss": 5.0, "second_loss": 4.0},
                       "896": {"first_loss": 5.0, "second_loss": 4.5}}}}}  # fmt: skip
    plotted = []
    monkeypatch.setattr(sweep, "plot", lambda rows, *a: plotted.extend(r["config"] for r in rows))
    sweep.write_report(rows, tmp_path, decode, longctx)
    assert sorted(plotted) == sorted(best)  # one point per model, at its best rate
    by = {r["config"]: r for r in json.loads((tmp_path / "sweep.json").read_text())}
    assert by["cpu_default_sliced"]["decode_ratio_b1"] == 1.2
    assert by["cpu_default_sliced"]["long_degradation"] == pytest.approx(0.2)  # last 2 of 8
    assert by["cpu_default_sliced"]["copy_gain"] == pytest.approx(0.5)  # at the longest gap
    assert "copy_gain" not in by["cpu_default_sliced_lr1e-2"]  # another trained run
    md = (tmp_path / "sweep.md").read_text()
    assert "## Each model at its best learning rate" in md and "decode × base B=1" in md
    assert len(json.loads((tmp_path / "sweep_best_lr.json").read_text())) == 2


def test_merge_adds_an_earlier_sweeps_rows_and_prefers_the_new_run(tmp_path, capsys, predictions):
    old = tmp_path / "old"
    rows = []
    for name, ls in (
        ("cpu_default_baseline", [5.0, 5.2, 5.4]),
        ("cpu_default_sliced", [4.4, 4.5, 4.6]),
        ("cpu_default_attnres", [4.7, 4.9, 5.1]),
    ):
        f = FAKE[name]
        s = _summary(f["variant"], f["blocks"], f["rank"], sum(ls) / 3)
        rows.append(sweep.make_row(name, s, {"val_loss": sum(ls) / 3, "val_batch_losses": ls}))
    rows[2]["delta_vs_baseline"] = 99.0  # stale: recomputed after the merge
    old.mkdir()
    (old / "sweep.json").write_text(json.dumps(rows))
    new = tmp_path / "new"
    for name, val in (("cpu_default_sliced", 3.9), ("cpu_default_projected", 4.2)):
        (new / name).mkdir(parents=True)
        f = FAKE[name]
        s = _summary(f["variant"], f["blocks"], f["rank"], val)
        (new / name / "summary.json").write_text(json.dumps(s))
    configs = "cpu_default_sliced,cpu_default_projected"
    args = ["--out", str(new), "--configs", configs, "--merge", str(old / "sweep.json")]
    assert sweep.main(args) == 0
    capsys.readouterr()
    merged = json.loads((new / "sweep.json").read_text())
    assert [r["config"] for r in merged] == [
        "cpu_default_baseline",
        "cpu_default_sliced",  # in the earlier place, from the new run
        "cpu_default_attnres",
        "cpu_default_projected",  # new config: after the earlier rows
    ]
    by = {r["config"]: r for r in merged}
    assert by["cpu_default_sliced"]["val_loss"] == 3.9
    assert by["cpu_default_sliced"]["val_batch_losses"] is None  # the new run's fields only
    assert by["cpu_default_attnres"]["delta_vs_baseline"] == pytest.approx(-0.3)
    assert by["cpu_default_baseline"]["val_batch_losses"] == [5.0, 5.2, 5.4]
    assert "| P-LR Block N=4 r=32 | cpu_default_projected |" in (new / "sweep.md").read_text()


def test_memory_case_follows_the_runs_config_and_summary():
    s = dict(_summary("sliced", 4, 32, 4.0), world_size=1)
    case = sweep.memory_case("cpu_default_sliced", s)
    assert case == {
        "flavor": "cpu_small", "variant": "sliced", "blocks": 4, "block_layers": None,
        "rank": 32, "seq": 256, "batch": 8, "ac": "none", "fsdp": 1, "dtype": "fp32",
        "optimizer": "adamw", "ortho_dtype": "bfloat16", "implementation": "foreach",
        "z_loss": 0.0, "loss_chunks": 8, "max_norm": 1.0,
    }  # fmt: skip
    muon = sweep.memory_case("cpu_default_muon", s)  # the paper recipe on CPU
    assert (muon["optimizer"], muon["ortho_dtype"], muon["z_loss"]) == ("recipe", "float32", 1e-5)
    paper = dict(_summary("projected", 8, 32, 3.0), flavor="paper_0p5b", seq_len=2048,
                 local_batch_size=4, world_size=64)  # fmt: skip
    paper = sweep.memory_case("paper_projected_block8_r32", paper)
    assert (paper["ac"], paper["dtype"], paper["fsdp"]) == ("selective", "bf16", 64)
    assert (paper["optimizer"], paper["implementation"]) == ("recipe", "fused")
    assert sweep.memory_case("not_a_config", s) is None
    assert sweep.memory_case("cpu_default_sliced", {"flavor": "cpu_small"}) is None  # no shape


def test_attach_memory_once_per_case_and_a_failure_leaves_a_dash():
    case = {"flavor": "debug", "batch": 2}
    cases = {"a": case, "b": dict(case), "c": None, "d": {"batch": 0}}
    rows = [{"config": name, "memory_case": c} for name, c in cases.items()]
    calls, lines = [], []

    def predict(c):
        calls.append(c)
        if not c["batch"]:
            raise ValueError("no tokens")
        return {"peak": 3 * 2**20, "at_peak": {"activations": 1}, "max": {}, "optimizer": "adamw"}

    sweep.attach_memory(rows, predict, progress=lines.append)
    assert len(calls) == 2  # a and b share one case
    assert [r.get("predicted_peak_mib") for r in rows] == [3.0, 3.0, None, None]
    assert rows[0]["predicted_memory"]["at_peak"] == {"activations": 1}
    assert any("d: no memory prediction (ValueError: no tokens)" in ln for ln in lines)
    assert [r.get("memory_error") for r in rows] == [None, None, None, "ValueError: no tokens"]
    filled = {"variant": "baseline", "blocks": None, "rank": None, "val_loss": 4.0,
              "added_flops_pct": 0.0, "params": 1, "tokens_per_s": None}  # fmt: skip
    table = sweep.markdown_table([{**r, **filled} for r in rows])
    assert "d: no predicted memory (ValueError: no tokens)" in table  # named, not dropped
    assert "| - |" in sweep.markdown_table([sweep.make_row("x", _summary("baseline", None, 32, 4))])


def test_memory_prediction_runs_the_benchmark():
    """The real predictor at the smallest run (cpu_smoke's shape, one rank)."""
    s = dict(_summary("sliced", 2, 16, 4.0), flavor="debug", seq_len=32, local_batch_size=2)
    case = sweep.memory_case("cpu_smoke", s)
    pred = sweep.predict_memory(case)
    assert pred["peak"] > 0 and pred["at_peak"]["activations"] > 0
    assert pred["optimizer"] == "adamw"


def test_merge_renames_an_earlier_sweeps_rss_column():
    old = [{"config": "a", "peak_mem_mib": 1500.0}]
    (row,) = sweep.merge_rows(old, [])
    assert row["peak_rss_mib"] == 1500.0 and "peak_mem_mib" not in row


def test_tokens_per_s_only_for_runs_measured_alone(tmp_path, capsys, predictions):
    loads = {  # other processes' cores: during the run, before it (None: no record)
        "cpu_default_baseline": {"other_cores": 0.05, "busy_cores_before": 0.1},
        "cpu_default_attnres": {"other_cores": 0.9, "busy_cores_before": 0.1},
        "cpu_default_sliced": {"other_cores": 0.05, "busy_cores_before": 1.2},
        "cpu_default_projected": None,
    }
    for name, f in FAKE.items():
        (tmp_path / name).mkdir()
        s = _summary(f["variant"], f["blocks"], f["rank"], f["val"])
        (tmp_path / name / "summary.json").write_text(json.dumps(s))
        if loads[name] is not None:
            (tmp_path / name / "machine_load.json").write_text(json.dumps(loads[name]))
    assert sweep.main(["--out", str(tmp_path), "--configs", ",".join(FAKE)]) == 0
    table = (tmp_path / "sweep.md").read_text()
    shown = [line for line in table.splitlines() if "| 1,234 |" in line]
    assert len(shown) == 1 and "| cpu_default_baseline |" in shown[0]
    assert "measured alone" in table
    rows = json.loads((tmp_path / "sweep.json").read_text())
    assert all(r["tokens_per_s"] == 1234.5 for r in rows)  # the JSON keeps every figure


@pytest.mark.slow
def test_an_installed_wheel_writes_the_memory_column(tmp_path):
    """The package built as a wheel and installed away from the clone (no ``benchmarks``, the
    clone off the path) predicts a run's memory for the sweep."""
    root, src = Path(__file__).resolve().parents[3], tmp_path / "src"
    for name in ("custom_ops", "titan_lrattnres", "train_configs"):  # built away from the clone
        shutil.copytree(root / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(root / name, src / name)
    pip = [sys.executable, "-m", "pip", "-q"]
    dist = tmp_path / "dist"
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(src)]
    subprocess.run(build, check=True, cwd=tmp_path)
    (wheel,) = dist.glob("*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True)
    code = (
        "import json, sys\n"
        "from titan_lrattnres.evaluation import sweep\n"
        "assert 'benchmarks' not in sys.modules\n"
        "s = dict(flavor='debug', variant='sliced', blocks=2, rank=16, seq_len=32,\n"
        "         local_batch_size=2, world_size=1)\n"
        "rows = [{'config': 'cpu_smoke', 'memory_case': sweep.memory_case('cpu_smoke', s)}]\n"
        "sweep.attach_memory(rows)\n"
        "print(json.dumps(rows[0].get('predicted_peak_mib')), sweep.__file__)\n"
    )
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    peak, where = out.stdout.split()[-2:]
    assert float(peak) > 0 and where.startswith(str(site))
