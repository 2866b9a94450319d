"""Convert a checkpoint from the one-bank query layout to one query per read site.

    python -m titan_lrattnres.convert CHECKPOINT [--out NEW]

Checkpoints written before pipeline parallelism kept every read site's query in one root
parameter ``router.query_bank [2L, r]``; now site t has its own ``router.query_<t> [r]``, so a
pipeline stage owns exactly its sites' queries and a checkpoint saved by any split keeps them all.
The conversion rewrites every entry that names the bank -- the parameter, the optimiser's
per-parameter state (row t-1 of ``exp_avg`` / ``exp_avg_sq`` goes to site t, ``step`` is copied)
and its per-parameter hyperparameters -- and leaves everything else (other weights, train state,
data loader, LR schedule) untouched, so training resumes from the converted folder exactly where
it stopped. ``CHECKPOINT`` is a DCP ``step-N`` folder or a run folder (every ``step-N`` in it);
without ``--out`` each folder is converted in place (the original is kept beside it as
``step-N.query_bank``). The new folder gets its checksums
(``titan_lrattnres.components.integrity``).

The evaluation tools (``titan_lrattnres.evaluation.inference.load_model``) read both layouts; the
trainer refuses the old one with this command in the message.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

import torch

from titan_lrattnres.components import integrity

OLD = "router.query_bank"
BACKUP_SUFFIX = ".query_bank"


def is_old_layout(keys) -> bool:
    """Whether flattened checkpoint keys hold the one-bank query layout."""
    return any(k == OLD or k.endswith("." + OLD) or f"{OLD}." in k for k in keys)


class OldLayoutError(RuntimeError):
    """A checkpoint in the one-bank query layout was given to the trainer."""


def refuse_old_layout(folder) -> None:
    """Raise :class:`OldLayoutError` (one line, with the command) for a one-bank checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    if is_old_layout(FileSystemReader(str(folder)).read_metadata().state_dict_metadata):
        raise OldLayoutError(
            f"checkpoint {folder} stores the depth queries in the old one-bank layout "
            f"({OLD} [2L, r]); convert it once with `python -m titan_lrattnres.convert {folder}`"
        )


def split_queries(state: dict, sites: int) -> dict:
    """``state`` (nested dicts, as DCP loads them) with every key naming ``router.query_bank``
    replaced by one key per read site: a ``[sites, ...]`` tensor gives site t its row t-1, any
    other value (a ``step`` counter, a learning rate) is copied to every site."""
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out[key] = split_queries(value, sites)
        elif isinstance(key, str) and OLD in key:
            rows = isinstance(value, torch.Tensor) and value.ndim >= 1
            if rows and value.shape[0] != sites:
                raise ValueError(f"{key}: {tuple(value.shape)} has no {sites} query rows")
            for t in range(1, sites + 1):
                v = value[t - 1] if rows else value
                new = key.replace(OLD, f"router.query_{t}")
                out[new] = v.clone() if isinstance(v, torch.Tensor) else v
        else:
            out[key] = value
    return out


def _sites(state: dict) -> int:
    for key, value in state.items():
        if key == OLD or key.endswith("." + OLD):
            return value.shape[0]
        if isinstance(value, dict) and (n := _sites(value)):
            return n
    return 0


def convert_folder(src: Path, dst: Path) -> int:
    """Write the converted copy of DCP folder ``src`` to ``dst``; returns the number of sites."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    integrity.check(src)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
        flat = Path(tmp) / "state.pt"
        dcp_to_torch_save(str(src), str(flat))
        state = torch.load(flat, weights_only=False)
        sites = _sites(state)
        if not sites:
            raise ValueError(f"{src} has no {OLD}: nothing to convert")
        torch.save(split_queries(state, sites), flat)
        torch_save_to_dcp(str(flat), str(dst))
    integrity.record(dst)
    return sites


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
        print(f"{args.checkpoint}: already in the per-site layout, nothing to do")
        return 0
    if args.out is not None and len(folders) > 1:
        print(f"error: --out takes one step-N folder; {args.checkpoint} has {len(folders)}")
        return 2
    for src in folders:
        if args.out is not None:
            sites = convert_folder(src, args.out)
            print(f"{src} -> {args.out}: {sites} read sites")
            continue
        new = src.with_name(src.name + ".converting")
        shutil.rmtree(new, ignore_errors=True)
        sites = convert_folder(src, new)
        src.rename(src.with_name(src.name + BACKUP_SUFFIX))
        new.rename(src)
        print(
            f"{src}: converted in place ({sites} read sites; original kept as "
            f"{src.name}{BACKUP_SUFFIX})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
