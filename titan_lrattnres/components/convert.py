"""Convert a checkpoint from the per-sublayer layout to the layer layout.

    python -m titan_lrattnres.convert CHECKPOINT [--out NEW]

The model's unit is the layer (``titan_lrattnres.model.model.Layer``): layer i holds the
attention and the MLP and the queries of its two read sites as one ``[2, r]`` parameter.
Checkpoints written before kept one module per sublayer and the queries in the depth router:

====================================  ==========================================
per-sublayer layout                   layer layout
====================================  ==========================================
``layers.{2i}.attention.X``           ``layers.{i}.attention.X``
``layers.{2i+1}.feed_forward.X``      ``layers.{i}.feed_forward.X``
``router.query_{2i+1}`` [r]           ``layers.{i}.queries`` [2, r], row 0
``router.query_{2i+2}`` [r]           ``layers.{i}.queries`` [2, r], row 1
``router.query_bank`` [2L, r]         rows 2i, 2i+1 -> ``layers.{i}.queries``
``router.embedding_key.weight``       ``embedding_key.weight``
====================================  ==========================================

(``router.query_bank`` is the older one-bank layout, from before one query per site; it
converts directly.) The conversion rewrites every entry that names a parameter -- the
parameter, the optimiser's per-parameter state (the two sites' ``exp_avg`` / ``exp_avg_sq``
rows stacked as the parameter's, a scalar such as ``step`` copied) and its per-parameter
hyperparameters -- and leaves everything else (train state, data loader, LR schedule)
untouched, so training resumes from the converted folder exactly where it stopped.
``CHECKPOINT`` is a DCP ``step-N`` folder or a run folder (every ``step-N`` in it); without
``--out`` each folder is converted in place (the original is kept beside it as
``step-N.sublayers``). The new folder gets its checksums
(``titan_lrattnres.components.integrity``).

The trainer refuses an old-layout checkpoint with this command in the message
(:func:`refuse_old_layout`). :func:`to_layer_layout` is the conversion of a state dict (flat, or
nested as DCP loads it) in memory; :func:`source_keys` names the stored entries that a model's
keys come from.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from titan_lrattnres.components import integrity

BACKUP_SUFFIX = ".sublayers"
OLD = "router.query_bank"  # the one-bank layout's parameter

# A parameter name inside a checkpoint key: at its start or after a dot (``state.<fqn>.exp_avg``,
# ``optimizer.param_groups.<fqn>.lr``), followed by a dot or the key's end.
_SUBLAYER = re.compile(r"(^|\.)layers\.(\d+)\.(attention|feed_forward)(?=\.|$)")
_ROUTER = re.compile(r"(^|\.)router\.([A-Za-z_]+\d*)(?=\.|$)")
_QUERY = re.compile(r"(^|\.)router\.query_(\d+|bank)(?=\.|$)")


def is_old_layout(keys: Iterable[str]) -> bool:
    """Whether flattened checkpoint keys are in the per-sublayer layout (either query layout):
    a ``router.`` parameter, or a layer index holding one of attention / MLP only."""
    held: dict[int, set[str]] = {}
    for key in keys:
        if _ROUTER.search(key):
            return True
        for m in _SUBLAYER.finditer(key):
            held.setdefault(int(m[2]), set()).add(m[3])
    return any(len(kinds) == 1 for kinds in held.values())


class OldLayoutError(RuntimeError):
    """A checkpoint in the per-sublayer layout was given to the trainer."""


def refuse_old_layout(folder) -> None:
    """Raise :class:`OldLayoutError` (one line, with the command) for an old-layout checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    if is_old_layout(FileSystemReader(str(folder)).read_metadata().state_dict_metadata):
        raise OldLayoutError(
            f"checkpoint {folder} is in the old per-sublayer layout (layers.{{2i}}.attention, "
            f"layers.{{2i+1}}.feed_forward, router.*); convert it once with "
            f"`python -m titan_lrattnres.convert {folder}`"
        )


def rename(key: str) -> str:
    """``key`` with its sublayer or router parameter name in the layer layout (not the
    queries: :func:`to_layer_layout` merges those); a key without one is returned as is."""

    def sublayer(m: re.Match) -> str:
        j, kind = int(m[2]), m[3]
        if j % 2 != (kind == "feed_forward"):
            raise ValueError(f"{key}: sublayer {j} cannot hold {kind} in the per-sublayer layout")
        return f"{m[1]}layers.{j // 2}.{kind}"

    def router(m: re.Match) -> str:
        if m[2] != "embedding_key":
            raise ValueError(f"{key}: router.{m[2]} has no place in the layer layout")
        return m[1] + m[2]

    return _ROUTER.sub(router, _SUBLAYER.sub(sublayer, key))


def num_layers(keys: Iterable[str]) -> int:
    """L of a per-sublayer checkpoint, from its sublayer indices (2L sublayers)."""
    last = max((int(m[2]) for k in keys for m in _SUBLAYER.finditer(k)), default=-1)
    return (last + 2) // 2


def to_layer_layout(state: dict, layers: int | None = None) -> dict:
    """``state`` (flat, or nested dicts as DCP loads them) in the layer layout: every key
    renamed (:func:`rename`); the per-site queries ``router.query_{t}`` (and every entry named
    after them) stacked two by two into ``layers.{i}.queries`` (a tensor of at least one dim:
    rows 0 and 1; anything else, e.g. a ``step`` counter or a learning rate: the same for both
    sites, copied); the one-bank ``router.query_bank [2L, ...]`` entries sliced into the same
    (a tensor: rows 2i, 2i+1; anything else copied to every layer). ``layers``: L, needed for
    the bank's non-tensor entries (default: from the state's sublayer indices)."""
    if layers is None:
        layers = num_layers(_all_keys(state))
    out: dict[Any, Any] = {}
    sites: dict[str, dict[int, Any]] = {}  # new key -> row -> value
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = to_layer_layout(value, layers)
            continue
        m = _QUERY.search(key) if isinstance(key, str) else None
        if m is None:
            out[rename(key) if isinstance(key, str) else key] = value
            continue
        if m[2] != "bank":
            t = int(m[2])
            if not 1 <= t <= 2 * layers:
                raise ValueError(f"{key}: read site {t} is not in 1..{2 * layers} (L={layers})")
            sites.setdefault(_query_key(key, m, (t - 1) // 2), {})[(t - 1) % 2] = value
            continue
        rows = isinstance(value, torch.Tensor) and value.ndim >= 1
        if rows and value.shape[0] != 2 * layers:
            raise ValueError(f"{key}: {tuple(value.shape)} has no {2 * layers} query rows")
        for i in range(layers):
            v = value[2 * i : 2 * i + 2] if rows else value
            out[_query_key(key, m, i)] = v.clone() if isinstance(v, torch.Tensor) else v
    for key, by_row in sites.items():
        if sorted(by_row) != [0, 1]:
            raise ValueError(f"{key}: needs both read sites' entries, got rows {sorted(by_row)}")
        first, second = by_row[0], by_row[1]
        if isinstance(first, torch.Tensor) and first.ndim >= 1:
            out[key] = torch.stack([first, second])
        elif _same(first, second):
            out[key] = first.clone() if isinstance(first, torch.Tensor) else first
        else:
            raise ValueError(f"{key}: the two read sites differ ({first!r}, {second!r})")
    return out


def _query_key(key: str, m: re.Match, i: int) -> str:
    """``key`` (its query name matched by ``m``) for layer i's ``queries``, renamed."""
    return rename(key[: m.start()]) + f"{m[1]}layers.{i}.queries" + rename(key[m.end() :])


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def _all_keys(state: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in state.items():
        name = f"{prefix}{key}"
        keys += _all_keys(value, name + ".") if isinstance(value, dict) else [name]
    return keys


def source_keys(own: Iterable[str], stored: Iterable[str]) -> list[str]:
    """The keys of an old-layout checkpoint (``stored``) that :func:`to_layer_layout` turns into
    the model keys ``own``: what a tool that loads the model alone has to read."""
    own, stored = set(own), list(stored)
    layers = range(num_layers(stored))
    wanted = []
    for key in stored:
        m = _QUERY.search(key)
        if m is None:
            new = [rename(key)]
        elif m[2] == "bank":  # every layer's queries
            new = [_query_key(key, m, i) for i in layers]
        else:
            new = [_query_key(key, m, (int(m[2]) - 1) // 2)]
        if any(n in own for n in new):
            wanted.append(key)
    return wanted


def convert_folder(src: Path, dst: Path) -> int:
    """Write the converted copy of DCP folder ``src`` to ``dst``; returns L, its layers."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    integrity.check(src)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
        flat = Path(tmp) / "state.pt"
        dcp_to_torch_save(str(src), str(flat))
        state = torch.load(flat, weights_only=False)
        keys = _all_keys(state)
        if not is_old_layout(keys):
            raise ValueError(f"{src} is in the layer layout already: nothing to convert")
        torch.save(to_layer_layout(state, num_layers(keys)), flat)
        torch_save_to_dcp(str(flat), str(dst))
    integrity.record(dst)
    return num_layers(keys)


def _targets(path: Path) -> list[Path]:
    from torch.distributed.checkpoint import FileSystemReader

    if (path / ".metadata").exists():
        folders = [path]
    else:
        root = path / "checkpoint" if (path / "checkpoint").is_dir() else path
        folders = [p for _, p in integrity.step_folders(root)]
    if not folders:
        raise FileNotFoundError(f"{path}: no DCP checkpoint folder (step-N with .metadata)")
    stored = {f: FileSystemReader(str(f)).read_metadata().state_dict_metadata for f in folders}
    return [f for f in folders if is_old_layout(stored[f])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m titan_lrattnres.convert", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("checkpoint", type=Path, help="a DCP step-N folder or a run folder")
    p.add_argument("--out", type=Path, help="write here instead of converting in place")
    args = p.parse_args(argv)
    try:
        folders = _targets(args.checkpoint)
    except (FileNotFoundError, integrity.CheckpointIntegrityError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not folders:
        print(f"{args.checkpoint}: already in the layer layout, nothing to do")
        return 0
    if args.out is not None and len(folders) > 1:
        print(f"error: --out takes one step-N folder; {args.checkpoint} has {len(folders)}")
        return 2
    if args.out is None:
        kept = [f.with_name(f.name + BACKUP_SUFFIX) for f in folders]
        if taken := [str(k) for k in kept if k.exists()]:
            print(f"error: {', '.join(taken)} exists already: move it away first", file=sys.stderr)
            return 2
    for src in folders:
        if args.out is not None:
            layers = convert_folder(src, args.out)
            print(f"{src} -> {args.out}: {layers} layers")
            continue
        new = src.with_name(src.name + ".converting")
        shutil.rmtree(new, ignore_errors=True)
        layers = convert_folder(src, new)
        src.rename(src.with_name(src.name + BACKUP_SUFFIX))
        new.rename(src)
        print(
            f"{src}: converted in place ({layers} layers; original kept as "
            f"{src.name}{BACKUP_SUFFIX})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
