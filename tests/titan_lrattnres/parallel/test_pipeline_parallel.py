"""Pipeline parallel (``titan_lrattnres.parallel.pipeline``): stage plans, hop layouts and bytes,
ownership and refusals (fast), and parity with one process on CPU over gloo (slow).

Stages are cut between layers. Parity runs (``parallel_worker.py`` via ``parallel_runs.py``;
``cpu_smoke`` with another model: ``debug`` L=2, Block N=2 (ends after sublayers 2 and 4: the
one cut, after layer 0, at a block end) or Full; ``*_small``: ``cpu_small`` L=4, Block N=2 (ends
after sublayers 4 and 8: the cuts after layers 0 and 2 inside a block, after layer 1 at its
end); 4 microbatches of 1
sequence) start from the seed checkpoint of their model written by one process. Checked against
the one-process run from the same seed: loss and gradient-clipping norm at each of 3 steps and
every parameter's step-1 gradient (gathered from every stage) within ``RTOL``; the checkpoint the
pipeline run saves loads in one process with every parameter bitwise the pipeline's own and the
logits within ``RTOL`` of the logits the pipeline schedule computes.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

from custom_ops.schedule import schedule_ends
from tests.titan_lrattnres.parallel_runs import (
    RTOL,
    RUN,
    Runs,
    _rel,
    assert_checkpoint_loads_in_one_process,
    assert_parity,
)
from titan_lrattnres.parallel.pipeline import LRAttnResStage, SourceCache, attach
from titan_lrattnres.parallel.pipeline_plan import (
    Hop,
    check_schedule,
    hop_table,
    plan_stages,
    stage_spans,
)

AC = {"full": FullAC, "selective": SelectiveAC}  # as the trainer builds them from its config
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
# ``*_small`` (L=4, Block N=2: ends after layers 1 and 3): the cut after layer 0 is mid-block
MID_BLOCK = ["--parallelism.module_fqns_per_model_part", "tok_embeddings,layers.0",
             "layers.1,layers.2,layers.3,norm,lm_head"]  # fmt: skip
INTERLEAVED = ["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
               "--parallelism.module_fqns_per_model_part", "tok_embeddings,layers.0", "layers.1",
               "layers.2", "layers.3,norm,lm_head"]  # fmt: skip


# -- fast ---------------------------------------------------------------------------------------
def test_plan_ships_only_what_the_receiving_rank_lacks():
    # L=6 (M=12), Block N=3 (ends after sublayers 4, 8, 12 = layers 1, 3, 5); 4 stages on 2
    # ranks (loop placement: 0, 2 | 1, 3)
    spans, ends = [(0, 0), (1, 2), (3, 3), (4, 5)], [4, 8, 12]
    naive = plan_stages(spans, [0, 1, 0, 1], ends, cache=False)
    cached = plan_stages(spans, [0, 1, 0, 1], ends)
    # after layer 0 (mid-block): the embedding and a partial; after 2: + block 1 and a partial;
    # after 3 (a block end): embedding + blocks 1, 2
    assert [p.send for p in naive[:3]] == [Hop(1, True, 0, 1), Hop(3, True, 0, 2),
                                           Hop(4, False, 0, 3)]  # fmt: skip
    # rank 0 holds the embedding (stage 0's): stage 2 receives block 1 and the partial;
    # rank 1 holds embedding + block 1 (stage 1's): stage 3 receives block 2 only
    assert [p.send for p in cached[:3]] == [Hop(1, True, 0, 1), Hop(3, True, 1, 2),
                                            Hop(4, False, 2, 3)]  # fmt: skip
    assert [(p.take_from, p.deposit) for p in cached] == [(None, True), (None, True), (0, False),
                                                          (1, False)]  # fmt: skip
    assert [p.send.tensors(projected=True) for p in cached[:3]] == [4, 4, 2]  # (v, k) pairs
    assert cached[0].send.tensors(projected=False, baseline=True) == 1
    one_per_rank = plan_stages(spans, [0, 1, 2, 3], ends)
    assert [p.send for p in one_per_rank] == [p.send for p in naive]  # nothing cached
    # Full (an end after every sublayer): no partial at any cut, 2 more sources per layer
    full = plan_stages(spans, [0, 1, 0, 1], list(range(1, 13)))
    assert [p.send for p in full[:3]] == [Hop(1, False, 0, 3), Hop(3, False, 3, 7),
                                          Hop(4, False, 7, 9)]  # fmt: skip


def test_stage_spans_check_the_split():
    names = [["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "norm", "lm_head"]]
    assert stage_spans(names, 3) == [(0, 0), (1, 2)]
    keyed = [["tok_embeddings", "embedding_key", "layers.0"], ["layers.1", "norm", "lm_head"]]
    assert stage_spans(keyed, 2) == [(0, 0), (1, 1)]
    with pytest.raises(ValueError, match=r"stage 1 must hold the next layers in order from "):
        stage_spans([["tok_embeddings", "layers.0"], ["layers.2", "norm", "lm_head"]], 3)
    with pytest.raises(ValueError, match="at least one"):
        stage_spans([["tok_embeddings", "layers.0", "layers.1"], ["norm", "lm_head"]], 2)
    with pytest.raises(ValueError, match="lists 'norm'"):
        stage_spans([["tok_embeddings", "layers.0", "norm"], ["layers.1", "lm_head"]], 2)
    with pytest.raises(ValueError, match="lists 'embedding_key'"):
        stage_spans([["tok_embeddings", "layers.0"], ["embedding_key", "layers.1", "norm",
                                                      "lm_head"]], 2)  # fmt: skip
    with pytest.raises(ValueError, match="all 3 layers"):
        stage_spans([["tok_embeddings", "layers.0"], ["layers.1", "norm", "lm_head"]], 3)


def test_hop_bytes_at_the_paper_shape():
    t = hop_table(24, 1024, 8, 64, "sliced", stages=4, per_rank=2)
    assert len(t["hops"]) == 7 and t["total"]["cached"] < t["total"]["naive"]
    assert [h["cut"] for h in t["hops"]] == [3, 6, 9, 12, 15, 18, 21]  # layers before each hop
    # every hop carries h (2 B per element, bf16) plus whole [d] sources
    assert all(h["cached"] % (2 * 1024) == 0 and h["cached"] >= 2048 for h in t["hops"])
    flat = hop_table(24, 1024, 8, 64, "sliced", stages=4, per_rank=1)
    assert flat["total"]["cached"] == flat["total"]["naive"]  # one stage per rank: no cache


def test_zero_bubble_schedules_are_refused_with_the_reason():
    check_schedule("Interleaved1F1B")
    with pytest.raises(NotImplementedError, match="split the backward"):
        check_schedule("ZBVZeroBubble")


@pytest.mark.parametrize(
    "blocks, backend, ac",
    [(2, "reference", None), (2, "auto", None), (None, "auto", None), (2, "auto", "full"),
     (None, "auto", "selective")],
)  # fmt: skip
@pytest.mark.parametrize("variant", ["baseline", "attnres", "sliced", "projected"])
def test_stages_own_their_queries_and_match_the_whole_model(build, variant, blocks, backend, ac):
    """Three stages of one model (``cpu_small``: L=4) in one process, layers 0 | 1-2 | 3 on ranks
    0, 1, 0, the hops passed by hand, the cache on: logits and every gradient equal the whole
    model's. Block N=2 (ends after layers 1 and 3): both cuts fall inside a block, so the
    partial crosses them, and the third stage reads the embedding from the cache. Full: no
    partial, every sublayer output a source, the third stage reads the first stage's three
    from the cache. With activation checkpointing on the stages' layers (``ac``)."""
    torch.manual_seed(0)
    whole = build(flavor="cpu_small", variant=variant, blocks=blocks, rank=8,
                  depth_backend=backend)  # fmt: skip

    spans, ranks = [(0, 0), (1, 2), (3, 3)], [0, 1, 0]
    plans = plan_stages(spans, ranks, schedule_ends(8, blocks))
    assert plans[2].take_from == 0 and plans[2].recv.first_source > 0  # read from the cache
    cache, stages = SourceCache(), []
    for plan in plans:
        part = copy.deepcopy(whole)
        for k in list(part.layers.keys()):
            if not plan.first <= int(k) <= plan.last:
                del part.layers[k]
        if plan.index:
            part.tok_embeddings = None
        if plan.send is not None:
            part.norm = part.lm_head = None
        attach(part, plan, cache)
        if ac is not None:
            AC[ac].Config().build().apply(part)
        stages.append(part)
    assert isinstance(stages[0], LRAttnResStage)

    def depth_params(stage):
        names = (n.replace("_checkpoint_wrapped_module.", "") for n, _ in stage.named_parameters())
        return sorted(n for n in names if n.endswith(".queries") or n.startswith("embedding_key"))

    key = ["embedding_key.weight"] if variant == "projected" else []
    want = [[*key, "layers.0.queries"], ["layers.1.queries", "layers.2.queries"],
            ["layers.3.queries"]]  # fmt: skip
    assert [depth_params(s) for s in stages] == (want if variant != "baseline" else [[], [], []])
    tokens = torch.randint(0, 4096, (2, 9))
    ref = whole(tokens)
    outs, ins = [stages[0](tokens)], [None]
    for stage in stages[1:]:  # each stage's inputs are leaves, as PipelineStage makes them
        ins.append(tuple(t.detach().requires_grad_() for t in outs[-1]))
        assert len(ins[-1]) == stage.plan.recv.tensors(
            variant == "projected", variant == "baseline"
        )
        outs.append(stage(*ins[-1]))
    torch.testing.assert_close(outs[-1], ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(ref)
    ref.backward(grad)
    torch.autograd.backward(outs[-1], grad)  # the stages' backwards, last first, as scheduled
    for i in range(len(stages) - 2, -1, -1):
        torch.autograd.backward(outs[i], [t.grad for t in ins[i + 1]])
    cache.check_drained()
    want = dict(whole.named_parameters())
    got = {n.replace("_checkpoint_wrapped_module.", ""): p.grad
           for s in stages for n, p in s.named_parameters()}  # fmt: skip
    assert sorted(got) == sorted(want)  # every parameter on exactly one stage
    for name, g in got.items():  # fp32 sums in another order (standard keys: |grad| ~ 500)
        assert _rel(g, want[name].grad) < RTOL, (name, _rel(g, want[name].grad))


# -- slow: multi-process parity ---------------------------------------------------------------
@pytest.fixture(scope="module")
def runs(env, tmp_path_factory):
    return Runs(env, tmp_path_factory.mktemp("pp_runs"))


CASES = {
    # model, flags (2 ranks)
    "sliced_1f1b_cut_at_block_end": ("sliced", PP2),  # default split: layer 0 | layer 1
    "projected_1f1b_cut_mid_block": ("projected_small", [*PP2, *MID_BLOCK]),
    "projected_interleaved_2x4_cached_selective_ac": (
        "projected_small",
        [*PP2, *INTERLEAVED, "activation-checkpoint:selective"],  # the GPU configs' AC
    ),
    "standard_full_1f1b_compiled": (
        "attnres_full",
        [*PP2, "--compile.enable", "--compile.backend", "aot_eager"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_pp2_equals_one_process(runs, case):
    model, flags = CASES[case]
    run = runs.run(model, f"pp2_{case}", flags, nproc=2)
    assert_parity(run, runs.ref(model))
    assert_checkpoint_loads_in_one_process(run)


@pytest.mark.slow
def test_3d_pp2_x_tp2_x_fsdp2_equals_one_process_with_validation(runs):
    """PP=2 x TP=2 (+ SP) x FSDP=2 on 8 gloo ranks (~1 min on 2 cores), validation on: the
    validation loss reported by rank 0 (which holds no last stage) is the one-process one."""
    val = ["--validator.enable"]
    flags = [*PP2, "--parallelism.tensor_parallel_degree", "2"]
    flags += ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2"]
    run = runs.run("sliced", "pp2_tp2_fsdp2", [*flags, *val], nproc=8)
    assert_parity(run, runs.ref("sliced"))
    assert_checkpoint_loads_in_one_process(run)
    ref_val = runs.run("sliced", "ref_sliced_val", val)
    got, want = (json.loads((r / "summary.json").read_text()) for r in (run, ref_val))
    assert got["world_size"] == 8
    assert got["final_val_loss"] == pytest.approx(want["final_val_loss"], rel=RTOL, abs=0)


@pytest.mark.slow
def test_pp2_paper_recipe_equals_one_process(runs, tmp_path):
    """Muon + AdamW, z-loss (``cpu_smoke_muon``): the losses and their z-loss part as in one
    process (torch's first-step shape inference calls the loss on uninitialised tensors)."""
    from tests.titan_lrattnres.trainer_runs import launch

    seed = ["--checkpoint.initial_load_path", str(runs.seed("sliced"))]
    argv = ["cpu_smoke_muon", *RUN, *seed]
    one, _ = launch([{"name": "one", "argv": [*argv, "--dump_folder", str(tmp_path / "one")]}],
                    tmp_path / "l1", runs.env)  # fmt: skip
    pp, _ = launch([{"name": "pp", "argv": [*argv, *PP2, "--dump_folder", str(tmp_path / "pp")]}],
                   tmp_path / "l2", runs.env, nproc=2)  # fmt: skip
    got, want = pp["pp"]["history"], one["one"]["history"]
    assert [h["step"] for h in got] == [h["step"] for h in want] == [1, 2, 3]
    for g, w in zip(got, want, strict=True):
        for key in ("loss", "z_loss"):
            assert g[key] == pytest.approx(w[key], rel=RTOL, abs=0), (key, g, w)
