"""``benchmarks.layer_units``: a model run in compile units of one layer keeps its numbers (the
loss and every gradient, bit for bit eager, to rounding compiled), and what it cannot run the
same way is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from benchmarks import overhead
from benchmarks.layer_units import per_layer

# 8 sublayers: two blocks of 4, each block end after an MLP sublayer
SHAPE = overhead.Shape(layers=4, dim=16, seq=8, heads=2, vocab=64, hidden=32)


def _loss_and_grads(model, tokens, targets):
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets)
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return loss.detach(), grads


def _pair(name, compile_):
    a = overhead.build(name, SHAPE, "cpu", torch.float32, compile_=False, seed=3)
    b = overhead.build(f"{name}:layer", SHAPE, "cpu", torch.float32, compile_=compile_, seed=3)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, SHAPE.vocab, (2, SHAPE.seq + 1), generator=g)
    tokens, targets = data[:, :-1], data[:, 1:].flatten()
    return _loss_and_grads(a, tokens, targets), _loss_and_grads(b, tokens, targets)


@pytest.mark.parametrize("name", ["baseline", "attnres2", "sliced2_r8", "projected2_r4"])
def test_layer_units_are_the_model_bit_for_bit_eager(name):
    (loss_a, grads_a), (loss_b, grads_b) = _pair(name, compile_=False)
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for n, g in grads_a.items():
        assert g is not None and grads_b[n] is not None, n
        assert torch.equal(g, grads_b[n]), n


def test_compiled_layer_units_are_the_model_to_rounding():
    (loss_a, grads_a), (loss_b, grads_b) = _pair("sliced2_r8", compile_=True)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-5)
    for n, g in grads_a.items():
        torch.testing.assert_close(grads_b[n], g, rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.parametrize(
    "name, ac, match",
    [
        ("full", "none", "block end after an MLP"),  # Full: read in pairs of sites
        ("attnres8", "none", "block end after an MLP"),  # one sublayer per block
        ("sliced2_r8", "selective", "without activation checkpointing"),
        ("torchtitan", "none", "per layer already"),
    ],
)
def test_what_layer_units_cannot_run_the_same_way_is_refused(name, ac, match):
    with pytest.raises(ValueError, match=match):
        overhead.build(f"{name}:layer", SHAPE, "cpu", torch.float32, compile_=False, ac=ac)


def test_an_unknown_unit_is_refused():
    with pytest.raises(ValueError, match="the one suffix is ':layer'"):
        overhead.parse_variant("attnres2:block")


def test_per_layer_checks_an_odd_number_of_sublayers_per_block():
    shape = overhead.Shape(layers=3, dim=16, seq=8, heads=2, vocab=64, hidden=32)
    model = overhead.build("attnres2", shape, "cpu", torch.float32, compile_=False)  # 3 a block
    with pytest.raises(ValueError, match="ends are"):
        per_layer(model, compile_=False)
