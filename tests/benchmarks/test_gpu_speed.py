"""The training-speed GPU run: its case list, kernel classes and targets, and its CPU dry run end
to end through ``gpu_check.sh --speed`` (every section and the profile, tiny shapes, the Trainer
on a tiny corpus)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_speed, step_profile
from tests.titan_lrattnres.trainer_runs import tiny_corpus_env

ROOT = Path(__file__).resolve().parents[2]


def test_cases_parse_and_refuse_in_one_line():
    assert gpu_speed.parse_cases(gpu_speed.CASES)[:2] == [(4, "selective", False),
                                                        (4, "selective", True)]  # fmt: skip
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
            "cases": {"B=4 AC=selective": {"result": rows}, "B=1 AC=none": {"result": rows}}
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


@pytest.mark.slow
def test_dry_run_runs_every_section(tmp_path):
    # a tiny corpus: the Trainer section needs one
    env = dict(tiny_corpus_env(tmp_path / "data_cache"), PYTHON=sys.executable)
    out = tmp_path / "speed.json"
    p = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--speed", str(out), "--dry-run"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads(out.read_text())
    cases = result["step_ratios"]["cases"]
    assert set(cases) == {"B=2 AC=none", "B=2 AC=selective"}
    for case in cases.values():
        assert case["result"]["sliced2_r32"]["median_overhead_vs_torchtitan_pct"] is not None
    profile = result["step_ratios"]["profile"]  # the first case's models, one step each
    assert profile["case"] == "B=2 AC=none"
    assert set(profile["ms_by_class"]) == set(result["step_ratios"]["config"]["variants"])
    assert profile["ms_by_class"]["baseline"]["matmuls"] > 0
    run = result["trainer"]["runs"]["cpu_smoke"]
    assert run["returncode"] == 0 and run["tokens_per_s"] > 0, run["tail"]
