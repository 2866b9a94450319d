"""The benchmarks' models have torchtitan's units: a model of L layers is L compiled units (and,
under FSDP2, L FSDP units beside torchtitan's own), trains three steps without a recompile, with
or without activation checkpointing. Several models in one process:
``tests/titan_lrattnres/model/test_compile.py``. Units, graphs and recompiles are dynamo's, so
the models compile with dynamo's ``eager`` backend; what AOTAutograd and Inductor make of the
layers' graphs: ``tests/titan_lrattnres/model/test_backends.py``."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from benchmarks import overhead

# 8 sublayers: sliced3 ends blocks inside layers (after an attention), projected2 after MLPs
SHAPE = overhead.Shape(layers=4, dim=32, seq=8, heads=2, vocab=64, hidden=64)
ROUTED = ("sliced3_r8", "projected2_r8", "full")


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _step(model, shape=SHAPE, seed=0):
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, shape.vocab, (1, shape.seq + 1), generator=g)
    return overhead.Step(model, data[:, :-1], data[:, 1:].flatten(), False, False)


def _build(name, shape=SHAPE, ac="none", compile_=True):
    return overhead.build(name, shape, "cpu", torch.float32, compile_, ac=ac, backend="eager")


def _compiled_units(model) -> list:
    """The compiled modules but P-LR's embedding key, a region of its own beside the layers
    (``test_the_embedding_key_is_the_one_other_compiled_unit``)."""
    key = getattr(model, "embedding_key", None)
    return [m for m in model.modules()
            if getattr(m, "_compiled_call_impl", None) is not None and m is not key]  # fmt: skip


@pytest.mark.parametrize("ac", ["none", "full"])
@pytest.mark.parametrize("name", ["torchtitan", "baseline", *ROUTED])
def test_a_model_of_l_layers_is_l_compiled_units(name, ac):
    model = _build(name, ac=ac)
    units = _compiled_units(model)
    assert len(units) == SHAPE.layers
    assert [id(u) for u in units] == [id(u) for u in model.layers.values()]


@pytest.mark.parametrize("name", ["baseline", "projected2_r8"])
def test_the_embedding_key_is_the_one_other_compiled_unit(name):
    model = _build(name)
    others = [m for m in model.modules() if getattr(m, "_compiled_call_impl", None) is not None
              and m not in list(model.layers.values())]  # fmt: skip
    assert others == ([model.embedding_key] if name.startswith("projected") else [])


@pytest.mark.parametrize("ac", ["none", "selective"])
@pytest.mark.parametrize("name", ["baseline", *ROUTED])
def test_three_steps_compile_once_per_plan_and_never_again(name, ac):
    """One graph per layer plan, made in the first step; no recompile in three steps (a code
    object with a second graph would fail at once: the recompile limit is 1)."""
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        model = _build(name, ac=ac)
        step = _step(model)
        losses = [step().item() for _ in range(3)]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert not counters["recompiles"], dict(counters["recompiles"])
    assert counters["graph_break"] == {}, dict(counters["graph_break"])
    graphs = model.router.graphs + model.router.projected  # P-LR: its embedding key's
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])


def test_full_ac_three_steps_no_recompile():
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        model = _build("projected2_r8", ac="full")
        step = _step(model)
        for _ in range(3):
            step()
    assert not counters["recompiles"], dict(counters["recompiles"])


def _fsdp_groups(model) -> int:
    """FSDP units of ``model``: distinct states of its ``fully_shard``-ed modules."""
    from torch.distributed.fsdp import FSDPModule

    return len({id(m._get_fsdp_state()) for m in model.modules() if isinstance(m, FSDPModule)})


@pytest.mark.parametrize("name", ["torchtitan", "projected2_r8"])
def test_fsdp_units_are_the_layers_and_torchtitans_own(name):
    """torchtitan's ``apply_fsdp_to_decoder`` on a one-rank gloo group: one unit per layer, and
    torchtitan's own (the embedding; the final norm with the head; the root, which holds the
    projected variant's embedding key); compiled, three steps without a recompile."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    from titan_lrattnres.evaluation.memory import process_group

    with process_group(1, fake=False):
        model = _build(name)
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
        apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32,
                              reduce_dtype=torch.float32, pp_enabled=False)  # fmt: skip
        assert _fsdp_groups(model) == SHAPE.layers + 3
        assert len(_compiled_units(model)) == SHAPE.layers
        step = _step(model)
        with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
            for _ in range(3):
                assert torch.isfinite(step())
    assert not counters["recompiles"], dict(counters["recompiles"])


@pytest.mark.parametrize("ac", ["none", "selective"])
def test_the_unshared_baseline_compiles_one_graph_per_layer(ac):
    """``baseline_unshared``: the baseline's step with L graphs, one per layer, where the baseline
    compiles one for all; the same losses."""
    losses = {}
    for name in ("baseline", "baseline_unshared"):
        torch._dynamo.reset()
        counters.clear()
        model = _build(name, ac=ac)
        assert len(_compiled_units(model)) == SHAPE.layers
        losses[name] = _step(model)().item()
        graphs = 1 if name == "baseline" else SHAPE.layers
        assert counters["stats"]["unique_graphs"] == graphs, (name, dict(counters["stats"]))
    assert losses["baseline"] == losses["baseline_unshared"]
