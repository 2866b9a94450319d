"""Fused CPU kernels of the depth read: ``depth_read.c``, compiled on first use, called via ctypes.

They compute ``custom_ops.composite``'s functions for fp32 CPU tensors in one pass per token over
its rows, on the OpenMP runtime torch has loaded (checked at load), sharing its thread pool. A
function returns None when it cannot serve a call (another dtype or device, no compiler, a refused
library): the caller runs the composite. C is reached through ``call``: arguments by name in the
order of ``SIGNATURES`` (checked against the C definitions at load), every address taken from a
checked fp32 CPU tensor, so that a slip raises instead of corrupting memory.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from custom_ops.cpu.calls import (
    SIGNATURES,
    At,
    call,
    check_signatures,
)
from custom_ops.layout import rows
from custom_ops.reference import DEFAULT_EPS

# LRATTNRES_CPU_KERNELS=0 (or ENABLED = False): every call left to the composite
ENABLED = os.environ.get("LRATTNRES_CPU_KERNELS", "1") != "0"
_SOURCE = Path(__file__).with_name("depth_read.c")
ABI = 4  # lrattnres_cpu_abi() of a library this wrapper can call
# Tokens per thread at least: at d=64, 32 tokens, a read of 5 to 47 sources for 2 to 6 queries
# took 0.64-0.83x its one-thread time on 2 threads (forward and backward; 1 source: 0.92-0.97x).
# A one-token decode call stays on one thread.
_MIN_TOKENS_PER_THREAD = 16


# An OpenMP runtime's file name: GNU (libgomp, also as a wheel's libgomp-<hash>), Intel, LLVM
_OPENMP = re.compile(r"lib(?:gomp|iomp5|omp)(?:-[0-9a-f]+)?\.so(?:\.[0-9]+)*")


def _cache_dir() -> Path:
    default = Path.home() / ".cache" / "titan-lrattnres" / "cpu-kernels"
    return Path(os.environ.get("LRATTNRES_CPU_CACHE", default))


def cpu_info() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ("model name", "flags", ...) and "cpus",
    the number of processors; empty where there is no /proc/cpuinfo."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    info: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    info["cpus"] = str(sum(line.startswith("processor") for line in lines))
    return info


def _cpu_identity() -> str:
    info = cpu_info()
    return f"{info.get('model name', '')} {info.get('flags', '')}" if info else platform.processor()


@functools.cache
def library():
    """The compiled library, or None (with one warning) when it cannot be built."""
    return build(_SOURCE)


def build(source: Path):
    """Compile the C file ``source`` (cached by its hash and this CPU) and load it; None, with
    one warning, when there is no compiler, the build fails, the library would bring a second
    OpenMP runtime or speaks another ABI; RuntimeError when ``SIGNATURES`` does not match its
    functions. ``library()`` builds this package's own ``depth_read.c``;
    ``benchmarks.cpu_kernels`` builds other revisions of it."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        warnings.warn("no C compiler: the CPU depth read runs the eager composite", stacklevel=2)
        return None
    flags = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
    # -march=native: the key includes this CPU's model and flags (a shared cache directory must
    # never hand one machine a library built for another's instruction set)
    ident = " ".join([cc, *flags, platform.machine(), _cpu_identity()])
    key = hashlib.sha256(source.read_bytes() + ident.encode()).hexdigest()
    path = _cache_dir() / f"depth_read-{key[:16]}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            out = Path(tmp) / path.name
            proc = subprocess.run(
                [cc, *flags, "-o", str(out), str(source), "-lm"], capture_output=True, text=True
            )
            if proc.returncode != 0:
                warnings.warn(
                    f"building {source.name} failed ({proc.stderr.strip()[:300]}): the CPU "
                    "depth read runs the eager composite",
                    stacklevel=2,
                )
                return None
            os.replace(out, path)  # atomic: a concurrent build never loads a half-written file
    before = _openmp_runtimes()
    lib = ctypes.CDLL(str(path))
    # Seen in /proc/self/maps after the load (what the linker did); warned, not raised: same maths
    if before and (second := _openmp_runtimes() - before):
        warnings.warn(
            f"{path.name} brought a second OpenMP runtime ({', '.join(sorted(second))}) beside "
            f"torch's ({', '.join(sorted(before))}): the CPU depth read runs the eager composite",
            stacklevel=2,
        )
        return None
    abi = getattr(lib, "lrattnres_cpu_abi", None)
    if abi is None or abi() != ABI:
        warnings.warn(
            f"{source} speaks the kernels' ABI {None if abi is None else abi()}, this wrapper "
            f"{ABI} (see lrattnres_cpu_abi in depth_read.c): not loaded",
            stacklevel=2,
        )
        return None
    check_signatures(source.read_text(), source.name)
    for name, params in SIGNATURES.items():
        getattr(lib, name).argtypes = [ctype for _, ctype in params]
        getattr(lib, name).restype = None
    return lib


def _openmp_runtimes() -> set[str]:
    """The files of the OpenMP runtimes mapped into this process (empty without /proc)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {parts[5].strip() for line in f if len(parts := line.split(None, 5)) == 6}
    except OSError:
        return set()
    return {p for p in paths if _OPENMP.fullmatch(os.path.basename(p))}


# ----------------------------------------------------------------------------- the entry points


# Kept lean: cached decode makes many one-token calls per generated token (docs/performance.md).
_F32, _CPU = torch.float32, torch.device("cpu")


def _threads(n: int) -> int:
    if n < 2 * _MIN_TOKENS_PER_THREAD:
        return 1
    return max(1, min(torch.get_num_threads(), n // _MIN_TOKENS_PER_THREAD))


def _usable(*tensors) -> bool:
    if not ENABLED:
        return False
    for t in tensors:
        if t is not None and (t.dtype != _F32 or not t.is_cpu):
            return False
    return True


def _empty(shape) -> torch.Tensor:
    """An fp32 CPU buffer, whatever torch's default dtype and device. The sizes go one by one:
    torch.empty parses a torch.Size slower than ints, by more than checking the buffer costs."""
    if not len(shape):
        return torch.empty((), dtype=_F32, device=_CPU)
    return torch.empty(*shape, dtype=_F32, device=_CPU)


def _rows(x):
    """``(tensor, row stride)`` of ``rows(x)``; the tensor keeps a copy alive. A contiguous x is
    passed as it is: a view is a dispatcher call, which costs more than the gap between a
    training step's matmuls, and each op here would otherwise make several."""
    if x.is_contiguous():
        return x, x.shape[-1]
    x2 = rows(x)
    return x2, x2.stride(0)


def _flat(x):
    """x's elements in row-major order (None: None)."""
    return None if x is None else x.contiguous()


def _row_table(xs) -> tuple[list, list]:
    """``(tensors, row strides)`` of ``_rows(x)`` for each x of ``xs``."""
    if all(map(torch.Tensor.is_contiguous, xs)):  # the common case, without a call per x
        return list(xs), [x.shape[-1] for x in xs]
    pairs = [_rows(x) for x in xs]
    return [x for x, _ in pairs], [stride for _, stride in pairs]


def _sources(values, keys) -> tuple:
    """The read kernels' source arguments ``(vp, vs, kp, ks)``: value and key rows and their
    strides (keys None: the values')."""
    vp, vs = _row_table(values)
    return (vp, vs, vp, vs) if keys is None else (vp, vs, *_row_table(keys))


def read_fwd(values, keys, queries, eps: float):
    """``composite.read_fwd`` fused, or None when not applicable."""
    if not _usable(*values, *(keys or ()), queries) or (lib := library()) is None:
        return None
    lead, d = values[0].shape[:-1], values[0].shape[-1]
    q = _flat(queries)
    nc, rank = q.shape
    n = values[0].numel() // d if d else 0
    out, lse = _empty((nc, *lead, d)), _empty((nc, *lead))
    vp, vs, kp, ks = _sources(values, keys)
    call(lib, "read_fwd", S=len(values), C=nc, n=n, d=d, r=rank, sliced=int(keys is None),
         vp=vp, vs=vs, kp=kp, ks=ks, q=q, eps=float(eps), out=out, lse=lse,
         threads=_threads(n))  # fmt: skip
    return out, lse


def _per_query_rows(grad_out, nc: int, n: int, d: int):
    """Each query's ``[n, d]`` gradient, from one ``[C, ..., d]`` tensor; None when there is no
    gradient at all."""
    if grad_out is None:
        return None
    g = _flat(grad_out)
    return [At(g, c * n * d) for c in range(nc)]


def read_bwd(values, keys, queries, lse, grad_out, grad_lse, eps: float):
    """``composite.read_bwd`` fused, or None when not applicable. ``grad_out``: ``[C, ..., d]``
    or None."""
    tensors = (queries, lse, grad_out, grad_lse, *values, *(keys or ()))
    if not _usable(*tensors) or (lib := library()) is None:
        return None
    shape, d = values[0].shape, values[0].shape[-1]
    q = _flat(queries)
    nc, rank = q.shape
    n = values[0].numel() // d if d else 0
    gv = [_empty(shape) for _ in values]
    gk = None if keys is None else [_empty(k.shape) for k in keys]
    dq = _empty((nc, rank))
    vp, vs, kp, ks = _sources(values, keys)
    call(lib, "read_bwd", S=len(values), C=nc, n=n, d=d, r=rank, sliced=int(keys is None),
         vp=vp, vs=vs, kp=kp, ks=ks, q=q, eps=float(eps), lse=_flat(lse),
         dout=_per_query_rows(grad_out, nc, n, d), dlse=_flat(grad_lse), gv=gv, gk=gk or gv,
         acc=0, dq=dq, threads=_threads(n))  # fmt: skip
    return gv, gk, dq


def _merge_inputs(out1, partial_value, partial_key, rank) -> tuple:
    """The merge kernels' row arguments ``(o1, o1s, pv, pvs, pk, pks)``; the partial key is
    the partial value's last ``rank`` columns when sliced."""
    (o1, o1s), (pv, pvs) = _rows(out1), _rows(partial_value)
    pk, pks = (At(pv, pv.shape[-1] - rank), pvs) if partial_key is None else _rows(partial_key)
    return o1, o1s, pv, pvs, pk, pks


def merge_fwd(out1, lse1, partial_value, partial_key, query, eps: float, emit_norm: bool):
    """``composite.merge_fwd`` fused, or None when not applicable."""
    if not _usable(out1, lse1, partial_value, partial_key, query) or (lib := library()) is None:
        return None
    shape, d = partial_value.shape, partial_value.shape[-1]
    q, lse = _flat(query), _flat(lse1)
    rank, n = q.shape[-1], lse.numel()
    h = _empty(shape)
    norm = _empty(shape) if emit_norm else h.new_empty(0)
    o1, o1s, pv, pvs, pk, pks = _merge_inputs(out1, partial_value, partial_key, rank)
    call(lib, "merge_fwd", n=n, d=d, r=rank, o1=o1, o1s=o1s, lse1=lse, pv=pv, pvs=pvs, pk=pk,
         pks=pks, q=q, eps=float(eps), norm_eps=DEFAULT_EPS, h=h, norm=norm if emit_norm else None,
         threads=_threads(n))  # fmt: skip
    return h, norm


def merge_bwd(out1, lse1, partial_value, partial_key, query, h, grad_h, grad_norm, eps: float):
    """``composite.merge_bwd`` fused, or None when not applicable."""
    if grad_norm is not None and grad_norm.numel() == 0:
        grad_norm = None
    tensors = (out1, lse1, partial_value, partial_key, query, h, grad_h, grad_norm)
    if not _usable(*tensors) or (lib := library()) is None:
        return None
    shape, d = partial_value.shape, partial_value.shape[-1]
    q, lse = _flat(query), _flat(lse1)
    rank, n = q.shape[-1], lse.numel()
    d_o1, d_pv, d_lse = _empty(shape), _empty(shape), _empty(lse1.shape)
    d_pk = None if partial_key is None else _empty(partial_key.shape)
    dq = _empty((rank,))
    o1, o1s, pv, pvs, pk, pks = _merge_inputs(out1, partial_value, partial_key, rank)
    call(lib, "merge_bwd", n=n, d=d, r=rank, sliced=int(partial_key is None), o1=o1, o1s=o1s,
         lse1=lse, pv=pv, pvs=pvs, pk=pk, pks=pks, q=q, eps=float(eps), norm_eps=DEFAULT_EPS,
         h=_flat(h), gh=_flat(grad_h), gn=_flat(grad_norm), d_o1=d_o1, d_lse1=d_lse, d_pv=d_pv,
         d_pk=d_pk, dq=dq, threads=_threads(n))  # fmt: skip
    return d_o1, d_lse, d_pv, d_pk, dq
