"""Named experiments: every name builds a Trainer.Config; the paper grid follows docs/method.md
§6."""

from __future__ import annotations

import functools

import pytest
import torch
from torchtitan.trainer import Trainer

import train_configs
from titan_lrattnres import model_registry, train
from titan_lrattnres.components.optimizers import QUERIES
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
        assert c.optimizer.param_groups[0].pattern == QUERIES


def test_paper_recipe():
    c = train_configs.get_config("paper_sliced_block8_r64")
    assert c.training.seq_len == 2048
    assert c.training.global_batch_size * c.training.seq_len == 262_144
    assert c.training.steps == 38_146  # the paper's max_steps: 10e9 // 262144
    assert c.lr_scheduler.warmup_steps == 2000
    assert c.lr_scheduler.decay_ratio == 0.2 and c.lr_scheduler.min_lr_factor == 0.1
    r = c.model_spec.model.router
    assert (r.variant, r.blocks, r.rank) == ("sliced", 8, 64)
    assert c.model_spec.model.dim == 1024 and len(c.model_spec.model.layers) == 24
    full = train_configs.get_config("paper_attnres_full").model_spec.model.router
    assert (full.variant, full.blocks, full.rank) == ("attnres", None, 1024)


# The paper's recipe, setting by setting (its training script's values for the 0.5B runs)
PAPER = {
    "steps": 38_146,
    "seq_len": 2048,
    "global_batch_seqs": 128,
    "warmup": 2000,
    "decay_ratio": 0.2,
    "min_lr_factor": 0.1,
    "decay_type": "linear",
    "muon": {"lr": 1e-3, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True, "beta2": 0.95},
    "muon_ortho_dtype": "bfloat16",
    "adamw": {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0},
    "momentum_schedule": (300, 100, 0.85, 0.95),
    "max_norm": 1.0,
    "z_loss_weight": 1e-5,
    "seed": 42,
    "vocab": 100_277,
    "init_std": 0.02,
}


@pytest.mark.parametrize(
    "name", ["paper_baseline", "paper_attnres_full", "paper_projected_block8_r32_float8"]
)
def test_paper_configs_hold_every_setting_of_the_papers_recipe(name):
    from titan_lrattnres.components.optimizers import MLP_INPUT

    c = train_configs.get_config(name)
    t, s = c.training, c.lr_scheduler
    assert (t.steps, t.seq_len, t.global_batch_size) == (
        PAPER["steps"],
        PAPER["seq_len"],
        PAPER["global_batch_seqs"],
    )
    assert (s.warmup_steps, s.decay_ratio, s.min_lr_factor, s.decay_type) == (
        PAPER["warmup"],
        PAPER["decay_ratio"],
        PAPER["min_lr_factor"],
        PAPER["decay_type"],
    )
    assert (
        s.momentum_warmup_steps,
        s.momentum_cooldown_steps,
        s.momentum_min,
        s.momentum_max,
    ) == PAPER["momentum_schedule"]
    (muon,) = [g for g in c.optimizer.param_groups if g.optimizer_name == "Muon"]
    assert muon.pattern == ".*" and muon.min_ndim == 2  # every >= 2-D weight the others leave
    assert {k: muon.optimizer_kwargs[k] for k in PAPER["muon"]} == PAPER["muon"]
    assert muon.optimizer_kwargs["ortho_dtype"] == PAPER["muon_ortho_dtype"]
    adamw = [g for g in c.optimizer.param_groups if g.optimizer_name == "AdamW"]
    expected = {r"tok_embeddings\.", r"lm_head\.", ".*"}
    if not name.startswith("paper_baseline"):
        expected.add(QUERIES)
    assert {g.pattern for g in adamw} == expected
    for g in adamw:
        assert {k: g.optimizer_kwargs[k] for k in PAPER["adamw"]} == PAPER["adamw"]
    assert c.optimizer.optimizer_factory_kwargs_by_name == {"Muon": {"fuse": MLP_INPUT}}
    assert t.max_norm == PAPER["max_norm"]
    assert c.loss.loss_fn.z_loss_weight == PAPER["z_loss_weight"]
    assert c.debug.seed == PAPER["seed"]
    m = c.model_spec.model
    assert m.vocab_size == PAPER["vocab"]
    inits = [m.tok_embeddings.param_init["weight"], m.lm_head.param_init["weight"]]
    for layer in m.layers:
        for mod in (layer.attention, layer.feed_forward):
            inits += [lin.param_init["weight"] for lin in _linears(mod)]
    if m.embedding_key is not None:  # projected
        inits.append(m.embedding_key.param_init["weight"])
    assert {_init_std(f) for f in inits} == {PAPER["init_std"]}


def _init_std(f) -> float | None:
    """``std`` of a ``partial(normal_, std=...)`` init, or of the one torchtitan's fused-qkv init
    wraps (a closure over the base init)."""
    if isinstance(f, functools.partial) and f.func is torch.nn.init.normal_:
        return f.keywords["std"]
    cells = [c.cell_contents for c in f.__closure__ or ()]
    found = {_init_std(c) for c in cells if callable(c)} - {None}
    return found.pop() if len(found) == 1 else None


def _linears(module_config) -> list:
    """The Linear configs of an attention or feed-forward config (w1/w2/w3, wqkv, wo)."""
    names = ("w1", "w2", "w3", "wo")
    out = [getattr(module_config, n) for n in names if hasattr(module_config, n)]
    qkv = getattr(module_config, "qkv_linear", None)
    return out + ([qkv.wqkv] if qkv is not None else [])


def _paper_lr_factor(step: int, total: int, warmup: int, decay: int) -> float:
    """The paper's WSD ("linear"), 0-based optimiser step: (step + 1) / warmup, then 1, then
    from the step ``total - decay`` on 0.1 + 0.9 (total - step) / decay."""
    if step < warmup:
        return (step + 1) / warmup
    if step < total - decay:
        return 1.0
    return 0.1 + 0.9 * (total - step) / decay


def _paper_momentum(step: int, total: int) -> float:
    """The paper's Muon momentum: 0.85 -> 0.95 over 300 steps, back over the last 100."""
    if step < 300:
        return 0.85 + step / 300 * 0.1
    if step > total - 100:
        return 0.95 - (step - (total - 100)) / 100 * 0.1
    return 0.95


def test_paper_schedules_equal_the_papers_at_every_step():
    """torchtitan's WSD (with its virtual last step) and the momentum schedule, built from a
    paper config, against the paper's formulas at each of the 38,146 steps: the decay starts at
    step 30,517 (0-based), the momentum cooldown after 38,046."""
    import dataclasses

    c = train_configs.get_config("paper_sliced_block8_r64")
    model = model_registry("debug", variant="sliced", blocks=2, rank=16).model.build()
    opt = dataclasses.replace(c.optimizer, implementation="for-loop").build(model_parts=[model])
    total = c.training.steps
    sched = c.lr_scheduler.build(optimizers=opt, training_steps=total)
    decay = round(0.2 * total)
    assert decay == 7629
    lam = sched.schedulers[0].lr_lambdas[0]
    worst = max(abs(lam(s) - _paper_lr_factor(s, total, 2000, decay)) for s in range(total))
    assert worst < 1e-12, worst
    assert lam(30_516) == 1.0 and lam(30_517) == 1.0 and lam(30_518) < 1.0
    assert all(sched.momentum(s) == pytest.approx(_paper_momentum(s, total)) for s in range(total))
    assert sched.momentum(38_046) == 0.95 and sched.momentum(38_047) < 0.95


def test_recipe_fusion_is_the_papers_only_and_golden_configs_stay_adamw():
    """Muon fuses each MLP's [w1; w3] in the paper_* configs; the CPU recipe configs keep them
    apart (their recorded losses), and the golden-curve configs (tiny_*) use no Muon at all."""
    for name in ("cpu_smoke_muon", "cpu_default_muon"):
        c = train_configs.get_config(name)
        assert c.optimizer.optimizer_factory_kwargs_by_name == {}
        assert any(g.optimizer_name == "Muon" for g in c.optimizer.param_groups)
    for name in train_configs.tiny.CONFIGS:
        c = train_configs.get_config(name)
        assert {g.optimizer_name for g in c.optimizer.param_groups} == {"AdamW"}
        assert c.optimizer.optimizer_factory_kwargs_by_name == {}


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
        assert {lr_of[f"layers.{i}.queries"] for i in range(2)} == {(4e-3, 0.0)}
    assert len(lr_of) == len(list(model.parameters()))
    assert config.optimizer.param_groups[-1].pattern == ".*"
