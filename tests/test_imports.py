"""The package's import graph: every module imports, no cycles, the demo stays at the edge.

Imports are read from the source (``ast``), lazy ones inside functions included: a
cycle hidden in a function body is still two modules that cannot be understood
(or moved) one without the other.
"""

from __future__ import annotations

import ast
import functools
import importlib
import re
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


@functools.cache
def fresh_interpreter() -> list[str]:
    """What one new interpreter has loaded: the CLI's modules once the library's entry
    points are imported, whether the CLI's import loads the demo, and the optional
    clients once every module outside the integrations is imported (in that order)."""
    library = sorted(m for m in MODULES if ".integrations" not in m and not m.endswith("__main__"))
    code = (
        "import sys, functional_ckpt, functional_ckpt.manager, functional_ckpt._src.root.listing\n"
        "print(sorted(m for m in sys.modules if m.startswith('functional_ckpt._src.cli')))\n"
        "import functional_ckpt._src.cli as c\nprint(c.__name__ + '.demo' in sys.modules)\n"
        f"for m in {library!r}: __import__(m)\n"
        f"print(sorted(c for c in {sorted(CLIENTS)!r} if c in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()


def test_the_library_never_loads_the_cli_or_the_demo() -> None:
    library = {m: imports_of(m) for m in MODULES if not m.startswith("functional_ckpt._src.cli")}
    assert {
        m
        for m, deps in library.items()
        if any(d.startswith("functional_ckpt._src.cli") for d in deps)
    } == {"functional_ckpt.__main__"}
    cli, demo, _ = fresh_interpreter()
    assert cli == "[]"
    assert demo == "False"  # only `fckpt demo` loads the demo


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
    assert fresh_interpreter()[2] == "[]"


# ---------------------------------------------------------------------------- layer order

#: The stages of the data flow, lowest first (docs/architecture.md). A module imports
#: modules of its own stage and of the stages before it, never of a later one: the
#: format knows nothing of saving, saving nothing of the manager.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors", ("functional_ckpt.errors",)),
    (
        "base",
        (
            "functional_ckpt._src",
            "functional_ckpt._src.paths",
            "functional_ckpt._src.text",
            "functional_ckpt._src.arguments",
            "functional_ckpt._src.version",
            "functional_ckpt._src.limits",
            "functional_ckpt._src.log",
            "functional_ckpt._src.native",
            "functional_ckpt._src.threads",
        ),
    ),
    ("codec", ("functional_ckpt._src.codec",)),
    ("format", ("functional_ckpt._src.format",)),
    ("storage", ("functional_ckpt._src.storage",)),
    ("state", ("functional_ckpt._src.state",)),
    ("distributed", ("functional_ckpt._src.distributed",)),
    ("policy", ("functional_ckpt._src.policy",)),
    ("save", ("functional_ckpt._src.save",)),
    ("restore", ("functional_ckpt._src.restore",)),
    ("dcp", ("functional_ckpt._src.dcp",)),
    ("root", ("functional_ckpt._src.root",)),
    ("export", ("functional_ckpt._src.export",)),
    ("remote", ("functional_ckpt._src.remote",)),
    ("recording", ("functional_ckpt._src.recording",)),
    ("manager", ("functional_ckpt._src.manager",)),
    ("integrations", ("functional_ckpt.integrations",)),
    (
        "public",
        (
            "functional_ckpt",
            "functional_ckpt.checkpoint",
            "functional_ckpt.codec",
            "functional_ckpt.manager",
            "functional_ckpt.policy",
            "functional_ckpt.recording",
        ),
    ),
    ("cli", ("functional_ckpt._src.cli",)),
    ("entry point", ("functional_ckpt.__main__",)),
]


def layer_of(module: str, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> int:
    """The index of the stage holding ``module`` (the longest matching prefix wins)."""
    best, length = -1, -1
    for i, (_, prefixes) in enumerate(layers):
        for prefix in prefixes:
            exact_only = prefix in ("functional_ckpt", "functional_ckpt._src")
            hit = module == prefix or (not exact_only and module.startswith(prefix + "."))
            if hit and len(prefix) > length:
                best, length = i, len(prefix)
    return best


def upward_imports(
    graph: dict[str, set[str]], layers: list[tuple[str, tuple[str, ...]]] = LAYERS
) -> list[str]:
    """Every import of a later stage, as 'module (stage) -> module (stage)'."""
    out = []
    for module, deps in sorted(graph.items()):
        mine = layer_of(module, layers)
        for dep in sorted(deps):
            theirs = layer_of(dep, layers)
            if theirs > mine:
                out.append(f"{module} ({layers[mine][0]}) -> {dep} ({layers[theirs][0]})")
    return out


def test_every_module_belongs_to_one_stage() -> None:
    assert [m for m in MODULES if layer_of(m) < 0] == []


def test_imports_go_only_down_the_data_flow() -> None:
    graph = {m: imports_of(m) for m in MODULES}
    assert upward_imports(graph) == []


def test_the_layer_check_finds_an_upward_import() -> None:
    graph = {
        "functional_ckpt._src.format.manifest": {"functional_ckpt._src.save.plan"},
        "functional_ckpt._src.save.plan": {"functional_ckpt._src.format.manifest"},
        "functional_ckpt.errors": set(),
    }
    assert upward_imports(graph) == [
        "functional_ckpt._src.format.manifest (format) -> functional_ckpt._src.save.plan (save)"
    ]
    assert layer_of("functional_ckpt._src.cli.demo.job") == layer_of("functional_ckpt._src.cli")
    assert layer_of("functional_ckpt._src") != layer_of("functional_ckpt._src.save")


# ---------------------------------------------------------------------------- names

#: Names several modules define on purpose, with the same meaning in each.
SHARED_NAMES = {"main"}  # each runnable module's entry function


def top_level_names(path: Path) -> set[str]:
    """Public names a module defines itself (functions, classes, assignments)."""
    names: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return {n for n in names if not n.startswith("_") and n != "T"}


def test_each_implementation_name_has_one_meaning() -> None:
    """No two modules of the implementation define the same public name."""
    where: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        if module.startswith("functional_ckpt._src"):
            for name in top_level_names(path):
                where.setdefault(name, []).append(module)
    twice = {n: ms for n, ms in where.items() if len(ms) > 1 and n not in SHARED_NAMES}
    assert twice == {}


def test_no_module_is_named_after_a_standard_library_module() -> None:
    clash = [m for m in MODULES if m.rpartition(".")[2] in sys.stdlib_module_names]
    assert clash == []


# ---------------------------------------------------------------------------- module state

#: Module-level state the package keeps: the registry the user fills on purpose, and this
#: process's saves. Anything else a function changes at module level is behaviour at a
#: distance: a cache of a pure function is an lru_cache on it, other state lives on the
#: object that owns it (a manager's trust memory).
KNOWN_STATE = {
    "functional_ckpt._src.codec.tagged": {"TAGGED", "_BY_TAG"},  # fc.codec.register
    # this process's saves: those exit must finish, what fc.save committed (its trust) and
    # each checkpoint group's last plans
    "functional_ckpt._src.save.staging": {"_RUNNING", "_UNREAD", "PROCESS_TRUST", "_PLANS"},
}

_MUTATORS = {
    "add", "append", "clear", "discard", "extend", "insert", "move_to_end", "pop",
    "popitem", "remove", "setdefault", "update",
}  # fmt: skip


def _frozen(cls: ast.ClassDef) -> bool:
    """A ``@dataclass(frozen=True)``: its instances are values, not state."""
    return any(
        isinstance(d, ast.Call) and any(k.arg == "frozen" for k in d.keywords)
        for d in cls.decorator_list
    )


def module_state(path: Path) -> set[str]:
    """Module-level names a function of the module rebinds or mutates, and module-level
    instances of the package's own classes."""
    tree = ast.parse(path.read_text(), str(path))
    top: set[str] = set()
    classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and not _frozen(n)}
    package_modules = {  # modules of the package imported by name: their classes count too
        a.asname or a.name
        for n in tree.body
        if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("functional_ckpt")
        for a in n.names
        if a.name[:1].islower()
    }
    found: set[str] = set()
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets, value = list(node.targets), node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        names = {t.id for t in targets if isinstance(t, ast.Name)}
        top |= names
        if names and isinstance(value, ast.Call):
            f = value.func
            if (isinstance(f, ast.Name) and f.id in classes) or (
                isinstance(f, ast.Attribute)
                and isinstance(f.value, ast.Name)
                and f.value.id in package_modules
                and f.attr[:1].isupper()
            ):
                found |= names
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for n in ast.walk(fn):
            if isinstance(n, ast.Global):
                found |= set(n.names)
            elif isinstance(n, ast.Assign | ast.AugAssign | ast.Delete):
                targets = list(n.targets) if isinstance(n, ast.Assign | ast.Delete) else [n.target]
                for t in targets:
                    if (
                        isinstance(t, ast.Subscript)
                        and isinstance(t.value, ast.Name)
                        and t.value.id in top
                    ):
                        found.add(t.value.id)
            elif (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr in _MUTATORS
                and isinstance(n.func.value, ast.Name)
                and n.func.value.id in top
            ):
                found.add(n.func.value.id)
    return found


def test_no_module_level_state_beyond_the_documented_caches() -> None:
    state = {m: module_state(p) for m, p in MODULES.items()}
    assert {m: s for m, s in state.items() if s} == KNOWN_STATE


def test_the_state_check_sees_a_global_flag(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text(
        "_SEEN = set()\nFLAG = False\nclass Memo: ...\nMEMO = Memo()\nTABLE = {'a': 1}\n"
        "@dataclass(frozen=True)\nclass Box: ...\nBOX = Box()\n"
        "def f(x):\n    global FLAG\n    FLAG = True\n    _SEEN.add(x)\n    return TABLE['a']\n"
        "from functional_ckpt._src.save import exchange\nCACHES = exchange.PlanCache()\n"
        "import msgpack\nPACKER = msgpack.Packer()\n"
    )
    assert module_state(src) == {"CACHES", "FLAG", "MEMO", "_SEEN"}


def test_the_architecture_page_has_a_line_for_every_module() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = []
    for module, path in MODULES.items():
        parts = module.split(".")
        if parts[:2] != ["functional_ckpt", "_src"] or path.name == "__init__.py":
            continue
        if parts[2] in ("cli",):  # one line for the command, one for its demo
            continue
        where = "/".join(parts[2:]) if len(parts) > 3 else f"_src/{parts[2]}"
        if f"`{where}`" not in page:
            missing.append(where)
    assert missing == []


def _imported_from(prefix: str) -> set[str]:
    """The modules outside ``prefix`` that the modules under it import."""
    return {
        dep
        for module in MODULES
        if module.startswith(prefix)
        for dep in imports_of(module)
        if not dep.startswith(prefix)
    }


def test_the_architecture_page_says_what_the_command_line_and_the_policies_import() -> None:
    """The page's layer claims that a test can check, checked against the source."""
    page = " ".join((ROOT / "docs" / "architecture.md").read_text().split())
    claim = re.search(r"It imports from the stages (.*?); the policies import from (.*?)\.", page)
    assert claim, "docs/architecture.md: the sentence naming what the command line imports"
    stages, public = claim[1].split("of the public modules only")
    cli = _imported_from("functional_ckpt._src.cli")
    assert set(re.findall(r"`([\w.]+)`", stages)) == {LAYERS[layer_of(d)][0] for d in cli} - {
        "public"
    }
    assert set(re.findall(r"`([\w.]+)`", public)) == {
        d for d in cli if not d.startswith("functional_ckpt._src")
    }
    assert {LAYERS[layer_of(d)][0] for d in _imported_from("functional_ckpt._src.policy")} == set(
        re.findall(r"`([\w.]+)`", claim[2])
    )


# ---------------------------------------------------------------------------- structure

#: Modules over 500 lines, each being split by concept. The list only shrinks: a module
#: that is back under the limit must leave it.
LONG_MODULES: set[str] = set()


def test_at_most_six_modules_at_the_top_level() -> None:
    """The public namespaces, one concept each (docs/architecture.md)."""
    top = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__"))
    assert len(top) <= 6, top


def test_no_module_is_over_500_lines() -> None:
    long = {m for m, p in MODULES.items() if len(p.read_text().splitlines()) > 500}
    assert long - LONG_MODULES == set()  # a new long module: split it by concept
    assert LONG_MODULES - long == set()  # now short: take it off the list


def test_the_manager_takes_at_most_eleven_parameters() -> None:
    """One option value per concern: a new concern joins an option value (``tiers=``)."""
    import inspect

    import functional_ckpt as fc

    params = list(inspect.signature(fc.CheckpointManager.__init__).parameters)[1:]
    assert len(params) <= 11, params
