"""Calls into the fused CPU kernels (``custom_ops.cpu``) that cannot corrupt memory: every buffer
the wrapper hands to C is fp32 on the CPU whatever torch's default dtype or device, the ctypes
argument tables match the C definitions, and a bad tensor at the low-level call raises instead
of reaching C."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import custom_ops
from custom_ops import composite, cpu
from custom_ops.cpu import calls
from custom_ops.reference import DEFAULT_EPS
from tests.custom_ops.cases import ReadCase, make_read, read_cases
from tests.custom_ops.tolerances import assert_close

# torch defaults the wrapper must not depend on: a float64 default dtype (an fp32 kernel writing
# into float64 buffers) and a non-CPU default device ("meta": a null data pointer on this host)
SETTINGS = ("float64", "meta")


@contextlib.contextmanager
def torch_defaults(setting: str | None):
    """torch's default dtype (``"float64"``) or device (``"meta"``) changed inside the block,
    restored after it; None changes nothing."""
    assert torch.get_default_dtype() == torch.float32
    assert not torch._C._len_torch_function_stack(), "a default device is already set"
    try:
        if setting == "float64":
            torch.set_default_dtype(torch.float64)
        elif setting == "meta":
            torch.set_default_device("meta")
        yield
    finally:
        torch.set_default_dtype(torch.float32)
        torch.set_default_device(None)


@contextlib.contextmanager
def fused(enabled: bool):
    """The fused kernels on or off (off: the eager composite serves the same calls)."""
    saved = cpu.ENABLED
    cpu.ENABLED = enabled
    try:
        yield
    finally:
        cpu.ENABLED = saved


def _fp32_case(case: ReadCase) -> ReadCase:
    return ReadCase(case.lead, case.d, case.r, case.sources, case.sliced, torch.float32, case.seed)


# r >= 2: the r = 1 key gradient cancels (tolerances.rank_one_cancellation), not the point here;
# two sources at least: the merge's phase 1 reads all but the last
CASES = read_cases(max_sources=5, widths=(7, 33, 64), max_tokens=40).filter(
    lambda c: c.r > 1 and c.sources > 1
)


def _check_all(name, got, want, reference):
    """``got`` (under another default) is ``want`` (under the defaults) bit for bit, and close to
    the composite's ``reference``: fp32 CPU tensors, None where the reference has None."""
    assert len(got) == len(want) == len(reference), name
    for i, (a, b, ref) in enumerate(zip(got, want, reference, strict=True)):
        if ref is None:
            assert a is None and b is None, f"{name}[{i}]"
            continue
        assert_close(f"{name}[{i}]", a, ref, torch.float32)
        assert a.dtype == torch.float32 and a.device.type == "cpu", f"{name}[{i}]: {a.dtype}"
        assert torch.equal(a, b), f"{name}[{i}]: not bit for bit the result under the defaults"


# --------------------------------------------------------------- through the public ops


def _public_inputs(case: ReadCase, n_queries: int):
    """Leaves (fp32, built under the defaults) and fixed upstream gradients of every call."""
    values, keys, queries = make_read(case, n_queries)
    g = torch.Generator().manual_seed(case.seed + 1)
    lead, d = values[0].shape[:-1], case.d
    done = None if keys is None else keys[:-1]
    with torch.no_grad():
        out, lse = composite.read_fwd(values[:-1], done, queries[:1], DEFAULT_EPS)
    upstream = {
        "out": torch.randn((n_queries, *lead, d), generator=g),
        "lse": torch.randn((n_queries, *lead), generator=g),
        "h": torch.randn((*lead, d), generator=g),
        "norm": torch.randn((*lead, d), generator=g),
    }
    phase1 = (out[0].clone().requires_grad_(), lse[0].clone().requires_grad_())
    return values, keys, queries, phase1, upstream


def _public_calls(values, keys, queries, phase1, upstream):
    """``(name, outputs and gradients)`` of each public op that the fused kernels serve on CPU:
    the single-query read, the bank read, the merge with its norm."""
    leaves = [*values, *(keys or ()), queries]
    results = []
    h, lse = custom_ops.depth_read_lse(values, keys, queries[0])
    ups = (upstream["out"][0], upstream["lse"][0])
    results.append(("depth_read_lse", [h, lse, *torch.autograd.grad((h, lse), leaves, ups)]))
    out, lse = custom_ops.block_read(values, keys, queries)
    ups = (upstream["out"], upstream["lse"])
    results.append(("block_read", [out, lse, *torch.autograd.grad((out, lse), leaves, ups)]))
    out1, lse1 = phase1
    pk = None if keys is None else keys[-1]
    h, norm = custom_ops.merge_partial(out1, lse1, values[-1], pk, queries[0], emit_norm=True)
    m_leaves = [out1, lse1, values[-1], *([] if pk is None else [pk]), queries]
    grads = torch.autograd.grad((h, norm), m_leaves, (upstream["h"], upstream["norm"]))
    results.append(("merge_partial", [h, norm, *grads]))
    return results


@pytest.mark.parametrize("setting", SETTINGS)
@settings(deadline=None, max_examples=8)
@given(CASES, st.integers(1, 3))
def test_public_ops_do_not_depend_on_torch_defaults(setting, case, n_queries):
    """The ops the kernels serve (read forward and backward, merge forward and backward) give
    the same numbers under a float64 default dtype or a meta default device as under the
    defaults, and those of the eager composite."""
    inputs = _public_inputs(_fp32_case(case), n_queries)
    with fused(False):
        reference = _public_calls(*inputs)
    want = _public_calls(*inputs)
    with torch_defaults(setting):
        got = _public_calls(*inputs)
    for (name, a), (_, b), (_, ref) in zip(got, want, reference, strict=True):
        _check_all(f"{name} ({setting})", a, b, ref)


# ------------------------------------------------------------ the wrapper's functions directly


def _direct_inputs(case: ReadCase, n_queries: int):
    values, keys, queries = make_read(case, n_queries)
    values = [v.detach() for v in values]
    keys = None if keys is None else [k.detach() for k in keys]
    queries = queries.detach()
    g = torch.Generator().manual_seed(case.seed + 2)
    out, lse = composite.read_fwd(values, keys, queries, DEFAULT_EPS)
    dout = torch.randn(out.shape, generator=g)
    dlse = torch.randn(lse.shape, generator=g)
    pk = None if keys is None else keys[-1]
    merge = (out[0], lse[0], values[-1], pk, queries[0])
    h = composite.merge_fwd(*merge, DEFAULT_EPS, True)[0]
    grad_h, grad_norm = torch.randn(h.shape, generator=g), torch.randn(h.shape, generator=g)
    return values, keys, queries, lse, dout, dlse, merge, h, grad_h, grad_norm


def _direct_calls(module, values, keys, queries, lse, dout, dlse, merge, h, grad_h, grad_norm):
    """``(name, results)`` of every kernel entry point of ``module`` (``cpu`` or ``composite``,
    the same functions)."""
    eps = DEFAULT_EPS
    gv, gk, dq = module.read_bwd(values, keys, queries, lse, dout, dlse, eps)
    results = [
        ("read_fwd", list(module.read_fwd(values, keys, queries, eps))),
        ("read_bwd", [*gv, *(gk or ()), dq]),
    ]
    gv, gk, dq = module.read_bwd(values, keys, queries, lse, dout, None, eps)
    results.append(("read_bwd without grad_lse", [*gv, *(gk or ()), dq]))
    for emit_norm in (False, True):
        h2, norm = module.merge_fwd(*merge, eps, emit_norm)
        results.append((f"merge_fwd emit_norm={emit_norm}", [h2, norm if emit_norm else None]))
    for gn in (None, grad_norm):
        got = module.merge_bwd(*merge, h, grad_h, gn, eps)
        results.append((f"merge_bwd grad_norm={gn is not None}", list(got)))
    return results


@pytest.mark.parametrize("setting", SETTINGS)
@settings(deadline=None, max_examples=8)
@given(CASES, st.integers(1, 3))
def test_kernel_functions_do_not_depend_on_torch_defaults(setting, case, n_queries):
    """``cpu.read_fwd``, ``read_bwd`` (stacked and per-query gradients), ``merge_fwd`` and
    ``merge_bwd`` called directly: under a float64 default dtype or a meta default device the
    same fp32 CPU results as under the defaults, and those of ``composite``."""
    inputs = _direct_inputs(_fp32_case(case), max(n_queries, 2))
    reference = _direct_calls(composite, *inputs)
    want = _direct_calls(cpu, *inputs)
    with torch_defaults(setting):
        got = _direct_calls(cpu, *inputs)
    for (name, a), (_, b), (_, ref) in zip(got, want, reference, strict=True):
        _check_all(f"{name} ({setting})", a, b, ref)


# ------------------------------------------------------------- the argument tables against C


def test_the_argument_tables_are_the_c_definitions():
    calls.check_signatures(cpu._SOURCE.read_text())
    found = calls.prototypes(cpu._SOURCE.read_text())
    for kernel, params in calls.SIGNATURES.items():
        assert found[kernel] == list(params), kernel


def _swapped(params, a: str, b: str):
    names = [name for name, _ in params]
    i, j = names.index(a), names.index(b)
    out = list(params)
    out[i], out[j] = out[j], out[i]
    return tuple(out)


WRONG_TABLES = {  # kernel, its table changed, what the error says
    "two arguments swapped": (
        "read_fwd",
        lambda p: _swapped(p, "vp", "kp"),
        "read_fwd: argument 6 is pointer kp in the table, pointer vp in C",
    ),
    "a wrong type": (
        "merge_bwd",
        lambda p: tuple((n, ctypes.c_int if n == "o1s" else t) for n, t in p),
        "merge_bwd: argument 5 is int o1s in the table, int64_t o1s in C",
    ),
    "a wrong name": (
        "merge_fwd",
        lambda p: tuple(("gh" if n == "h" else n, t) for n, t in p),
        "merge_fwd: argument 13 is pointer gh in the table, pointer h in C",
    ),
    "an argument missing": (
        "read_bwd",
        lambda p: p[:-1],
        "read_bwd: 19 arguments in the table, 20 in C; argument 19 is nothing in the table, "
        "int threads in C",
    ),
}


@pytest.mark.parametrize("wrong", list(WRONG_TABLES))
def test_a_wrong_argument_table_is_refused_at_load(monkeypatch, wrong):
    """A table that does not list its C function's parameters (count, order, names, types)
    raises one clear error when the library is loaded, before any call."""
    kernel, change, message = WRONG_TABLES[wrong]
    monkeypatch.setitem(calls.SIGNATURES, kernel, change(calls.SIGNATURES[kernel]))
    with pytest.raises(RuntimeError, match="SIGNATURES does not match depth_read.c") as e:
        calls.check_signatures(cpu._SOURCE.read_text())
    assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(RuntimeError, match=re.escape(message)):
        cpu.build(cpu._SOURCE)  # the load itself (the cached library)


def test_a_changed_c_definition_is_refused():
    """The other way round: C changed (two parameters swapped), the table not."""
    text = cpu._SOURCE.read_text()
    head = "void merge_fwd(int64_t n, int64_t d, int64_t r,"
    assert text.count(head) == 1
    text = text.replace(head, "void merge_fwd(int64_t n, int64_t r, int64_t d,")
    with pytest.raises(RuntimeError, match="merge_fwd: argument 1 is int64_t d in the table, "):
        calls.check_signatures(text)


# ------------------------------------------------------------------ the low-level call checked


class _NoC:
    """A stand-in library: records any kernel call that gets past the checks."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append(name)


def _merge_fwd_args(n=5, d=16, r=4):
    """Valid keyword arguments of the C ``merge_fwd`` (projected key, with the norm)."""
    g = torch.Generator().manual_seed(0)
    o1, pv, pk = (torch.randn(n, w, generator=g) for w in (d, d, r))
    return dict(n=n, d=d, r=r, o1=o1, o1s=d, lse1=torch.randn(n, generator=g), pv=pv, pvs=d,
                pk=pk, pks=r, q=torch.randn(r, generator=g), eps=DEFAULT_EPS,
                norm_eps=DEFAULT_EPS, h=torch.empty(n, d), norm=torch.empty(n, d),
                threads=1)  # fmt: skip


def _read_fwd_args(n=6, d=8, r=3, sources=3, queries=2):
    g = torch.Generator().manual_seed(1)
    values = [torch.randn(n, d, generator=g) for _ in range(sources)]
    keys = [torch.randn(n, r, generator=g) for _ in range(sources)]
    return dict(S=sources, C=queries, n=n, d=d, r=r, sliced=0, vp=values, vs=[d] * sources,
                kp=keys, ks=[r] * sources, q=torch.randn(queries, r, generator=g),
                eps=DEFAULT_EPS, out=torch.empty(queries, n, d), lse=torch.empty(queries, n),
                threads=1)  # fmt: skip


def test_the_low_level_call_runs_the_kernel_by_name():
    """``calls.call`` with valid arguments (in any keyword order) is what the entry points run."""
    lib = cpu.library()
    args = _merge_fwd_args()
    calls.call(lib, "merge_fwd", **dict(reversed(list(args.items()))))
    h, norm = cpu.merge_fwd(args["o1"], args["lse1"], args["pv"], args["pk"], args["q"],
                            DEFAULT_EPS, True)  # fmt: skip
    assert torch.equal(args["h"], h) and torch.equal(args["norm"], norm)
    args = _read_fwd_args()
    calls.call(lib, "read_fwd", **args)
    out, lse = cpu.read_fwd(args["vp"], args["kp"], args["q"], DEFAULT_EPS)
    assert torch.equal(args["out"], out) and torch.equal(args["lse"], lse)


def _columns(x: torch.Tensor, step: int) -> torch.Tensor:
    """x's values with column stride ``step``."""
    wide = torch.zeros(x.shape[0], x.shape[1] * step)
    wide[:, ::step] = x
    return wide[:, ::step]


BAD_CALLS = {  # kernel, argument, bad value (from the valid arguments), what the error says
    "float64 output": ("merge_fwd", "h", lambda a: a["h"].double(), "h: dtype torch.float64"),
    "bf16 input": ("merge_fwd", "q", lambda a: a["q"].bfloat16(), "q: dtype torch.bfloat16"),
    "meta output": ("merge_fwd", "norm", lambda a: a["norm"].to("meta"), "norm: on meta"),
    "meta row": ("merge_fwd", "o1", lambda a: a["o1"].to("meta"), "o1: on meta"),
    "column stride": ("merge_fwd", "pv", lambda a: _columns(a["pv"], 2), "pv: strides (32, 2)"),
    "transposed output": ("merge_fwd", "h", lambda a: a["h"].t(), "not contiguous"),
    "short output": ("merge_fwd", "h", lambda a: a["h"][:4], "h: 64 elements from the address"),
    "narrow rows": ("merge_fwd", "pk", lambda a: a["pk"][:, :3], "pk: 5 rows of 3"),
    "wrong row stride": ("merge_fwd", "o1s", lambda a: 8, "o1: rows 16 apart, the stride"),
    "NULL input": ("merge_fwd", "q", lambda a: None, "q: None"),
    "no tensor": ("merge_fwd", "lse1", lambda a: a["lse1"].tolist(), "lse1: a list, not"),
    "no threads": ("merge_fwd", "threads", lambda a: 0, "threads: 0"),
    "float64 source": (
        "read_fwd",
        "vp",
        lambda a: [*a["vp"][:2], a["vp"][2].double()],
        "vp[2]: dtype torch.float64",
    ),
    "short table": ("read_fwd", "kp", lambda a: a["kp"][:2], "kp: wants a list of 3"),
    "short strides": ("read_fwd", "vs", lambda a: a["vs"][:2], "list of 3 row strides"),
    "meta query bank": ("read_fwd", "q", lambda a: a["q"].to("meta"), "q: on meta"),
    "short lse": ("read_fwd", "lse", lambda a: a["lse"][:1], "lse: 6 elements"),
}


@pytest.mark.parametrize("bad", list(BAD_CALLS))
def test_a_bad_tensor_never_reaches_c(bad):
    """A wrong dtype, device, layout or size handed to the low-level call raises a one-line
    ValueError naming the kernel and the argument, before any address goes to C."""
    kernel, name, change, message = BAD_CALLS[bad]
    args = _merge_fwd_args() if kernel == "merge_fwd" else _read_fwd_args()
    lib = _NoC()
    calls.call(lib, kernel, **args)  # the valid call gets through
    assert lib.calls == [kernel]
    args[name] = change(args)
    with pytest.raises(ValueError, match=f"{kernel} argument ") as e:
        calls.call(lib, kernel, **args)
    assert message in str(e.value) and "\n" not in str(e.value)
    assert lib.calls == [kernel]


def test_arguments_go_by_name_only():
    lib, args = _NoC(), _merge_fwd_args()
    with pytest.raises(TypeError, match=r"missing arguments \['o1s'\], unknown \['o1_stride'\]"):
        renamed = {"o1_stride" if k == "o1s" else k: v for k, v in args.items()}
        calls.call(lib, "merge_fwd", **renamed)
    with pytest.raises(TypeError):
        calls.call(lib, "merge_fwd", *args.values())  # positional: refused
    assert lib.calls == []


class _Recorder:
    """A stand-in library: keeps the arguments of each kernel call (a table as a list)."""

    def __init__(self):
        self.args = []

    def __getattr__(self, name):
        def run(*args):
            self.args.append([list(a) if isinstance(a, ctypes.Array) else a for a in args])

        return run


def _outcome(kernel: str, args: dict):
    """What ``calls.call`` passes to C (the arguments, addresses included), or its ValueError."""
    lib = _Recorder()
    try:
        calls.call(lib, kernel, **args)
    except ValueError as e:
        return str(e)
    return lib.args


class _AnyTensorMeta(type):
    def __instancecheck__(cls, x):
        return isinstance(x, torch.Tensor)


class _AnyTensor(metaclass=_AnyTensorMeta):
    """Stands for torch.Tensor in ``calls``: every tensor is an instance, but none has it as its
    class, so ``call`` skips its inline tests of the common cases and checks each tensor in full."""


def _stand_ins(rows: int, width: int) -> dict:
    """Right and wrong values for an argument read as ``rows`` fp32 rows of ``width``."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(rows, width, generator=g)
    wide = torch.randn(rows, width + 3, generator=g)
    return {
        "rows": x, "3-D": x[None], "1-D": x.reshape(-1), "fewer rows": x[:-1],
        "more rows": torch.randn(rows + 2, width), "a view": x.new_empty(rows + 1, width)[1:],
        "padded rows": wide[:, :width], "narrow": x[:, :-1], "transposed": x.t(),
        "column stride": _columns(x, 2), "0-D": torch.randn((), generator=g),
        "no columns": torch.randn(rows, 0), "a parameter": torch.nn.Parameter(x),
        "float64": x.double(), "meta": x.to("meta"), "at 0": calls.At(x, 0),
        "at column 3 of wider rows": calls.At(wide, 3), "at -1": calls.At(x, -1),
        "at 1": calls.At(x, 1), "None": None, "a list": x.tolist(),
    }  # fmt: skip


INLINE_CASES = {  # kernel (rank), argument, its rows and width, its stride argument, strides
    "o1": ("merge_fwd", 4, "o1", 5, 16, "o1s", (16, 19, 8, 0)),
    "pk": ("merge_fwd", 4, "pk", 5, 4, "pks", (4, 7, 16)),
    "pk, r = 0": ("merge_fwd", 0, "pk", 5, 0, "pks", (0, 3)),
    "h": ("merge_fwd", 4, "h", 5, 16, None, ()),
    "lse1": ("merge_fwd", 4, "lse1", 1, 5, None, ()),
    "norm": ("merge_fwd", 4, "norm", 5, 16, None, ()),
    "out": ("read_fwd", 3, "out", 12, 8, None, ()),
    "vp[1]": ("read_fwd", 3, "vp", 6, 8, "vs", (8, 11, 4)),
    "kp[2]": ("read_fwd", 3, "kp", 6, 3, "ks", (3, 6)),
    "kp[2], r = 0": ("read_fwd", 0, "kp", 6, 0, "ks", (0, 3)),
}


@pytest.mark.parametrize("case", list(INLINE_CASES))
def test_the_inline_checks_are_the_full_checks(monkeypatch, case):
    """``call`` accepts the common cases inline (a plain contiguous fp32 CPU tensor): for right
    and wrong tensors, row strides and table entries, it passes the same addresses, or raises the
    same error, as when every tensor goes through the full check."""
    kernel, rank, name, rows, width, stride_name, strides = INLINE_CASES[case]
    args = _merge_fwd_args(r=rank) if kernel == "merge_fwd" else _read_fwd_args(r=rank)
    entry = {"vp": 1, "kp": 2}.get(name)
    for label, value in _stand_ins(rows, width).items():
        for stride in strides or (None,):
            changed = dict(args)
            if entry is None:
                changed[name] = value
                if stride is not None:
                    changed[stride_name] = stride
            else:
                changed[name] = [value if i == entry else v for i, v in enumerate(args[name])]
                changed[stride_name] = [stride if i == entry else s
                                        for i, s in enumerate(args[stride_name])]  # fmt: skip
            inline = _outcome(kernel, changed)
            with monkeypatch.context() as m:
                m.setattr(calls, "_Tensor", _AnyTensor)
                full = _outcome(kernel, changed)
            assert inline == full, (label, stride)


def test_a_list_passed_twice_is_checked_once(monkeypatch):
    """A sliced read passes its values as the keys too (and their row strides): the table is
    built and checked once, with the same addresses as for two equal lists; a list that meets
    the first use's check meets the weaker second's. Different row strides: checked anew."""
    built = []
    table = calls._table
    monkeypatch.setattr(calls, "_table", lambda *a: built.append(a[1]) or table(*a))
    args = _read_fwd_args(r=3)
    args.update(sliced=1, kp=args["vp"], ks=args["vs"])
    shared = _outcome("read_fwd", args)
    assert len(built) == 2  # vp and vs; kp and ks reuse them
    built.clear()
    copies = _outcome("read_fwd", {**args, "kp": list(args["vp"]), "ks": list(args["vs"])})
    assert len(built) == 4 and copies == shared
    built.clear()
    bad = dict(args, vp=[*args["vp"][:-1], args["vp"][-1][:, :-1]])  # its last rows too narrow
    bad.update(kp=bad["vp"])
    assert _outcome("read_fwd", bad).startswith("read_fwd argument vp[2]")
    built.clear()
    _outcome("read_fwd", {**args, "ks": list(args["vs"])})
    assert [n.stride for n in built if isinstance(n, calls._Rows)] == ["vs", "ks"]  # anew


@pytest.mark.parametrize("sizes", [dict(sources=0), dict(queries=0), dict(n=0), dict(r=0)])
def test_empty_sizes_are_checked_alike(monkeypatch, sizes):
    """No source, query, token or key dim: the call goes through or raises a ValueError, the same
    with and without the inline checks."""
    args = _read_fwd_args(**sizes)
    with monkeypatch.context() as m:
        m.setattr(calls, "_Tensor", _AnyTensor)
        full = _outcome("read_fwd", args)
    assert _outcome("read_fwd", args) == full


def test_a_changed_table_is_followed(monkeypatch):
    """``call`` keeps how it walks each kernel's table; a new table is walked anew."""
    lib, args = _Recorder(), _merge_fwd_args()
    calls.call(lib, "merge_fwd", **args)
    swapped = _swapped(calls.SIGNATURES["merge_fwd"], "eps", "norm_eps")
    monkeypatch.setitem(calls.SIGNATURES, "merge_fwd", swapped)
    calls.call(lib, "merge_fwd", **{**args, "eps": 1.0, "norm_eps": 2.0})
    names = [name for name, _ in swapped]
    assert (lib.args[1][names.index("eps")], lib.args[1][names.index("norm_eps")]) == (1.0, 2.0)
    assert lib.args[0][names.index("eps")] == lib.args[0][names.index("norm_eps")] == DEFAULT_EPS


def test_a_wrongly_allocated_buffer_raises_instead_of_a_wrong_answer(monkeypatch):
    """What the entry points prepare themselves is checked too: buffers allocated in float64
    (the default-dtype slip) raise a ValueError rather than come back with garbage."""
    monkeypatch.setattr(cpu, "_empty", lambda shape: torch.empty(shape, dtype=torch.float64))
    args = _merge_fwd_args()
    merge = (args["o1"], args["lse1"], args["pv"], args["pk"], args["q"])
    with pytest.raises(ValueError, match="merge_fwd argument h: dtype torch.float64"):
        cpu.merge_fwd(*merge, DEFAULT_EPS, False)
    h = torch.randn(5, 16)
    with pytest.raises(ValueError, match="merge_bwd argument d_o1: dtype torch.float64"):
        cpu.merge_bwd(*merge, h, torch.randn(5, 16), None, DEFAULT_EPS)
    values, keys, queries = args["pv"], args["pk"], args["q"][None]
    with pytest.raises(ValueError, match="read_fwd argument out: dtype torch.float64"):
        cpu.read_fwd([values], [keys], queries, DEFAULT_EPS)


def test_inputs_the_kernels_cannot_serve_go_to_the_composite():
    """Not fp32 or not on the CPU: None (the caller runs the composite), not an error."""
    args = _merge_fwd_args()
    merge = (args["o1"], args["lse1"], args["pv"], args["pk"], args["q"])
    assert cpu.merge_fwd(*(x.double() for x in merge), DEFAULT_EPS, True) is None
    assert cpu.merge_fwd(*(x.to("meta") for x in merge), DEFAULT_EPS, True) is None
    h = torch.randn(5, 16, dtype=torch.float64)
    assert cpu.merge_bwd(*merge, h, None, None, DEFAULT_EPS) is None


# ------------------------------------------------------------------------ one OpenMP runtime


def test_the_kernels_share_torchs_openmp_runtime():
    """In a fresh process: loading the library maps no OpenMP runtime beside the one torch
    loaded (its libgomp.so.1 resolves to torch's copy), and no warning is raised."""
    script = (
        "import warnings, torch\n"
        "from custom_ops import cpu\n"
        "before = cpu._openmp_runtimes()\n"
        "warnings.simplefilter('error')\n"
        "assert cpu.library() is not None\n"
        "after = cpu._openmp_runtimes()\n"
        "assert len(before) == 1 and after == before, (before, after)\n"
        "print(*after)\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "libgomp" in proc.stdout


def test_a_second_openmp_runtime_leaves_the_calls_to_the_composite(monkeypatch):
    """Were the library to bring its own OpenMP runtime beside torch's, it is not used: one
    warning, None (the composite runs)."""
    seen = iter([{"/torch/lib/libgomp.so.1"}, {"/torch/lib/libgomp.so.1", "/usr/libgomp.so.1"}])
    monkeypatch.setattr(cpu, "_openmp_runtimes", lambda: next(seen))
    with pytest.warns(UserWarning, match=r"second OpenMP runtime \(/usr/libgomp.so.1\) beside"):
        assert cpu.build(cpu._SOURCE) is None
