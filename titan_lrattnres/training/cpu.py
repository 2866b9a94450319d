"""Run torchtitan 0.3.0's Trainer on a machine without an accelerator (CPU + gloo).

torchtitan's Trainer assumes CUDA. ``apply()`` installs these settings, only when no accelerator
is present:

- device type "cpu" (before torchtitan is imported, or on its module-level copies when it
  already is); the process group backend then becomes gloo;
- the ``torch.cpu`` stubs the device-memory monitor and ``barrier(device_ids=...)`` call;
- FSDP2 reduces with SUM, as gloo has no PREMUL_SUM (same numbers: the divide factor is 1);
- :func:`keep_freed_memory`: glibc keeps freed blocks instead of returning them to the kernel,
  so fresh activations are not page-faulted in again (performance only);
- :func:`release_gloo_at_exit`: gloo's worker threads may need the GIL to free a tensor after the
  interpreter starts finalizing, which aborts the process; the GIL is released briefly at exit;
- :func:`serial_helper_threads`: torch ops run by helper threads (gloo's copies) use one thread,
  so libgomp never manages more threads than CPUs (past that, every OpenMP team sleeps and each
  small parallel op of the main thread pays a wake-up).

Why and what each one costs: docs/performance.md ("Training on CPU"). The model uses SDPA on
CPU, so FlexAttention needs nothing. These touch torchtitan internals written for exactly
``TORCHTITAN_VERSION`` (listed with the package's other private names in
:mod:`titan_lrattnres.torchtitan_internals`, and checked by its test).
"""

from __future__ import annotations

import atexit
import importlib.metadata
import os
import sys
import time
import types
import warnings

import torch

TORCHTITAN_VERSION = "0.3.0"

# Modules that bind ``device_type`` / ``device_module`` by name at import time.
_NAME_BOUND = (
    "torchtitan.tools.utils",
    "torchtitan.components.metrics",
    "torchtitan.distributed.utils",
    "torchtitan.distributed.parallel_dims",
    "torchtitan.models.common.token_dispatcher",
    "torchtitan.tools.profiler",
)
_applied = False


def has_accelerator() -> bool:
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return torch.cuda.is_available()


def check_torchtitan_version() -> str:
    """The installed torchtitan version; warns when it is not the one the shim was written for."""
    try:
        version = importlib.metadata.version("torchtitan")
    except importlib.metadata.PackageNotFoundError as e:
        raise RuntimeError("torchtitan is not installed (pip install torchtitan==0.3.0)") from e
    if version != TORCHTITAN_VERSION:
        warnings.warn(
            f"titan_lrattnres.training.cpu patches torchtitan {TORCHTITAN_VERSION} internals; "
            f"installed is {version}. CPU training may fail: pin torchtitan=={TORCHTITAN_VERSION}.",
            RuntimeWarning,
            stacklevel=2,
        )
    return version


def _cpu_device_module() -> types.ModuleType:
    c = torch.cpu
    c.get_device_name = lambda *a, **k: "cpu"
    c.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        total_memory=_total_memory(), name="cpu"
    )
    c.reset_peak_memory_stats = lambda *a, **k: None
    c.empty_cache = lambda *a, **k: None
    c.memory_stats = lambda *a, **k: {}
    c.current_device = lambda: 0
    if not hasattr(c, "set_device"):
        c.set_device = lambda *a, **k: None
    return c


def _total_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return 16 * 2**30


def keep_freed_memory() -> bool:
    """Serve allocations below 1 GiB from glibc's heap and never trim it, so freed
    activations are reused without page faults. True when applied (glibc only)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = libc.mallopt if libc is not None else None
    except (OSError, AttributeError):
        return False
    if mallopt is None:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, 1 << 30)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def _loaded_library(stem: str) -> str | None:
    """Path of the loaded shared library whose file name starts with ``stem`` (Linux)."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "/" in line}
    except OSError:
        return None
    return next((p for p in sorted(paths) if os.path.basename(p).startswith(stem)), None)


def serial_helper_threads() -> bool:
    """Torch ops run on other threads (gloo's workers) with one thread; this one keeps its
    count. True when applied (GNU OpenMP, and MKL's per-thread setting when torch has MKL)."""
    import ctypes

    n = torch.get_num_threads()
    gomp, torch_cpu = _loaded_library("libgomp"), _loaded_library("libtorch_cpu")
    if n <= 1 or gomp is None:
        return False
    mkl = None
    if torch.backends.mkl.is_available():
        lib = ctypes.CDLL(torch_cpu) if torch_cpu else None
        mkl = getattr(lib, "MKL_Set_Num_Threads_Local", None)  # C's; lowercase: Fortran's
        if mkl is None:  # its GEMMs would follow the new default of 1
            return False
    torch.set_num_threads(1)  # the default of every thread that starts computing from now on
    ctypes.CDLL(gomp).omp_set_num_threads(n)  # this thread's own OpenMP count ...
    if mkl is not None:
        mkl(n)  # ... and MKL's
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
        return False
    return True


def _patch_fsdp_sum_reduction() -> None:
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.set_gradient_divide_factor
    if getattr(original, "_lrattnres_cpu", False):
        return

    def set_gradient_divide_factor(self, factor: float) -> None:
        original(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    set_gradient_divide_factor._lrattnres_cpu = True
    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


def _gloo_threads() -> int:
    """How many of this process's threads are gloo workers (Linux: /proc; elsewhere -1)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return -1
    n = 0
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().strip() == "pt_gloo_runloop"
        except OSError:
            continue
    return n


def _let_gloo_threads_finish() -> None:
    if _gloo_threads() != 0:  # -1: no /proc to look in, so wait as if there were
        time.sleep(0.05)  # releases the GIL: a gloo thread waiting for it frees its tensors


_released_at_exit = False


def release_gloo_at_exit() -> None:
    """At interpreter exit, let gloo's worker threads free their last tensors first (see
    the module's docstring). Idempotent; for multi-rank scripts that skip ``apply()``."""
    global _released_at_exit
    if not _released_at_exit:
        atexit.register(_let_gloo_threads_finish)
        _released_at_exit = True


def apply(force: bool = False) -> bool:
    """Install the CPU patches if no accelerator is present (or ``force``). Idempotent.

    Returns True when the patches are active.
    """
    global _applied
    if _applied:
        return True
    if has_accelerator() and not force:
        return False
    check_torchtitan_version()
    torch._utils._get_available_device_type = lambda: "cpu"
    device_module = _cpu_device_module()
    for name in _NAME_BOUND:  # modules imported before us
        mod = sys.modules.get(name)
        if mod is None:
            continue
        if hasattr(mod, "_get_available_device_type"):
            mod._get_available_device_type = torch._utils._get_available_device_type
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = device_module
    _patch_fsdp_sum_reduction()
    keep_freed_memory()
    release_gloo_at_exit()
    serial_helper_threads()
    _applied = True
    return True


def is_applied() -> bool:
    return _applied
