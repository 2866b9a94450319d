"""Inputs the public API accepts, through the Triton kernels under TRITON_INTERPRET=1 (see
conftest.py), against the eager reference: source counts at the edges of the padded-tuple
buckets, strided (non-contiguous) sources and keys, keys of mixed dtypes, and launchers that
build nothing on the host (no pointer table: a launch is capturable in a CUDA graph)."""

from __future__ import annotations

import pytest
import torch

import custom_ops
from custom_ops import reference
from custom_ops.kernels import common, merge, read_bwd, read_fwd
from tests.custom_ops.cases import ReadCase, Seen, grads_of, leaves, make_read
from tests.custom_ops.test_custom_ops_read import check_block_read, check_depth_read
from tests.custom_ops.tolerances import assert_close

EPS = reference.DEFAULT_EPS


def _leaf(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a leaf that keeps its strides."""
    return x.detach().requires_grad_()


def _check_read(values, keys, query, tol_dtype: torch.dtype):
    """``depth_read_lse`` with backend="triton" == the reference: out, lse, every gradient."""
    inputs = leaves(values, keys, query)
    got, got_g = grads_of(
        lambda: custom_ops.depth_read_lse(values, keys, query, backend="triton"), inputs
    )
    ref_keys = keys if keys is not None else reference.sliced_keys(values, query.shape[-1])
    want, want_g = grads_of(lambda: reference.depth_read_with_lse(values, ref_keys, query), inputs)
    assert_close("out", got[0], want[0], tol_dtype)
    assert_close("lse", got[1], want[1], torch.float32)
    for i, (a, b) in enumerate(zip(got_g, want_g, strict=True)):
        assert a.dtype == b.dtype, f"grad of input {i}: {a.dtype} vs {b.dtype}"
        assert_close(f"grad of input {i}", a, b, tol_dtype)


def test_buckets():
    counts = (1, 8, 9, 16, 17, 49, 64, 65)
    assert [common.bucket(s) for s in counts] == [8, 8, 16, 16, 32, 64, 64, 128]
    assert common.padded(["a", "b"], 4) == ("a", "b", "a", "a")


def test_alignment():
    assert common.alignment(torch.bfloat16, 1024, 2048) == 8
    assert common.alignment(torch.bfloat16, 1000, 1064) == 8
    assert common.alignment(torch.bfloat16, 1000, 1002) == 2
    assert common.alignment(torch.float32, 1000, 4) == 4
    assert common.alignment(torch.float16, 33) == 1


@pytest.mark.parametrize(
    "sources, sliced", [(8, True), (9, False), (16, True), (17, False)], ids=lambda x: str(x)
)
def test_sources_at_bucket_edges(sources, sliced):
    """S = 8 fills bucket 8; 9 and 16 use bucket 16; 17 bucket 32 (forward and backward)."""
    case = ReadCase((2, 5), 24, 8, sources, sliced, torch.float32, seed=sources)
    check_depth_read(case, backend="triton")


def test_block_read_in_second_bucket():
    case = ReadCase((7,), 40, 16, 11, False, torch.bfloat16, seed=3)
    check_block_read(case, 3, backend="triton")


@pytest.mark.parametrize("sliced", [True, False], ids=["sliced", "projected"])
def test_strided_sources(sliced):
    """Every second column of ``[64, 2048]`` buffers: the launcher's contiguous copies must live
    until the kernel has read them (they were freed first: errors up to 1e27)."""
    g = torch.Generator().manual_seed(11)
    values = [_leaf((torch.randn(64, 2048, generator=g) * (1 + s))[:, ::2]) for s in range(4)]
    keys = None if sliced else [_leaf(torch.randn(64, 32, generator=g)[:, ::2]) for _ in range(4)]
    query = _leaf(2 * torch.randn(16, generator=g))
    assert not values[0].is_contiguous()
    _check_read(values, keys, query, torch.float32)


def test_row_strided_sources():
    """Row-strided views (the projected ``[o; k]`` layout: value and key share rows of d + r),
    read in place, with rows of different strides in one call."""
    g = torch.Generator().manual_seed(12)
    d, r = 48, 8
    wide = [torch.randn(3, 5, d + r, generator=g) for _ in range(3)]
    values = [_leaf(w[..., :d]) for w in wide] + [_leaf(torch.randn(3, 5, d, generator=g))]
    keys = [_leaf(w[..., d:]) for w in wide] + [_leaf(torch.randn(3, 5, r, generator=g))]
    _check_read(values, keys, _leaf(2 * torch.randn(r, generator=g)), torch.float32)


def test_mixed_key_dtypes_in_the_launchers():
    """fp32, bf16 and fp16 keys in one launch (the public API refuses them; the launchers, which
    pick every key through one tuple of one element type, convert them exactly to the promoted
    dtype): read as given, each key's gradient returned in its own dtype."""
    g = torch.Generator().manual_seed(13)
    values = [_leaf(torch.randn(6, 40, generator=g) * (1 + s)) for s in range(3)]
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    keys = [_leaf(torch.randn(6, 8, generator=g).to(dt)) for dt in dtypes]
    queries = _leaf(2 * torch.randn(2, 8, generator=g))
    grad_out = torch.randn(2, 6, 40, generator=g)
    out, lse = read_fwd.read_fwd(values, keys, queries, EPS)
    grads = read_bwd.read_bwd(values, keys, queries, lse, grad_out, None, EPS)
    want, want_lse = reference.depth_read_with_lse(values, keys, queries)
    (want * grad_out).sum().backward()
    assert_close("out", out, want, torch.float32)
    assert_close("lse", lse, want_lse, torch.float32)
    for i, (a, x) in enumerate(
        zip([*grads[0], *grads[1], grads[2]], leaves(values, keys, queries))
    ):
        assert a.dtype == x.dtype, f"grad of input {i}: {a.dtype}, input {x.dtype}"
        assert_close(f"grad of input {i}", a, x.grad, x.dtype)


def test_merge_with_strided_partial():
    """merge_partial on a strided partial value and key == the one-pass read."""
    g = torch.Generator().manual_seed(14)
    d, r = 40, 8
    values = [_leaf((torch.randn(9, 2 * d, generator=g) * (1 + s))[:, ::2]) for s in range(3)]
    keys = [_leaf(torch.randn(9, 2 * r, generator=g)[:, ::2]) for _ in range(3)]
    query = _leaf(2 * torch.randn(r, generator=g))
    inputs = leaves(values, keys, query)

    def two_phase():
        out1, lse1 = custom_ops.block_read(values[:2], keys[:2], query[None], backend="triton")
        h = custom_ops.merge_partial(out1[0], lse1[0], values[2], keys[2], query, backend="triton")
        return (h,)

    got, got_g = grads_of(two_phase, inputs)
    want, want_g = grads_of(lambda: (reference.depth_read(values, keys, query),), inputs)
    assert_close("h", got[0], want[0], torch.float32)
    for i, (a, b) in enumerate(zip(got_g, want_g, strict=True)):
        assert_close(f"grad of input {i}", a, b, torch.float32)


def test_launchers_build_nothing_on_the_host(monkeypatch):
    """No per-call host tensor (the former pointer table came from ``torch.tensor`` +
    ``pin_memory``): every launch argument is a tensor the caller passed or allocated on the
    device, or a plain Python scalar."""

    def refuse(*args, **kwargs):
        raise AssertionError("a launcher built a host tensor")

    case = ReadCase((4,), 24, 8, 10, False, torch.float32, seed=5)
    values, keys, query = make_read(case)
    monkeypatch.setattr(torch, "tensor", refuse)
    monkeypatch.setattr(torch.Tensor, "pin_memory", refuse)
    out, lse = custom_ops.depth_read_lse(values, keys, query, backend="triton")
    (out.sum() + lse.sum()).backward()
    h = custom_ops.merge_partial(
        out.detach(), lse.detach(), values[0], keys[0], query, backend="triton"
    )
    h.sum().backward()


# What a launcher may do besides its kernel: allocate, view, read dtypes, and reduce the
# backward's per-program dq partials (one sum). No zero-fill, copy or cast per call.
_LAUNCHER_OPS = {
    f"aten.{op}" for op in (
        "empty.memory_format", "empty_strided.default", "empty_like.default",
        "new_empty.default", "view.default", "slice.Tensor", "promote_types.default",
        "sum.dim_IntList",
    )
}  # fmt: skip


@pytest.mark.parametrize("sliced", [True, False], ids=["sliced", "projected"])
@pytest.mark.parametrize("grad_lse", [False, True], ids=["out-grad", "out+lse-grads"])
def test_launchers_launch_only_their_kernel(monkeypatch, sliced, grad_lse):
    """The read's and the merge's forward and backward (bf16 sources, fp32 bank output; with
    and without the lse gradients, the merge with and without its norm): besides each kernel
    (not run here), only ``_LAUNCHER_OPS``."""
    monkeypatch.setattr(common.Launch, "__call__", lambda self: None)
    for owner, name in ((torch, "empty"), (torch, "empty_like"), (torch.Tensor, "new_empty")):
        monkeypatch.setattr(owner, name, getattr(owner, name).__wrapped__)  # not NaN-filled here
    case = ReadCase((2, 6), 40, 8, 5, sliced, torch.bfloat16, seed=6)
    values, keys, _ = make_read(case)
    values = [v.detach() for v in values]
    keys = None if keys is None else [k.detach() for k in keys]
    queries = torch.randn(3, 8)
    with Seen() as fwd:
        out, lse = read_fwd.read_fwd(values, keys, queries, EPS)
    grads = torch.randn_like(out), torch.randn_like(lse) if grad_lse else None
    with Seen() as bwd:
        read_bwd.read_bwd(values, keys, queries, lse, *grads, EPS)
    site = out[0], lse[0], values[0], None if keys is None else keys[0], queries[0]
    with Seen() as merge_fwd:
        h, _ = merge.merge_fwd(*site, EPS, emit_norm=grad_lse)
    grad_h, grad_norm = torch.randn_like(h), torch.randn_like(h) if grad_lse else None
    with Seen() as merge_bwd:
        merge.merge_bwd(*site, h, grad_h, grad_norm, EPS)
    for seen in (fwd, bwd, merge_fwd, merge_bwd):
        assert set(seen.ops) <= _LAUNCHER_OPS, seen.ops
    assert bwd.ops.count("aten.sum.dim_IntList") == merge_bwd.ops.count("aten.sum.dim_IntList") == 1
