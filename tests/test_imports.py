"""The package's import graph: every module imports, no cycles, the demo stays at the edge.

Imports are read from the source (``ast``), lazy ones inside functions included: a
cycle hidden in a function body is still two modules that cannot be understood
(or moved) one without the other.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "functional_ckpt"
ROOT = PACKAGE.parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The package module ``name`` refers to (a module, or the package that holds a name)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(module: str) -> set[str]:
    """Package modules that ``module`` imports, anywhere in its source."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor if is_package else anchor[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                found.add(target)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_graph_has_no_cycles() -> None:
    graph = {m: imports_of(m) for m in MODULES}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.endswith("__main__")))
def test_every_module_imports(module: str) -> None:
    importlib.import_module(module)


def test_the_library_never_loads_the_cli_or_the_demo() -> None:
    library = {m: imports_of(m) for m in MODULES if not m.startswith("functional_ckpt._src.cli")}
    assert {
        m
        for m, deps in library.items()
        if any(d.startswith("functional_ckpt._src.cli") for d in deps)
    } == {"functional_ckpt.__main__"}
    code = (
        "import sys, functional_ckpt, functional_ckpt.manager, functional_ckpt._src.root.listing\n"
        "print(sorted(m for m in sys.modules if m.startswith('functional_ckpt._src.cli')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    code = "import sys, functional_ckpt._src.cli as c\nprint(c.__name__ + '.demo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"  # only `fckpt demo` loads the demo


#: The optional clients, and the one module allowed to import each.
CLIENTS = {
    "lightning": "functional_ckpt.integrations.lightning",
    "pytorch_lightning": "functional_ckpt.integrations.lightning",
    "transformers": "functional_ckpt.integrations.hf",
    "accelerate": "functional_ckpt.integrations.accelerate",
    "torchdata": "functional_ckpt.integrations.torchdata",
}


def clients_of(module: str) -> set[str]:
    """The optional clients ``module`` imports, anywhere in its source."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found & set(CLIENTS)


def test_each_client_is_imported_by_its_integration_only() -> None:
    assert "functional_ckpt.integrations.lightning" in MODULES
    importers = {m: clients_of(m) for m in MODULES}
    assert {m: c for m, c in importers.items() if c} == {
        "functional_ckpt.integrations.lightning": {"lightning"},
        "functional_ckpt.integrations.hf": {"transformers"},
    }
    for module, clients in importers.items():
        assert all(CLIENTS[c] == module for c in clients), (module, clients)
    library = sorted(m for m in MODULES if ".integrations" not in m and not m.endswith("__main__"))
    code = (
        f"import sys\nfor m in {library!r}: __import__(m)\n"
        f"print(sorted(c for c in {sorted(CLIENTS)!r} if c in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
