"""Tensor (+ sequence) parallel: vocabulary padding, per-module layouts and refusals (fast), and
parity with one process on CPU over gloo (slow).

Parity runs (``parallel_worker.py`` via ``parallel_runs.py``: ``cpu_smoke`` with another model, 3
steps, ``--debug.seed 0 --debug.deterministic``) all start from a seed checkpoint of their model
written by one process (``--checkpoint.create_seed_checkpoint``). Checked against the one-process
run from the same seed: loss and gradient-clipping norm at every step and every parameter's step-1
gradient within ``RTOL`` (measured: <= 1.2e-7 loss, <= 3e-7 norm, <= 1e-6 gradients). After 3 AdamW
steps the parameters are not compared with one process: AdamW turns fp32 rounding of a gradient
near its eps into a visible step (measured: one embedding entry 8.8e-4 apart). The checkpoint a TP
run saves is loaded in one process (``inference.load_model``): every parameter bitwise the TP
run's, logits within ``RTOL`` of the TP model's own (measured: 3.5e-7; the matmuls are split)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.titan_lrattnres.parallel_runs import (
    Runs,
    _rel,
    assert_checkpoint_loads_in_one_process,
    assert_parity,
)
from titan_lrattnres.model.model import PAD_LOGIT
from titan_lrattnres.model.registry import build_model_config

TP2 = ["--parallelism.tensor_parallel_degree", "2"]
NO_SP = ["--parallelism.no-enable_sequence_parallel"]


# -- fast ---------------------------------------------------------------------------------------
def _copy_into_padded(small, padded) -> None:
    """``padded`` gets ``small``'s weights (its extra vocabulary rows keep their values)."""
    with torch.no_grad():
        mine = dict(padded.named_parameters())
        for name, p in small.named_parameters():
            mine[name][: p.shape[0]].copy_(p)


def test_padded_vocab_same_loss_grads_and_greedy_tokens():
    from titan_lrattnres.components.zloss import ce_and_z
    from titan_lrattnres.evaluation.generate import generate

    torch.manual_seed(0)
    small = build_model_config("debug", blocks=2, vocab_size=1000, vocab_multiple=1).build()
    padded = build_model_config("debug", blocks=2, vocab_size=1000).build()
    for m in (small, padded):
        m.init_states(buffer_device=torch.device("cpu"))
    assert small.lm_head.out_features == 1000 and padded.lm_head.out_features == 1024
    assert padded.tok_embeddings.num_embeddings == 1024 and padded.vocab_size == 1000
    _copy_into_padded(small, padded)
    tokens = torch.randint(0, 1000, (2, 33), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    logits_s, logits_p = small(x), padded(x)
    assert (logits_p[..., 1000:] == PAD_LOGIT).all()
    torch.testing.assert_close(logits_p[..., :1000], logits_s, rtol=0, atol=0)
    for loss_fn in (
        lambda z: torch.nn.functional.cross_entropy(z.flatten(0, 1), y.flatten(), reduction="sum"),
        lambda z: sum(ce_and_z(z, y)),
    ):
        ls, lp = loss_fn(logits_s), loss_fn(logits_p)
        torch.testing.assert_close(lp, ls, rtol=1e-6, atol=0)
    lp.backward()
    ls.backward()
    gp, gs = padded.lm_head.weight.grad, small.lm_head.weight.grad
    assert _rel(gp[:1000], gs) < 1e-6  # fp32 rounding: softmax sums over 1024 vs 1000 entries
    assert (gp[1000:] == 0).all() and (padded.tok_embeddings.weight.grad[1000:] == 0).all()
    prompt = tokens[:, :5]
    for use_cache in (True, False):
        out_s = generate(small, prompt, 12, use_cache=use_cache)
        out_p = generate(padded, prompt, 12, use_cache=use_cache)
        assert torch.equal(out_s, out_p) and int(out_p.max()) < 1000


def test_vocab_multiple_and_flavor_rows():
    cl100k = build_model_config("paper_0p5b")
    assert cl100k.vocab_size == 100277 and cl100k.lm_head.out_features == 100288
    assert cl100k.tok_embeddings.num_embeddings == 100288
    assert build_model_config("debug", blocks=2).lm_head.out_features == 4096  # no padding needed
    with pytest.raises(ValueError, match="vocab_multiple must be an int >= 1"):
        build_model_config("debug", blocks=2, vocab_multiple=0)


def _trainer_config(**parallelism):
    from train_configs.cpu import cpu_smoke

    c = cpu_smoke()
    for k, v in parallelism.items():
        setattr(c.parallelism, k, v)
    return c


def test_every_norm_has_its_own_config_and_layout():
    c = _trainer_config(tensor_parallel_degree=2)
    m = c.model_spec.model
    norms = [n for layer in m.layers for n in (layer.attention_norm, layer.ffn_norm)] + [m.norm]
    assert len({id(n) for n in norms}) == len(norms)
    m.update_from_config(config=c)
    for norm in norms[:-1]:
        layer = norm.sharding_config
        assert layer.out_dst_shardings is None  # stays a sequence shard
        assert layer.in_src_shardings["input"].partition_spec is not None  # SP: sequence shards
    assert m.norm.sharding_config.out_dst_shardings is not None  # gathered for the head


@pytest.mark.parametrize("sp, axis_type", [(True, "R"), (False, "I")])
def test_depth_parameters_on_the_tp_axis(sp, axis_type):
    """Each layer's ``queries`` and the root ``embedding_key``: ``I`` without SP (every rank
    computes the whole gradient: no reduction, exact norm), ``R`` with SP (each rank's gradient
    covers its tokens)."""
    import spmd_types as spmd
    from torchtitan.distributed.parallel_dims import MeshAxisName

    from titan_lrattnres.spec import model_registry

    c = _trainer_config(tensor_parallel_degree=2, enable_sequence_parallel=sp)
    c.model_spec = model_registry("debug", variant="projected", blocks=2, rank=16)
    m = c.model_spec.model
    m.update_from_config(config=c)
    want = {"R": spmd.R, "I": spmd.I}[axis_type]
    queries = [(layer, "queries") for layer in m.layers]
    assert len(queries) == 2
    for layer in m.layers:  # the layer's own parameter (its sublayers declare theirs)
        assert list(layer.sharding_config.state_shardings) == ["queries"]
    for cfg, name in (*queries, (m.embedding_key, "weight")):
        layout = cfg.sharding_config.state_shardings[name]
        assert layout.axis_types[MeshAxisName.TP] is want


def test_tp_syncs_the_loss_vocabulary_and_checks_degrees():
    from titan_lrattnres.spec import model_registry

    c = _trainer_config(tensor_parallel_degree=2)
    c.model_spec = model_registry("debug", blocks=2, rank=16, vocab_size=1025)
    c.model_spec.model.update_from_config(config=c)
    assert c.loss.loss_fn.global_vocab_size == 1088  # the head's (padded) rows

    c = _trainer_config(tensor_parallel_degree=3)
    with pytest.raises(ValueError, match=r"tensor_parallel_degree \(3\) must divide n_heads \(4\)"):
        c.model_spec.model.update_from_config(config=c)
    c = _trainer_config(tensor_parallel_degree=2)
    c.model_spec = model_registry("debug", blocks=2, rank=16, vocab_size=1025, vocab_multiple=1)
    with pytest.raises(ValueError, match="must divide the padded vocabulary .* = 1025"):
        c.model_spec.model.update_from_config(config=c)


def test_tp_refuses_a_loss_without_vocabulary_parallelism():
    from torchtitan.components.loss import ChunkedLossWrapper, MSELoss

    c = _trainer_config(tensor_parallel_degree=2)
    c.loss = ChunkedLossWrapper.Config(loss_fn=MSELoss.Config())  # on local vocabulary shards
    with pytest.raises(NotImplementedError, match="vocabulary-parallel loss.*MSELoss is not one"):
        c.model_spec.model.update_from_config(config=c)


# -- slow: multi-process parity ---------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(env, tmp_path_factory):
    return Runs(env, tmp_path_factory.mktemp("tp_runs"))


CASES = {
    # model, sequence parallel, extra flags (TP without SP: test_recipe_tp's compiled case)
    "sliced_sp_typechecked": ("sliced", True, ["--debug.spmd_typechecking"]),
    # a padded vocabulary, and torchtitan's selective AC of each layer
    "projected_sp_padded_vocab_selective_ac_typechecked": (
        "projected_v1025",
        True,
        ["--debug.spmd_typechecking", "activation-checkpoint:selective"],
    ),
    # phase 1 as aten maths (the reference backend) on the sequence shards, type-checked
    "projected_reference_sp_typechecked": ("projected_ref", True, ["--debug.spmd_typechecking"]),
    "standard_full_sp_compiled": (
        "attnres_full",
        True,
        ["--compile.enable", "--compile.backend", "aot_eager"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_tp2_equals_one_process(runs, case):
    model, sp, extra = CASES[case]
    run = runs.run(model, f"tp2_{case}", [*TP2, *([] if sp else NO_SP), *extra], nproc=2)
    assert_parity(run, runs.ref(model))
    assert_checkpoint_loads_in_one_process(run)


@pytest.mark.slow
def test_2d_fsdp2_x_tp2_equals_one_process(runs):
    """dp_shard=2 x tp=2 on 4 gloo ranks (~45 s on 2 cores); 2 sequences per DP rank = the
    reference's 4 in the same global order."""
    args = [*TP2, "--parallelism.data_parallel_shard_degree", "2"]
    run = runs.run("sliced", "fsdp2_x_tp2", [*args, "--training.local_batch_size", "2"], nproc=4)
    assert_parity(run, runs.ref("sliced"))
    s = json.loads((run / "summary.json").read_text())
    assert s["world_size"] == 4
