"""The AOTInductor package runs from C++ with no Python in the process: the loader
(``titan_lrattnres/evaluation/aoti_runner.cpp``) is built once per module with ``g++`` against the
torch wheel's libtorch, and runs the Python-free package (reference depth reads: no
``lrattnres::`` node) of every variant, Full and Block, giving the Python model's logits.

Fails (never skips) when ``g++`` or the torch headers are missing."""

import json
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._inductor.config
import torch.distributed.checkpoint as dcp

from tests.titan_lrattnres._tiny import trained
from titan_lrattnres.evaluation import export

pytestmark = pytest.mark.slow  # ~15 s per compiled package on 2 CPU cores

SHAPES = [(1, 5), (3, 23)]  # neither the export example (2, 16)
TOL = dict(rtol=1e-4, atol=1e-4)  # fp32: inductor's fused kernels reorder sums


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory):
    """A fresh inductor cache for the module, none of the user's: every package here is
    compiled from scratch (no two graphs hash alike)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor_cache")))
        yield


def _libraries(binary: Path) -> list[str]:
    """The shared libraries ``ldd`` lists for ``binary`` (names, not paths: the torch wheel
    lives under a ``python3.X`` folder)."""
    ldd = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
    assert "not found" not in ldd, ldd
    return [line.split()[0] for line in ldd.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def runner(tmp_path_factory) -> Path:
    """The C++ loader, built once: a plain executable, no libpython among its libraries."""
    assert shutil.which("g++"), "g++ is needed to build the C++ loader of the AOTI package"
    assert export.RUNNER_SOURCE.is_file(), export.RUNNER_SOURCE
    binary = export.build_aoti_runner(tmp_path_factory.mktemp("aoti_runner") / "aoti_runner")
    libs = _libraries(binary)
    assert {"libtorch.so", "libtorch_cpu.so", "libc10.so"} <= set(libs), libs
    assert not [lib for lib in libs if "python" in lib.lower()], libs  # libpython, libtorch_python
    return binary


def _graph_targets(program) -> list[str]:
    return [str(n.target) for n in program.graph.nodes if n.op == "call_function"]


# how a package names a custom op: ``lrattnres::block_read`` (the proxy executor's JSON) and
# ``torch.ops.lrattnres.block_read.default`` (wrapper code); not the ``titan-lrattnres`` paths
# of the compile commands the wrapper records
CUSTOM_OP = re.compile(rb"(?<![\w-])lrattnres(?:::|\.)\w")


def _assert_python_free_package(path: Path) -> None:
    """No call into the Python-registered ops anywhere in the compiled package (wrapper and
    kernel code, metadata, the shared library). A ``--no-python-free`` package of a fused model
    names them, and the C++ loader refuses it ("Could not find schema for lrattnres::...")."""
    with zipfile.ZipFile(path) as z:
        for name in z.namelist():
            found = CUSTOM_OP.findall(z.read(name))
            assert not found, (name, found[:3])


def _run_cpp(runner: Path, package: Path, xs, tmp_path: Path) -> list[torch.Tensor]:
    """Run the loader on ``xs`` in one process with an empty environment (no PATH, no
    PYTHONPATH, no PYTHONHOME): nothing of Python is reachable from it."""
    argv = [str(runner), str(package)]
    for i, x in enumerate(xs):
        x.numpy().astype(np.int64).tofile(tmp_path / f"tokens{i}.bin")
        argv += [str(x.shape[0]), str(x.shape[1]), f"tokens{i}.bin", f"logits{i}.bin"]
    res = subprocess.run(argv, env={}, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-4000:]
    out = []
    for i, (x, line) in enumerate(zip(xs, res.stdout.splitlines(), strict=True)):
        b, t, v = map(int, line.split())
        assert (b, t) == tuple(x.shape)
        logits = np.fromfile(tmp_path / f"logits{i}.bin", dtype=np.float32)
        out.append(torch.from_numpy(logits).view(b, t, v))
    return out


def _inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, s, generator=g) for s in SHAPES]


def _compare(model, xs, got, label):
    with torch.no_grad():
        want = [model(x) for x in xs]
    diff = max((g - w).abs().max().item() for g, w in zip(got, want, strict=True))
    print(f"{label}: max |C++ - Python| = {diff:.3g}")
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.parametrize(
    "variant,blocks",
    [
        ("baseline", None),
        ("attnres", 2),
        ("sliced", 3),
        ("projected", None),
    ],  # each variant once, Full and Block both; projected Block: through the CLI below
    ids=lambda v: "full" if v is None else str(v),
)
def test_cpp_loader_matches_python_model(variant, blocks, runner, inductor_cache, tmp_path):
    model, _ = trained(variant, blocks, depth_backend=None, steps=1)  # fused depth backend
    assert model.router.backend == "auto"
    # static shape: a dynamic package compiles ~2x slower; the CLI test covers dynamic shapes
    program = export.export_python_free(model, dynamic=False)
    targets = _graph_targets(program)
    assert targets and not [t for t in targets if "lrattnres" in t], targets
    assert model.router.backend == "auto"  # restored after the export
    # the wrapper (the host code that calls the kernels) unoptimised: ~3 s less per package
    # here; the kernels are compiled as always. The CLI test below builds the default package.
    with torch._inductor.config.patch({"aot_inductor.compile_wrapper_opt_level": "O0"}):
        package = export.compile_aoti(program, tmp_path / "model_aoti.pt2")
    _assert_python_free_package(package)
    xs = [torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))]
    _compare(model, xs, _run_cpp(runner, package, xs, tmp_path), f"{variant} blocks={blocks}")


def test_cli_aoti_package_runs_from_cpp(runner, inductor_cache, tmp_path):
    """``python -m titan_lrattnres.export --depth-backend compiled`` (phase 1 as the registered
    op): model.pt2 keeps the ``lrattnres::`` nodes, model_aoti.pt2 (Python-free by default) has
    none and runs from C++ at two shapes (dynamic batch and sequence length)."""
    model, args = trained("projected", 2, depth_backend=None)
    run = tmp_path / "run"
    dcp.save(model.state_dict(), checkpoint_id=str(run / "checkpoint" / "step-3"))
    (run / "model_args.json").write_text(json.dumps(args))
    out = tmp_path / "out"
    cli = ["--run", str(run), "--out", str(out), "--format", "export,aoti"]
    assert export.main([*cli, "--depth-backend", "compiled"]) == 0
    record = json.loads((out / "export.json").read_text())
    assert record["depth_backend"] == "compiled" and record["custom_op_nodes"], record
    assert record["aoti"] == {
        "depth_backend": "reference",
        "custom_op_nodes": [],
        "python_free": True,
    }
    package = out / "model_aoti.pt2"
    _assert_python_free_package(package)
    xs = _inputs()
    _compare(model, xs, _run_cpp(runner, package, xs, tmp_path), "projected blocks=2 (CLI)")
