"""The import graph of ``src/pagedllm``: no module imports itself through others, and each package
imports only the packages below it (docs/design.md, "Layout").

Every import counts, top-level or inside a function: a lazy import is still a dependency. The
peers' worker scripts (``bench/peer_scripts/``) run under other Pythons and are not modules of
the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pagedllm

ROOT = Path(pagedllm.__file__).parent

# Modules at the top of the package that import nothing above them.
LEAVES = {"build_record", "cache_dir", "errors", "config", "dtypes", "cpu_features", "cpu_extension", "machine",
          "cli_args"}
# What each package may import, besides the leaves: those before it in the dependency order.
BELOW_ENGINE = {"kvcache", "kvstore", "attention", "models"}
ALLOWED = {
    "kvcache": set(),
    "kvstore": {"kvcache"},
    "attention": {"kvcache", "kvstore"},
    "models": {"kvcache", "kvstore", "attention"},
    "engine": BELOW_ENGINE,
    "parallel": BELOW_ENGINE | {"engine"},
    "llm": BELOW_ENGINE | {"engine", "parallel"},
    "server": BELOW_ENGINE | {"engine", "parallel", "llm", "pagedllm"},
    "cluster": BELOW_ENGINE | {"engine", "parallel", "llm", "pagedllm", "server", "workloads", "sim"},
    "workloads": set(),
    "loadgen": {"workloads"},
    "sim": BELOW_ENGINE | {"engine", "llm", "pagedllm", "workloads"},
    "bench": BELOW_ENGINE | {"engine", "llm", "pagedllm", "workloads", "sim"},
}
TOOLS = {"pagedllm", "cli", "__main__", "extensions"}  # the package's front doors: anything below them


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py") if "peer_scripts" not in p.parts}


def imports_of(name: str, path: Path) -> set[str]:
    """The package's modules that ``name`` imports (a ``from pkg import mod`` names the module)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "pagedllm"


def test_the_walk_sees_the_whole_package():
    assert {"pagedllm.engine.engine", "pagedllm.sim.simulator", "pagedllm.loadgen.serve_bench",
            "pagedllm.cli"} <= MODULES.keys()
    assert any(m.startswith("pagedllm.kvcache.") for m in GRAPH["pagedllm.engine.scheduler"])
    assert "pagedllm.workloads.traces" in GRAPH["pagedllm.sim.simulator"]


def test_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others():
    assert cycles(GRAPH) == []


@pytest.mark.parametrize("package", sorted({package_of(m) for m in MODULES} - TOOLS))
def test_each_package_imports_only_packages_below_it(package):
    allowed = LEAVES | ALLOWED.get(package, set())  # a leaf imports other leaves only
    upward = sorted(f"{m} -> {d}" for m, deps in GRAPH.items() if package_of(m) == package
                    for d in deps if package_of(d) not in allowed | {package})
    assert upward == []


def test_the_control_plane_never_imports_torch():
    heavy = sorted(f"{m} imports {d}" for m, path in MODULES.items() if package_of(m) == "kvcache"
                   for node in ast.walk(ast.parse(path.read_text()))
                   for d in ([a.name for a in node.names] if isinstance(node, ast.Import) else
                             [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                   if d.split(".")[0] == "torch")
    assert heavy == []
