"""The training-speed GPU run: its plan, estimate, kernel classes and targets; the figures
survive a SIGTERM and a failing variant; and its CPU dry run end to end through
``gpu_check.sh --speed`` (every section and the profile, tiny shapes, the paper configs through
the Trainer on a tiny corpus)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import gpu_report, gpu_speed, overhead, step_profile
from tests.titan_lrattnres.trainer_runs import tiny_corpus_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks" / "gpu_check.sh")
# two cheap variants and the reference: the tests check what is kept, not the figures
FAST = ["--sections", "step_ratios", "--variants", "torchtitan,baseline,sliced2_r32"]


def _env(tmp_path, **extra) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), PYTHON=sys.executable, OMP_NUM_THREADS="1",
                HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"),
                LRATTNRES_WHEEL_SITE=str(tmp_path / "site"), **extra)  # fmt: skip


def test_cases_parse_and_refuse_in_one_line():
    assert gpu_speed.parse_cases(gpu_speed.CASES) == [(4, "selective", False)]
    assert gpu_speed.parse_cases(gpu_speed.REST) == [(1, "none", False), (4, "selective", True),
                                                     (1, "none", True)]  # fmt: skip
    for bad in ("4", "4:some", "4:none:graph", "x:none"):
        with pytest.raises(ValueError):
            gpu_speed.parse_cases(bad)


def test_kernel_classes():
    kernel_class = step_profile.kernel_class
    assert kernel_class("_read_fwd_kernel") == "depth reads"
    assert kernel_class("lrattnres::read_backward") == "depth reads"
    assert kernel_class("triton_poi_fused_add_mul_0") == "Inductor fused"
    assert kernel_class("## Call CompiledFxGraph fdhnzks ##") == "Inductor fused"
    assert kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmuls"
    assert kernel_class("triton_tem_fused_flex_attention_0") == "attention"
    assert kernel_class("aten::mm") == "matmuls"
    assert kernel_class("vectorized_elementwise_kernel") == "other"


def test_targets_against_torchtitan_and_the_trainer():
    rows = {"torchtitan": {"median_overhead_vs_torchtitan_pct": 0.0},
            "sliced8_r64": {"median_overhead_vs_torchtitan_pct": 4.0},
            "full": {"median_overhead_vs_torchtitan_pct": 16.0}}  # fmt: skip
    result = {
        "step_ratios": {
            "cases": {"B=4 AC=selective": {"variants": rows}, "B=1 AC=none": {"variants": rows}}
        },  # fmt: skip
        "trainer": {
            "runs": {
                "paper_baseline": {"tokens_per_s": 100.0},
                "paper_sliced_block8_r64": {"tokens_per_s": 94.0},
            }
        },  # fmt: skip
    }
    got = {t["target"]: t["ok"] for t in gpu_speed.targets(result)}
    assert got == {
        "sliced8_r64 <= +5 % over torchtitan (B=4 AC=selective)": True,
        "full <= +15 % over torchtitan (B=4 AC=selective)": False,
        "Trainer tokens/s routed >= 0.95 x baseline": False,
    }


def test_default_plan_puts_the_paper_case_first_graphs_last_and_fits_525_s():
    plan = gpu_speed.Plan(dry=False)
    assert plan.cases[0] == (4, "selective", False)
    rest = gpu_speed.Plan(dry=False, cases_text=gpu_speed.REST)
    graphs = [c[2] for c in rest.cases]
    assert graphs == sorted(graphs)  # every CUDA-graph case after every other
    per_graph, _ = gpu_speed.stored_compile_seconds()
    est = gpu_speed.estimate(plan, list(gpu_speed.SECTIONS), per_graph)
    assert list(est["parts_s"]) == ["startup", "gate", "B=4 AC=selective", "trainer"]
    assert est["total_s"] <= 525, est
    # a routed model compiles one graph per distinct layer plan: 24 at L=24 for Full and Block
    # N=8 (a block every 3 layers), 12 for N=4 (layers 1-4 of a 6-layer block share one); the
    # decoder and the baseline one each; P-LR's embedding key one more
    assert est["compiles"] == 1 + 1 + 24
    names = ("full", "block8", "attnres4", "projected8_r32")
    assert [gpu_speed.layer_graphs(v, plan.shape) for v in names] == [24, 24, 12, 25]
    # the dry run runs the same plan at a tiny shape: the same variant kinds and Trainer runs
    dry = gpu_speed.Plan(dry=True)
    kinds = [[overhead.parse_variant(v)[0] for v in p.variants] for p in (dry, plan)]
    assert kinds[0] == kinds[1] and dry.trainer == plan.trainer and len(dry.cases) == 1
    # without a stored GPU run: the documented constant per graph
    none = gpu_speed.estimate(plan, ["step_ratios"], gpu_speed.COMPILE_GRAPH_S)
    assert none["parts_s"]["B=4 AC=selective"] >= 26 * gpu_speed.COMPILE_GRAPH_S


def test_recorder_replaces_the_file_whole(tmp_path):
    path = tmp_path / "out.json"
    rec = gpu_speed.Recorder(path, {"a": 1})
    rec.save()
    rec.result["b"] = [1, 2]
    rec.save()
    assert json.loads(path.read_text()) == {"a": 1, "b": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary file left


def test_sigterm_after_the_first_case_keeps_its_figures(tmp_path):
    out = tmp_path / "speed.json"
    proc = subprocess.Popen(
        ["bash", SCRIPT, "--speed", str(out), "--dry-run", *FAST, "--cases", "2:selective,1:none"],
        env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines = []
    t0 = time.time()
    for line in proc.stdout:  # stop as soon as the first case is done
        lines.append(line)
        if line.startswith("[step_ratios] B=2 AC=selective done"):
            proc.send_signal(signal.SIGTERM)
            break
        assert time.time() - t0 < 120, "".join(lines)[-3000:]
    rest = proc.communicate(timeout=60)[0]
    assert proc.returncode != 0, "".join(lines)[-3000:] + rest
    result = json.loads(out.read_text())  # valid JSON
    assert result["stopped"].startswith("signal SIGTERM")
    case = result["step_ratios"]["cases"]["B=2 AC=selective"]
    for name in ("torchtitan", "baseline", "sliced2_r32"):
        row = case["variants"][name]
        assert len(row["step_s"]) == 2 and row["compile_s"] > 0, row
        assert row["median_overhead_vs_torchtitan_pct"] is not None
    assert set(result["step_ratios"]["profile"]["ms_by_class"]) == set(case["variants"])
    assert result["versions"]["torch"] and "triton" in result["versions"]
    assert "estimate" in result and result["estimate"]["total_s"] <= 525


def test_a_failing_variant_leaves_the_others(tmp_path):
    out = tmp_path / "speed.json"
    p = subprocess.run(
        ["bash", SCRIPT, "--speed", str(out), "--dry-run", *FAST, "--cases", "1:none",
         "--fail-variant", "baseline"],
        env=_env(tmp_path), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    assert "FAILED: step_ratios B=1 AC=none/baseline" in p.stdout
    variants = json.loads(out.read_text())["step_ratios"]["cases"]["B=1 AC=none"]["variants"]
    assert "made to fail on purpose" in variants["baseline"]["error"]
    for name in ("torchtitan", "sliced2_r32"):
        assert len(variants[name]["step_s"]) == 2 and "error" not in variants[name]
    assert variants["sliced2_r32"]["median_overhead_vs_torchtitan_pct"] is not None
    md = gpu_report.report(json.loads(out.read_text()))  # the committed report's table
    assert "| baseline | - | - | - | - | - | - | RuntimeError: baseline: made to fail" in md
    assert "| sliced2_r32 |" in md and "`baseline` made to fail on purpose" in md


@pytest.mark.slow
def test_dry_run_runs_every_section(tmp_path):
    # a tiny corpus: the Trainer section needs one
    env = dict(tiny_corpus_env(tmp_path / "data_cache"), PYTHON=sys.executable)
    out = tmp_path / "speed.json"
    p = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--speed", str(out), "--dry-run"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["gate"]["all_ok"], result["gate"]
    cases = result["step_ratios"]["cases"]
    assert list(cases) == ["B=2 AC=selective"]
    row = cases["B=2 AC=selective"]["variants"]["sliced2_r32"]
    assert row["median_overhead_vs_torchtitan_pct"] is not None and row["graphs"] == 4
    profile = result["step_ratios"]["profile"]  # the first case's models, one step each
    assert profile["case"] == "B=2 AC=selective"
    assert set(profile["ms_by_class"]) == set(cases["B=2 AC=selective"]["variants"])
    assert profile["ms_by_class"]["baseline"]["matmuls"] > 0
    for config in gpu_speed.TRAINER:  # the paper configs, through the Trainer at a tiny shape
        run = result["trainer"]["runs"][config]
        assert run["returncode"] == 0 and run["tokens_per_s"] > 0, run["tail"]
