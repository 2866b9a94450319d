"""Export a trained model: ``torch.export`` program, AOTInductor package, safetensors weights,
Hugging Face folder.

    python -m titan_lrattnres.export --checkpoint CKPT --out DIR \
        [--format all|export|aoti|safetensors|hf] [--tokenizer tokenizer.json] [--no-python-free]

Writes into ``DIR``:
- ``model.pt2``: ``torch.export.export`` of the model in eval mode (``tokens [B, T] int64 ->
  logits [B, T, V]``), batch and sequence length dynamic (``1 <= B``, ``2 <= T <= max_seq_len``
  of RoPE). The depth reads stay ``lrattnres::`` custom-op nodes when the model uses a fused
  depth backend; ``reference`` exports plain aten ops. Load with
  ``titan_lrattnres.evaluation.inference.load_exported`` (imports ``custom_ops`` first, as any
  loader must);
- ``model_aoti.pt2``: the program compiled ahead of time by AOTInductor for this machine's
  device (CPU here); load with ``titan_lrattnres.evaluation.inference.load_aoti``, or from C++
  with no Python in the process (``torch::inductor::AOTIModelPackageLoader``; a small loader is
  ``titan_lrattnres/evaluation/aoti_runner.cpp``). Python-free by default (``--python-free``):
  the package is exported from the same weights with the ``reference`` depth backend, whose reads
  are plain aten ops, so its graph has no ``lrattnres::`` node (checked before compiling).
  ``--no-python-free`` keeps the model's depth backend, whose ``lrattnres::`` nodes are
  Python-registered ops: such a package loads only in a Python process that imports
  ``custom_ops``;
- ``safetensors/``: ``model.safetensors`` + ``config.json`` (build_model_config kwargs + format
  version), which ``titan_lrattnres.evaluation.inference.load_model`` rebuilds into the same model;
- ``hf/``: a Hugging Face transformers folder (``config.json`` with ``auto_map``,
  ``model.safetensors``, ``generation_config.json``, the tokenizer files and the remote code) that
  ``AutoModelForCausalLM.from_pretrained(DIR/hf, trust_remote_code=True)`` loads offline
  (``titan_lrattnres.evaluation.hf``). Needs ``transformers`` (a dev extra), so ``all`` leaves it
  out: ask for it by name. The tokenizer: ``--tokenizer``, else the one beside the checkpoint,
  else the embedded corpus's when built;
- ``export.json``: what was written, the model arguments and the dynamic-shape ranges.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import torch
from torch.export import Dim

from titan_lrattnres.evaluation.generate import max_seq_len
from titan_lrattnres.evaluation.inference import (
    add_checkpoint_args,
    default_tokenizer,
    depth_backend,
    find_tokenizer,
    load_from_cli,
    save_safetensors,
)

FORMATS = ("export", "aoti", "safetensors", "hf")
ALL_FORMATS = ("export", "aoti", "safetensors")  # ``--format all``: hf needs transformers
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


def export_python_free(model, *, dynamic: bool = True):
    """``export_program`` of ``model`` with the ``reference`` depth backend: the depth reads as
    plain aten ops, no ``lrattnres::`` node, so the AOTInductor package compiled from it runs
    without Python (``AOTIModelPackageLoader`` in a C++ process). Raises if a node remains."""
    with depth_backend(model, "reference"):
        program = export_program(model, dynamic=dynamic)
    left = custom_op_nodes(program)
    if left:
        raise RuntimeError(
            f"reference depth backend exported lrattnres:: nodes {sorted(set(left))}"
        )
    return program


RUNNER_SOURCE = Path(__file__).with_name("aoti_runner.cpp")


def aoti_runner_command(binary: str | Path, *, compiler: str = "g++") -> list[str]:
    """The command that builds ``aoti_runner.cpp`` (a C++ loader of ``model_aoti.pt2``) into
    ``binary`` against the installed torch wheel's libtorch: its headers and libraries, its
    C++ ABI, C++20 (the torch headers need it), rpath to ``torch/lib``. ``--no-as-needed``
    keeps ``libtorch.so`` loaded: the package's compiled model needs it, and a library loaded
    with ``dlopen`` does not search the program's rpath."""
    root = Path(torch.__file__).parent
    lib = root / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        compiler,
        "-std=c++20",
        "-O2",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        str(RUNNER_SOURCE),
        "-o",
        str(binary),
        f"-I{root / 'include'}",
        f"-L{lib}",
        f"-Wl,-rpath,{lib}",
        "-Wl,--no-as-needed",
        "-ltorch",
        "-ltorch_cpu",
        "-lc10",
    ]


def build_aoti_runner(binary: str | Path, *, compiler: str = "g++") -> Path:
    """Build the C++ loader (``aoti_runner_command``); returns ``binary``. ~10 s."""
    subprocess.run(aoti_runner_command(binary, compiler=compiler), check=True)
    return Path(binary)


def compile_aoti(program, path: str | Path) -> Path:
    import torch._inductor

    return Path(torch._inductor.aoti_compile_and_package(program, package_path=str(path)))


def export_all(
    model,
    model_args: dict,
    out: str | Path,
    formats=ALL_FORMATS,
    *,
    dynamic: bool = True,
    tokenizer: str | Path | None = None,
    python_free: bool = True,
) -> dict:
    """Write the requested formats into ``out``; returns the ``export.json`` record.
    ``tokenizer``: the ``tokenizer.json`` the hf folder carries (None: none). ``python_free``:
    compile the AOTInductor package from the reference-backend program (no ``lrattnres::``
    node; loads from C++ without Python); False: from the model's own backend."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    record: dict = {"model_args": model_args, "files": {}}
    if "safetensors" in formats:
        save_safetensors(model, model_args, out / "safetensors")
        record["files"]["safetensors"] = "safetensors"
    if "hf" in formats:
        from titan_lrattnres.evaluation.hf import export_hf

        record["hf"] = export_hf(model, out / "hf", tokenizer=tokenizer)
        record["files"]["hf"] = "hf"
    if "export" in formats or "aoti" in formats:
        record["dynamic"] = (
            {"batch": [1, None], "seq": [MIN_SEQ, max_seq_len(model)]} if dynamic else None
        )
        program = None  # the model's own depth backend (model.pt2)
        if "export" in formats or not python_free or model.router.backend == "reference":
            program = export_program(model, dynamic=dynamic)
            record["custom_op_nodes"] = sorted(set(custom_op_nodes(program)))
            record["depth_backend"] = model.router.backend
        if "export" in formats:
            torch.export.save(program, str(out / "model.pt2"))
            record["files"]["export"] = "model.pt2"
        if "aoti" in formats:
            aoti_program, aoti_backend = program, model.router.backend
            if program is None or (python_free and record["custom_op_nodes"]):
                aoti_program, aoti_backend = export_python_free(model, dynamic=dynamic), "reference"
            nodes = sorted(set(custom_op_nodes(aoti_program)))
            compile_aoti(aoti_program, out / "model_aoti.pt2")
            record["files"]["aoti"] = "model_aoti.pt2"
            record["aoti"] = {
                "depth_backend": aoti_backend,
                "custom_op_nodes": nodes,
                "python_free": not nodes,  # AOTIModelPackageLoader from C++, no Python
            }
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
    p.add_argument(
        "--format",
        default="all",
        help=f"all (= {','.join(ALL_FORMATS)}), or a comma list of " + ", ".join(FORMATS),
    )
    p.add_argument("--static", action="store_true", help="export the example shape only")
    p.add_argument(
        "--python-free",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="AOTInductor package from the reference depth backend: no lrattnres:: node, loads "
        "from C++ without Python (default); --no-python-free keeps the model's depth backend "
        "(the package then needs a Python process that imports custom_ops)",
    )
    p.add_argument(
        "--tokenizer",
        help="tokenizer.json for the hf folder (default: beside the checkpoint, else the "
        "embedded corpus's when built)",
    )
    ns = p.parse_args(argv)
    formats = ALL_FORMATS if ns.format == "all" else tuple(ns.format.split(","))
    bad = set(formats) - set(FORMATS)
    if bad:
        raise SystemExit(f"unknown --format {sorted(bad)}; choose all or from {FORMATS}")
    model, args, path = load_from_cli(ns)
    tokenizer = None
    if "hf" in formats:
        tokenizer = ns.tokenizer or find_tokenizer(path) or default_tokenizer(model.vocab_size)
    record = export_all(
        model,
        args,
        ns.out,
        formats,
        dynamic=not ns.static,
        tokenizer=tokenizer,
        python_free=ns.python_free,
    )
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
