"""Fused CPU kernels of the depth read: ``depth_read.c``, built on first use, called via ctypes.

Same contracts as ``custom_ops.composite`` (query bank ``[C, r]``, fp32 results shaped
``[C, ...]``), one pass per token over its rows: each value row is read once in the forward and
once in the backward, where the eager composite makes C·S whole-tensor passes plus temporaries.
Tokens are split over ``torch.get_num_threads()`` OpenMP threads of the libgomp torch has
already loaded (the library links ``libgomp.so.1``, which resolves to torch's copy): the kernels
share torch's thread pool instead of competing with its spinning workers.

Scope: fp32 tensors on CPU whose rows have unit column stride (other layouts are copied, kept
alive for the call). Every function returns None when it cannot serve the call (another dtype
or device, or no C compiler): the caller then uses the eager composite. The library is compiled
with the system C compiler into ``$LRATTNRES_CPU_CACHE`` (default
``~/.cache/titan-lrattnres/cpu-kernels``), keyed by the source's hash; ``ENABLED = False`` turns
the kernels off (tests compare both paths).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from custom_ops.layout import rows

ENABLED = os.environ.get("LRATTNRES_CPU_KERNELS", "1") != "0"
NORM_EPS = torch.finfo(torch.float32).eps
_SOURCE = Path(__file__).with_name("depth_read.c")
ABI = 3  # lrattnres_cpu_abi() of a library this wrapper can call
_MIN_TOKENS_PER_THREAD = 64
_P, _I, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
_N = ctypes.c_int
_SIGNATURES = {  # the last argument is the thread count
    "read_fwd": [_I] * 5 + [_N] + [_P] * 5 + [_D] + [_P] * 2 + [_N],
    "read_bwd": [_I] * 5 + [_N] + [_P] * 5 + [_D] + [_P] * 6 + [_N],
    "merge_fwd": [_I] * 3 + [_P, _I, _P, _P, _I, _P, _I, _P, _D, _D, _P, _P, _N],
    "merge_bwd": [_I] * 3 + [_N, _P, _I, _P, _P, _I, _P, _I, _P, _D, _D] + [_P] * 8 + [_N],
}


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
    one warning, when there is no compiler or the build fails. ``library()`` builds this
    package's own ``depth_read.c``; ``benchmarks.cpu_kernels`` builds other revisions of it."""
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
    lib = ctypes.CDLL(str(path))
    abi = getattr(lib, "lrattnres_cpu_abi", None)
    if abi is None or abi() != ABI:
        warnings.warn(
            f"{source} speaks the kernels' ABI {None if abi is None else abi()}, this wrapper "
            f"{ABI} (see lrattnres_cpu_abi in depth_read.c): not loaded",
            stacklevel=2,
        )
        return None
    for name, args in _SIGNATURES.items():
        getattr(lib, name).argtypes = args
        getattr(lib, name).restype = None
    return lib


def _threads(n: int) -> int:
    return max(1, min(torch.get_num_threads(), n // _MIN_TOKENS_PER_THREAD))


def _usable(*tensors) -> bool:
    return ENABLED and all(t is None or (t.is_cpu and t.dtype == torch.float32) for t in tensors)


def _table(tensors, ctype):
    return (ctype * len(tensors))(*tensors)


def _rows(x):
    """``(tensor, address, row stride)`` of ``rows(x)``; the tensor keeps a copy alive. A
    contiguous x is passed as it is: a view is a dispatcher call, ~10 µs, several times that
    between a training step's matmuls, and each op here would otherwise make several."""
    if x.is_contiguous():
        return x, x.data_ptr(), x.shape[-1]
    x2 = rows(x)
    return x2, x2.data_ptr(), x2.stride(0)


def _flat(x):
    """``(tensor, address)`` of x's elements in row-major order (None: (None, None))."""
    if x is None:
        return None, None
    x = x.contiguous()
    return x, x.data_ptr()


def _sources(values, keys):
    """Rows (kept alive by the caller) and the ctypes pointer / stride tables."""
    v2 = [_rows(v) for v in values]
    k2 = v2 if keys is None else [_rows(k) for k in keys]
    tables = (
        _table([v[1] for v in v2], _P),
        _table([v[2] for v in v2], _I),
        _table([k[1] for k in k2], _P),
        _table([k[2] for k in k2], _I),
    )
    return (v2, k2), tables


def read_fwd(values, keys, queries, eps: float):
    """``composite.read_fwd`` fused, or None when not applicable."""
    if not _usable(*values, *(keys or ()), queries) or (lib := library()) is None:
        return None
    lead, d = values[0].shape[:-1], values[0].shape[-1]
    q, q_ptr = _flat(queries)
    nc, rank = q.shape
    n = values[0].numel() // d if d else 0
    kept, tables = _sources(values, keys)
    out = torch.empty((nc, *lead, d), dtype=torch.float32)
    lse = torch.empty((nc, *lead), dtype=torch.float32)
    args = (len(values), nc, n, d, rank, int(keys is None), *tables, q_ptr, float(eps),
            out.data_ptr(), lse.data_ptr())  # fmt: skip
    lib.read_fwd(*args, _threads(n))
    del kept
    return out, lse


def _per_query_rows(grad_out, nc: int, n: int, d: int):
    """``(kept, table)``: the address of each query's ``[n, d]`` gradient, from one ``[C, ...,
    d]`` tensor or from a sequence of C tensors (None entries: zero); table None when there is
    no gradient at all."""
    if grad_out is None:
        return None, None
    if isinstance(grad_out, torch.Tensor):
        g, ptr = _flat(grad_out)
        return g, _table([ptr + 4 * c * n * d for c in range(nc)], _P)  # fp32: 4 bytes
    flats = [_flat(g) for g in grad_out]
    return flats, _table([p for _, p in flats], _P)


def read_bwd(values, keys, queries, lse, grad_out, grad_lse, eps: float):
    """``composite.read_bwd`` fused, or None when not applicable. ``grad_out``: ``[C, ..., d]``
    or a sequence of C per-query gradients ``[..., d]`` (None entries: zero), each read where it
    lies (``api.block_read(split=True)``'s backward: no stacked copy)."""
    per_query = grad_out if isinstance(grad_out, (list, tuple)) else (grad_out,)
    tensors = (*values, *(keys or ()), queries, lse, *per_query, grad_lse)
    if not _usable(*tensors) or (lib := library()) is None:
        return None
    shape, d = values[0].shape, values[0].shape[-1]
    q, q_ptr = _flat(queries)
    nc, rank = q.shape
    n = values[0].numel() // d if d else 0
    kept, tables = _sources(values, keys)
    (lse2, lse_ptr), (dlse, dlse_ptr) = _flat(lse), _flat(grad_lse)
    dout, dout_table = _per_query_rows(grad_out, nc, n, d)
    gv = [torch.empty(shape, dtype=torch.float32) for _ in values]
    gk = None if keys is None else [torch.empty(k.shape, dtype=torch.float32) for k in keys]
    threads = _threads(n)
    dq = torch.empty((nc, rank), dtype=torch.float32)
    args = (len(values), nc, n, d, rank, int(keys is None), *tables, q_ptr, float(eps), lse_ptr,
            dout_table, dlse_ptr, _table([g.data_ptr() for g in gv], _P),
            _table([g.data_ptr() for g in (gk or gv)], _P), dq.data_ptr())  # fmt: skip
    lib.read_bwd(*args, threads)
    del kept, lse2, dout, dlse
    return gv, gk, dq


def _merge_inputs(out1, partial_value, partial_key, rank):
    """Rows of the merge's operands: ``(kept, o1, pv, pk)``, each ``(address, row stride)``; pk
    is the partial value's last ``rank`` columns when sliced."""
    o1, pv = _rows(out1), _rows(partial_value)
    if partial_key is None:
        pk = (pv[1] + 4 * (partial_value.shape[-1] - rank), pv[2])  # fp32: 4 bytes
        kept = (o1[0], pv[0])
    else:
        k = _rows(partial_key)
        pk, kept = k[1:], (o1[0], pv[0], k[0])
    return kept, o1[1:], pv[1:], pk


def merge_fwd(out1, lse1, partial_value, partial_key, query, eps: float, emit_norm: bool):
    """``composite.merge_fwd`` fused, or None when not applicable."""
    if not _usable(out1, lse1, partial_value, partial_key, query) or (lib := library()) is None:
        return None
    shape, d = partial_value.shape, partial_value.shape[-1]
    (q, q_ptr), (lse, lse_ptr) = _flat(query), _flat(lse1)
    rank, n = q.shape[-1], lse.numel()
    kept, o1, pv, pk = _merge_inputs(out1, partial_value, partial_key, rank)
    h = torch.empty(shape, dtype=torch.float32)
    norm = torch.empty(shape, dtype=torch.float32) if emit_norm else h.new_empty(0)
    args = (n, d, rank, *o1, lse_ptr, *pv, *pk, q_ptr, float(eps), NORM_EPS, h.data_ptr(),
            norm.data_ptr() if emit_norm else None)  # fmt: skip
    lib.merge_fwd(*args, _threads(n))
    del kept
    return h, norm


def merge_bwd(out1, lse1, partial_value, partial_key, query, h, grad_h, grad_norm, eps: float):
    """``composite.merge_bwd`` fused, or None when not applicable."""
    if grad_norm is not None and grad_norm.numel() == 0:
        grad_norm = None
    tensors = (out1, lse1, partial_value, partial_key, query, h, grad_h, grad_norm)
    if not _usable(*tensors) or (lib := library()) is None:
        return None
    shape, d = partial_value.shape, partial_value.shape[-1]
    (q, q_ptr), (lse, lse_ptr) = _flat(query), _flat(lse1)
    rank, n = q.shape[-1], lse.numel()
    kept, o1, pv, pk = _merge_inputs(out1, partial_value, partial_key, rank)
    (h2, h_ptr), (gh, gh_ptr), (gn, gn_ptr) = map(_flat, (h, grad_h, grad_norm))
    d_o1, d_pv = torch.empty(shape), torch.empty(shape)
    d_lse = torch.empty(lse1.shape)
    d_pk = None if partial_key is None else torch.empty(partial_key.shape)
    threads = _threads(n)
    dq = torch.empty(rank)
    args = (n, d, rank, int(partial_key is None), *o1, lse_ptr, *pv, *pk, q_ptr, float(eps),
            NORM_EPS, h_ptr, gh_ptr, gn_ptr, d_o1.data_ptr(), d_lse.data_ptr(), d_pv.data_ptr(),
            None if d_pk is None else d_pk.data_ptr(), dq.data_ptr())  # fmt: skip
    lib.merge_bwd(*args, threads)
    del kept, h2, gh, gn
    return d_o1, d_lse, d_pv, d_pk, dq
