"""The completed sources' gradients, summed in fp32 in place (``custom_ops.SourceBank``)
instead of by autograd: in fp32 the very numbers autograd's sums give (the same terms in the
same order; the embedding's under Block to one rounding), with and without activation
checkpointing, for Full and Block, sliced and projected keys; no autograd addition per read and
source; a retained graph's second backward adds the same again; a read finding only some of its
sources' sums held adds them to its own; and a forward without a backward frees its sources."""

import pytest
import torch

import custom_ops
from tests.titan_lrattnres.model.test_recompute_reads import _grads, _loss, _model, _tokens
from titan_lrattnres.model.depth import DepthRouter, _BankRead

CASES = [("attnres", None), ("sliced", 2), ("projected", 2), ("projected", None)]


def _autograd_sums(monkeypatch):
    """The router with no bank: autograd sums each source's gradients, as before the bank."""
    monkeypatch.setattr(DepthRouter, "_bank", lambda self, state, values, keys, queries: (None, 0))


def _step(variant, blocks, ac):
    model = _model(variant, blocks, ac)
    loss = _loss(model, _tokens())
    loss.backward()
    return loss, _grads(model)


@pytest.mark.parametrize("ac", [None, "selective", "full"])
@pytest.mark.parametrize("variant, blocks", CASES)
def test_bank_gives_autograds_sums(monkeypatch, variant, blocks, ac):
    loss, got = _step(variant, blocks, ac)
    with monkeypatch.context() as m:
        _autograd_sums(m)
        loss0, want = _step(variant, blocks, ac)
    assert torch.equal(loss, loss0)
    assert got.keys() == want.keys()
    for name, g in want.items():
        if name == "tok_embeddings.weight":
            # sublayer 1 reads the embedding itself too, and its gradient used to come between
            # the phase-1 reads' (the first read, for site 1 at least, is made before sublayer 1
            # runs; Full reads phase 1 per pair of sites): one rounding
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
    """Full at M = 8 sublayers: phase 1 at the even sites t = 0, 2, ..., 8 reads the embedding
    and t outputs (each odd site merges its own sublayer's output in), 25 source gradients for
    9 sources. Autograd adds 16 of them to others; with the bank, none (the fused CPU kernels
    add in place)."""
    with_bank = _adds("attnres", None)
    with monkeypatch.context() as m:
        _autograd_sums(m)
        without = _adds("attnres", None)
    m = 8
    assert without - with_bank == sum(t + 1 for t in range(0, m + 1, 2)) - (m + 1), (
        without,
        with_bank,
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


@pytest.mark.parametrize("per_site", [True, False])  # a list: the CPU tables; a tensor: the op
def test_a_read_finding_some_sums_held_adds_them(per_site):
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
    bank = custom_ops.SourceBank(None, "auto")
    bank.extend(values)
    bank.value_sums[:] = [held[0].clone(), None, held[2].clone()]
    read = _BankRead(3, 1, False, None, "auto", bank, fresh=1)
    grads = (list(grad_out.unbind(0)) if per_site else grad_out, None)
    with torch.no_grad():
        got = read.backward([*values, query[0]], (None, lse), grads)
    assert got[0] is None
    assert torch.equal(got[1], fresh[1]) and torch.equal(got[2], held[2] + fresh[2])
    assert torch.equal(got[3], fresh_q[0])
    assert torch.equal(bank.value_sums[0], held[0] + fresh[0])
    assert bank.value_sums[1:] == [None, None]


def test_reads_under_a_mode_leave_the_sums_to_autograd():
    """Under a function mode (as the SPMD type checker's) the reads keep the ops' own autograd:
    no bank, and the same gradients."""
    from torch.overrides import TorchFunctionMode

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    calls = []
    bank = DepthRouter._bank

    def spy(self, *args):
        found = bank(self, *args)
        calls.append(found[0] is not None)
        return found

    with pytest.MonkeyPatch.context() as m:
        m.setattr(DepthRouter, "_bank", spy)
        _, want = _step("sliced", 2, None)
        assert calls and all(calls)
        calls.clear()
        with Mode():
            _, got = _step("sliced", 2, None)
        assert calls and not any(calls)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=2e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("ac", [None, "selective"])
@pytest.mark.parametrize("variant, blocks", [("attnres", None), ("projected", 2)])
def test_a_forward_without_backward_frees_its_sources(variant, blocks, ac):
    """The bank the reads share holds no path back into the graph that holds it (a reference
    cycle through autograd's nodes, which no collector frees): once the loss is dropped, so are
    the sources, backward or not."""
    import gc
    import weakref

    model, refs = _model(variant, blocks, ac), []
    step = model.router.step

    def spy(state, j, out):
        found = step(state, j, out)
        refs.extend(weakref.ref(v) for v in state.values[len(refs) :])
        return found

    model.router.step = spy
    loss = _loss(model, _tokens())
    assert refs and all(r() is not None for r in refs)
    del loss
    gc.collect()
    assert all(r() is None for r in refs), sum(r() is not None for r in refs)
