"""Checkpoint integrity: a checksum record in every checkpoint this project saves, verified before
any checkpoint is loaded, and a vetted DCP ``.metadata`` (torch's ``FileSystemReader`` reads it
with plain ``pickle.load``, so a checkpoint folder from elsewhere could run code when loaded).

Record: ``step-N/checksums.json`` = ``{"format": "lrattnres-checksums", "version": 1,
"complete": bool, "algorithm": "sha256", "files": {path: {"size": bytes, "sha256": hex}}}`` over
every file of the step folder (paths relative to it). SHA-256: a strong hash in the standard
library, hardware-accelerated on current CPUs (about 1.4 GB/s a core here, faster than BLAKE2b),
and checkable by hand with ``sha256sum``.

Saving (:func:`begin`, then the save, then :func:`record`): rank 0 first writes a record with
``"complete": false``; once the save has finished on every rank the ranks hash the files
between them and rank 0 replaces it (temporary file, fsync, ``os.replace``) with the complete
record. A save killed at any point leaves either no ``.metadata`` or an incomplete record: an
interrupted save, never mistaken for a checkpoint.

Loading (:func:`problem`): a folder is refused when a recorded file is missing, has another size
or another SHA-256, when the save was interrupted, or when its ``.metadata`` pickle refers to
anything but DCP's metadata classes, ``torch.Size`` / dtypes / layouts, paths and plain
containers (an allow-list unpickler), or a non-tensor item (loaded by DCP with
``torch.load(weights_only=False)``) does not pass ``torch.load(weights_only=True)``. A folder
without a record (saved before records existed, or by a plain ``dcp.save``) is loaded with a
warning. :func:`resume_folder` is training's policy: the newest intact checkpoint; newer ones
that fail are moved to ``rejected/`` with a warning each, never deleted.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import pickle
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

RECORD = "checksums.json"
FORMAT, VERSION, ALGORITHM = "lrattnres-checksums", 1, "sha256"
REJECTED = "rejected"  # beside the step folders; matches no ``step-N`` pattern (not purged)
HF_INDEX = "model.safetensors.index.json"  # a last-step save in HF format has no .metadata
CHUNK = 1 << 22  # bytes hashed per read (4 MiB): shards are gigabytes, memory stays bounded

log = logging.getLogger(__name__)


class CheckpointIntegrityError(RuntimeError):
    """A checkpoint is damaged, incomplete or unsafe to unpickle; the message is one line."""


# -- saving -------------------------------------------------------------------------------------
def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def write_json(path: Path, body: dict, indent: int = 1) -> None:
    """``body`` as JSON at ``path``, atomically and durably (temporary file, fsync,
    ``os.replace``, fsync of the folder): a reader sees the old file or the new, never a part."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(body, f, indent=indent, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a full disk leaves no partial file behind
        raise
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself
    finally:
        os.close(fd)


def _write(folder: Path, body: dict) -> None:
    write_json(folder / RECORD, {"format": FORMAT, "version": VERSION, **body})


def _share_outcome(write) -> None:
    """``write()`` on rank 0; its ``OSError``, if any, raised on every rank (a collective when a
    process group is up): no rank goes on into a collective save that rank 0 has left."""
    failure = None
    if rank() == 0:
        try:
            write()
        except OSError as e:
            failure = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [failure]
        dist.broadcast_object_list(box, src=0)
        failure = box[0]
    if failure is not None:
        raise failure


def begin(folder: str | Path) -> None:
    """Before a save (every rank calls it; rank 0 writes): mark ``folder`` as being saved."""

    def write():
        Path(folder).mkdir(parents=True, exist_ok=True)
        _write(Path(folder), {"complete": False, "algorithm": ALGORITHM, "files": {}})

    _share_outcome(write)


def record(folder: str | Path) -> None:
    """After a save has finished on every rank (collective when a process group is up): write
    the complete record of ``folder``."""
    folder, distributed = Path(folder), dist.is_initialized()
    names = [_files(folder) if rank() == 0 else None]
    if distributed:
        dist.broadcast_object_list(names, src=0)
    digests = _digests(folder, names[0], distributed)

    def write():
        files = {n: {"size": (folder / n).stat().st_size, ALGORITHM: digests[n]} for n in names[0]}
        _write(folder, {"complete": True, "algorithm": ALGORITHM, "files": files})

    _share_outcome(write)  # every rank waits for the record, as a barrier would


def _files(folder: Path) -> list[str]:
    return sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and p.name not in (RECORD, RECORD + ".tmp")
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)  # releases the GIL: the thread pool hashes files in parallel
    return h.hexdigest()


def _digests(folder: Path, names: list[str], distributed: bool) -> dict[str, str]:
    """SHA-256 of each file; with ``distributed`` each rank hashes every W-th file and the
    ranks exchange the results."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    mine = names[rank::world]
    with ThreadPoolExecutor(max(1, min(8, len(mine)))) as pool:
        out = dict(zip(mine, pool.map(lambda n: _sha256(folder / n), mine), strict=True))
    if world > 1:
        parts: list = [None] * world
        dist.all_gather_object(parts, out)
        out = {k: v for part in parts for k, v in part.items()}
    return out


# -- loading ------------------------------------------------------------------------------------
def _first_line(e: BaseException) -> str:
    lines = [s for s in str(e).splitlines() if s.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def read_record(folder: str | Path) -> dict | None:
    path = Path(folder) / RECORD
    return json.loads(path.read_text()) if path.is_file() else None


def interrupted(folder: str | Path) -> str | None:
    """Why ``folder`` holds an unfinished save (no ``.metadata``, or a record marked
    incomplete), or None."""
    folder = Path(folder)
    where = f"checkpoint {folder}"
    if not (folder / ".metadata").is_file() and not (folder / HF_INDEX).is_file():
        return f"{where} has no .metadata: its save was interrupted"
    try:
        complete = (read_record(folder) or {"complete": True})["complete"]
    except Exception:
        return None  # an unreadable record: damaged, not interrupted (problem says so)
    if not complete:
        return f"{where}: {RECORD} marks the save unfinished: it was interrupted (or still runs)"
    return None


def problem(folder: str | Path, *, distributed: bool = False) -> str | None:
    """Why the checkpoint in ``folder`` must not be loaded (one line naming it and the file),
    or None. ``distributed``: a collective, each rank hashes a share of the files."""
    folder = Path(folder)
    where = f"checkpoint {folder}"
    if (why := interrupted(folder)) is not None:
        return why
    try:
        rec = read_record(folder) or {"format": FORMAT, "algorithm": ALGORITHM, "files": {}}
        if (rec["format"], rec["algorithm"]) != (FORMAT, ALGORITHM):
            raise ValueError(f"not a {FORMAT} record with {ALGORITHM}")
        files = {n: (int(e["size"]), str(e[ALGORITHM])) for n, e in rec["files"].items()}
    except Exception as e:
        return f"{where}: {RECORD} is unreadable ({_first_line(e)})"
    bad = []
    for name, (recorded, _) in sorted(files.items()):
        path = folder / name
        size = path.stat().st_size if path.is_file() else None
        if size is None:
            bad.append(f"{name} is missing")
        elif size != recorded:
            cut = " (truncated)" if size < recorded else ""
            bad.append(f"{name} has {size} bytes, {recorded} recorded{cut}")
    if bad:
        return f"{where}: {'; '.join(bad)}"
    if (folder / ".metadata").is_file() and (why := vet(folder)) is not None:
        return f"{where}: {why}"
    if files:
        digests = _digests(folder, sorted(files), distributed)
        bad = [n for n in sorted(files) if digests[n] != files[n][1]]
        if bad:
            are = "is" if len(bad) == 1 else "are"
            return f"{where}: {', '.join(bad)} {are} corrupted (SHA-256 differs from {RECORD})"
    return None


def _report(folder: Path) -> None:
    """Log how a folder that passed :func:`problem` was checked."""
    rec = read_record(folder)
    if rec is None:
        log.warning(
            f"checkpoint {folder} has no {RECORD} (saved before checksums were recorded, or "
            "by a plain dcp.save): loading it unverified"
        )
    else:
        log.info(f"checkpoint {folder}: {len(rec['files'])} files match {RECORD}")


def check(folder: str | Path, *, distributed: bool = False) -> None:
    """Raise :class:`CheckpointIntegrityError` if :func:`problem` finds one; warn when the folder
    has no record."""
    why = problem(folder, distributed=distributed)
    if why is not None:
        raise CheckpointIntegrityError(why)
    _report(Path(folder))


def step_folders(folder: str | Path) -> list[tuple[int, Path]]:
    """``(N, path)`` of every ``step-N`` folder in ``folder``, newest first."""
    root = Path(folder)
    if not root.is_dir():
        return []
    steps = [
        (int(m.group(1)), p) for p in root.iterdir() if (m := re.fullmatch(r"step-(\d+)", p.name))
    ]
    return sorted(steps, reverse=True)


def resume_folder(folder: str | Path, *, distributed: bool = False) -> Path | None:
    """The newest step folder of a run's checkpoint ``folder`` that passes :func:`problem`
    (None if none). The newer ones that fail are moved to ``folder/rejected/`` (rank 0) with a
    warning naming each and why, so that no later save or purge mixes with them. When none
    passes and one is damaged, not just interrupted, nothing is moved and this raises: a fresh
    start would lose the run."""
    found, rejected = None, []
    for _, path in step_folders(folder):
        why = problem(path, distributed=distributed)
        if why is None:
            found = path
            _report(found)
            break
        rejected.append((path, why))
    damaged = [why for path, why in rejected if interrupted(path) is None]
    if found is None and damaged:
        more = f" (and {len(damaged) - 1} more)" if len(damaged) > 1 else ""
        raise CheckpointIntegrityError(
            f"no intact checkpoint to resume from: {damaged[0]}{more}. Move the damaged step "
            f"folders out of {folder} to start afresh"
        )
    if rank() == 0:
        for path, why in rejected:
            log.warning(f"resume: skipping {why}; moved it to {_move_aside(path)}")
    if distributed:
        dist.barrier()  # nobody looks for the newest step before the move
    return found


def _move_aside(path: Path) -> Path:
    dest_dir = path.parent / REJECTED
    dest_dir.mkdir(exist_ok=True)
    dest, n = dest_dir / path.name, 1
    while dest.exists():
        dest, n = dest_dir / f"{path.name}.{n}", n + 1
    path.rename(dest)
    return dest


# -- vetting the pickles DCP would load ------------------------------------------------------------
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # torch.strided & co. pickle through it
    "torch": {"Size"},  # and every torch.dtype, below
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset"},
}


class _Refused(pickle.UnpicklingError):
    pass


class _MetadataUnpickler(pickle.Unpickler):
    """Looks up only the globals of ``_ALLOWED`` and torch's dtypes; anything else (a function
    such as ``os.system``, any other class) is refused before it is imported."""

    def find_class(self, module: str, name: str):
        allowed = name in _ALLOWED.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise _Refused(f"{module}.{name}")
        return super().find_class(module, name)


def vet(folder: str | Path) -> str | None:
    """Why DCP must not unpickle ``folder``'s ``.metadata`` or its non-tensor items, or None."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

    folder = Path(folder)
    try:
        with open(folder / ".metadata", "rb") as f:
            md = _MetadataUnpickler(f).load()
    except _Refused as e:
        return f".metadata refers to {e}, which no DCP metadata does: refused (it could run code)"
    except Exception as e:
        return f".metadata is not readable DCP metadata ({_first_line(e)})"
    if not isinstance(md, Metadata):
        return f".metadata holds a {type(md).__name__}, not DCP metadata"
    item = ".metadata"
    try:
        for index, info in md.storage_data.items():
            if not isinstance(md.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                continue  # tensors: DCP reads them with weights_only=True itself
            item = f"item {index.fqn} of {info.relative_path}"
            if info.transform_descriptors:
                return f"{item} is stored transformed (compressed?): it cannot be vetted"
            with open(folder / info.relative_path, "rb") as f:
                f.seek(info.offset)
                raw = f.read(info.length)
            torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as e:
        return f"{item} is not plain data ({unpickle_error(e)}): refused (it could run code)"
    return None


def unpickle_error(e: BaseException) -> str:
    """One line for a failed (weights-only) unpickling: the refused global when there is one."""
    found = re.search(r"GLOBAL (\S+)", str(e))
    return f"it refers to {found.group(1)}" if found else _first_line(e)
