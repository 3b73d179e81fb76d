"""The layer rules of docs/architecture.md, read from the code's import statements (module level
and inside functions alike): no import cycle between top-level packages; the router and the
protocol layer never import torch or the engine; the worker roles never import each other.
Pure static analysis (ast), no import is executed."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = sorted(d.name for d in REPO.iterdir() if (d / "__init__.py").exists() and d.name != "tests")

# package -> the project packages it may never import (directly or lazily)
FORBIDDEN = {
    "proto": set(PACKAGES) - {"proto"},
    "router": set(PACKAGES) - {"router", "proto"},
    "worker": {"prefill_worker", "decode_worker", "router", "deploy", "bench"},
    "prefill_worker": {"decode_worker", "router", "deploy", "bench"},
    "decode_worker": {"prefill_worker", "router", "deploy", "bench"},
    "engine": {"worker", "prefill_worker", "decode_worker", "router", "deploy", "bench", "kv_transfer"},
    "planner": set(PACKAGES) - {"planner"},   # pure decision logic: actuation lives in deploy/
    "kernels": {"engine", "worker", "prefill_worker", "decode_worker", "router", "deploy", "bench"},
}
NO_TORCH = ("proto", "router", "planner")  # nor anything that imports torch (transformers, nixl)
TORCH_LIKE = {"torch", "transformers", "nixl", "triton"}


def _imports(package: str) -> list[tuple[str, str]]:
    """(file, imported top-level module) for every absolute import in the package."""
    found = []
    for path in (REPO / package).rglob("*.py"):
        rel = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.Import):
                found += [(rel, a.name.split(".")[0]) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.append((rel, node.module.split(".")[0]))
    return found


def _graph() -> dict[str, dict[str, str]]:
    """package -> {imported package: first file that imports it}."""
    graph: dict[str, dict[str, str]] = {p: {} for p in PACKAGES}
    for p in PACKAGES:
        for rel, mod in _imports(p):
            if mod in graph and mod != p:
                graph[p].setdefault(mod, rel)
    return graph


def _find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None (depth-first search with colours)."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for p in sorted(graph):
        if p not in state and (cycle := visit(p)):
            return cycle
    return None


def test_the_package_scan_sees_the_real_packages():
    graph = _graph()
    assert {"engine", "router", "proto", "worker", "prefill_worker", "decode_worker", "deploy"} <= set(PACKAGES)
    assert "worker" in graph["prefill_worker"] and "proto" in graph["router"]  # the scan finds imports


def test_no_import_cycle_between_top_level_packages():
    graph = _graph()
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(
        f"{a} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"


def test_the_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b": "a.py"}, "b": {"c": "b.py"}, "c": {"a": "c.py"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b": ""}, "b": {}, "c": {"a": ""}}) is None


def test_layer_rules():
    graph = _graph()
    broken = [f"{p} imports {q} ({graph[p][q]})" for p, banned in FORBIDDEN.items() if p in graph
              for q in sorted(banned & set(graph[p]))]
    assert not broken, broken


def test_router_and_protocol_layer_never_import_torch():
    broken = [f"{rel} imports {mod}" for p in NO_TORCH for rel, mod in _imports(p) if mod in TORCH_LIKE]
    assert not broken, broken


def test_every_package_is_installed_by_pyproject():
    """A package missing from [tool.setuptools.packages.find] imports in the repo's tests but not in
    an installed `pdserve` (the serve subprocess failed on `planner` that way)."""
    import fnmatch
    import tomllib

    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    missing = [p for p in PACKAGES if not any(fnmatch.fnmatch(p, pat) for pat in include)]
    assert not missing, f"add {missing} to [tool.setuptools.packages.find] include in pyproject.toml"


def test_every_data_file_the_runtime_reads_is_package_data():
    """A data file next to the code (a kernel source, the calibration text) that is not in
    [tool.setuptools.package-data] exists in the repo's tests but not in a built wheel: int8 and
    FP8 KV calibration read engine/quantization/calibration.txt at load."""
    import fnmatch
    import tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    # deploy/ holds deployment artifacts (Grafana, KubeRay), bench/*.sh scripts, proto/ its sources
    runtime_dirs = ("engine", "kernels", "kv_transfer", "worker", "router", "evals", "planner")
    files = [p.relative_to(REPO) for d in runtime_dirs for p in (REPO / d).rglob("*")
             if p.is_file() and p.suffix not in (".py", ".pyc") and "__pycache__" not in p.parts]
    assert files, "expected data files (kernels/csrc)"

    def packaged(rel) -> bool:
        for pkg, patterns in data.items():
            base = pkg.replace(".", "/") + "/"
            if str(rel).startswith(base) and any(fnmatch.fnmatch(str(rel)[len(base):], pat) for pat in patterns):
                return True
        return False

    missing = [str(f) for f in files if not packaged(f)]
    assert not missing, f"add {missing} to [tool.setuptools.package-data] in pyproject.toml"
