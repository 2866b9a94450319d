"""Registration of the ``lrattnres::`` ops on CPU: opcheck, torch.compile, export, input errors."""

from __future__ import annotations

import os

import pytest
import torch

import custom_ops
from custom_ops import reference
from tests.custom_ops.cases import ReadCase, make_read
from tests.custom_ops.tolerances import assert_close

OPS = torch.ops.lrattnres
EPS = 1e-6


def _inputs(sliced: bool, dtype=torch.float32, lead=(2, 5), d=12, r=5, sources=3):
    return make_read(ReadCase(lead, d, r, sources, sliced, dtype, seed=11))


def _strided(lead, d):
    """A non-contiguous ``[..., d]`` view (every other column of a wider tensor)."""
    return torch.randn(*lead, 2 * d)[..., ::2].requires_grad_()


def opcheck_cases():
    v, k, q = _inputs(False)
    bank = torch.randn(3, 5, requires_grad=True)
    nc = [_strided((2, 5), 12) for _ in range(3)]
    o1 = torch.randn(2, 5, 12, requires_grad=True)
    l1 = torch.randn(2, 5, requires_grad=True)
    lse = torch.randn(3, 2, 5)
    return {
        "depth_read": (OPS.depth_read.default, (v, k, q, EPS, "compiled")),
        "depth_read_noncontig": (OPS.depth_read.default, (nc, k, q, EPS, "compiled")),
        "depth_read_sliced": (OPS.depth_read_sliced.default, (v, q, EPS, "compiled")),
        "block_read": (OPS.block_read.default, (v, k, bank, EPS, "compiled")),
        "block_read_sliced": (OPS.block_read_sliced.default, (nc, bank, EPS, "compiled")),
        "read_backward": (
            OPS.read_backward.default,
            (v, k, bank, lse, torch.randn(3, 2, 5, 12), torch.randn(3, 2, 5), EPS, "compiled"),
        ),
        "read_backward_sliced": (
            OPS.read_backward.default,
            (v, [], bank, lse, torch.randn(3, 2, 5, 12), None, EPS, "compiled"),
        ),
        "merge_partial": (
            OPS.merge_partial.default,
            (o1, l1, v[0], k[0], q, EPS, False, "compiled"),
        ),
        "merge_partial_sliced_norm": (
            OPS.merge_partial.default,
            (o1, l1, nc[0], None, q, EPS, True, "compiled"),
        ),
        "merge_partial_backward": (
            OPS.merge_partial_backward.default,
            (
                o1,
                l1,
                v[0],
                None,
                q,
                v[1].detach(),
                torch.randn(2, 5, 12),
                torch.randn(2, 5, 12),
                EPS,
                "compiled",
            ),
        ),  # fmt: skip
    }


@pytest.mark.parametrize("name", list(opcheck_cases()))
def test_opcheck(name):
    op, args = opcheck_cases()[name]
    if name.endswith(("backward", "backward_sliced")):
        # backward ops have no double backward: check them on plain (non-grad) inputs
        args = tuple(_detach(a) for a in args)
    torch.library.opcheck(op, args)


def _detach(x):
    if isinstance(x, torch.Tensor):
        return x.detach()
    return [t.detach() for t in x] if isinstance(x, list) else x


def _model(values, keys, query, bank):
    """A function touching every public op, as a model's block would."""
    h = custom_ops.depth_read(values, keys, query)
    out1, lse1 = custom_ops.block_read(values[:-1], None if keys is None else keys[:-1], bank)
    pk = None if keys is None else keys[-1]
    h2, n2 = custom_ops.merge_partial(out1[0], lse1[0], values[-1], pk, query, emit_norm=True)
    return h.float().sum() + (h2.float() * n2.float()).sum() + out1.sum()


def _run_grads(fn, values, keys, query, bank):
    inputs = [*values, *(keys or []), query, bank]
    loss = fn(values, keys, query, bank)
    grads = torch.autograd.grad(loss, inputs)
    return loss.detach(), grads


def _check_compiled(backend: str, sliced: bool, dtype: torch.dtype):
    """``_model`` compiled with ``fullgraph=True`` gives the eager loss and every gradient."""
    values, keys, query = _inputs(sliced, dtype)
    bank = torch.randn(2, 5, requires_grad=True)
    want = _run_grads(_model, values, keys, query, bank)
    torch._dynamo.reset()
    compiled = torch.compile(_model, fullgraph=True, backend=backend)
    got = _run_grads(compiled, values, keys, query, bank)
    assert_close("loss", got[0], want[0], dtype)
    for a, b in zip(got[1], want[1], strict=True):
        assert_close("grad", a, b, dtype)


@pytest.mark.parametrize("sliced", [True, False])
def test_compile_aot_eager_fullgraph(sliced):
    _check_compiled("aot_eager", sliced, torch.float32)


@pytest.mark.slow
def test_compile_inductor(tmp_path, monkeypatch):
    # a warm inductor cache can serve a stale op body: a fresh cache tests this tree's ops
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")
    _check_compiled("inductor", False, torch.bfloat16)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path)


class _Block(torch.nn.Module):
    def __init__(self, r):
        super().__init__()
        self.query = torch.nn.Parameter(torch.randn(r))
        self.bank = torch.nn.Parameter(torch.randn(2, r))

    def forward(self, a, b, c):
        return _model([a, b, c], None, self.query, self.bank)


def test_export_keeps_ops():
    values = [v.detach() for v in _inputs(True)[0]]
    block = _Block(5)
    ep = torch.export.export(block, tuple(values))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    for name in ("depth_read_sliced", "block_read_sliced", "merge_partial"):
        assert f"lrattnres.{name}.default" in targets, targets
    torch.testing.assert_close(ep.module()(*values), block(*values))


def _errors():
    v, k, q = _inputs(False)
    return [
        (lambda: custom_ops.depth_read(v, k, q, backend="cuda"), "unknown backend"),
        (lambda: custom_ops.depth_read([], [], q), "at least one source"),
        (lambda: custom_ops.depth_read(v, k[:2], q), "3 values but 2 keys"),
        (lambda: custom_ops.depth_read([v[0], v[1][..., :-1]], k[:2], q), "value 1 has shape"),
        (lambda: custom_ops.depth_read(v, k, q[:-1]), "rank"),
        (lambda: custom_ops.depth_read(v, [x[:1] for x in k], q), "leading dims"),
        (lambda: custom_ops.depth_read(v, k, q[None]), r"query must be \[r\]"),
        (lambda: custom_ops.block_read(v, k, q), r"query must be \[c, r\]"),
        (lambda: custom_ops.depth_read(v, None, torch.randn(13)), "r <= d"),
        (lambda: custom_ops.depth_read([v[0], v[1].double()], None, q), "value 1 is torch.float64"),
        (
            lambda: custom_ops.merge_partial(v[0], v[0][..., 0], v[1][:1], None, q),
            "out1 has shape",
        ),
        (lambda: custom_ops.merge_partial(v[0], v[0], v[1], None, q), "lse1 has shape"),
    ]


@pytest.mark.parametrize("index", range(len(_errors())))
def test_clear_errors(index):
    fn, match = _errors()[index]
    with pytest.raises(ValueError, match=match):
        fn()


def test_reference_backend_is_the_reference():
    values, keys, query = _inputs(False)
    got = custom_ops.depth_read(values, keys, query, backend="reference")
    assert torch.equal(got, reference.depth_read(values, keys, query))


def test_compiled_composites_keep_caches_of_their_own():
    """CUDA's ``compiled`` impl compiles each composite function from its own code: compiled
    through the shared ``no_grad`` wrapper, the functions would fill one cache and every shape past
    its limit would run uncompiled (here: 8 graphs against a limit of 5, which raises)."""
    from custom_ops import composite
    from custom_ops.ops import compile_own

    fwd = compile_own(composite.read_fwd, backend="eager", dynamic=False)
    bwd = compile_own(composite.read_bwd, backend="eager", dynamic=False)
    limit = dict(recompile_limit=5, fail_on_recompile_limit_hit=True)
    with torch._dynamo.config.patch(**limit):
        for sources in (2, 3, 4, 5):
            v = [torch.randn(2, 3, 16) for _ in range(sources)]
            q = torch.randn(1, 4)
            out, lse = fwd(v, None, q, EPS)
            want = composite.read_fwd(v, None, q, EPS)
            torch.testing.assert_close((out, lse), want, rtol=0, atol=0)
            grads = bwd(v, None, q, lse, torch.randn_like(out), None, EPS)
            assert len(grads[0]) == sources and not grads[0][0].requires_grad
