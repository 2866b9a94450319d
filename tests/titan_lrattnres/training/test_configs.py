"""Named experiments: every name builds a Trainer.Config; the paper grid follows SPEC §6."""

from __future__ import annotations

import pytest
import torch
from torchtitan.trainer import Trainer

import train_configs
from titan_lrattnres.training import train
from train_configs import common, cpu, paper_grid

EXPECTED_PAPER = {
    "paper_baseline",
    "paper_attnres_full",
    *(f"paper_attnres_block{n}" for n in (4, 8, 16)),
    *(f"paper_sliced_full_r{r}" for r in (16, 32, 64, 128, 256, 512)),
    *(f"paper_sliced_block{n}_r64" for n in (4, 8, 16)),
    *(f"paper_projected_full_r{r}" for r in (16, 32, 64)),
    *(f"paper_projected_block{n}_r32" for n in (4, 8, 16)),
}


@pytest.mark.parametrize("name", sorted(train_configs.CONFIGS))
def test_every_name_builds_a_trainer_config(name):
    config = train_configs.get_config(name)
    assert isinstance(config, Trainer.Config)
    assert config.run_name == name
    assert config.model_spec.model.router.backend == common.DEPTH_BACKEND
    assert config.dump_folder.endswith(name)


def test_names():
    assert {"cpu_smoke", "cpu_default"} <= set(train_configs.CONFIGS)
    for v in ("baseline", "attnres", "sliced", "projected"):
        config = train_configs.get_config(f"cpu_default_{v}")
        assert config.model_spec.model.router.variant == v
    assert set(paper_grid.GRID) == EXPECTED_PAPER


def test_cpu_variants_are_matched():
    keys = ("seq_len", "local_batch_size", "steps")
    base = train_configs.get_config("cpu_default_baseline")
    for v in ("attnres", "sliced", "projected"):
        c = train_configs.get_config(f"cpu_default_{v}")
        assert [getattr(c.training, k) for k in keys] == [getattr(base.training, k) for k in keys]
        assert c.training.mixed_precision_param == "float32"
        assert c.optimizer.param_groups[0].pattern == r"router\.query_"


def test_paper_recipe():
    c = train_configs.get_config("paper_sliced_block8_r64")
    assert c.training.seq_len == 2048
    assert c.training.global_batch_size * c.training.seq_len == 262_144
    assert c.training.steps == 38_147  # ceil(10e9 / 262144)
    assert c.lr_scheduler.warmup_steps == 2000
    assert c.lr_scheduler.decay_ratio == 0.2 and c.lr_scheduler.min_lr_factor == 0.1
    r = c.model_spec.model.router
    assert (r.variant, r.blocks, r.rank) == ("sliced", 8, 64)
    assert c.model_spec.model.dim == 1024 and len(c.model_spec.model.layers) == 48
    full = train_configs.get_config("paper_attnres_full").model_spec.model.router
    assert (full.variant, full.blocks, full.rank) == ("attnres", None, 1024)


def test_unknown_name_is_a_clear_error(capsys):
    with pytest.raises(KeyError, match="unknown config 'nope'.*cpu_default"):
        train_configs.get_config("nope")
    assert train.main(["nope"]) == 1
    err = capsys.readouterr().err
    assert "unknown config 'nope'" in err and "cpu_smoke" in err and "paper_baseline" in err


def test_module_path_and_cli_overrides():
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(
        [
            "--module",
            "titan_lrattnres",
            "--config",
            "cpu_smoke",
            "--training.steps",
            "7",
            "--compile.enable",
            "--compile.backend",
            "aot_eager",
        ]
    )
    assert config.training.steps == 7 and config.compile.backend == "aot_eager"
    assert config.run_name == "cpu_smoke"
    with pytest.raises(ValueError, match="not found.*cpu_default"):
        ConfigManager().parse_args(["--module", "titan_lrattnres", "--config", "nope"])


@pytest.mark.parametrize("variant", ["baseline", "sliced"])
def test_param_groups_split_queries_embeddings_head(variant):
    config = cpu.cpu_smoke()
    opt = common.param_groups(
        variant, lr=1e-3, lr_embed=2e-3, lr_head=3e-3, lr_query=4e-3, implementation="foreach"
    )
    from titan_lrattnres.model.registry import build_model_config

    model = build_model_config(
        "debug", variant=variant, blocks=2, depth_backend="reference"
    ).build()
    model.init_states(buffer_device=torch.device("cpu"))
    optimizers = opt.build(model_parts=[model])
    lr_of = {}
    for o in optimizers:
        for g in o.param_groups:
            for n in g["param_names"]:
                lr_of[n] = (g["lr"], g["weight_decay"])
    assert lr_of["tok_embeddings.weight"] == (2e-3, 0.0)
    assert lr_of["lm_head.weight"] == (3e-3, 0.0)
    assert lr_of["layers.0.attention.wo.weight"] == (1e-3, 0.1)
    if variant == "baseline":
        assert not any("query" in n for n in lr_of)
    else:
        assert {lr_of[f"router.query_{t}"] for t in range(1, 5)} == {(4e-3, 0.0)}
    assert len(lr_of) == len(list(model.parameters()))
    assert config.optimizer.param_groups[-1].pattern == ".*"
