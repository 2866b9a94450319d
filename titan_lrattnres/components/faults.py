"""Faults while a run writes to disk (no space, a quota, a read-only folder), each ended in one
line that names the path, what was being written and the last complete checkpoint, and says how
to resume; and a warning, before the first save, when the free space is below one checkpoint.

:func:`write_fault` recognises such a fault in what a write raised: an ``OSError`` with one of
:data:`WRITE_ERRNOS`, also when it is wrapped (DCP gathers each rank's error into a
``CheckpointException``, a ``BaseException``, or chains it) or when torch's zip writer reports
it as a ``RuntimeError`` ("file write failed"). :func:`writing` turns one into
:class:`WriteFaultError`; anything else passes through unchanged.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import shutil
from collections.abc import Iterator

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

WRITE_ERRNOS = {
    errno.ENOSPC: "free space",
    errno.EDQUOT: "free space within your quota",
    errno.EFBIG: "free space or use a file system that takes larger files",
    errno.EROFS: "make the folder writable (or pass another --dump_folder)",
    errno.EACCES: "make the folder writable (or pass another --dump_folder)",
    errno.EPERM: "make the folder writable (or pass another --dump_folder)",
    errno.EIO: "check the disk",
}
_ZIP_WRITE_FAILED = "file write failed"  # torch's PytorchStreamWriter on a failed write


class WriteFaultError(RuntimeError):
    """A write failed for want of space or permission; the message is one line."""


def _causes(e: BaseException) -> Iterator[BaseException]:
    """``e``, its causes and contexts, and the per-rank errors of a DCP ``CheckpointException``."""
    seen, todo = set(), [e]
    while todo:
        cur = todo.pop(0)
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        yield cur
        todo += [cur.__cause__, cur.__context__]
        for failure in (getattr(cur, "failures", None) or {}).values():  # rank -> (error, trace)
            todo.append(failure[0] if isinstance(failure, tuple) else failure)


def write_fault(e: BaseException) -> tuple[str, str | None] | None:
    """``(reason, file)`` when ``e`` is a failed write (see the module docstring), else None."""
    for cur in _causes(e):
        if isinstance(cur, OSError) and cur.errno in WRITE_ERRNOS:
            code = errno.errorcode.get(cur.errno, str(cur.errno))
            return f"{cur.strerror or os.strerror(cur.errno)} ({code})", cur.filename
    for cur in _causes(e):
        if isinstance(cur, RuntimeError) and _ZIP_WRITE_FAILED in str(cur):
            return "a write failed (is the disk full?)", None
    return None


def _advice(e: BaseException) -> str:
    for cur in _causes(e):
        if isinstance(cur, OSError) and cur.errno in WRITE_ERRNOS:
            return WRITE_ERRNOS[cur.errno]
    return "free space"


def fault_message(
    e: BaseException, what: str, path: str, last: str | None, *, resume: bool = True
) -> str | None:
    """The one line for write fault ``e`` while writing ``what`` to ``path``, or None when ``e``
    is no write fault. ``last``: the last complete checkpoint; ``resume``: whether rerunning the
    command resumes (False once training has finished)."""
    found = write_fault(e)
    if found is None:
        return None
    reason, file = found
    where = f" ({file})" if file and os.fspath(file) != os.fspath(path) else ""
    keep = f"the last complete checkpoint is {last}" if last else "no checkpoint is complete"
    head = f"could not write {what} {path}: {reason}{where}"
    if resume:
        return f"{head}; {keep}; {_advice(e)}, then rerun the same command to resume"
    return f"{head}; training has finished and {keep}; {_advice(e)} for the run's other files"


@contextlib.contextmanager
def writing(what: str, path, last=None, *, resume: bool = True):
    """Raise :class:`WriteFaultError` (:func:`fault_message`) when the body fails to write;
    ``last``: the last complete checkpoint, or a function returning it (called on a fault)."""
    try:
        yield
    except BaseException as e:
        if write_fault(e) is None:
            raise
        last_path = last() if callable(last) else last
        raise WriteFaultError(fault_message(e, what, str(path), last_path, resume=resume)) from e


# -- free space ---------------------------------------------------------------------------------
def _bytes(t: torch.Tensor) -> int:
    """Bytes of the whole tensor (of every shard together for a DTensor)."""
    return t.numel() * t.element_size()  # a DTensor's numel is its global one


def checkpoint_bytes(model_parts, optimizers) -> int:
    """About how many bytes one full checkpoint takes: the parameters, buffers and optimiser
    state of all ranks, each tensor counted once (every rank calls it: one collective)."""
    sizes: dict[str, int] = {}
    for part in model_parts:
        named = dict(part.named_parameters())
        for name, t in [*named.items(), *part.named_buffers()]:
            sizes[name] = _bytes(t)
        by_param = {id(p): n for n, p in named.items()}
        for opt in optimizers or ():
            for p, state in opt.state.items():
                name = by_param.get(id(p), f"?{id(p)}")
                for k, v in state.items():
                    if isinstance(v, torch.Tensor):
                        sizes[f"{name}/{k}"] = _bytes(v)
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts: list = [None] * dist.get_world_size()
        dist.all_gather_object(parts, sizes)
        sizes = {k: v for part in parts for k, v in part.items()}
    return sum(sizes.values())


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def free_bytes(folder: str) -> int | None:
    """Free bytes on the file system of ``folder`` (or of its nearest existing parent)."""
    probe = folder
    while probe and not os.path.isdir(probe):
        probe = os.path.dirname(probe.rstrip("/"))
    try:
        return shutil.disk_usage(probe or ".").free
    except OSError:
        return None


def low_space_warning(folder: str, need: int) -> str | None:
    """The warning line when the file system of ``folder`` has less free space than ``need``
    bytes (one checkpoint), else None."""
    free = free_bytes(folder)
    if free is None or free >= need:
        return None
    return (
        f"only {_mib(free)} free where checkpoints go ({folder}); one checkpoint needs about "
        f"{_mib(need)}: the next save will fail. Free space or pass another --dump_folder"
    )
