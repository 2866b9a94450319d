"""Export: torch.export program, AOTInductor package and safetensors, reloaded in a fresh
process; dynamic batch and sequence length; lrattnres:: custom ops kept as graph nodes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import custom_ops  # noqa: F401  (registers torch.ops.lrattnres)
from tests.titan_lrattnres._tiny import trained
from titan_lrattnres.evaluation import export
from titan_lrattnres.evaluation.inference import load_model

ROOT = Path(__file__).resolve().parents[3]
SHAPES = [(1, 5), (3, 23)]  # two shapes, neither the export example (2, 16)

LOADER = """
import sys, torch
from titan_lrattnres.evaluation.inference import load_aoti, load_exported, load_model
kind, path, data = sys.argv[1:4]
load = {"export": load_exported, "aoti": load_aoti, "safetensors": lambda p: load_model(p)[0]}
f = load[kind](path)
with torch.no_grad():
    torch.save([f(x) for x in torch.load(data)], data + "." + kind + ".pt")
"""


def _inputs(tmp_path):
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, 256, s, generator=g) for s in SHAPES]
    torch.save(xs, tmp_path / "inputs.pt")
    return xs


def _fresh_process(kind, path, tmp_path):
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    data = tmp_path / "inputs.pt"
    subprocess.run(
        [sys.executable, "-c", LOADER, kind, str(path), str(data)],
        check=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    return torch.load(f"{data}.{kind}.pt")


@pytest.mark.parametrize(
    "variant,blocks,backend",
    [
        ("baseline", None, "reference"),
        ("attnres", None, "reference"),
        ("projected", 2, "reference"),
        ("sliced", 3, "auto"),
        ("projected", None, "auto"),
    ],
)
def test_exported_program_dynamic_shapes(variant, blocks, backend):
    model, _ = trained(variant, blocks, backend, steps=1)
    program = export.export_program(model)
    run = program.module()
    with torch.no_grad():
        for shape in SHAPES:
            x = torch.randint(0, 256, shape)
            torch.testing.assert_close(run(x), model(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "variant,blocks,expected",
    [
        ("sliced", 3, {"lrattnres.block_read_sliced.default"}),
        ("projected", 2, {"lrattnres.block_read.default"}),
    ],
)
def test_fused_backend_keeps_custom_op_nodes(variant, blocks, expected):
    """Fails (never skips) if the lrattnres:: ops are not registered. With the ``compiled``
    backend each layer's phase-1 read stays one op; the merges with what a layer adds since
    phase 1 are aten ops inside the layer (``depth.site_read``), for the compiler to fuse."""
    model, _ = trained(variant, blocks, "compiled", steps=0)
    assert set(export.custom_op_nodes(export.export_program(model))) == expected
    ref, _ = trained(variant, blocks, "reference", steps=0)
    assert export.custom_op_nodes(export.export_program(ref)) == []


def test_cli_export_and_safetensors_reload_in_fresh_process(tmp_path):
    # default depth backend (auto): on CPU the inductor read, exported as aten ops
    model, args = trained("sliced", 3, depth_backend=None)
    run = tmp_path / "run"
    dcp.save(model.state_dict(), checkpoint_id=str(run / "checkpoint" / "step-3"))
    (run / "model_args.json").write_text(json.dumps(args))
    out = tmp_path / "out"
    assert (
        export.main(["--run", str(run), "--out", str(out), "--format", "export,safetensors"]) == 0
    )
    record = json.loads((out / "export.json").read_text())
    assert record["dynamic"]["seq"] == [2, 512] and set(record["files"]) == {
        "export",
        "safetensors",
    }
    assert record["depth_backend"] == "auto" and record["custom_op_nodes"] == [], record
    xs = _inputs(tmp_path)
    with torch.no_grad():
        eager = [model(x) for x in xs]
    for x, got, want in zip(
        xs, _fresh_process("export", out / "model.pt2", tmp_path), eager, strict=True
    ):
        assert got.shape == (*x.shape, 256)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for got, want in zip(
        _fresh_process("safetensors", out / "safetensors", tmp_path), eager, strict=True
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    rebuilt, rebuilt_args = load_model(out / "safetensors")
    assert rebuilt_args == args
    for k, v in model.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[k], v), k


@pytest.mark.parametrize("layout", ["sites", "pairs"])
@pytest.mark.parametrize("kind", ["dcp", "safetensors"])
def test_earlier_layouts_are_refused_with_the_converting_command(kind, layout, tmp_path):
    """Per sublayer (told by name) and pairs (told by shape, in DCP metadata and in tensors)."""
    from safetensors.torch import save_file

    from tests.titan_lrattnres.components.test_convert import to_old_layout
    from titan_lrattnres.components.convert import OldLayoutError, old_layout
    from titan_lrattnres.evaluation.inference import save_safetensors

    model, args = trained("projected", 2, steps=0)
    old = to_old_layout(model.state_dict(), layout)
    assert old_layout(model.state_dict()) is None
    run = tmp_path / "run"
    if kind == "dcp":
        folder = run / "checkpoint" / "step-1"
        dcp.save(old, checkpoint_id=str(folder))
        (run / "model_args.json").write_text(json.dumps(args))
    else:
        folder = save_safetensors(model, args, run)
        save_file({k: v.contiguous() for k, v in old.items()}, str(folder / "model.safetensors"))
    with pytest.raises(OldLayoutError) as refused:
        load_model(run)
    message = str(refused.value)
    assert f"`python -m titan_lrattnres.convert {folder}`" in message and "\n" not in message
    assert ("has 2 rows" in message) == (layout == "pairs")
    with pytest.raises(SystemExit, match="python -m titan_lrattnres.convert"):
        export.main(["--run", str(run), "--out", str(tmp_path / "out"), "--format", "export"])
    # the baseline's earlier layout has no router parameter: one sublayer per entry tells it
    baseline, _ = trained("baseline", None, steps=0)
    assert "MLP without attention" in old_layout(to_old_layout(baseline.state_dict()))
    assert old_layout(["router.query_bank", "tok_embeddings.weight"]) == "'router.query_bank'"


def test_unknown_format_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown --format"):
        export.main(["--checkpoint", str(tmp_path), "--out", str(tmp_path), "--format", "onnx"])


@pytest.mark.slow
def test_aoti_package_reloads_in_fresh_process(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    model, args = trained("projected", 2, depth_backend=None)
    # the package that keeps the lrattnres:: ops (the Python-free one: test_aoti_cpp.py)
    record = export.export_all(model, args, tmp_path / "out", formats=("aoti",), python_free=False)
    assert record["files"] == {"aoti": "model_aoti.pt2"}
    xs = _inputs(tmp_path)
    got = _fresh_process("aoti", tmp_path / "out" / "model_aoti.pt2", tmp_path)
    with torch.no_grad():
        for x, g in zip(xs, got, strict=True):
            torch.testing.assert_close(g, model(x), rtol=1e-4, atol=1e-4)
