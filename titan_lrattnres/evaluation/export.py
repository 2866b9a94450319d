"""Export a trained model: ``torch.export`` program, AOTInductor package, safetensors weights.

    python -m titan_lrattnres.export --checkpoint CKPT --out DIR \
        [--format all|export|aoti|safetensors]

Writes into ``DIR``:
- ``model.pt2``: ``torch.export.export`` of the model in eval mode (``tokens [B, T] int64 ->
  logits [B, T, V]``), batch and sequence length dynamic (``1 <= B``, ``2 <= T <= max_seq_len``
  of RoPE). The depth reads stay ``lrattnres::`` custom-op nodes when the model uses a fused
  depth backend; ``reference`` exports plain aten ops. Load with
  ``titan_lrattnres.evaluation.inference.load_exported`` (imports ``custom_ops`` first, as any
  loader must);
- ``model_aoti.pt2``: the same program compiled ahead of time by AOTInductor for this machine's
  device (CPU here); load with ``titan_lrattnres.evaluation.inference.load_aoti``;
- ``safetensors/``: ``model.safetensors`` + ``config.json`` (build_model_config kwargs + format
  version), which ``titan_lrattnres.evaluation.inference.load_model`` rebuilds into the same model;
- ``export.json``: what was written, the model arguments and the dynamic-shape ranges.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch.export import Dim

from titan_lrattnres.evaluation.generate import max_seq_len
from titan_lrattnres.evaluation.inference import (
    add_checkpoint_args,
    load_from_cli,
    save_safetensors,
)

FORMATS = ("export", "aoti", "safetensors")
MIN_SEQ = 2  # size-0/1 dims specialise in torch.export; T=1 runs through the KV-cache decoder


def export_program(model, *, batch: int = 2, seq_len: int = 16, dynamic: bool = True):
    """``torch.export.export`` of ``model`` (eval mode) on int64 tokens ``[batch, seq_len]``."""
    model.eval()
    tokens = torch.zeros(batch, seq_len, dtype=torch.long, device=next(model.parameters()).device)
    shapes = None
    if dynamic:
        shapes = {
            "tokens": {0: Dim("batch", min=1), 1: Dim("seq", min=MIN_SEQ, max=max_seq_len(model))}
        }
    with torch.no_grad():
        return torch.export.export(model, (tokens,), dynamic_shapes=shapes)


def custom_op_nodes(program) -> list[str]:
    """Targets of the ``lrattnres::`` nodes in an exported program's graph."""
    return [
        str(n.target)
        for n in program.graph.nodes
        if n.op == "call_function" and str(n.target).startswith("lrattnres.")
    ]


def compile_aoti(program, path: str | Path) -> Path:
    import torch._inductor

    return Path(torch._inductor.aoti_compile_and_package(program, package_path=str(path)))


def export_all(
    model, model_args: dict, out: str | Path, formats=FORMATS, *, dynamic: bool = True
) -> dict:
    """Write the requested formats into ``out``; returns the ``export.json`` record."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    record: dict = {"model_args": model_args, "files": {}}
    if "safetensors" in formats:
        save_safetensors(model, model_args, out / "safetensors")
        record["files"]["safetensors"] = "safetensors"
    if "export" in formats or "aoti" in formats:
        program = export_program(model, dynamic=dynamic)
        record["custom_op_nodes"] = sorted(set(custom_op_nodes(program)))
        record["depth_backend"] = model.router.backend
        record["dynamic"] = (
            {"batch": [1, None], "seq": [MIN_SEQ, max_seq_len(model)]} if dynamic else None
        )
        if "export" in formats:
            torch.export.save(program, str(out / "model.pt2"))
            record["files"]["export"] = "model.pt2"
        if "aoti" in formats:
            compile_aoti(program, out / "model_aoti.pt2")
            record["files"]["aoti"] = "model_aoti.pt2"
    (out / "export.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m titan_lrattnres.export",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_checkpoint_args(p)
    p.add_argument("--out", required=True)
    p.add_argument("--format", default="all", help="all, or a comma list of " + ", ".join(FORMATS))
    p.add_argument("--static", action="store_true", help="export the example shape only")
    ns = p.parse_args(argv)
    formats = FORMATS if ns.format == "all" else tuple(ns.format.split(","))
    bad = set(formats) - set(FORMATS)
    if bad:
        raise SystemExit(f"unknown --format {sorted(bad)}; choose all or from {FORMATS}")
    model, args, _ = load_from_cli(ns)
    record = export_all(model, args, ns.out, formats, dynamic=not ns.static)
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
