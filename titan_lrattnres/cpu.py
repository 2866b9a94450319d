"""Run torchtitan 0.3.0's Trainer on a machine without an accelerator (CPU + gloo).

The Trainer ships CUDA-only (``tools/utils.py``: ``device_type = ... or "cuda"``). ``apply()``
installs the patches below, and only when no accelerator is present:

- P1  device type "cpu": ``torch._utils._get_available_device_type`` before torchtitan is
      imported; if torchtitan is already imported (``python -m torchtitan.train --module
      titan_lrattnres``), the module-level copies of ``device_type`` / ``device_module`` too.
      The process group backend then becomes gloo by itself.
- P2  ``torch.cpu`` stubs that the device-memory monitor calls.
- P2b ``torch.cpu.current_device`` (barrier(device_ids=[...])).
- P5  gloo has no PREMUL_SUM: FSDP2 reduces with SUM (same numbers: the divide factor is 1).
- P6  ``keep_freed_memory()``: glibc keeps freed blocks mapped instead of returning them to the
      kernel. PyTorch's CPU allocator has no cache, so every activation and gradient is a fresh
      malloc; past glibc's mmap threshold each one is page-faulted in again on first write
      (measured here: ~1 ms per fresh 2 MB buffer, ten times the write itself). A performance
      setting only: no result changes.
- P7  ``release_gloo_at_exit()``: at exit, the GIL is released for 50 ms while gloo's worker
      threads exist. Those threads (``pt_gloo_runloop``) drop a finished collective's tensors
      after the caller's ``wait`` has returned, and freeing a tensor that Python no longer
      holds takes the GIL. Asked for once the interpreter is finalizing, the GIL ends the
      thread (Python 3.11: ``pthread_exit``, unwound through a ``noexcept`` C++ frame):
      ``terminate called without an active exception``, SIGABRT, after the run's work is done,
      and torchrun reports the rank failed. Measured on a 2-core VM: 6 of 30 two-rank runs of
      ``tests/titan_lrattnres/test_checkpoint_integrity.py``'s script without it, 0 of 30 with
      it. ``atexit`` handlers run before finalization, while other threads may still take the
      GIL.

- P8  ``serial_helper_threads()``: torch ops that other threads run (gloo's workers: the copies
      of a collective) use one thread; the calling thread keeps its count. A thread that runs
      a parallel torch op starts its own OpenMP team and keeps it, and once libgomp manages
      more threads than there are CPUs, every team waits for work with a short spin and then
      sleeps: the main thread's many small parallel ops each pay a futex wake-up. In
      ``make train`` the first checkpoint's collectives did it (the gloo workers' team threads
      are named ``pt_gloo_runloop``): tokens/s fell ~20 % from the first save on, for every
      variant; with it those steps run at the pre-save speed (+25 %), and steps before any
      save 0.6-3.4 % slower, what any explicit thread setting costs here (a bare
      ``torch.set_num_threads(2)`` measured the same; README, "make train throughput").
      Results move at rounding level, as with any change of torch's thread settings
      (``make train``'s validation loss 4.9594 -> 4.9589, and 4.9602 with a bare
      ``torch.set_num_threads(2)``; the first gradient apart is an attention backward's),
      and stay reproducible run to run.

No FlexAttention patch is needed: the model uses SDPA on CPU (``attn_backend="auto"``).
The patches touch torchtitan internals and were written for exactly ``TORCHTITAN_VERSION``.
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
            f"titan_lrattnres.cpu patches torchtitan {TORCHTITAN_VERSION} internals; installed "
            f"is {version}. CPU training may fail: pin torchtitan=={TORCHTITAN_VERSION}.",
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
    """P6: serve allocations below 1 GiB from glibc's heap and never trim it, so freed
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
    """P8: torch ops run on other threads (gloo's workers) with one thread; this one keeps its
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
    """P7: at interpreter exit, let gloo's worker threads free their last tensors first (see
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
    torch._utils._get_available_device_type = lambda: "cpu"  # P1
    device_module = _cpu_device_module()  # P2, P2b
    for name in _NAME_BOUND:  # P1 for modules imported before us
        mod = sys.modules.get(name)
        if mod is None:
            continue
        if hasattr(mod, "_get_available_device_type"):
            mod._get_available_device_type = torch._utils._get_available_device_type
        if hasattr(mod, "device_type"):
            mod.device_type = "cpu"
        if hasattr(mod, "device_module"):
            mod.device_module = device_module
    _patch_fsdp_sum_reduction()  # P5
    keep_freed_memory()  # P6
    release_gloo_at_exit()  # P7
    serial_helper_threads()  # P8
    _applied = True
    return True


def is_applied() -> bool:
    return _applied
