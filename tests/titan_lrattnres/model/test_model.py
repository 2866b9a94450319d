"""Model properties for every variant (docs/method.md §1-4) against a slow loop written here."""

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import custom_ops
from titan_lrattnres.model.registry import FLAVORS, Flavor, build_model_config

VARIANTS = ["baseline", "attnres", "sliced", "projected"]
SETTINGS = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


EPS = torch.finfo(torch.float32).eps


def rms(x, eps=EPS):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def sublayer_output(layer, j, h):
    """``o_j`` (projected: ``(o_j, RMSNorm(k_j))``) of sublayer j (of ``layer``) from its parts:
    what it writes before any residual or partial."""
    if j % 2:
        y = layer.attention(layer.attention_norm(h), None, None)
    else:
        y = layer.feed_forward(layer.ffn_norm(h))
    if not layer.key_rank:
        return y
    return y[..., : layer.dim], rms(y[..., layer.dim :]).float()


def slow_forward(model, tokens, n_blocks):
    """An obviously-correct LR-AttnRes forward: explicit source sets per site, explicit softmax.

    ``n_blocks`` (None = Full) is the block count the model was built with; the source sets are
    derived here from docs/method.md §3, never from the model's router."""
    router = model.router
    variant, m = router.variant, router.num_sublayers
    layers = list(model.layers.values())
    e = model.tok_embeddings(tokens)
    outs, keys = [e], []
    if variant == "projected":
        keys.append(rms(e @ model.embedding_key.weight.T))  # the raw W_0^K e
    h = e
    for j in range(1, m + 1):
        out = sublayer_output(layers[(j - 1) // 2], j, h)
        if variant == "projected":
            out, k = out
            keys.append(k.double())  # normalised at emission (checked in its own test)
        outs.append(out)
        if variant == "baseline":
            h = sum(outs)  # e + Σ o_j
            continue
        # the source set of site j, straight from docs/method.md §3
        if n_blocks is None:
            members = [[i] for i in range(1, j + 1)]
        else:
            ends = [math.ceil(m * i / n_blocks) for i in range(1, n_blocks + 1)]
            members, start = [], 0
            for end in ends:
                if end <= j:
                    members.append(list(range(start + 1, end + 1)))
                    start = end
            if start < j:
                members.append(list(range(start + 1, j + 1)))  # partial incl. o_j
        values = [e] + [sum(outs[i] for i in grp) for grp in members]
        if variant == "projected":
            ks = [keys[0]] + [sum(keys[i] for i in grp) for grp in members]
        else:
            r = router.rank
            ks = [v[..., -r:] for v in values]
        q = torch.cat(model.depth_queries())[j - 1].double()  # site order, 1..2L
        logits = torch.stack([(rms(k) * q).sum(-1) for k in ks])
        alpha = torch.softmax(logits, 0)
        h = sum(a.unsqueeze(-1) * v.double() for a, v in zip(alpha, values)).to(e.dtype)
    return model.lm_head(model.norm(h))


# 3 layers (M = 6) at a tiny width. N = 4 does not divide 2L: blocks of 2, 1, 2 and 1 sublayers,
# so site 4 merges a partial after two completed blocks. N = 1: one block, a partial at every site
# but the last. N = 6 = 2L: every sublayer its own block (Full through the Block code path).
THREE_LAYERS = Flavor(dim=32, n_layers=3, n_heads=2, hidden_dim=48, vocab_size=128, max_seq_len=16)
SOURCE_SETS = {"full": None, "N1": 1, "N4": 4, "N6": 6}
EVERY_VARIANT = [("baseline", "full")] + [(v, n) for v in VARIANTS[1:] for n in SOURCE_SETS]


def check_slow_loop(build, flavor, variant, blocks, rank, backend, seed):
    model = build(
        flavor=flavor, variant=variant, blocks=blocks, rank=rank, seed=seed, depth_backend=backend
    )
    vocab = model.tok_embeddings.num_embeddings
    tokens = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        got, want = model(tokens), slow_forward(model, tokens, blocks)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["reference", "compiled"])
@pytest.mark.parametrize(
    "variant,source_set", EVERY_VARIANT, ids=[f"{v}-{n}" for v, n in EVERY_VARIANT]
)
def test_every_variant_matches_slow_loop(build, variant, source_set, backend):
    """Every variant x {Full, N not dividing 2L, N = 1, N = 2L}, one-pass (reference) and
    two-phase (compiled: block read + merge) reads, r = 5 < d."""
    blocks = SOURCE_SETS[source_set]
    check_slow_loop(build, THREE_LAYERS, variant, blocks, 5, backend, seed=len(variant))


def test_slow_loop_tells_the_source_sets_apart(build):
    """The comparison above resolves source sets: the same weights read with another block
    count give another answer (Full and N = 2L are the same sets, by docs/method.md §3)."""
    model = build(flavor=THREE_LAYERS, variant="sliced", blocks=4, rank=5)
    tokens = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        outs = {name: slow_forward(model, tokens, n) for name, n in SOURCE_SETS.items()}
    torch.testing.assert_close(outs["full"], outs["N6"], rtol=0, atol=0)
    for a, b in itertools.combinations(["full", "N1", "N4"], 2):
        assert (outs[a] - outs[b]).abs().max() > 1e-3, (a, b)


@st.composite
def configs(draw):
    variant = draw(st.sampled_from(VARIANTS))
    blocks = draw(st.sampled_from([None, 1, 2, 3, 4]))
    rank = draw(st.integers(1, 64))
    return variant, blocks, rank


@SETTINGS
@given(configs(), st.sampled_from(["reference", "compiled"]), st.integers(0, 1000))
def test_block_sums_match_slow_loop(build, cfg, backend, seed):
    """Hypothesis exploring on top of the explicit grid: the debug flavor (M = 4), any rank."""
    variant, blocks, rank = cfg
    check_slow_loop(build, "debug", variant, blocks, rank, backend, seed)


def test_zero_queries_are_a_uniform_mean_not_the_residual_sum(build):
    model = build(variant="sliced", blocks=None, rank=8, randomize_queries=False)
    assert all(torch.count_nonzero(q) == 0 for q in model.depth_queries())
    tokens = torch.randint(0, 4096, (1, 5))
    e = model.tok_embeddings(tokens)
    layer = model.layers["0"]
    o1 = layer.attention(layer.attention_norm(e), None, None)
    seen = []
    layer.run(
        lambda x: layer.attention(x, None, None), *model.start(e), on_read=lambda *a: seen.append(a)
    )
    t, values, keys, query = seen[0]
    assert t == 1 and keys is None and len(values) == 2
    torch.testing.assert_close(values[1], o1)  # site 1 reads e and o_1: their plain mean
    h1 = custom_ops.reference.depth_read(values, custom_ops.reference.sliced_keys(values, 8), query)
    torch.testing.assert_close(h1, (e + o1) / 2)


@SETTINGS
@given(configs(), st.integers(1, 11))
def test_prefix_invariance(build, cfg, cut):
    variant, blocks, rank = cfg
    model = build(variant=variant, blocks=blocks, rank=rank)
    g = torch.Generator().manual_seed(cut)
    a = torch.randint(0, 4096, (2, 12), generator=g)
    b = a.clone()
    b[:, cut:] = torch.randint(0, 4096, (2, 12 - cut), generator=g)
    with torch.no_grad():
        la, lb = model(a), model(b)
    torch.testing.assert_close(la[:, :cut], lb[:, :cut], rtol=0, atol=1e-5)
    assert not torch.allclose(la[:, cut:], lb[:, cut:])


@pytest.mark.parametrize("blocks", [None, 2, 4])
def test_standard_attnres_equals_sliced_with_rank_d(build, blocks):
    std = build(variant="attnres", blocks=blocks)
    sl = build(variant="sliced", blocks=blocks, rank=FLAVORS["debug"].dim, seed=1)
    sl.load_state_dict(std.state_dict())
    tokens = torch.randint(0, 4096, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(std(tokens), sl(tokens), rtol=0, atol=0)


def _nparams(**kw):
    with torch.device("meta"):
        model = build_model_config("debug", **kw).build()
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("flavor", ["debug", "paper_0p5b"])
@pytest.mark.parametrize("blocks", [None, 4])
@pytest.mark.parametrize("rank", [1, 16, 32])
def test_parameter_counts(flavor, blocks, rank):
    f = FLAVORS[flavor]
    d, n_layers, hid = f.dim, f.n_layers, f.hidden_dim

    def count(**kw):
        with torch.device("meta"):
            model = build_model_config(flavor, blocks=blocks, **kw).build()
        return sum(p.numel() for p in model.parameters())

    base = count(variant="baseline")
    assert count(variant="projected", rank=rank) - base == (
        rank * n_layers * (d + hid) + rank * d + 2 * n_layers * rank
    )
    assert count(variant="sliced", rank=rank) - base == 2 * n_layers * rank
    assert count(variant="attnres") - base == 2 * n_layers * d


def test_paper_model_size():
    with torch.device("meta"):
        model = build_model_config("paper_0p5b", variant="baseline").build()
    n = sum(p.numel() for p in model.parameters())
    assert 0.4e9 < n < 0.65e9, n  # ~0.5B with an untied 100k head


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_backward_finite(build, variant, dtype):
    model = build(variant=variant, blocks=2, rank=16, dtype=dtype)
    tokens = torch.randint(0, 4096, (2, 16))
    loss = torch.nn.functional.cross_entropy(
        model(tokens).float().flatten(0, 1), tokens.roll(-1, 1).flatten()
    )
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert torch.isfinite(p.grad).all(), name
    if variant != "baseline":
        assert all(q.grad.abs().sum() > 0 for q in model.depth_queries())
    if variant == "projected":
        assert model.layers["0"].feed_forward.w2.weight.grad[-16:].abs().sum() > 0


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("blocks", [None, 3])
def test_trains_a_few_steps(build, variant, blocks):
    model = build(variant=variant, blocks=blocks, rank=8, randomize_queries=False)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 64, (4, 32), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(6):
        loss = torch.nn.functional.cross_entropy(
            model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5, losses


def test_projected_keys_are_normalised_at_emission(build):
    model = build(variant="projected", rank=8, blocks=2)
    h = torch.randn(2, 5, 64)
    for layer in model.layers.values():
        for raw in (layer.attention(h, None, None), layer.feed_forward(h)):
            o, k = layer.emit(raw)
            torch.testing.assert_close(o, raw[..., :64])
            torch.testing.assert_close(k, rms(raw[..., 64:]).float())
            assert k.dtype == torch.float32


def test_queries_are_fp32_zero_initialised(build):
    model = build(variant="projected", rank=8, blocks=2, randomize_queries=False)
    queries = {n: p for n, p in model.named_parameters() if "quer" in n}
    # the sites feeding each layer: layer 0 site 1 (site 0 has no query), layer 1 sites 2, 3
    # and the final read 4
    assert list(queries) == ["layers.0.queries", "layers.1.queries"]
    assert [q.shape for q in queries.values()] == [(1, 8), (3, 8)]
    assert [layer.sites for layer in model.layers.values()] == [(1,), (2, 3, 4)]
    for q in queries.values():
        assert q.dtype == torch.float32 and torch.count_nonzero(q) == 0


def test_projected_output_projection_is_one_torchtitan_linear(build):
    from torchtitan.models.common.linear import Linear

    model = build(variant="projected", rank=8, blocks=2)
    for layer in model.layers.values():
        for proj in (layer.attention.wo, layer.feed_forward.w2):
            assert isinstance(proj, Linear) and proj.out_features == 64 + 8


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(variant="nope"), r"variant must be one of"),
        (dict(variant="sliced", rank=0, blocks=2), r"rank must be an int in \[1, 64\]"),
        (dict(variant="sliced", rank=65, blocks=2), r"rank must be an int in \[1, 64\]"),
        (dict(variant="projected", rank=65, blocks=2), r"rank must be an int in \[1, 64\]"),
        (dict(blocks=0), r"blocks must be None \(Full\) or an int in \[1, 4\]"),
        (dict(blocks=5), r"blocks must be None \(Full\) or an int in \[1, 4\]"),
        (dict(depth_backend="fast", blocks=2), r"depth_backend must be one of"),
    ],
)
def test_bad_config_fails_at_config_time(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_model_config("debug", **kwargs)


def test_unknown_flavor_lists_flavors():
    with pytest.raises(ValueError, match="flavor must be one of.*paper_0p5b"):
        build_model_config("huge")


def test_flops_include_routing():
    from titan_lrattnres.model.flops import routing_flops

    base = build_model_config("debug", variant="baseline")
    sl = build_model_config("debug", variant="sliced", rank=16, blocks=2)
    with torch.device("meta"):
        mb, ms = base.build(), sl.build()
    nb, fb = base.get_nparams_and_flops(mb, 64)
    ns, fs = sl.get_nparams_and_flops(ms, 64)
    # 6 x the routing parameters (queries) + 3 x the read (fwd + bwd)
    assert fs - fb == 6 * (ns - nb) + 3 * routing_flops("sliced", 2, 64, 192, 16, 2)
