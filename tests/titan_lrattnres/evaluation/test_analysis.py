"""Routing analysis: weights, statistics, heatmap, CLI (docs/method.md §6)."""

import json
import math

import pytest
import torch

from titan_lrattnres.evaluation import analysis
from titan_lrattnres.evaluation.inference import build_model, save_safetensors

VARIANTS = [
    ("attnres", None),
    ("sliced", 2),
    ("projected", 3),
    ("sliced", None),
]


def _model(variant, blocks, queries="random", seed=0):
    torch.manual_seed(seed)
    args = dict(flavor="debug", variant=variant, blocks=blocks, rank=16)
    model = build_model(args, depth_backend="reference")
    with torch.no_grad():
        for q in model.depth_queries():
            q.normal_(0, 2.0) if queries == "random" else q.zero_()
    return model, args


@pytest.mark.parametrize("variant,blocks", VARIANTS)
def test_capture_matches_model_and_rows_sum_to_one(variant, blocks):
    model, _ = _model(variant, blocks)
    tokens = torch.randint(0, 4096, (2, 11))
    logits, alphas = analysis.capture_routing(model, tokens)
    torch.testing.assert_close(logits, model(tokens), rtol=0, atol=0)  # same numerics
    m = model.router.num_sublayers
    assert len(alphas) == m
    n = len(model.router.ends)
    for t, a in enumerate(alphas, start=1):
        assert a.shape == (len(analysis.source_labels(t, m, n)), 2, 11)
        torch.testing.assert_close(a.sum(0), torch.ones(2, 11))
    # random queries route non-uniformly somewhere
    assert max((a - 1 / a.shape[0]).abs().max().item() for a in alphas) > 0.05


@pytest.mark.parametrize("variant,blocks", VARIANTS)
def test_zero_queries_are_uniform(variant, blocks):
    model, _ = _model(variant, blocks, queries="zero")
    stats, summary = analysis.analyse(model, [torch.randint(0, 4096, (2, 9))])
    for s in stats:
        assert s.mean_weight == pytest.approx([1 / s.num_sources] * s.num_sources, abs=1e-6)
        assert s.norm_entropy == pytest.approx(1.0, abs=1e-6)
        assert s.eff_sources == pytest.approx(s.num_sources, rel=1e-6)
        assert s.top1_mass == pytest.approx(1 / s.num_sources, abs=1e-6)
        assert s.input_dependence == pytest.approx(0.0, abs=1e-7)
    assert summary["norm_entropy"] == pytest.approx(1.0, abs=1e-6)


def test_site_stats_on_known_weights():
    # two tokens: one-hot and uniform over 4 sources
    a = torch.tensor([[1.0, 0.25], [0.0, 0.25], [0.0, 0.25], [0.0, 0.25]])
    s = analysis.site_stats(3, a, ["e", "B1", "B2", "P3"])
    assert s.norm_entropy == pytest.approx(0.5)
    assert s.eff_sources == pytest.approx((1 + 4) / 2)
    assert s.top1_mass == pytest.approx((1 + 0.25) / 2)
    assert s.mean_weight == pytest.approx([0.625, 0.125, 0.125, 0.125])
    assert s.input_dependence == pytest.approx((0.375 + 3 * 0.125) / 4)


def test_source_labels_follow_schedule():
    assert analysis.source_labels(3, 4, 4) == ["e", "o1", "o2", "o3"]
    assert analysis.source_labels(1, 4, 2) == ["e", "P1"]
    assert analysis.source_labels(2, 4, 2) == ["e", "B1"]
    assert analysis.source_labels(3, 4, 2) == ["e", "B1", "P2"]


def test_heatmap_and_report(tmp_path):
    model, _ = _model("sliced", 2)
    stats, summary = analysis.analyse(model, [torch.randint(0, 4096, (1, 8))] * 2)
    png = analysis.plot_heatmap(stats, tmp_path / "h.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = analysis.markdown_report(stats, summary)
    assert md.count("\n| ") >= len(stats) + 2
    assert math.isfinite(summary["eff_sources"]) and summary["sites"] == len(stats)


def test_cli_on_export(tmp_path):
    model, args = _model("projected", 2)
    save_safetensors(model, args, tmp_path / "ckpt")
    rc = analysis.main(
        [
            "--checkpoint",
            str(tmp_path / "ckpt"),
            "--out",
            str(tmp_path / "out"),
            "--tokens",
            "64",
            "--batch",
            "2",
            "--seq-len",
            "16",
            "--random",
        ]
    )
    assert rc == 0
    report = json.loads((tmp_path / "out" / "routing.json").read_text())
    assert report["tokens"] == 64 and len(report["sites"]) == 4
    assert (tmp_path / "out" / "routing_heatmap.png").stat().st_size > 1000


def test_cli_baseline_says_no_routing(tmp_path):
    model = build_model(dict(flavor="debug", variant="baseline", blocks=None))
    save_safetensors(model, dict(flavor="debug", variant="baseline", blocks=None), tmp_path / "c")
    analysis.main(["--checkpoint", str(tmp_path / "c"), "--out", str(tmp_path / "o"), "--random"])
    report = json.loads((tmp_path / "o" / "routing.json").read_text())
    assert report["routing"] is None and "no depth routing" in report["note"]
    with pytest.raises(ValueError, match="no depth routing"):
        analysis.capture_routing(model, torch.zeros(1, 4, dtype=torch.long))


def test_cli_on_dcp_run_with_trainer_summary_only(tmp_path):
    # torchtitan's checkpointer stores the model keys flat at the top level of the DCP state
    import torch.distributed.checkpoint as dcp

    model, args = _model("sliced", 3)
    run = tmp_path / "run"
    dcp.save(model.state_dict(), checkpoint_id=str(run / "checkpoint" / "step-2"))
    dcp.save(
        {k: v * 0 for k, v in model.state_dict().items()},
        checkpoint_id=str(run / "checkpoint" / "step-1"),
    )  # older: must not be picked
    summary = {"flavor": "debug", "variant": "sliced", "blocks": 3, "rank": 16, "steps": 2}
    (run / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "out"
    analysis.main(
        [
            "--run",
            str(run),
            "--out",
            str(out),
            "--tokens",
            "32",
            "--batch",
            "1",
            "--seq-len",
            "32",
            "--random",
            "--depth-backend",
            "reference",
        ]
    )
    report = json.loads((out / "routing.json").read_text())
    assert report["model_args"] == {"flavor": "debug", "variant": "sliced", "blocks": 3, "rank": 16}
    tokens = analysis.token_batches(32, 1, 32, 4096, seed=0)
    _, want = analysis.capture_routing(model, tokens[0])
    got = report["sites"][2]["mean_weight"]
    assert got == pytest.approx(want[2].reshape(want[2].shape[0], -1).mean(1).tolist(), rel=1e-5)


def test_cli_on_the_models_own_samples(tmp_path):
    model, args = _model("sliced", 2)
    save_safetensors(model, args, tmp_path / "ckpt")
    argv = ["--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--tokens",
            "64", "--batch", "2", "--seq-len", "16", "--random", "--generated", "--prompt-len",
            "4"]  # fmt: skip
    assert analysis.main(argv) == 0
    report = json.loads((tmp_path / "out" / "routing.json").read_text())
    assert report["tokens"] == 64 and "own samples" in report["data"]
    assert report["summary_on_prompt_data"].keys() == report["summary"].keys()
    assert "| own samples | the prompting data |" in (tmp_path / "out" / "routing.md").read_text()


def test_generated_batches_keep_the_prompt_and_continue_it():
    model, _ = _model("sliced", 2)
    batch = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(0))
    (out,) = analysis.generated_batches(model, [batch], prompt_len=3, temperature=1.0, seed=0)
    assert out.shape == batch.shape and torch.equal(out[:, :3], batch[:, :3])
    assert not torch.equal(out, batch)  # the rest is the model's, not the data
    (again,) = analysis.generated_batches(model, [batch], prompt_len=3, temperature=1.0, seed=0)
    assert torch.equal(out, again)  # seeded
    with pytest.raises(ValueError, match=r"--prompt-len must be in \[1, 9\]"):
        analysis.generated_batches(model, [batch], prompt_len=10, temperature=1.0, seed=0)
