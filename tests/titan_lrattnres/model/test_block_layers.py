"""Block AttnRes by block size in layers (``block_layers=k``): an end every 2k sublayers from the
start, the last block partial; the same model as ``blocks=N`` where the two schedules coincide."""

from __future__ import annotations

import pytest
import torch

from custom_ops.schedule import (
    block_ends,
    layer_block_ends,
    schedule_ends,
    site_sources,
    source_counts,
    source_sets,
)
from titan_lrattnres.evaluation import analysis
from titan_lrattnres.evaluation.inference import build_model, model_args_from_summary
from titan_lrattnres.model.flops import added_flops_percent
from titan_lrattnres.model.registry import Flavor, build_model_config
from train_configs import common, get_config

THREE_LAYERS = Flavor(dim=32, n_layers=3, n_heads=2, hidden_dim=48, vocab_size=128, max_seq_len=16)


def test_ends_every_2k_sublayers_last_block_partial():
    assert layer_block_ends(24, 5) == [10, 20, 24]  # 12 layers in blocks of 5, 5, 2
    assert layer_block_ends(8, 1) == [2, 4, 6, 8]
    assert layer_block_ends(6, 2) == [4, 6]
    assert layer_block_ends(6, 3) == [6]
    for bad in (0, 4, 1.5, None):
        with pytest.raises(ValueError, match="block_layers must be an int in"):
            layer_block_ends(6, bad)


@pytest.mark.parametrize("layers", [1, 2, 3, 4, 6, 12])
def test_coincides_with_a_block_count_when_k_divides_l(layers):
    m = 2 * layers
    for k in range(1, layers + 1):
        if layers % k == 0:
            assert layer_block_ends(m, k) == block_ends(m, layers // k)
            assert source_counts(layers, None, block_layers=k) == source_counts(layers, layers // k)


def test_source_sets_follow_the_size_schedule():
    # L = 3, k = 2: blocks {1..4} and {5, 6}
    assert site_sources(3, 6, None, block_layers=2) == [("embedding", 0), ("partial", 1)]
    assert site_sources(4, 6, None, block_layers=2) == [("embedding", 0), ("block", 1)]
    assert site_sources(5, 6, None, block_layers=2) == [
        ("embedding", 0),
        ("block", 1),
        ("partial", 2),
    ]  # noqa: E501
    counts = source_counts(3, None, block_layers=2)
    assert counts == [len(site_sources(t, 6, None, block_layers=2)) for t in range(1, 7)]
    assert counts == [2, 2, 2, 2, 3, 3]
    assert analysis.source_labels(5, 6, None, block_layers=2) == ["e", "B1", "P2"]
    with pytest.raises(ValueError, match="not both"):
        schedule_ends(6, 2, 2)


@pytest.mark.parametrize("schedule", [{"blocks": None}, {"blocks": 2}, {"blocks": 5},
                                      {"block_layers": 2}, {"block_layers": 3}])  # fmt: skip
def test_the_layers_walk_the_schedule(build, schedule):
    """Each layer's plan, and the sources each site reads, are the source sets
    ``source_sets`` walks: completed sources and a partial after each sublayer."""
    model = build(THREE_LAYERS, variant="sliced", rank=4, **schedule)
    m = model.router.num_sublayers
    walk = source_sets(m, schedule.get("blocks"), schedule.get("block_layers"))
    for i, layer in enumerate(model.layers.values()):
        assert (layer.plan.sources - 1, layer.plan.partial_in) == walk[2 * i], i
    seen = {}

    def call(layer, *stream):
        attend = lambda x: layer.attention(x, None, None)  # noqa: E731
        on_read = lambda t, values, keys, query: seen.setdefault(t, len(values))  # noqa: E731
        return layer.run(attend, *stream, on_read=on_read)

    model.run_layers(model.start(torch.randn(1, 2, 32)), call)
    assert seen == {t: 1 + sum(walk[t]) for t in range(1, m + 1)}


def test_both_given_is_refused():
    with pytest.raises(ValueError, match=r"give blocks \(a count, got 2\) or block_layers"):
        build_model_config("debug", blocks=2, block_layers=1)
    with pytest.raises(ValueError, match="got None"):  # None (Full) is a choice too
        build_model_config("debug", blocks=None, block_layers=1)
    with pytest.raises(ValueError, match=r"block_layers must be an int in \[1, 2\]"):
        build_model_config("debug", block_layers=3)
    assert build_model_config("cpu_small").router.blocks == 8  # the default still applies
    c = build_model_config("debug", variant="baseline", block_layers=1)
    assert c.router.blocks is None and c.router.block_layers is None


@pytest.mark.parametrize("variant", ["attnres", "sliced", "projected"])
def test_named_configs_by_size(variant):
    """cpu_default_*_k3 (L = 4, k = 3): blocks of 3 and 1 layers, ends 6 and 8 (partial last)."""
    router = get_config(f"cpu_default_{variant}_k3").model_spec.model.router
    assert (router.variant, router.blocks, router.block_layers) == (variant, None, 3)
    assert schedule_ends(router.num_sublayers, router.blocks, router.block_layers) == [6, 8]
    recipe = dict(name="both", flavor="cpu_small", variant=variant, rank=32, seq_len=256,
                  local_batch_size=8, steps=200, lr=3e-3, warmup_steps=20, decay_ratio=None,
                  min_lr_factor=0.1)  # fmt: skip
    with pytest.raises(ValueError, match=r"give blocks \(a count, got 4\) or block_layers"):
        common.make_config(**recipe, blocks=4, block_layers=3)
    by_count = common.make_config(**recipe, blocks=4).model_spec.model.router
    assert (by_count.blocks, by_count.block_layers) == (4, None)


@pytest.mark.parametrize("variant", ["attnres", "sliced", "projected"])
@pytest.mark.parametrize("k, n", [(1, 2), (2, 1)])
def test_same_model_as_the_coinciding_block_count(build, variant, k, n):
    """debug (L = 2): k = 1 is N = 2, k = 2 is N = 1: same parameters, FLOPs and outputs."""
    by_size = build(variant=variant, block_layers=k, rank=8, depth_backend="compiled")
    by_count = build(variant=variant, blocks=n, rank=8, depth_backend="compiled")
    assert by_size.router.ends == by_count.router.ends
    a, b = dict(by_size.named_parameters()), dict(by_count.named_parameters())
    assert a.keys() == b.keys() and all(torch.equal(a[p], b[p]) for p in a)
    cs = build_model_config("debug", variant=variant, block_layers=k, rank=8)
    cn = build_model_config("debug", variant=variant, blocks=n, rank=8)
    assert cs.get_nparams_and_flops(by_size, 64) == cn.get_nparams_and_flops(by_count, 64)
    shape = dict(num_layers=2, dim=64, hidden=192, rank=8)
    assert added_flops_percent(variant, block_layers=k, **shape) == added_flops_percent(
        variant, blocks=n, **shape
    )
    tokens = torch.randint(0, 4096, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(by_size(tokens), by_count(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("variant", ["sliced", "projected"])
def test_partial_last_block_two_phase_equals_one_pass(build, variant):
    """L = 3, k = 2: blocks of 4 and 2 sublayers; the fused two-phase read (block read +
    merge) equals the one-pass reference read, forward and gradients."""
    models = {
        b: build(flavor=THREE_LAYERS, variant=variant, block_layers=2, rank=5, depth_backend=b)
        for b in ("reference", "compiled")
    }
    assert models["compiled"].router.ends == [4, 6]
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    outs = {b: m(tokens) for b, m in models.items()}
    torch.testing.assert_close(outs["compiled"], outs["reference"], rtol=1e-5, atol=1e-5)
    for out in outs.values():
        out.square().mean().backward()
    ref = dict(models["reference"].named_parameters())
    for name, p in models["compiled"].named_parameters():
        torch.testing.assert_close(p.grad, ref[name].grad, rtol=1e-4, atol=1e-5, msg=name)


def test_run_summary_round_trip():
    summary = {"flavor": "debug", "variant": "sliced", "blocks": None, "block_layers": 1,
               "rank": 8}  # fmt: skip
    args = model_args_from_summary(summary)
    assert args == {"flavor": "debug", "variant": "sliced", "block_layers": 1, "rank": 8}
    assert build_model(args).router.ends == [2, 4]
