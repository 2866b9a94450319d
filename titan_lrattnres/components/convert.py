"""Convert a checkpoint from an earlier parameter layout to the layer layout.

    python -m titan_lrattnres.convert CHECKPOINT [--out NEW]

The model's unit is the layer (``titan_lrattnres.model.model.Layer``): layer i holds the
attention, the MLP and the queries of the read sites that feed them as one ``[n, r]``
parameter, rows in site order (``titan_lrattnres.model.depth.layer_sites``): site 1 for layer 0
(site 0 reads the embedding alone and has no query), sites 2i and 2i+1 for layer i, and the
final read 2L as the last layer's last row. Two earlier layouts convert:

====================================  ==========================================
earlier layout                        layer layout
====================================  ==========================================
per-sublayer:
``layers.{2i}.attention.X``           ``layers.{i}.attention.X``
``layers.{2i+1}.feed_forward.X``      ``layers.{i}.feed_forward.X``
``router.query_{t}`` [r]              the row of site t
``router.query_bank`` [2L, r]         row t-1: the row of site t
``router.embedding_key.weight``       ``embedding_key.weight``
pairs (a layer held sites 2i+1, 2i+2):
``layers.{i}.queries`` [2, r]         rows 0, 1: the rows of sites 2i+1, 2i+2
====================================  ==========================================

(``router.query_bank`` is the oldest one-bank layout; the pair layout is told by the shape of
``layers.0.queries``, two rows where L > 1.) The conversion rewrites every entry that names a
query parameter -- the parameter, the optimiser's per-parameter state (the sites'
``exp_avg`` / ``exp_avg_sq`` rows regrouped as the parameter's, a scalar such as ``step``
copied) and its per-parameter hyperparameters -- renames the per-sublayer modules, and leaves
everything else (train state, data loader, LR schedule) untouched, so training resumes from
the converted folder exactly where it stopped. ``CHECKPOINT`` is a DCP ``step-N`` folder or a
run folder (every ``step-N`` in it); without ``--out`` each folder is converted in place (the
original is kept beside it as ``step-N.old-layout``). The new folder gets its checksums
(``titan_lrattnres.components.integrity``).

The trainer refuses an earlier-layout checkpoint with this command in the message
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
from titan_lrattnres.model.depth import layer_sites

BACKUP_SUFFIX = ".old-layout"
OLD = "router.query_bank"  # the one-bank layout's parameter

# A parameter name inside a checkpoint key: at its start or after a dot (``state.<fqn>.exp_avg``,
# ``optimizer.param_groups.<fqn>.lr``), followed by a dot or the key's end.
_SUBLAYER = re.compile(r"(^|\.)layers\.(\d+)\.(attention|feed_forward)(?=\.|$)")
_ROUTER = re.compile(r"(^|\.)router\.([A-Za-z_]+\d*)(?=\.|$)")
_QUERY = re.compile(r"(^|\.)router\.query_(\d+|bank)(?=\.|$)")
_PAIR = re.compile(r"(^|\.)layers\.(\d+)\.queries(?=\.|$)")
_FIRST_QUERIES = re.compile(r"(^|\.)layers\.0\.queries$")  # the parameter, not its state


def is_old_layout(entries: Iterable[str]) -> bool:
    """Whether flattened checkpoint entries are in an earlier layout (:func:`old_layout`)."""
    return old_layout(entries) is not None


def old_layout(entries: Iterable[str]) -> str | None:
    """What marks flattened checkpoint or state-dict ``entries`` as an earlier layout, None for
    the current one: a ``router.`` parameter (per-site queries, the one-bank
    ``router.query_bank``, the embedding's key), a layer entry with one sublayer, or -- told by
    shape, so ``entries`` must map keys to tensors or DCP metadata -- a two-row
    ``layers.0.queries`` in a model of several layers (the pair layout)."""
    return _layout(entries)[1]


def _layout(entries: Iterable[str]) -> tuple[str | None, str | None]:
    """``(layout, what marks it)``: layout ``"sublayers"``, ``"pairs"`` or None (current)."""
    held: dict[int, set[str]] = {}
    for key in entries:
        if _ROUTER.search(key):
            return "sublayers", f"'{key}'"
        for m in _SUBLAYER.finditer(key):
            held.setdefault(int(m[2]), set()).add(m[3])
    for kind, missing in (("feed_forward", "an MLP without attention"),
                          ("attention", "attention without an MLP")):  # fmt: skip
        for i in sorted(held):
            if held[i] == {kind}:
                return "sublayers", f"'layers.{i}' holds {missing} (one sublayer per entry)"
    if isinstance(entries, dict) and len(held) > 1:  # one layer: both layouts are the same
        for key, value in entries.items():
            if _FIRST_QUERIES.search(key) and _rows(value) == 2:
                return "pairs", f"'{key}' has 2 rows (a layer held read sites 2i+1 and 2i+2)"
    return None, None


def _rows(value) -> int | None:
    """Rows of a tensor or of DCP tensor metadata (``.size``); None for anything else."""
    shape = value.shape if isinstance(value, torch.Tensor) else getattr(value, "size", None)
    return shape[0] if isinstance(shape, torch.Size) and len(shape) else None


class OldLayoutError(RuntimeError):
    """A checkpoint in an earlier parameter layout was given to the trainer or a loader."""


def refuse_old_layout(folder, entries: Iterable[str] | None = None) -> None:
    """Raise :class:`OldLayoutError` (one line, with the converting command) when ``entries``
    (default: the DCP metadata of ``folder``) are in an earlier layout."""
    if entries is None:
        from torch.distributed.checkpoint import FileSystemReader

        entries = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    found = old_layout(entries)
    if found is not None:
        raise OldLayoutError(
            f"checkpoint {folder} is in an earlier parameter layout ({found}); convert it once "
            f"with `python -m titan_lrattnres.convert {folder}`"
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


def num_layers(keys: Iterable[str], layout: str = "sublayers") -> int:
    """L of a checkpoint in an earlier layout, from its module indices."""
    last = max((int(m[2]) for k in keys for m in _SUBLAYER.finditer(k)), default=-1)
    return last + 1 if layout == "pairs" else (last + 2) // 2


def to_layer_layout(state: dict, layers: int | None = None, layout: str | None = None) -> dict:
    """``state`` (flat, or nested dicts as DCP loads them) in the layer layout.

    Every key is renamed (:func:`rename`), and every entry named after a query -- the
    parameter, its optimiser state, its hyperparameters -- is regrouped by read site: the
    per-site ``router.query_{t}``, the one-bank ``router.query_bank [2L, ...]`` (row t-1) and
    the pair layout's ``layers.{i}.queries [2, ...]`` (rows: sites 2i+1, 2i+2) become
    ``layers.{i}.queries`` with one row per site of ``layer_sites(i)`` (a tensor of at least
    one dim: its rows stacked; anything else, e.g. a ``step`` counter or a learning rate: the
    same for every site, copied). ``layers``: L (default: from the module indices);
    ``layout``: ``"sublayers"`` or ``"pairs"`` (default: told from ``state``)."""
    flat = dict(_flat(state))
    layout = layout or _layout(flat)[0] or "sublayers"
    layers = layers if layers is not None else num_layers(flat, layout)
    out: dict[Any, Any] = {}
    sites: dict[str, dict[int, Any]] = {}  # new key of layer "\0" -> site -> row or value
    _regroup(state, layers, layout, out, sites)
    for (*path, template), by_site in sites.items():
        name = template.replace("\0", "i")
        missing = sorted(set(range(1, 2 * layers + 1)) - set(by_site))
        if missing:
            raise ValueError(f"{name}: no entry for read sites {missing}")
        for i in range(layers):
            rows = [by_site[t] for t in layer_sites(i, i == layers - 1)]
            first = rows[0]
            if isinstance(first, torch.Tensor) and first.ndim >= 1:
                value = torch.stack(rows)
            elif all(_same(first, r) for r in rows[1:]):
                value = first.clone() if isinstance(first, torch.Tensor) else first
            else:
                raise ValueError(f"{name}: the read sites differ {rows}")
            _put(out, (*path, template.replace("\0", str(i))), value)
    return out


def _regroup(state: dict, layers: int, layout: str, out: dict, sites: dict, path=()) -> None:
    """Copy ``state``'s entries into ``out`` (nested alike) renamed, and its query entries into
    ``sites`` by read site (:func:`to_layer_layout`)."""
    pairs = layout == "pairs"
    for key, value in state.items():
        if isinstance(value, dict):
            _regroup(value, layers, layout, out, sites, (*path, key))
            continue
        m = None
        if isinstance(key, str):
            m = _PAIR.search(key) if pairs else _QUERY.search(key)
        if m is None:
            _put(out, (*path, key if pairs or not isinstance(key, str) else rename(key)), value)
            continue
        rows = isinstance(value, torch.Tensor) and value.ndim >= 1
        if pairs:  # layer i's rows: sites 2i+1, 2i+2
            i = int(m[2])
            if rows and value.shape[0] != 2:
                raise ValueError(f"{key}: {tuple(value.shape)} has no 2 query rows")
            by_site = {2 * i + 1 + j: value[j] if rows else value for j in range(2)}
        elif m[2] != "bank":
            t = int(m[2])
            if not 1 <= t <= 2 * layers:
                raise ValueError(f"{key}: read site {t} is not in 1..{2 * layers} (L={layers})")
            by_site = {t: value}
        else:
            if rows and value.shape[0] != 2 * layers:
                raise ValueError(f"{key}: {tuple(value.shape)} has no {2 * layers} query rows")
            by_site = {t: value[t - 1] if rows else value for t in range(1, 2 * layers + 1)}
        template = (*path, _query_key(key, m, "\0", renamed=not pairs))
        sites.setdefault(template, {}).update(by_site)


def _put(out: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        out = out.setdefault(key, {})
    out[path[-1]] = value


def _flat(state: dict, prefix: str = ""):
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flat(value, name + ".")
        else:
            yield name, value


def _query_key(key: str, m: re.Match, i, renamed: bool = True) -> str:
    """``key`` (its query name matched by ``m``) for layer i's ``queries``, the rest renamed
    (``renamed``: from the per-sublayer layout)."""
    name = rename if renamed else str
    return name(key[: m.start()]) + f"{m[1]}layers.{i}.queries" + name(key[m.end() :])


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def source_keys(own: Iterable[str], stored: Iterable[str]) -> list[str]:
    """The keys of an earlier-layout checkpoint (``stored``; a mapping to tell the pair layout)
    that :func:`to_layer_layout` turns into the model keys ``own``: what a tool that loads the
    model alone has to read."""
    own = set(own)
    layout = _layout(stored)[0] or "sublayers"
    stored = list(stored)
    n = num_layers(stored, layout)
    wanted = []
    for key in stored:
        m = (_PAIR if layout == "pairs" else _QUERY).search(key)
        if m is None:
            new = [key if layout == "pairs" else rename(key)]
        else:
            if layout == "pairs":
                sites = [2 * int(m[2]) + 1, 2 * int(m[2]) + 2]
            else:
                sites = range(1, 2 * n + 1) if m[2] == "bank" else [int(m[2])]
            layers = {min(t // 2, n - 1) for t in sites}  # the layers holding those sites
            new = [_query_key(key, m, i, renamed=layout != "pairs") for i in sorted(layers)]
        if any(k in own for k in new):
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
        entries = dict(_flat(state))
        layout = _layout(entries)[0]
        if layout is None:
            raise ValueError(f"{src} is in the layer layout already: nothing to convert")
        layers = num_layers(entries, layout)
        torch.save(to_layer_layout(state, layers, layout), flat)
        torch_save_to_dcp(str(flat), str(dst))
    integrity.record(dst)
    return layers


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
