"""Ahead-of-time compile of every Triton kernel for the H200 (sm_90), without a GPU.

Each case builds the launch the launcher would issue on GPU (``*_launch(..., gpu=True)``, so
``common.blocks`` takes its GPU branch) from small CPU tensors, binds its real arguments with
Triton's own launch-time specializer for an sm_90 target (argument types, ``tt.divisibility``
attributes, int 1 → constexpr: what a launch with these arguments would compile), then runs
``triton.compile`` through ptxas to a cubin. The bundled ``ptxas -v`` reports registers and spill
bytes per kernel, the PTX the width of every global access; ``pytest -s`` prints the table.
Token count 64 and 3 sources (bucket 8) give the same specialization as any real T divisible by
16 and 2 <= S <= 8; each larger bucket is one more compile of the same code.

Default cases are a subset sized to stay near a minute on 2 cores (~75 s with an empty Triton
cache: bf16 over d x c, fp16/fp32 and the other key modes on the common d = 1024, merges at
d = 1000 and 1024); ``LRATTNRES_SM90_FULL=1`` compiles the whole d in {64, 1000, 1024, 4096} x
r in {16, 64, 1024} x c in {1, 3, 6, 24} x 3 dtypes grid. Measured with triton 3.8 (ptxas 12.9);
triton 3.6's ptxas 12.8 spills 12-20 B in a few common shapes (the pointer-table kernels too).
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import platform
import re
import subprocess
import tempfile

import pytest
import torch
import triton

from custom_ops.kernels import common, merge, read_bwd, read_fwd

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    TARGET = GPUTarget("cuda", 90, 32)
    BACKEND = make_backend(TARGET)
    PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    _UNAVAILABLE = None if os.access(PTXAS, os.X_OK) else f"no bundled ptxas at {PTXAS}"
except Exception as e:  # noqa: BLE001 - any import/backend failure means: cannot test here
    _UNAVAILABLE = f"Triton NVIDIA backend unavailable: {type(e).__name__}: {e}"

# Triton's Linux x86_64 wheels ship the NVIDIA backend and its ptxas: there a missing one is a
# broken install, which fails (test_nvidia_backend_is_available) instead of skipping the check.
_MUST_RUN = platform.system() == "Linux" and platform.machine() == "x86_64"
pytestmark = [
    pytest.mark.skipif(
        _UNAVAILABLE is not None and not _MUST_RUN,
        reason=f"{_UNAVAILABLE} (Triton ships ptxas only in its Linux x86_64 wheels)",
    ),
    pytest.mark.skipif(common.INTERPRET, reason="kernels were built for TRITON_INTERPRET=1"),
]


def test_nvidia_backend_is_available():
    assert _UNAVAILABLE is None, _UNAVAILABLE


FULL = os.environ.get("LRATTNRES_SM90_FULL") == "1"
TOKENS, SOURCES, EPS = 64, 3, 1e-6
SMEM_LIMIT = 227 * 1024  # H100/H200 max dynamic shared memory per block
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DS, RS, CS = (64, 1000, 1024, 4096), (16, 64, 1024), (1, 3, 6, 24)


def _common_shape(d: int, c: int) -> bool:
    """Shapes that must not spill: d = 1024 with a bank of at most 8 queries."""
    return d == 1024 and c <= 8


# --------------------------------------------------------------------------- compile + ptxas


def _specialize(launch: common.Launch):
    """``(options, signature, constexprs, attrs)`` exactly as ``JITFunction.run`` derives them."""
    kernel = launch.kernel
    binder = create_function_from_signature(kernel.signature, kernel.params, BACKEND)
    kwargs = dict(launch.constexprs, num_warps=launch.num_warps)
    bound, specialization, options = binder(*launch.args, **kwargs)
    return kernel._pack_args(BACKEND, kwargs, bound, specialization, options)


@functools.cache
def _compile(kernel, signature: str, constexprs: str, attrs: str, options_key: str, packed):
    options, sig, cx, at = packed.value
    ck = triton.compile(ASTSource(kernel, sig, cx, at), target=TARGET, options=options.__dict__)
    assert ck.asm.get("cubin"), "no cubin"
    ptx = ck.asm["ptx"]
    arch = re.search(r"^\.target\s+(\w+)", ptx, re.M).group(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        cmd = [PTXAS, "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", path, "-o", path + ".o"]
        log = subprocess.run(cmd, capture_output=True, text=True, check=True).stderr
    stores, loads = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log).groups()
    return {
        "arch": arch,
        "regs": int(re.search(r"Used (\d+) registers", log).group(1)),
        "spill_st": int(stores),
        "spill_ld": int(loads),
        "smem": ck.metadata.shared,
        **_access_widths(ck.asm["ttgir"], ptx, 32 * options.num_warps),
    }


class _Packed:
    """Carries the unhashable specialization past ``functools.cache`` (keyed by its strings)."""

    def __init__(self, value):
        self.value = value

    def __hash__(self):
        return 0

    def __eq__(self, other):
        return isinstance(other, _Packed)


def compile_launch(launch: common.Launch) -> dict:
    packed = _specialize(launch)
    options, sig, cx, at = packed
    key = (str(sig), str(sorted(cx.items())), str(sorted(at.items())), repr(options))
    return _compile(launch.kernel, *key, _Packed(packed))


# --------------------------------------------------------------------------- access widths
# Every tile load/store of the Triton IR (shape, element type, source position) is matched with
# the PTX instructions at its source position (``.loc``: file, line, and the line it is inlined
# at). A tile that gives each thread >= 16 bytes along rows of >= 16 bytes must move in 128-bit
# instructions only; a smaller one cannot (a [4, 64] bf16 key tile over 256 threads: one element
# each), whatever its alignment.

_IR_LOC = re.compile(r"^(#loc\d*) = loc\((.*)\)$", re.M)
_IR_ACCESS = re.compile(
    r"tt\.(?:load|store) [^\n]*?: tensor<([\dx]+)x!tt\.ptr<(\w+)>[^\n]*loc\((#loc\d*)\)"
)
_PTX_FILE = re.compile(r'^\s*\.file\s+(\d+)\s+"([^"]+)"', re.M)
# triton 3.8 writes the call site as ``inlined_at F L C``; 3.6 only in the comment: ``@[ f:L:C``
_PTX_LOC = re.compile(
    r"\s*\.loc\s+(\d+) (\d+) \d+(?:, function_name \S+, inlined_at (\d+) (\d+))?"
    r"(?:.*?//\s*\S+\s+@\[\s*([^:\s]+):(\d+))?"
)
_PTX_ACCESS = re.compile(r"\s*(?:@!?%p\d+\s+)?(ld|st)\.global(\S*)")
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "i64": 8}


def _ir_frames(defs: dict, ref: str) -> list:
    """Source frames ``(file, line)`` of an IR location, innermost first."""
    text = defs.get(ref, "")
    if m := re.fullmatch(r'"([^"]+)":(\d+):\d+', text):
        return [(os.path.basename(m.group(1)), int(m.group(2)))]
    if m := re.fullmatch(r'"[^"]*"\((#loc\d*)\)', text):  # a named value
        return _ir_frames(defs, m.group(1))
    if m := re.fullmatch(r"callsite\((#loc\d*) at (#loc\d*)\)", text):
        return _ir_frames(defs, m.group(1)) + _ir_frames(defs, m.group(2))
    return []


def _ptx_accesses(ptx: str) -> list:
    """``[(file, line, caller (file, line) or None, "ld" | "st", bits)]``, in PTX order."""
    files = {k: os.path.basename(v) for k, v in _PTX_FILE.findall(ptx)}
    where, out = (None, 0, None), []
    for line in ptx.splitlines():
        if m := _PTX_LOC.match(line):
            f, ln, cf, cln, comment_file, comment_line = m.groups()
            caller = (files.get(cf), int(cln)) if cf else None
            if caller is None and comment_file:
                caller = (os.path.basename(comment_file), int(comment_line))
            where = (files.get(f), int(ln), caller)
        elif m := _PTX_ACCESS.match(line):
            mods = m.group(2).split(".")
            lanes = next((int(x[1:]) for x in mods if re.fullmatch(r"v\d", x)), 1)
            bits = next(int(x[1:]) for x in reversed(mods) if re.fullmatch(r"[bufs]\d+", x))
            out.append((*where, m.group(1), lanes * bits))
    return out


def _access_widths(ttgir: str, ptx: str, threads: int) -> dict:
    """Global accesses (all, 128-bit) and the wide tiles not moved in 128-bit accesses only.

    An access inlined from a helper is identified by the helper's file and its call site (the
    instructions of a one-line helper may carry any of its lines); one in the kernel body by its
    statement: the nearest IR access at or above its ``.loc`` line (a statement's instructions
    carry its later lines)."""
    defs = dict(_IR_LOC.findall(ttgir))
    tiles = {}  # (file, caller frame) or (file, line) -> description if wide, else None
    for shape, elem, ref in _IR_ACCESS.findall(ttgir):
        dims, size = [int(x) for x in shape.split("x")], _BYTES[elem]
        wide = math.prod(dims) * size >= 16 * threads and dims[-1] * size >= 16
        frames = _ir_frames(defs, ref)
        key = (frames[0][0], frames[1]) if len(frames) > 1 else frames[0]
        tiles[key] = tiles.get(key) or (f"{elem} [{shape.replace('x', ', ')}]" if wide else None)
    accesses = _ptx_accesses(ptx)
    bits = {key: set() for key in tiles}
    for f, ln, caller, _, b in accesses:
        if caller is not None:
            key = (f, caller)
        else:
            above = [k for k in tiles if k[0] == f and isinstance(k[1], int) and k[1] <= ln]
            key = max(above, key=lambda k: k[1], default=None)
        if key in bits:
            bits[key].add(b)
    narrow = [f"{key} {tile}: {sorted(bits[key])}-bit" for key, tile in tiles.items()
              if tile and bits[key] != {128}]  # fmt: skip
    return {
        "ld": sum(a[3] == "ld" for a in accesses),
        "ld128": sum(a[3] == "ld" and a[4] == 128 for a in accesses),
        "st": sum(a[3] == "st" for a in accesses),
        "st128": sum(a[3] == "st" and a[4] == 128 for a in accesses),
        "wide": sum(tile is not None for tile in tiles.values()),
        "narrow": narrow,
    }


# --------------------------------------------------------------------------- the cases


def _sources(dt, d, r):
    values = [torch.empty(TOKENS, d, dtype=dt) for _ in range(SOURCES)]
    keys = [torch.empty(TOKENS, r, dtype=dt) for _ in range(SOURCES)]
    return values, keys


def read_launches(dt, d, r, c, sliced):
    """The fwd and bwd launches of a read: a depth read (out in the values' dtype) for c = 1,
    a query-bank read (fp32 out) otherwise; queries are fp32 master weights."""
    values, keys = _sources(dt, d, r)
    keys = None if sliced else keys
    q = torch.empty(c, r)
    out_dtype = dt if c == 1 else torch.float32
    fwd, out, lse = read_fwd.read_fwd_launch(values, keys, q, EPS, out_dtype, gpu=True)
    grads = torch.empty_like(out), torch.empty_like(lse)
    bwd, *_ = read_bwd.read_bwd_launch(values, keys, q, lse, *grads, EPS, gpu=True)
    return fwd, bwd


def merge_launches(dt, d, r, sliced, norm):
    """The merge fwd and bwd launches (out1 is a bank read's fp32 output)."""
    pv, pk = torch.empty(TOKENS, d, dtype=dt), None if sliced else torch.empty(TOKENS, r, dtype=dt)
    out1, lse1, q = torch.empty(TOKENS, d), torch.empty(TOKENS), torch.empty(r)
    fwd, h, _ = merge.merge_fwd_launch(out1, lse1, pv, pk, q, EPS, norm, gpu=True)
    gn = torch.empty_like(h) if norm else None
    bwd, *_ = merge.merge_bwd_launch(out1, lse1, pv, pk, q, h, torch.empty_like(h), gn, EPS, True)
    return fwd, bwd


def read_cases():
    """``(dtype, d, r, c, sliced)``; sliced keys (the value's tail) need r <= d."""
    if FULL:
        for name, d, r, c in itertools.product(DTYPES, DS, RS, CS):
            yield from ((name, d, r, c, sl) for sl in (True, False) if r <= d or not sl)
        return
    yield from (("bf16", d, 64, c, True) for d in DS for c in (1, 6))
    yield from (("bf16", 1024, 64, c, True) for c in (3, 24))
    yield from (("bf16", 1024, 64, c, False) for c in CS)
    yield from (("bf16", 1000, 64, c, False) for c in (1, 6))
    yield from ((name, 1024, 64, c, True) for name in ("fp16", "fp32") for c in (1, 6))
    yield from ((name, 1024, 64, 1, False) for name in ("fp16", "fp32"))
    yield from (("bf16", 1024, r, c, False) for r in (16, 1024) for c in (1, 6))


def merge_cases():
    """``(dtype, d, r, sliced, norm)``: bf16 at d = 1000 and 1024 in full; fp16 / fp32 with the
    most (sliced + norm) and the fewest live tiles."""
    if FULL:
        grid = itertools.product(DTYPES, DS, RS, (True, False), (True, False))
        yield from (case for case in grid if case[2] <= case[1] or not case[3])
        return
    for d, sliced, norm in itertools.product((1000, 1024), (True, False), (True, False)):
        yield "bf16", d, 64, sliced, norm
    for name in ("fp16", "fp32"):
        yield from ((name, 1024, 64, True, True), (name, 1024, 64, False, False))


def _row(kind, name, d, r, c, variant, launch):
    res = compile_launch(launch)
    assert max(launch.grid[1:], default=1) < 65536, launch.grid
    assert res["smem"] <= SMEM_LIMIT, res
    cx = launch.constexprs
    tile = "x".join(str(cx.get(k, 1)) for k in ("BLOCK_C", "BLOCK_T", "BLOCK_D", "BLOCK_R"))
    return dict(kind=kind, dtype=name, d=d, r=r, c=c, variant=variant, tile=tile,
                warps=launch.num_warps, **res)  # fmt: skip


def _print_table(rows):
    """One line per kernel; ``ld``/``st``: 128-bit / all global access instructions in the PTX,
    ``wide``: tiles that give a thread >= 16 contiguous bytes (all 128-bit, or the test fails)."""
    print(f"\n{'kernel':10} {'dtype':5} {'d':>5} {'r':>5} {'c':>3} {'variant':12} "
          f"{'CxTxDxR':16} {'w':>2} {'regs':>4} {'spill st/ld':>12} {'smem':>6} "
          f"{'ld':>6} {'st':>6} {'wide':>4}")  # fmt: skip
    for x in rows:
        spill = f"{x['spill_st']}/{x['spill_ld']}"
        ld, st = f"{x['ld128']}/{x['ld']}", f"{x['st128']}/{x['st']}"
        print(f"{x['kind']:10} {x['dtype']:5} {x['d']:5} {x['r']:5} {x['c']:3} {x['variant']:12} "
              f"{x['tile']:16} {x['warps']:2} {x['regs']:4} {spill:>12} {x['smem']:6} "
              f"{ld:>6} {st:>6} {x['wide']:4}")  # fmt: skip


@functools.cache
def read_rows():
    rows = []
    for name, d, r, c, sliced in read_cases():
        fwd, bwd = read_launches(DTYPES[name], d, r, c, sliced)
        variant = "sliced" if sliced else "keys"
        rows.append(_row("read_fwd", name, d, r, c, variant, fwd))
        rows.append(_row("read_bwd", name, d, r, c, variant, bwd))
    return rows


@functools.cache
def merge_rows():
    rows = []
    for name, d, r, sliced, norm in merge_cases():
        fwd, bwd = merge_launches(DTYPES[name], d, r, sliced, norm)
        variant = ("sliced" if sliced else "keys") + ("+norm" if norm else "")
        rows.append(_row("merge_fwd", name, d, r, 1, variant, fwd))
        rows.append(_row("merge_bwd", name, d, r, 1, variant, bwd))
    return rows


# --------------------------------------------------------------------------- tests


def test_blocks_gpu_branch_is_explicit():
    """``gpu=True`` gives the GPU tiles whatever TRITON_INTERPRET says."""
    assert common.blocks(6, 1024, 64, gpu=True) != common.blocks(6, 1024, 64, gpu=False)
    assert common.blocks(6, 1024, 64, gpu=not common.INTERPRET) == common.blocks(6, 1024, 64)


def test_read_kernels_compile_for_sm90():
    rows = read_rows()
    _print_table(rows)
    assert {x["arch"] for x in rows} == {"sm_90a"}


def test_merge_kernels_compile_for_sm90():
    rows = merge_rows()
    _print_table(rows)
    assert {x["arch"] for x in rows} == {"sm_90a"}


def test_no_register_spills_on_common_shapes():
    """d = 1024, c <= 8: no spill stores (see ``common.blocks`` for the measured registers)."""
    rows = [x for x in read_rows() + merge_rows() if _common_shape(x["d"], x["c"])]
    assert rows
    spills = [x for x in rows if x["spill_st"] > 0]
    assert not spills, "\n".join(map(str, spills))


def test_wide_tiles_move_in_128_bit_accesses():
    """Every tile of values, keys, their gradients, outputs (and fp32 partials) that gives a
    thread >= 16 contiguous bytes is loaded / stored with 128-bit instructions only: d and r are
    multiples of 8 in every case, and the sources are kernel arguments whose alignment Triton
    knows. With the former device pointer table, 36 of the 76 default kernels failed here (the
    read forward's values in 16-bit ``ld.global.b16``, the merges at d = 1000 likewise)."""
    rows = read_rows() + merge_rows()
    assert all(x["wide"] > 0 for x in rows), "a kernel without wide tiles checks nothing"
    narrow = [f"{x['kind']} {x['dtype']} d={x['d']} r={x['r']} c={x['c']} {x['variant']}: {n}"
              for x in rows for n in x["narrow"]]  # fmt: skip
    assert not narrow, "\n".join(narrow)
    common_c1 = [x for x in rows if x["dtype"] == "bf16" and x["d"] == 1024 and x["c"] == 1]
    assert all(x["ld128"] and x["st128"] for x in common_c1), common_c1
