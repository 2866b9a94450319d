"""Ahead-of-time compile of every Triton kernel for the H200 (sm_90), without a GPU.

Each case builds the launch the launcher would issue on GPU (``*_launch(..., gpu=True)``, so
``common.blocks`` takes its GPU branch) from small CPU tensors, binds its real arguments with
Triton's own launch-time specializer for an sm_90 target (argument types, ``tt.divisibility``
attributes, int 1 → constexpr: what a launch with these arguments would compile), then runs
``triton.compile`` through ptxas to a cubin. The bundled ``ptxas -v`` reports registers and spill
bytes per kernel; ``pytest -s`` prints the table. Token count 64 and 3 sources give the same
specialization as any real T divisible by 16 and S > 1.

Default cases are a subset sized to stay under a minute on 2 cores (bf16 over the d x c grid,
fp16/fp32 and the other key modes on the common d = 1024); ``LRATTNRES_SM90_FULL=1`` compiles the
whole d in {64, 1000, 1024, 4096} x r in {16, 64, 1024} x c in {1, 3, 6, 24} x 3 dtypes grid.
"""

from __future__ import annotations

import functools
import itertools
import os
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

pytestmark = [
    pytest.mark.skipif(_UNAVAILABLE is not None, reason=str(_UNAVAILABLE)),
    pytest.mark.skipif(common.INTERPRET, reason="kernels were built for TRITON_INTERPRET=1"),
]

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
    yield from (("bf16", d, 64, c, True) for d in DS for c in CS)
    yield from (("bf16", 1024, 64, c, False) for c in CS)
    yield from ((name, 1024, 64, c, True) for name in ("fp16", "fp32") for c in (1, 6))
    yield from (("bf16", 1024, r, c, False) for r in (16, 1024) for c in (1, 6))


def merge_cases():
    grid = itertools.product(DTYPES, DS, RS) if FULL else [("bf16", d, 64) for d in (1000, 1024)]
    for (name, d, r), sliced, norm in itertools.product(grid, (True, False), (True, False)):
        if r <= d or not sliced:
            yield name, d, r, sliced, norm


def _row(kind, name, d, r, c, variant, launch):
    res = compile_launch(launch)
    assert max(launch.grid[1:], default=1) < 65536, launch.grid
    assert res["smem"] <= SMEM_LIMIT, res
    cx = launch.constexprs
    tile = "x".join(str(cx.get(k, 1)) for k in ("BLOCK_C", "BLOCK_T", "BLOCK_D", "BLOCK_R"))
    return dict(kind=kind, dtype=name, d=d, r=r, c=c, variant=variant, tile=tile,
                warps=launch.num_warps, **res)  # fmt: skip


def _print_table(rows):
    print(f"\n{'kernel':10} {'dtype':5} {'d':>5} {'r':>5} {'c':>3} {'variant':12} "
          f"{'CxTxDxR':16} {'w':>2} {'regs':>4} {'spill st/ld':>12} {'smem':>6}")  # fmt: skip
    for x in rows:
        print(f"{x['kind']:10} {x['dtype']:5} {x['d']:5} {x['r']:5} {x['c']:3} {x['variant']:12} "
              f"{x['tile']:16} {x['warps']:2} {x['regs']:4} "
              f"{str(x['spill_st']) + '/' + str(x['spill_ld']):>12} {x['smem']:6}")  # fmt: skip


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
