"""The package's layout: the layer order between its sub-packages and no import cycle between
its modules (function-level imports included), the commands under their documented names, and
the public API importable from the package."""

import ast
import importlib
import json
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "titan_lrattnres"
ROOT = PACKAGE.parent
COMMANDS = ("train", "generate", "export", "analysis", "longctx", "sweep", "convert", "data")
# The layers, lowest first (README.md, "Layout"): a unit imports units of lower layers only.
# A unit: a sub-package or root module of titan_lrattnres, or one of the other top-level packages.
LAYERS = [
    ("custom_ops",),
    ("titan_lrattnres.torchtitan_internals",),
    ("titan_lrattnres.model",),
    ("titan_lrattnres.components",),
    ("titan_lrattnres.parallel",),
    ("titan_lrattnres.spec",),
    ("titan_lrattnres.training",),
    ("train_configs",),
    ("titan_lrattnres.evaluation",),
    (
        "titan_lrattnres",
        "titan_lrattnres.config_registry",
        *(f"titan_lrattnres.{c}" for c in COMMANDS),
    ),  # fmt: skip
    ("benchmarks",),
]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(packages=("titan_lrattnres",)) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports anywhere in its file."""
    modules = {_module_name(p): p for pkg in packages for p in (ROOT / pkg).rglob("*.py")}
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


def unit(module: str) -> str:
    """The sub-package or root module of titan_lrattnres holding ``module``, or its top-level
    package."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "titan_lrattnres" else parts[0]


def unit_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph at unit level (a unit's imports of itself left out)."""
    out: dict[str, set[str]] = {}
    for module, deps in graph.items():
        out.setdefault(unit(module), set()).update(unit(d) for d in deps)
    return {u: deps - {u} for u, deps in out.items()}


def layer_violations(graph: dict[str, set[str]], layers) -> list[str]:
    """Every import of a module by a module in another unit of the same or a lower layer."""
    rank = {u: i for i, layer in enumerate(layers) for u in layer}
    return sorted(
        f"{module} -> {dep}"
        for module, deps in graph.items()
        for dep in deps
        if unit(module) != unit(dep) and rank[unit(dep)] >= rank[unit(module)]
    )


def test_layer_order():
    graph = import_graph(("custom_ops", "titan_lrattnres", "train_configs", "benchmarks"))
    units = unit_graph(graph)
    placed = {u for layer in LAYERS for u in layer}
    assert set(units) <= placed, f"units in no layer (add them to LAYERS): {set(units) - placed}"
    assert layer_violations(graph, LAYERS) == []
    assert find_cycle(units) is None, " -> ".join(find_cycle(units))


def test_layer_check_finds_an_upward_import():
    low, high = "titan_lrattnres.low", "titan_lrattnres.high"
    layers = [(low,), (high,)]
    down = {f"{high}.a": {f"{low}.b"}, f"{low}.b": {f"{low}.c"}, f"{low}.c": set()}
    assert layer_violations(down, layers) == []
    up = {**down, f"{low}.c": {f"{high}.a"}}
    assert layer_violations(up, layers) == [f"{low}.c -> {high}.a"]
    assert layer_violations(
        {f"{low}.b": {"titan_lrattnres.low2.x"}}, [(low, "titan_lrattnres.low2")]
    ) == [  # fmt: skip
        f"{low}.b -> titan_lrattnres.low2.x"  # same layer, another unit
    ]
    assert find_cycle(unit_graph(up)) == [high, low, high]


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


def test_a_submodule_loads_only_what_it_imports():
    code = (
        "import sys, titan_lrattnres.model.flops; "
        "print(sorted(m for m in sys.modules if m.startswith('titan_lrattnres')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["['titan_lrattnres',", "'titan_lrattnres.model',",
                                  "'titan_lrattnres.model.flops']"]  # fmt: skip


# One child process runs every command as ``python -m`` would (``runpy`` under ``__main__``) with
# --help, and prints each one's exit code and whether it printed a usage line.
_RUN_EACH = """
import contextlib, io, json, runpy, sys
report = {}
for command in sys.argv[1:]:
    out = io.StringIO()
    sys.argv = [command, "--help"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_module(f"titan_lrattnres.{command}", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code or 0
    report[command] = [code, "usage" in out.getvalue().lower(), out.getvalue()[-500:]]
print(json.dumps(report))
"""


def test_every_command_runs_under_its_name():
    for command in COMMANDS:
        assert callable(importlib.import_module(f"titan_lrattnres.{command}").main), command
    out = subprocess.run([sys.executable, "-c", _RUN_EACH, *COMMANDS], capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(report) == sorted(COMMANDS)
    for command, (code, usage, text) in report.items():
        assert code == 0 and usage, (command, text)


def test_location_dependent_paths_point_at_the_repository(monkeypatch):
    from titan_lrattnres.components import data

    monkeypatch.delenv(data.CACHE_ENV, raising=False)
    assert data.cache_dir() == PACKAGE.parent / "data_cache"
