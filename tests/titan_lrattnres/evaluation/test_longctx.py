"""The long-input evaluation's construction on hand-made inputs with known answers."""

from __future__ import annotations

import math

import pytest
import torch

from titan_lrattnres.evaluation import longctx

V = 32


class Uniform(torch.nn.Module):
    def forward(self, tokens):
        return torch.zeros(*tokens.shape, V)


class Induction(torch.nn.Module):
    """Predicts, at every position, the token that followed the previous occurrence of the
    current token (uniform when the token is new): a perfect copier."""

    def forward(self, tokens):
        out = torch.zeros(*tokens.shape, V)
        for b, row in enumerate(tokens.tolist()):
            for p, t in enumerate(row):
                prev = [i for i in range(p) if row[i] == t]
                if prev:
                    out[b, p, row[prev[-1] + 1]] = 100.0
        return out


def test_copy_sequence_scores_the_span_tokens_of_each_occurrence():
    tokens, s1, s2 = longctx.copy_sequence([5, 6, 7], [1, 2])
    assert tokens.tolist() == [5, 6, 7, 1, 2, 5, 6, 7]
    targets = tokens[1:].tolist()
    assert targets[s1] == [6, 7] and targets[s2] == [6, 7]
    _, s1, s2 = longctx.copy_sequence([5, 6, 7], [])
    assert (s1, s2) == (slice(0, 2), slice(3, 5))


def test_copy_probe_known_answers():
    spans = [[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]]
    filler = torch.arange(0, 8)  # tokens disjoint from the spans
    res = longctx.copy_probe(Induction(), spans, filler, gaps=[0, 3, 6])
    for gap, r in res.items():
        assert r["second_loss"] < 1e-6, gap  # the copier copies
        assert r["first_loss"] == pytest.approx(math.log(V))  # nothing to copy the first time
        assert r["probes"] == 2
    res = longctx.copy_probe(Uniform(), spans, filler, gaps=[4])
    assert res[4]["second_loss"] == pytest.approx(math.log(V))


def test_position_losses_and_buckets():
    flat = torch.randint(0, V, (100,), generator=torch.Generator().manual_seed(0))
    losses, n = longctx.position_losses(Uniform(), flat, length=12, max_seqs=5, batch=2)
    assert n == 5 and len(losses) == 12
    assert losses == pytest.approx([math.log(V)] * 12)
    assert longctx.buckets([1.0, 3.0, 5.0, 7.0, 9.0], 2) == [2.0, 6.0, 9.0]
    with pytest.raises(ValueError, match="no sequence of 201"):
        longctx.position_losses(Uniform(), flat, length=200, max_seqs=1)


def test_function_spans_take_the_head_of_each_function():
    text = "x = 1\n\ndef f(a):\n    return a + 1\n\nclass C:\n    def g(self):\n        pass\n"
    spans = longctx.function_spans([text, "def broken(:\n"], lambda s: list(s.encode()), 8)
    assert [bytes(s).decode() for s in spans] == ["def f(a)", "def g(se"]
    assert longctx.function_spans([text], lambda s: list(s.encode()), 100) == []


def test_compare_with_baseline():
    run = {"loss_by_position": {"1": {"buckets": [2.0, 3.0]}},
           "copy_probe": {"0": {"second_loss": 1.0}}}  # fmt: skip
    base = {"loss_by_position": {"1": {"buckets": [2.5, 2.0]}},
            "copy_probe": {"0": {"second_loss": 1.5}}}  # fmt: skip
    result = {"runs": {"baseline": base, "sliced N=4 r=32": run}}
    longctx.compare_with_baseline(result)
    vs = run["vs_baseline"]
    assert vs["loss_by_position"]["1"] == [-0.5, 1.0] and vs["copy_second_loss"]["0"] == -0.5
