"""The paper's Muon: Polar Express against an SVD reference, one step against a readable
reference, parameter routing by name, the momentum schedule, and 2 gloo ranks (FSDP2 and HSDP
meshes) against one process plus a DCP save / resume (``muon_dist_worker.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_lrattnres import model_registry
from titan_lrattnres.components.muon import POLAR_EXPRESS_COEFFS, Muon, assign_owners, polar_express
from titan_lrattnres.components.optimizers import (
    MomentumLRSchedulers,
    muon_momentum,
    recipe_param_groups,
    routing,
)

ROOT = Path(__file__).resolve().parents[3]
SHAPES = [(64, 64), (96, 40), (40, 96), (37, 24), (1000, 17)]
# Polar Express against U p(S) V^T: fp32 matmuls vs float64 SVD; bf16 matmuls (the paper's).
PE_TOL = {torch.float32: 2e-5, torch.bfloat16: 4e-2}


def _composite(s: torch.Tensor) -> torch.Tensor:
    for a, b, c in POLAR_EXPRESS_COEFFS:
        s = a * s + b * s**3 + c * s**5
    return s


def test_polar_express_series_maps_the_spectrum_into_a_band_around_one():
    """The published series (arXiv:2505.16932, l = 1e-3): every singular value in [1e-3, 1]
    lands in 1 +- 0.1412 after 5 steps; below l it is not yet orthogonalised."""
    s = _composite(torch.logspace(-3, 0, 20001, dtype=torch.float64))
    assert 0.8588 < s.min() and s.max() < 1.1412
    assert abs((s.min() + s.max()).item() - 2) < 1e-9  # equioscillation around 1
    assert _composite(torch.tensor(1e-4, dtype=torch.float64)) < 0.2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_polar_express_equals_the_polynomial_applied_to_the_svd(shape, dtype):
    torch.manual_seed(0)
    g = torch.randn(shape, dtype=torch.float64)
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    scale = g.to(dtype).double().norm() * 1.02 + 1e-6
    ref = u @ torch.diag(_composite(s / scale)) @ vh
    got = polar_express(g.float(), dtype).double()
    err = ((got - ref).norm() / ref.norm()).item()
    assert err < PE_TOL[dtype], err


def _reference_step(w, g, m, v, *, lr, wd, mu, beta2):
    """The LR-AttnRes code's Muon step for one matrix, fp32 throughout."""
    m.lerp_(g, 1 - mu)
    u = g.lerp(m, mu)
    rows, cols = w.shape
    x = u.mT if rows > cols else u
    x = x / (x.norm() * 1.02 + 1e-6)
    for a, b, c in POLAR_EXPRESS_COEFFS:
        A = x @ x.mT
        x = a * x + (b * A + c * A @ A) @ x
    o = x.mT if rows > cols else x
    norm = o.norm()
    v.lerp_(o.square().mean(dim=-1 if rows >= cols else -2, keepdim=True), 1 - beta2)
    o = o * v.clamp(min=1e-10).rsqrt()
    o = o * (norm / o.norm().clamp(min=1e-10)) * max(1, rows / cols) ** 0.5
    w.sub_(lr * wd * (o * w >= 0) * w).sub_(lr * o)


def test_one_process_step_equals_the_reference():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    refs = [p.detach().clone() for p in params]
    moms = [torch.zeros_like(p) for p in refs]
    vars_ = [torch.zeros(r, 1) if r >= c else torch.zeros(1, c) for r, c in SHAPES]
    opt = Muon(params, lr=0.02, weight_decay=0.1, momentum=0.9, beta2=0.95, ortho_dtype="float32")
    for _ in range(3):
        for p, w, m, v in zip(params, refs, moms, vars_):
            p.grad = torch.randn_like(p)
            _reference_step(w, p.grad, m, v, lr=0.02, wd=0.1, mu=0.9, beta2=0.95)
        opt.step()
    for p, w in zip(params, refs):
        assert (p.detach() - w).abs().max() < 1e-6


def test_muon_refuses_vectors_and_unknown_dtypes():
    with pytest.raises(ValueError, match=">= 2-D"):
        Muon([torch.nn.Parameter(torch.zeros(3))])
    with pytest.raises(ValueError, match="ortho_dtype"):
        Muon([torch.nn.Parameter(torch.zeros(3, 3))], ortho_dtype="float16")


def test_owners_balance_the_work_and_agree_everywhere():
    shapes = [(1024, 1024)] * 4 + [(2816, 1024)] * 2 + [(64, 1024)]
    owners = assign_owners(shapes, 4)
    assert owners == assign_owners(list(shapes), 4)
    assert sorted(set(owners)) == [0, 1, 2, 3]


@pytest.mark.parametrize("variant", ["baseline", "attnres", "sliced", "projected"])
def test_routing_follows_the_paper_by_name(variant):
    model = model_registry("debug", variant=variant, blocks=2, rank=16).model.build()
    opt = recipe_param_groups(variant, implementation="for-loop").build(model_parts=[model])
    got = routing(opt)
    adamw = {"tok_embeddings.weight", "lm_head.weight"}
    if variant != "baseline":
        adamw |= {f"router.query_{t}" for t in range(1, 5)}  # one per read site (M = 4)
    muon = set()
    for layer in (0, 2):
        muon |= {
            f"layers.{layer}.attention.qkv_linear.wqkv.weight",
            f"layers.{layer}.attention.wo.weight",  # [W^O; W^K] for projected
            f"layers.{layer + 1}.feed_forward.w1.weight",
            f"layers.{layer + 1}.feed_forward.w2.weight",
            f"layers.{layer + 1}.feed_forward.w3.weight",
        }
    if variant == "projected":
        muon.add("router.embedding_key.weight")
        assert model.get_parameter("layers.0.attention.wo.weight").shape[0] == 64 + 16
    assert got == {**{n: "AdamW" for n in adamw}, **{n: "Muon" for n in muon}}
    muon_opt = next(o for o in opt if isinstance(o, Muon))
    assert (
        muon_opt.param_groups[0]["lr"] == 1e-3 and muon_opt.param_groups[0]["weight_decay"] == 0.1
    )
    for o in opt:
        if not isinstance(o, Muon):
            assert all(g["lr"] == 3e-4 and g["weight_decay"] == 0 for g in o.param_groups)


@pytest.mark.filterwarnings("ignore::UserWarning")  # scheduler steps without optimiser steps
def test_momentum_schedule_warmup_cooldown_and_resume():
    f = [muon_momentum(s, 1000, 300, 100, 0.85, 0.95) for s in range(1000)]
    assert f[0] == 0.85 and f[150] == pytest.approx(0.90) and f[300] == f[900] == 0.95
    assert f[950] == pytest.approx(0.90) and f[999] == pytest.approx(0.851)
    model = model_registry("debug", variant="sliced", blocks=2, rank=16).model.build()
    opt = recipe_param_groups("sliced", implementation="for-loop").build(model_parts=[model])
    cfg = MomentumLRSchedulers.Config(warmup_steps=2, momentum_warmup_steps=4)
    sched = cfg.build(optimizers=opt, training_steps=10)
    muon_opt = next(o for o in opt if isinstance(o, Muon))
    seen = []
    for _ in range(3):
        seen.append(muon_opt.param_groups[0]["momentum"])
        sched.step()
    assert seen == pytest.approx([0.85, 0.875, 0.90])
    resumed = cfg.build(optimizers=opt, training_steps=10)
    resumed.load_state_dict(sched.state_dict())
    assert muon_opt.param_groups[0]["momentum"] == pytest.approx(0.925)
    assert sched.get_metrics()["momentum/Muon"] == pytest.approx(0.925)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("muon_dist")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
    cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0"]
    cmd += [str(Path(__file__).parents[1] / "muon_dist_worker.py"), str(out)]
    p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["2", "1x2", "2x1"], ids=["fsdp2", "hsdp_1x2", "hsdp_2x1"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_two_ranks_equal_one_process(two_ranks, mesh, dtype):
    """3 steps on tall/wide/uneven (19/18, 2/1, 1/0 rows)/3-D weights: the owner sees exactly the
    single-process matrix, so the result is bitwise equal (tolerance: fp32 1e-6, bf16 0)."""
    for rank in two_ranks:
        r = rank[f"{mesh}_{dtype}"]
        assert r["max_abs_diff"] <= (1e-6 if dtype == "float32" else 0.0), r
        assert r["variance_is_dtensor"] and r["variance_placements"][-1] == "S(1)"
        # one all-to-all out, one back, over the shard sub-mesh only (none when it has 1 rank)
        assert r["collectives_per_step"] == (0.0 if mesh == "2x1" else 2.0)


@pytest.mark.slow
def test_two_ranks_one_matrix_one_owner(two_ranks):
    for rank in two_ranks:
        r = rank["single_float32"]
        assert r["max_abs_diff"] == 0.0 and r["collectives_per_step"] == 2.0
        assert r["variance_placements"] == ["S(0)"]  # tall: one statistic per row


@pytest.mark.slow
def test_dcp_resume_gives_a_bitwise_identical_next_step(two_ranks):
    for rank in two_ranks:
        assert rank["dcp"] == {"bitwise": True, "variance_shard": True}


@pytest.mark.parametrize("name", ["paper_sliced_block8_r64", "paper_projected_block8_r32_float8"])
def test_paper_configs_train_the_recipe(name):
    import train_configs
    from titan_lrattnres.components.optimizers import MuonOptimizersContainer
    from titan_lrattnres.components.zloss import ZLossCrossEntropy, ZLossMetricsProcessor

    c = train_configs.get_config(name)
    assert isinstance(c.optimizer, MuonOptimizersContainer.Config)
    muon = [g for g in c.optimizer.param_groups if g.optimizer_name == "Muon"]
    assert len(muon) == 1 and muon[0].min_ndim == 2
    kw = muon[0].optimizer_kwargs
    assert (kw["lr"], kw["weight_decay"], kw["beta2"], kw["ortho_dtype"]) == (
        1e-3,
        0.1,
        0.95,
        "bfloat16",
    )
    sched = c.lr_scheduler
    assert isinstance(sched, MomentumLRSchedulers.Config)
    assert (sched.momentum_warmup_steps, sched.momentum_cooldown_steps) == (300, 100)
    assert (sched.momentum_min, sched.momentum_max) == (0.85, 0.95)
    assert isinstance(c.loss.loss_fn, ZLossCrossEntropy.Config)
    assert c.loss.loss_fn.z_loss_weight == 1e-5 and c.training.max_norm == 1.0
    assert isinstance(c.metrics, ZLossMetricsProcessor.Config)


def test_muon_refuses_tensor_parallel_layouts():
    from unittest import mock

    from torch.distributed.tensor import DTensor, Replicate, Shard

    p = mock.MagicMock(spec=DTensor)
    p.shape, p.ndim = torch.Size([8, 4]), 2
    p.placements = (Replicate(), Shard(1))  # row-parallel TP weight
    with pytest.raises(NotImplementedError, match="not tensor parallel"):
        Muon([torch.nn.Parameter(torch.zeros(2, 2)), p])
