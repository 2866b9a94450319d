"""The package's layout: no import cycle between its modules (function-level imports included),
the commands under their documented names, and the public API importable from the package."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "titan_lrattnres"
COMMANDS = ("train", "generate", "export", "analysis", "longctx", "sweep", "convert", "data")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its file."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # ``from pkg import mod`` imports mod, as ``import pkg.mod`` does: the edge to
                # the package's __init__, which every submodule import runs, is left out
                subs = [f"{node.module}.{a.name}" for a in node.names]
                names = [t for t in subs if t not in modules]
                targets = [t for t in subs if t in modules] + [node.module] * bool(names)
            else:
                continue
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep, [*path, dep])):
                return cycle
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node, [node])):
            return cycle
    return None


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    # the package root re-exports the public API; every other module may depend on its parts
    graph = {m: d - {"titan_lrattnres"} for m, d in graph.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_public_api():
    import titan_lrattnres

    for name in ("model_registry", "build_model_config", "Flavor", "FLAVORS",
                 "added_flops_percent", "load_model"):  # fmt: skip
        assert callable(getattr(titan_lrattnres, name)) or name == "FLAVORS", name
    assert "paper_0p5b" in titan_lrattnres.FLAVORS


@pytest.mark.parametrize("command", COMMANDS)
def test_command_runs_under_its_name(command):
    module = importlib.import_module(f"titan_lrattnres.{command}")
    assert callable(module.main)
    out = subprocess.run([sys.executable, "-m", f"titan_lrattnres.{command}", "--help"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "usage" in (out.stdout + out.stderr).lower()


def test_location_dependent_paths_point_at_the_repository(monkeypatch):
    from titan_lrattnres.components import data

    monkeypatch.delenv(data.CACHE_ENV, raising=False)
    assert data.cache_dir() == PACKAGE.parent / "data_cache"
