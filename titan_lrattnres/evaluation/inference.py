"""Load a trained LR-AttnRes model for evaluation, analysis, export and generation.

Two checkpoint formats are accepted by :func:`load_model`:

- **safetensors export** (this project's format, written by :func:`save_safetensors`): a folder
  with ``model.safetensors`` and ``config.json`` =
  ``{"format": "lrattnres-safetensors", "format_version": 1, "model_args": {...}}``;
- **torchtitan DCP checkpoint**: a ``step-N`` folder (or a run / dump folder, whose newest
  ``checkpoint/step-N`` is used) plus the model arguments, from ``model_args=`` or a
  ``model_args.json`` (else the trainer's ``summary.json``, which records flavor, variant,
  blocks and rank) found in the checkpoint folder or up to three folders above it.
  torchtitan's checkpointer flattens the model state to the top level of the DCP state
  (``layers.0.attention.wo.weight``, ``layers.0.queries``); a ``model.``-prefixed layout, as
  ``dcp.save({"model": model.state_dict()})`` writes it, is read too.

Either format in an earlier layout of the parameters (per sublayer: ``layers.{2i}.attention``,
``layers.{2i+1}.feed_forward``, ``router.query_<t>``, ``router.embedding_key``; or one
``router.query_bank``) is refused with the command that converts it
(``python -m titan_lrattnres.convert FOLDER``).

The model arguments are the keyword arguments of
:func:`titan_lrattnres.model.registry.build_model_config` (``flavor, variant, blocks, rank, eps,
vocab_size``; ``depth_backend`` / ``attn_backend`` may be overridden at load time).
"""

from __future__ import annotations

import contextlib
import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch

import custom_ops  # noqa: F401  (registers the lrattnres:: ops before any program is loaded)
from titan_lrattnres.components import convert, integrity
from titan_lrattnres.model.registry import ModelIdentity, build_model_config

FORMAT = "lrattnres-safetensors"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
MODEL_ARGS_FILE = "model_args.json"
SUMMARY_FILE = "summary.json"  # the trainer's run summary (flavor, variant, blocks, rank)
MODEL_ARG_NAMES = (
    "flavor",
    "variant",
    "blocks",
    "block_layers",
    "rank",
    "eps",
    "vocab_size",
    "depth_backend",
    "attn_backend",
)


def ensure_ops_registered() -> None:
    """Import ``custom_ops`` so that ``torch.ops.lrattnres.*`` exist (needed before
    ``torch.export.load`` / ``aoti_load_package`` of a program that calls them)."""
    import custom_ops  # noqa: F401, F811


def clean_model_args(args: dict[str, Any]) -> dict[str, Any]:
    unknown = set(args) - set(MODEL_ARG_NAMES)
    if unknown:
        raise ValueError(f"unknown model arguments {sorted(unknown)}; allowed {MODEL_ARG_NAMES}")
    if "flavor" not in args:
        raise ValueError("model arguments need a 'flavor'")
    return dict(args)


def build_model(
    model_args: dict[str, Any],
    *,
    depth_backend: str | None = None,
    attn_backend: str | None = None,
    device: str | torch.device = "cpu",
) -> torch.nn.Module:
    """Build and initialise (random weights) the model for ``model_args``, in eval mode."""
    args = clean_model_args(model_args)
    if depth_backend is not None:
        args["depth_backend"] = depth_backend
    if attn_backend is not None:
        args["attn_backend"] = attn_backend
    elif torch.device(device).type == "cpu":
        args.setdefault("attn_backend", "sdpa")
    flavor = args.pop("flavor")
    model = build_model_config(flavor, **args).build()
    model.to(device)
    model.init_states(buffer_device=torch.device(device))
    return model.eval()


@contextlib.contextmanager
def depth_backend(model, backend: str):
    """Run ``model``'s depth reads with ``backend`` inside the block (same weights: the backend
    is how the layers compute a read, not what they hold); restored on exit."""
    old = model.router.backend
    model.set_depth_backend(backend)
    try:
        yield model
    finally:
        model.set_depth_backend(old)


# -- safetensors export --------------------------------------------------------------------------
def save_safetensors(model: torch.nn.Module, model_args: dict[str, Any], out_dir: str | Path):
    """Write ``model.safetensors`` + ``config.json``; returns the folder."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(out / WEIGHTS_FILE), metadata={"format": FORMAT})
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model_args": clean_model_args(model_args),
    }
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out


def _read_export_config(folder: Path) -> dict[str, Any]:
    config = json.loads((folder / CONFIG_FILE).read_text())
    if config.get("format") != FORMAT:
        raise ValueError(f"{folder / CONFIG_FILE} is not a {FORMAT} config")
    if config.get("format_version", 0) > FORMAT_VERSION:
        raise ValueError(
            f"{folder}: format_version {config['format_version']} is newer than "
            f"this code ({FORMAT_VERSION})"
        )
    return config["model_args"]


# -- DCP --------------------------------------------------------------------------------------
def is_dcp_folder(path: Path) -> bool:
    return (path / ".metadata").is_file()


def latest_step_folder(path: Path) -> Path | None:
    """Newest ``step-N`` DCP folder in ``path``, ``path/checkpoint`` or ``path/checkpoints``."""
    for root in (path, path / "checkpoint", path / "checkpoints"):
        if not root.is_dir():
            continue
        steps = [
            (int(m.group(1)), p)
            for p in root.iterdir()
            if (m := re.fullmatch(r"step-(\d+)", p.name)) and is_dcp_folder(p)
        ]
        if steps:
            return max(steps)[1]
    return None


def find_upwards(start: Path, name: str, levels: int = 3) -> Path | None:
    p = start.resolve()
    for _ in range(levels + 1):
        if (p / name).is_file():
            return p / name
        p = p.parent
    return None


def model_args_from_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """Model arguments recorded in a run's ``summary.json`` (written by the trainer from a
    ``ModelIdentity``); a summary without ``blocks`` leaves ``build_model_config``'s default."""
    args = ModelIdentity.from_record(summary).model_args()
    if "blocks" not in summary and summary.get("block_layers") is None:
        args.pop("blocks", None)
    return args


def find_model_args(folder: Path) -> dict[str, Any] | None:
    """``model_args.json``, else the model fields of ``summary.json``, in ``folder`` or up to
    three folders above it."""
    found = find_upwards(folder, MODEL_ARGS_FILE)
    if found is not None:
        return json.loads(found.read_text())
    found = find_upwards(folder, SUMMARY_FILE)
    if found is not None:
        args = model_args_from_summary(json.loads(found.read_text()))
        if {"flavor", "variant"} <= set(args):
            return args
    return None


def load_dcp_into(model: torch.nn.Module, folder: str | Path) -> None:
    """Load the model weights of a DCP checkpoint (single process, no process group) once
    ``titan_lrattnres.components.integrity`` has verified it (checksums, vetted ``.metadata``);
    raises ``CheckpointIntegrityError`` (one line) for a damaged, incomplete or unsafe folder."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    integrity.check(folder)
    reader = FileSystemReader(str(folder))
    stored = reader.read_metadata().state_dict_metadata
    convert.refuse_old_layout(folder, stored)
    read = list(model.state_dict())
    prefix = "" if all(k in stored for k in read) else "model."
    missing = [k for k in read if prefix + k not in stored]
    if missing:
        raise KeyError(
            f"{folder}: DCP checkpoint lacks model keys {missing[:5]} "
            f"(has e.g. {sorted(stored)[:5]})"
        )
    # Load in the stored dtype (a last-step export may be bf16), then cast into the model.
    state = {
        prefix + k: torch.empty(stored[prefix + k].size, dtype=stored[prefix + k].properties.dtype)
        for k in read
    }
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
        try:
            dcp.load(state, storage_reader=reader)
        except (Exception, CheckpointException) as e:  # e.g. an unrecorded, damaged folder
            cause = next(iter(e.failures.values()))[0] if isinstance(e, CheckpointException) else e
            raise integrity.CheckpointIntegrityError(
                f"checkpoint {folder} cannot be read ({integrity.unpickle_error(cause)})"
            ) from e
    model.load_state_dict({k.removeprefix(prefix): v for k, v in state.items()}, strict=True)


# -- the one entry point ----------------------------------------------------------------------
def resolve_checkpoint(path: str | Path) -> tuple[str, Path]:
    """``("safetensors" | "dcp", folder)`` for an export folder, a DCP folder or a run folder."""
    p = Path(path)
    if (p / CONFIG_FILE).is_file() and (p / WEIGHTS_FILE).is_file():
        return "safetensors", p
    if is_dcp_folder(p):
        return "dcp", p
    step = latest_step_folder(p)
    if step is not None:
        return "dcp", step
    raise FileNotFoundError(
        f"{p}: neither a safetensors export ({CONFIG_FILE} + {WEIGHTS_FILE}), nor a DCP folder "
        "(.metadata), nor a run folder with checkpoint/step-N"
    )


def load_model(
    path: str | Path,
    *,
    model_args: dict[str, Any] | str | Path | None = None,
    depth_backend: str | None = None,
    device: str | torch.device = "cpu",
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Load ``(model in eval mode, model_args)`` from a checkpoint (see the module docstring).

    ``model_args`` may be a dict or a JSON file path; it is required for DCP checkpoints unless
    a ``model_args.json`` sits in the checkpoint folder or up to three folders above it.
    """
    kind, folder = resolve_checkpoint(path)
    if isinstance(model_args, (str, Path)):
        model_args = json.loads(Path(model_args).read_text())
    if kind == "safetensors":
        from safetensors.torch import load_file

        args = model_args or _read_export_config(folder)
        state = load_file(str(folder / WEIGHTS_FILE))
        convert.refuse_old_layout(folder, state)
        model = build_model(args, depth_backend=depth_backend, device=device)
        model.load_state_dict(state, strict=True)
        return model, clean_model_args(args)
    if model_args is None:
        model_args = find_model_args(folder) or find_model_args(Path(path))
        if model_args is None:
            raise FileNotFoundError(
                f"{folder}: a DCP checkpoint needs the model arguments: pass --model-args FILE, "
                f"or put {MODEL_ARGS_FILE} (or the trainer's {SUMMARY_FILE}) in the run folder"
            )
    model = build_model(model_args, depth_backend=depth_backend, device=device)
    load_dcp_into(model, folder)
    return model.eval(), clean_model_args(model_args)


def find_tokenizer(path: str | Path) -> Path | None:
    """``tokenizer.json`` in the checkpoint folder or up to three folders above (or a
    ``tokenizer/`` / ``assets/tokenizer`` subfolder of those)."""
    p = Path(path).resolve()
    for _ in range(4):
        for cand in (
            p / "tokenizer.json",
            p / "tokenizer" / "tokenizer.json",
            p / "assets" / "tokenizer" / "tokenizer.json",
        ):
            if cand.is_file():
                return cand
        p = p.parent
    return None


def default_tokenizer(vocab_size: int) -> Path | None:
    """The embedded corpus's tokenizer (what the CPU configs train with) when it is built and
    its vocabulary fits ``vocab_size``."""
    source = default_validation_source()
    if source is None:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return None
    fits = Tokenizer.from_file(str(source[1])).get_vocab_size() <= vocab_size
    return source[1] if fits else None


def add_checkpoint_args(parser) -> None:
    """The ``--checkpoint / --run / --model-args / --depth-backend`` CLI options."""
    parser.add_argument(
        "--checkpoint",
        help="safetensors export folder, DCP step-N folder or run "
        "folder (newest checkpoint/step-N)",
    )
    parser.add_argument("--run", help="run (dump) folder; same as --checkpoint RUN")
    parser.add_argument(
        "--model-args",
        help="JSON file of build_model_config kwargs (DCP only, "
        f"when the run folder has no {MODEL_ARGS_FILE})",
    )
    parser.add_argument(
        "--depth-backend",
        default=None,
        help="override the depth backend (reference|inductor|compiled|triton|auto)",
    )


def load_from_cli(ns) -> tuple[torch.nn.Module, dict[str, Any], Path]:
    path = ns.checkpoint or ns.run
    if path is None:
        raise SystemExit("give --checkpoint PATH or --run DIR")
    try:
        model, args = load_model(path, model_args=ns.model_args, depth_backend=ns.depth_backend)
    except (integrity.CheckpointIntegrityError, convert.OldLayoutError) as e:
        raise SystemExit(f"error: {e}") from None
    return model, args, Path(path)


# -- validation tokens ------------------------------------------------------------------------
def default_validation_source() -> tuple[Path, Path] | None:
    """``(val.jsonl, tokenizer.json)`` of the embedded corpus when it has been built."""
    try:
        from titan_lrattnres.components.data import corpus_dir, tokenizer_dir
    except ImportError:
        return None
    val, tok = corpus_dir() / "val.jsonl", tokenizer_dir() / "tokenizer.json"
    return (val, tok) if val.is_file() and tok.is_file() else None


def validation_tokens(jsonl: str | Path, tokenizer: str | Path, max_tokens: int) -> torch.Tensor:
    """Token ids ``[n]`` (int64) of the documents of a ``{"text": ...}`` JSONL file, each
    followed by the tokenizer's ``<|endoftext|>`` id when it has one; at most ``max_tokens``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    eot = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    with open(jsonl) as f:
        for line in f:
            ids += tok.encode(json.loads(line)["text"]).ids
            if eot is not None:
                ids.append(eot)
            if len(ids) >= max_tokens:
                break
    return torch.tensor(ids[:max_tokens], dtype=torch.long)


# -- exported programs -------------------------------------------------------------------------
def load_exported(path: str | Path):
    """A ``torch.export`` program saved by ``titan_lrattnres.evaluation.export`` as a callable
    module (``tokens [B, T] -> logits [B, T, V]``); registers the ``lrattnres::`` ops first. Load
    only programs you trust: ``torch.export.load`` unpickles parts of a ``.pt2`` without
    ``weights_only`` (weights alone travel safely as the safetensors export)."""
    ensure_ops_registered()
    return torch.export.load(str(path)).module()


def load_aoti(path: str | Path):
    """An AOTInductor package saved by ``titan_lrattnres.evaluation.export`` as a callable
    (``tokens [B, T] -> logits [B, T, V]``); registers the ``lrattnres::`` ops first. The
    package is compiled machine code: load only packages you trust."""
    ensure_ops_registered()
    import torch._inductor

    return torch._inductor.aoti_load_package(str(path))
