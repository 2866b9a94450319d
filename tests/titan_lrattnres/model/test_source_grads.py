"""The completed sources' gradients, summed in fp32 in place (``depth._Sink``) instead of by
autograd: in fp32 the very numbers autograd's sums give (the same terms in the same order; the
embedding's under Block to one rounding), with and without activation checkpointing, for Full
and Block, sliced and projected keys; no
autograd addition per read and source; a retained graph's second backward adds the same again;
and a read finding only some of its sources' sums held adds them to its own."""

import pytest
import torch

import custom_ops
from tests.titan_lrattnres.model.test_recompute_reads import _grads, _loss, _model, _tokens
from titan_lrattnres.model.depth import DepthRouter, _BankRead, _Sink

CASES = [("attnres", None), ("sliced", 2), ("projected", 2), ("projected", None)]


def _autograd_sums(monkeypatch):
    """The router with no sink: autograd sums each source's gradients, as before the sink."""
    monkeypatch.setattr(DepthRouter, "_sink", staticmethod(lambda state, n, tensors: (None, 0)))


def _step(variant, blocks, ac):
    model = _model(variant, blocks, ac)
    loss = _loss(model, _tokens())
    loss.backward()
    return loss, _grads(model)


@pytest.mark.parametrize("ac", [None, "selective", "full"])
@pytest.mark.parametrize("variant, blocks", CASES)
def test_sink_gives_autograds_sums(monkeypatch, variant, blocks, ac):
    loss, got = _step(variant, blocks, ac)
    with monkeypatch.context() as m:
        _autograd_sums(m)
        loss0, want = _step(variant, blocks, ac)
    assert torch.equal(loss, loss0)
    assert got.keys() == want.keys()
    for name, g in want.items():
        if name == "tok_embeddings.weight" and blocks is not None:
            # sublayer 1 reads the embedding itself too, and its gradient used to come between
            # the phase-1 reads' (block 1's read is made before sublayer 1 runs): one rounding
            err = ((got[name] - g).norm() / g.norm()).item()
            assert 0 <= err < 1e-6, err
            continue
        assert torch.equal(got[name], g), (name, (got[name] - g).abs().max().item())


def _adds(variant, blocks) -> int:
    model = _model(variant, blocks)
    loss = _loss(model, _tokens())
    with torch.profiler.profile() as prof:
        loss.backward()
    return sum(e.count for e in prof.key_averages() if e.key in ("aten::add", "aten::add_"))


def test_autograd_adds_no_source_gradients(monkeypatch):
    """Full at M = 8 sublayers: site j reads the embedding and j outputs, 44 source gradients
    for 9 sources. Autograd adds 35 of them to others; with the sink, none (the fused CPU
    kernels add in place)."""
    with_sink = _adds("attnres", None)
    with monkeypatch.context() as m:
        _autograd_sums(m)
        without = _adds("attnres", None)
    m = 8
    assert without - with_sink == sum(j + 1 for j in range(1, m + 1)) - (m + 1), (
        without,
        with_sink,
    )


@pytest.mark.parametrize("variant, blocks", CASES)
def test_a_retained_graph_adds_the_same_again(variant, blocks):
    model = _model(variant, blocks)
    loss = _loss(model, _tokens())
    loss.backward(retain_graph=True)
    once = {n: g.clone() for n, g in _grads(model).items()}
    loss.backward()
    for name, g in _grads(model).items():
        assert torch.equal(g, 2 * once[name]), name


def test_a_read_finding_some_sums_held_adds_them():
    """Sources 0 and 2 hold sums, 1 none (a read whose outputs reached no loss ran no
    backward): the read hands on source 1's and 2's gradients (its own, plus 2's sum) and keeps
    source 0's, its own added; in fp32 bit for bit."""
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(2, 5, 16, generator=g) for _ in range(3)]
    query = torch.randn(1, 4, generator=g)
    out, lse = custom_ops.block_read(values, None, query)
    grad_out = torch.randn(out.shape, generator=g)
    fresh, _, fresh_q = custom_ops.block_read_backward(values, None, query, lse, grad_out, None)
    held = [torch.randn(v.shape, generator=g) for v in values]
    sink = _Sink()
    sink.values = [held[0].clone(), None, held[2].clone()]
    read = _BankRead(3, 1, False, None, "auto", sink, fresh=1)
    with torch.no_grad():
        got = read.backward([*values, query[0]], (None, lse), (grad_out, None))
    assert got[0] is None
    assert torch.equal(got[1], fresh[1]) and torch.equal(got[2], held[2] + fresh[2])
    assert torch.equal(got[3], fresh_q[0])
    assert torch.equal(sink.values[0], held[0] + fresh[0]) and sink.values[1:] == [None, None]


def test_reads_under_a_mode_leave_the_sums_to_autograd():
    """Under a function mode (as the SPMD type checker's) the reads keep the ops' own autograd:
    no sink, and the same gradients."""
    from torch.overrides import TorchFunctionMode

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    calls = []
    sink = DepthRouter._sink

    def spy(state, n, tensors):
        found = sink(state, n, tensors)
        calls.append(found[0] is not None)
        return found

    with pytest.MonkeyPatch.context() as m:
        m.setattr(DepthRouter, "_sink", staticmethod(spy))
        _, want = _step("sliced", 2, None)
        assert calls and all(calls)
        calls.clear()
        with Mode():
            _, got = _step("sliced", 2, None)
        assert calls and not any(calls)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=2e-6, atol=1e-7, msg=name)
