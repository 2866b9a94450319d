"""Checked calls into the CPU kernels: each exported function's parameters by name
(``SIGNATURES``, checked against the C definitions when the library loads) and ``call``, which
passes arguments by name and checks every tensor before its address is taken (dtype, device,
layout, size), so that a slip raises instead of corrupting memory."""

from __future__ import annotations

import ctypes
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
                 ("eps", _D), *_each("lse dout dlse gv gk dq", _P), ("threads", _N)),
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
    """A table of ``count`` row strides (int64)."""

    count: int


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


def call(lib, kernel: str, /, **args) -> None:
    """Runs ``kernel`` of ``lib`` with ``args`` by name, passed in the order of ``SIGNATURES``.

    A pointer argument is a tensor (or an ``At``), a list of them for a table of addresses (ints
    for a table of row strides) or None for NULL where the kernel allows it. Each is checked
    against what the kernel reaches through it (``_memory``) before its address is taken: fp32,
    on the CPU, contiguous or rows of unit column stride, large enough; a ValueError naming the
    argument otherwise (a TypeError for a missing or unknown argument)."""
    params = SIGNATURES[kernel]
    if args.keys() != {name for name, _ in params}:
        names = [name for name, _ in params]
        missing = [name for name in names if name not in args]
        unknown = [name for name in args if name not in names]
        raise TypeError(f"{kernel}: missing arguments {missing}, unknown {unknown}")
    memory = _memory(kernel, args)
    ordered = []
    for name, ctype in params:
        value = args[name]
        if ctype is _P:
            value = _pointer(f"{kernel} argument {name}", value, memory[name], args)
        elif ctype is not _D and value < (1 if name == "threads" else 0):
            raise ValueError(f"{kernel} argument {name}: {value}")
        ordered.append(value)
    getattr(lib, kernel)(*ordered)


def _pointer(where: str, value, need, args: dict):
    """The address (or ctypes table of addresses) ``value`` stands for, once checked."""
    if isinstance(need, _Strides):
        if not isinstance(value, (list, tuple)) or len(value) != need.count:
            raise ValueError(f"{where}: wants a list of {need.count} row strides")
        return (_I * need.count)(*value)
    stride = args[need.stride] if isinstance(need, _Rows) else None
    if not need.table:
        return _address(where, value, need, stride)
    if value is None and getattr(need, "null", False):
        return None
    if not isinstance(value, (list, tuple)) or len(value) != need.table:
        raise ValueError(f"{where}: wants a list of {need.table} tensors")
    if stride is not None and (not isinstance(stride, (list, tuple)) or len(stride) != need.table):
        raise ValueError(f"{where}: wants a list of {need.table} row strides in {need.stride}")
    return (_P * need.table)(
        *(
            _address(f"{where}[{i}]", x, need, None if stride is None else stride[i])
            for i, x in enumerate(value)
        )
    )


def _address(where: str, value, need, stride: int | None) -> int | None:
    if value is None:
        if getattr(need, "null", False):
            return None
        raise ValueError(f"{where}: None, where the kernel reads or writes")
    x, offset = value if isinstance(value, At) else (value, 0)
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{where}: a {type(x).__name__}, not a tensor")
    if x.dtype != torch.float32:
        raise ValueError(f"{where}: dtype {x.dtype}, the kernel takes torch.float32")
    if x.device.type != "cpu":
        raise ValueError(f"{where}: on {x.device}, the kernel takes CPU memory")
    if isinstance(need, _Flat):
        if not x.is_contiguous():
            raise ValueError(
                f"{where}: strides {x.stride()} of shape {tuple(x.shape)}: not contiguous"
            )
        if not 0 <= offset <= x.numel() - need.size:
            have = x.numel() - offset
            raise ValueError(
                f"{where}: {have} elements from the address, the kernel reaches {need.size}"
            )
    else:
        n, width, row_stride = _row_layout(where, x)
        if n < need.rows or not 0 <= offset <= width - need.width:
            raise ValueError(
                f"{where}: {n} rows of {width} (from column {offset}), the kernel reads "
                f"{need.rows} of {need.width}"
            )
        if need.rows > 1 and stride != row_stride:
            raise ValueError(f"{where}: rows {row_stride} apart, the stride argument is {stride}")
    return x.data_ptr() + 4 * offset  # fp32: 4 bytes


def _row_layout(where: str, x: torch.Tensor) -> tuple[int, int, int]:
    """``(rows, width, row stride)`` of x read as rows of unit column stride."""
    width = x.shape[-1] if x.dim() else 0
    if x.dim() and x.is_contiguous():
        return (x.numel() // width if width else 0), width, width
    if x.dim() == 2 and (x.stride(1) == 1 or width == 1):
        return x.shape[0], width, x.stride(0)
    raise ValueError(f"{where}: strides {x.stride()} of shape {tuple(x.shape)}: not rows")
