"""Checked calls into the CPU kernels: each exported function's parameters by name
(``SIGNATURES``, checked against the C definitions when the library loads) and ``call``, which
passes arguments by name and checks every tensor before its address is taken (dtype, device,
layout, size), so that a slip raises instead of corrupting memory."""

from __future__ import annotations

import ctypes
import operator
import re
from typing import NamedTuple

import torch

_P, _I, _D, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double, ctypes.c_int


def _each(names: str, ctype) -> list[tuple[str, type]]:
    return [(name, ctype) for name in names.split()]


# Each exported function's parameters (name, ctypes type) in order, as depth_read.c defines them
# (checked at load: check_signatures); ``call`` passes arguments by these names.
SIGNATURES: dict[str, tuple[tuple[str, type], ...]] = {
    "read_fwd": (*_each("S C n d r", _I), ("sliced", _N), *_each("vp vs kp ks q", _P),
                 ("eps", _D), *_each("out lse", _P), ("threads", _N)),
    "read_bwd": (*_each("S C n d r", _I), ("sliced", _N), *_each("vp vs kp ks q", _P),
                 ("eps", _D), *_each("lse dout dlse gv gk", _P), ("acc", _N), ("dq", _P),
                 ("threads", _N)),
    "merge_fwd": (*_each("n d r", _I), ("o1", _P), ("o1s", _I), ("lse1", _P), ("pv", _P),
                  ("pvs", _I), ("pk", _P), ("pks", _I), ("q", _P), *_each("eps norm_eps", _D),
                  *_each("h norm", _P), ("threads", _N)),
    "merge_bwd": (*_each("n d r", _I), ("sliced", _N), ("o1", _P), ("o1s", _I), ("lse1", _P),
                  ("pv", _P), ("pvs", _I), ("pk", _P), ("pks", _I), ("q", _P),
                  *_each("eps norm_eps", _D), *_each("h gh gn d_o1 d_lse1 d_pv d_pk dq", _P),
                  ("threads", _N)),
}  # fmt: skip
_C_TYPES = {"int64_t": _I, "int": _N, "double": _D}  # and any pointer: c_void_p


def prototypes(text: str) -> dict[str, list[tuple[str, type | str]]]:
    """The parameters ``(name, ctypes type)`` of each exported (non-static) ``void`` function
    defined in the C source ``text``; a pointer is ``c_void_p``, a type without a ctypes
    counterpart here stays its C spelling."""
    text = re.sub(r"/\*.*?\*/|//[^\n]*", " ", text, flags=re.S)
    found = {}
    for m in re.finditer(r"^void\s+(\w+)\s*\(([^)]*)\)\s*\{", text, flags=re.M):
        params = []
        for param in m.group(2).split(","):
            *words, name = param.replace("*", " * ").split()
            base = " ".join(w for w in words if w not in ("const", "restrict", "*"))
            params.append((name, _P if "*" in words else _C_TYPES.get(base, base)))
        found[m.group(1)] = [] if params == [("void", "")] else params
    return found


def check_signatures(text: str, source: str = "depth_read.c") -> None:
    """RuntimeError, in one line, unless each ``SIGNATURES`` table lists its C function's
    parameters in the source ``text``: the same count, order, names and types."""
    found, problems = prototypes(text), []
    for fn, params in SIGNATURES.items():
        if fn not in found:
            problems.append(f"{fn}: no exported definition")
            continue
        want, got = (_spelt(p) for p in (params, found[fn]))
        if want == got:
            continue
        i = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), min(len(want), len(got)))
        table, c = (ps[i] if i < len(ps) else "nothing" for ps in (want, got))
        count = (
            f"{len(want)} arguments in the table, {len(got)} in C; "
            if len(want) != len(got)
            else ""
        )
        problems.append(f"{fn}: {count}argument {i} is {table} in the table, {c} in C")
    if problems:
        raise RuntimeError(
            f"custom_ops.cpu.SIGNATURES does not match {source}: {'; '.join(problems)}"
        )


def _spelt(params) -> list[str]:
    """``"type name"`` of each parameter, the type in C (a ctypes type without one here: its
    name; c_int64 is c_long on LP64)."""
    c = {_I: "int64_t", _N: "int", _D: "double", _P: "pointer"}
    return [f"{c.get(t, getattr(t, '__name__', t))} {name}" for name, t in params]


# ------------------------------------------------------------------------- checked kernel calls
# Cached decode makes ~100 one-token calls per generated token, so ``call`` is lean: what it checks
# for a kernel and its integer arguments is worked out once (``_plan``), the common cases are
# tested inline, and the full check (``_address``), with its messages, runs only for the others.


class At(NamedTuple):
    """The address of ``tensor``'s element ``offset`` (row-major): a pointer inside a tensor."""

    tensor: torch.Tensor
    offset: int


class _Flat(NamedTuple):
    """A contiguous fp32 tensor of at least ``size`` elements from the address on; ``table``:
    a table of that many such addresses; ``null``: NULL allowed (the table or its entries)."""

    size: int
    table: int = 0
    null: bool = False


class _Rows(NamedTuple):
    """``rows`` fp32 rows of ``width`` elements from the address on, unit column stride, the
    argument ``stride`` apart (per entry for a table of ``table`` addresses)."""

    rows: int
    width: int
    stride: str
    table: int = 0


class _Strides(NamedTuple):
    """A table of ``table`` row strides (int64)."""

    table: int


def _memory(kernel: str, a: dict) -> dict:
    """What ``kernel`` reaches behind each pointer argument, by name, given its arguments ``a``
    (depth_read.c's comments on each function)."""
    n, d, r = a["n"], a["d"], a["r"]
    if kernel.startswith("read"):
        s, c = a["S"], a["C"]
        kept = {"vp": _Rows(n, d, "vs", s), "vs": _Strides(s), "kp": _Rows(n, r, "ks", s),
                "ks": _Strides(s), "q": _Flat(c * r), "lse": _Flat(c * n)}  # fmt: skip
        if kernel == "read_fwd":
            return {**kept, "out": _Flat(c * n * d)}
        return {**kept, "dout": _Flat(n * d, c, null=True), "dlse": _Flat(c * n, null=True),
                "gv": _Flat(n * d, s), "gk": _Flat(n * r, s), "dq": _Flat(c * r)}  # fmt: skip
    kept = {"o1": _Rows(n, d, "o1s"), "lse1": _Flat(n), "pv": _Rows(n, d, "pvs"),
            "pk": _Rows(n, r, "pks"), "q": _Flat(r), "h": _Flat(n * d)}  # fmt: skip
    if kernel == "merge_fwd":
        return {**kept, "norm": _Flat(n * d, null=True)}
    grads = {"d_o1": _Flat(n * d), "d_lse1": _Flat(n), "d_pv": _Flat(n * d), "dq": _Flat(r),
             "d_pk": _Flat(n * r, null=bool(a["sliced"]))}  # fmt: skip
    return {**kept, "gh": _Flat(n * d, null=True), "gn": _Flat(n * d, null=True), **grads}


_F32, _Tensor = torch.float32, torch.Tensor
_LAYOUTS: dict = {}  # kernel: its SIGNATURES entry, getters of its arguments, its plans


def _plan(kernel: str, params, ints: tuple) -> tuple:
    """Checks ``kernel``'s integer arguments ``ints`` (>= 0, threads >= 1; a ValueError) and
    gives each pointer's ``(position, need, size, width, room)`` for ``call``'s inline test: a
    plain contiguous tensor of at least ``size`` elements (None: no such test), flat from its
    start (``width`` None) or rows ``width`` apart (the stride argument) from a column <= room."""
    names = [name for name, t in params if t in (_I, _N)]
    for name, value in zip(names, ints):
        if value < (name == "threads"):
            raise ValueError(f"{kernel} argument {name}: {value}")
    a = dict(zip(names, ints))
    memory, plan = _memory(kernel, a), []
    for i, (name, t) in enumerate(params):
        if t is _P:
            need, size, width, room = memory[name], None, None, None
            if need.__class__ is _Flat and not need.table:
                size = need.size
            elif need.__class__ is _Rows and not need.table and a.get(need.stride, 0) > 0:
                width = a[need.stride]
                size, room = need.rows * width, width - need.width
            plan.append((i, need, size, width, room))
    return tuple(plan)


class _Refused(ValueError):
    """What is wrong with an argument: the text after its name (``": ..."``, ``"[i]: ..."``)."""


def call(lib, kernel: str, /, **args) -> None:
    """Runs ``kernel`` of ``lib`` with ``args`` by name, passed in the order of ``SIGNATURES``.

    A pointer argument is a tensor (or an ``At``), a list of them for a table of addresses (ints
    for a table of row strides) or None for NULL where the kernel allows it. Each is checked
    against what the kernel reaches through it (``_memory``) before its address is taken: fp32,
    on the CPU, contiguous or rows of unit column stride, large enough; a ValueError naming the
    argument otherwise (a TypeError for a missing or unknown argument)."""
    params = SIGNATURES[kernel]
    if (layout := _LAYOUTS.get(kernel)) is None or layout[0] is not params:
        in_order = operator.itemgetter(*(name for name, _ in params))
        ints = operator.itemgetter(*(i for i, (_, t) in enumerate(params) if t in (_I, _N)))
        layout = _LAYOUTS[kernel] = (params, in_order, ints, {})
    _, in_order, ints, plans = layout
    try:
        if len(args) != len(params):
            raise KeyError(kernel)
        ordered = list(in_order(args))
    except KeyError:
        names = [name for name, _ in params]
        missing = [name for name in names if name not in args]
        unknown = [name for name in args if name not in names]
        raise TypeError(f"{kernel}: missing arguments {missing}, unknown {unknown}") from None
    if (plan := plans.get(key := ints(ordered))) is None:
        if len(plans) >= 256:  # a decode step repeats the same few
            plans.clear()
        plan = plans[key] = _plan(kernel, params, key)
    tables = []  # (list, need, table) built by this call: a list passed twice is checked once
    try:
        for i, need, size, width, room in plan:
            x, offset = ordered[i], 0
            if x.__class__ is At:
                x, offset = x
            if (size is not None and x.__class__ is _Tensor and x.dtype == _F32 and x.is_cpu
                    and x.is_contiguous() and x.numel() >= size
                    and (offset == 0 if width is None
                         else x.dim() and x.shape[-1] == width and 0 <= offset <= room)
                    ):  # fmt: skip
                ordered[i] = x.data_ptr() + 4 * offset  # fp32: 4 bytes
            elif need.table or need.__class__ is _Strides:
                for seen, seen_need, table in tables:
                    if seen is x and _covers(seen_need, need, args):
                        ordered[i] = table
                        break
                else:
                    ordered[i] = _table(x, need, args)
                    tables.append((x, need, ordered[i]))
            elif x is not None or need.__class__ is not _Flat or not need.null:  # else NULL
                stride = args[need.stride] if need.__class__ is _Rows else None
                ordered[i] = _address(ordered[i], need, stride)
    except _Refused as e:
        raise ValueError(f"{kernel} argument {params[i][0]}{e}") from None
    getattr(lib, kernel)(*ordered)


def _covers(checked, need, args: dict) -> bool:
    """Whether a table that passed ``checked`` also meets ``need`` (sliced keys are the values'
    tails: their rows pass as the values' do; a value gradient table serves as the keys')."""
    if checked.__class__ is not need.__class__ or checked.table != need.table:
        return False
    if need.__class__ is _Strides:
        return True
    if need.__class__ is _Flat:
        return not checked.null and not need.null and checked.size >= need.size
    return (checked.rows >= need.rows and checked.width >= need.width
            and args[checked.stride] is args[need.stride])  # fmt: skip


def _table(value, need, args: dict):
    """The ctypes table of addresses or row strides ``value`` stands for, once checked against
    ``need``; _Refused otherwise."""
    n = need.table
    if need.__class__ is _Strides:
        if not isinstance(value, (list, tuple)) or len(value) != n:
            raise _Refused(f": wants a list of {n} row strides")
        return (_I * n)(*value)
    if value is None and need.__class__ is _Flat and need.null:
        return None
    if not isinstance(value, (list, tuple)) or len(value) != n:
        raise _Refused(f": wants a list of {n} tensors")
    if need.__class__ is _Flat:
        strides, size, width = (None,) * n, need.size, None
    elif isinstance(strides := args[need.stride], (list, tuple)) and len(strides) == n:
        size, width = need.rows, need.width
    else:
        raise _Refused(f": wants a list of {n} row strides in {need.stride}")
    addresses = []
    for x, s in zip(value, strides):
        if (x.__class__ is _Tensor and x.dtype == _F32 and x.is_cpu and x.is_contiguous()
                and (x.numel() >= size if width is None
                     else x.dim() and x.shape[-1] == s and 0 < s and width <= s
                     and x.numel() >= size * s)):  # fmt: skip
            addresses.append(x.data_ptr())  # the common case inline, as in call
            continue
        try:
            addresses.append(_address(x, need, s))
        except _Refused as e:
            raise _Refused(f"[{len(addresses)}]{e}") from None
    return (_P * n)(*addresses)


def _address(value, need, stride: int | None) -> int | None:
    """The address of one tensor (or ``At``) once checked against ``need`` (``stride``: the row
    stride argument, for rows); None for None where NULL is allowed; _Refused otherwise."""
    if value is None:
        if need.__class__ is _Flat and need.null:
            return None
        raise _Refused(": None, where the kernel reads or writes")
    x, offset = value if isinstance(value, At) else (value, 0)
    if not isinstance(x, _Tensor):
        raise _Refused(f": a {type(x).__name__}, not a tensor")
    if x.dtype != _F32:
        raise _Refused(f": dtype {x.dtype}, the kernel takes torch.float32")
    if not x.is_cpu:
        raise _Refused(f": on {x.device}, the kernel takes CPU memory")
    if need.__class__ is _Flat:
        if not x.is_contiguous():
            raise _Refused(f": strides {x.stride()} of shape {tuple(x.shape)}: not contiguous")
        if not 0 <= offset <= x.numel() - need.size:
            have = x.numel() - offset
            raise _Refused(f": {have} elements from the address, the kernel reaches {need.size}")
        return x.data_ptr() + 4 * offset  # fp32: 4 bytes
    width = x.shape[-1] if x.dim() else 0
    if x.dim() and x.is_contiguous():  # (rows, width, row stride) of x read as rows
        n, row_stride = (x.numel() // width if width else 0), width
    elif x.dim() == 2 and (x.stride(1) == 1 or width == 1):
        n, row_stride = x.shape[0], x.stride(0)
    else:
        raise _Refused(f": strides {x.stride()} of shape {tuple(x.shape)}: not rows")
    if n < need.rows or not 0 <= offset <= width - need.width:
        raise _Refused(
            f": {n} rows of {width} (from column {offset}), the kernel reads {need.rows} of "
            f"{need.width}"
        )
    if need.rows > 1 and stride != row_stride:
        raise _Refused(f": rows {row_stride} apart, the stride argument is {stride}")
    return x.data_ptr() + 4 * offset
