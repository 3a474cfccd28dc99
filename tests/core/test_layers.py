"""The package's layers point one way (protocol -> transport -> algorithms -> backend, set-up apart, tools
beside them) and its module-level imports have no cycle. Read from the source, nothing imported."""
from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "torch_thunderbolt"

# What each lower layer must never import (it would point upwards).
FORBIDDEN = {
    "protocol": {"transport", "rendezvous", "algorithms", "backend", "bench", "cli", "testing"},
    "transport": {"rendezvous", "algorithms", "backend", "bench", "cli", "testing", "compression"},
    "algorithms": {"backend", "bench", "cli", "testing", "rendezvous"},
    "rendezvous": {"algorithms", "backend", "bench", "cli", "testing", "compression"},
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _top_level_imports(path: Path) -> set[str]:
    """Package modules imported at module level (not inside functions, not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    pkg = _module_name(path).split(".")
    if path.name != "__init__.py":
        pkg = pkg[:-1]
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ([node] if not isinstance(node, (ast.If, ast.Try)) else ast.walk(node)):
            if isinstance(sub, ast.ImportFrom):
                if sub.level:
                    base = pkg[: len(pkg) - sub.level + 1]
                    mod = ".".join(base + ([sub.module] if sub.module else []))
                else:
                    mod = sub.module or ""
                if mod.startswith("torch_thunderbolt"):
                    found.add(mod)
                    found.update(f"{mod}.{a.name}" for a in sub.names)
            elif isinstance(sub, ast.Import):
                found.update(a.name for a in sub.names if a.name.startswith("torch_thunderbolt"))
    return found


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in PKG.rglob("*.py")}
    return {name: {m for m in _top_level_imports(path) if m in modules and m != name}
            for name, path in modules.items()}


def test_lower_layers_never_import_upper_ones() -> None:
    graph = _graph()
    # The reader sees the imports it must (else this test could pass on an empty graph).
    assert "torch_thunderbolt.transport.engine" in graph["torch_thunderbolt.algorithms.collectives"]
    assert "torch_thunderbolt.transport.engine" in graph["torch_thunderbolt.transport.tcp"]
    bad = []
    for name, deps in graph.items():
        layer = name.split(".")[1] if "." in name else ""
        for dep in deps:
            target = dep.split(".")[1] if dep.count(".") else ""
            if target in FORBIDDEN.get(layer, set()):
                bad.append(f"{name} imports {dep}")
    assert not bad, "\n".join(sorted(bad))


def test_module_level_imports_have_no_cycle() -> None:
    graph = _graph()
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in graph.get(node, ()):
            if state.get(dep) == 1:
                cycles.append(path[path.index(dep):] + [dep] if dep in path else [node, dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    # A package's __init__ importing its own submodules is not a cycle of its layers.
    real = [c for c in cycles if not all(m == c[0] or m.startswith(c[0] + ".") or c[0].startswith(m + ".")
                                         for m in c)]
    assert not real, real


def _every_import(path: Path) -> set[str]:
    """Package modules `path` imports anywhere: module level, in functions, under TYPE_CHECKING, or by a
    literal name through importlib.import_module / __import__."""
    tree = ast.parse(path.read_text())
    pkg = _module_name(path).split(".")
    if path.name != "__init__.py":
        pkg = pkg[:-1]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            found.add(mod)
            found.update(f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")):
            found.add(str(node.args[0].value))
    return {m for m in found if m.startswith("torch_thunderbolt")}


def test_no_module_outside_testing_imports_it_even_inside_a_function() -> None:
    """testing/ holds the test doubles (the fake verbs fabric among them): the runtime and the tools reach
    the fake only through the provider name config.py maps (VERBS_PROVIDERS), never through an import. The
    one exception is `bench --workload`, whose point is to run the models on testing's emulated Mac GPU."""
    testing = "torch_thunderbolt.testing"
    allowed = ("torch_thunderbolt.bench.workloads", "torch_thunderbolt.bench.config")
    seen = {_module_name(p): _every_import(p) for p in PKG.rglob("*.py")}
    # The reader sees imports inside functions (else this test could pass on an empty reading).
    assert "torch_thunderbolt.transport.providers" in seen["torch_thunderbolt.rendezvous.rdma"]
    assert "torch_thunderbolt.testing.fake_verbs.fabric" in seen["torch_thunderbolt.testing.fake_verbs"]
    bad = [f"{name} imports {dep}" for name, deps in seen.items()
           if not (name == testing or name.startswith(testing + ".") or name.startswith(allowed))
           for dep in deps if dep == testing or dep.startswith(testing + ".")]
    assert not bad, "\n".join(sorted(bad))
    bench = [dep for name, deps in seen.items() if name.startswith(allowed) for dep in deps
             if dep.startswith(testing + ".") and "fake_verbs" in dep]
    assert not bench, bench  # even the bench reaches the fake fabric only by its provider name
