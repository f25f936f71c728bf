"""The layering DESIGN.md draws holds in the code: no import cycles between accelrun's modules, and the
layers below train/ do not reach up into it.

Imports are read from the source with ``ast`` (nothing is imported), function-level imports included:
a cycle hidden inside a function is still two modules that cannot be understood one without the other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "accelrun"

# Cycles known today, each with why it is still here. The test fails when one disappears, so that the
# entry goes with it. (None: dist.launch runs the entry point train.entry hands it, train.rank.run_rank.)
KNOWN_CYCLES: set[frozenset[str]] = set()


def _modules(package: Path) -> dict[str, Path]:
    out = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _owner(name: str, modules: dict[str, Path]) -> str | None:
    """The accelrun module ``name`` lives in (``a.b.func`` -> ``a.b``), or None outside accelrun."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package's modules it imports, anywhere in its source."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {_owner(a.name, modules) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: up from this module's package
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import sub` imports the submodule; `from mod import name` the module.
                targets |= {_owner(f"{base}.{a.name}", modules) for a in node.names}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []
    for root in sorted(graph):
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
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(frozenset(component))
    return cycles


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph()


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub.b import g\n")
    (pkg / "sub" / "b.py").write_text("from .. import a\nfrom . import c\ndef g(): ...\n")
    (pkg / "sub" / "c.py").write_text("import os\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a", "pkg.sub.c"}
    assert import_cycles(graph) == [frozenset({"pkg.a", "pkg.sub.b"})]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycles_between_modules(graph):
    cycles = set(import_cycles(graph))
    new = [sorted(c) for c in cycles - KNOWN_CYCLES]
    assert not new, f"import cycles between accelrun modules: {new}"
    gone = [sorted(c) for c in KNOWN_CYCLES - cycles]
    assert not gone, f"these known cycles are gone: remove them from KNOWN_CYCLES: {gone}"


def test_dist_below_train_imports_nothing_from_train(graph):
    # Training applies dist's layouts (dist.layout.apply_layout) and hands dist.launch its rank entry
    # point (train.rank.run_rank); dist never needs train's code.
    bad = {m: sorted(t for t in targets if t.startswith("accelrun.train"))
           for m, targets in graph.items() if m.startswith("accelrun.dist.")}
    assert not {m: t for m, t in bad.items() if t}


def test_compile_knows_nothing_of_training_or_the_cli(graph):
    bad = {m: sorted(t for t in targets if t.startswith(("accelrun.train", "accelrun.cli")))
           for m, targets in graph.items() if m.startswith("accelrun.compile")}
    assert not {m: t for m, t in bad.items() if t}
