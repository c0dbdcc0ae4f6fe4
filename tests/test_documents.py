"""Untrusted JSON and YAML documents are bounded before anything expands them.

Config files (``fckpt run --config``), a manager's configuration (parsed YAML as
it comes) and the state files beside checkpoints go through one loader
(``codec/documents``) with the msgpack decoder's budgets: nesting depth,
containers, expanded size, a YAML alias counted once per use. Deep nesting and a
"billion laughs" get one clear error, in a child process whose peak memory is
measured (no timing).
"""

from __future__ import annotations

import ast
import contextlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from functional_ckpt._src.codec import documents
from functional_ckpt._src.limits import LIMITS
from functional_ckpt.errors import ConfigError
from tests.patience import HANG

PACKAGE = Path(__file__).resolve().parent.parent / "functional_ckpt"
ROOT = PACKAGE.parent

#: Peak memory a refused document may add to the process that reads it.
BOUND_MIB = 64


def laughs(depth: int) -> str:
    """A YAML "billion laughs" under ``metadata``: each level lists the previous one nine
    times by alias (depth 9: about 500 bytes, 9**10 strings expanded)."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, depth + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "root: ckpt\nmetadata:\n" + "".join(f"  {line}\n" for line in lines)


_PRELUDE = """\
import json, resource, sys
import yaml
import functional_ckpt as fc
from functional_ckpt._src.cli.main import main
fc.CheckpointManager  # imported before the baseline: torch is not what is measured
with open("/proc/self/status") as f:
    vm = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
cap = vm + (int(sys.argv[1]) << 20)
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
def status(key):  # this process's own (getrusage's maxrss may be its parent's, from fork)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))
base = status("VmRSS:")
out = {}
try:
"""

_EPILOGUE = """\
except BaseException as e:
    out["raised"] = f"{type(e).__name__}: {e}"
out["grew_mib"] = (status("VmHWM:") - base) / 1024
print(json.dumps(out))
"""


def _child(code: str, limit_mib: int = 1024) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter whose address space may grow by ``limit_mib``
    (so an unbounded expansion ends in ``MemoryError`` there, not in the machine); it
    sets ``out[...]``, returned here with ``grew_mib`` (its peak RSS above its baseline)
    and ``stderr``."""
    body = textwrap.indent(textwrap.dedent(code).strip() + "\n", "    ")
    done = subprocess.run(
        [sys.executable, "-c", _PRELUDE + body + _EPILOGUE, str(limit_mib)],
        capture_output=True,
        text=True,
        timeout=HANG,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    result["stderr"] = done.stderr
    return result


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_fckpt_run_refuses_a_deeply_nested_config_in_one_line(tmp_path: Path, suffix: str) -> None:
    """Regression: 100,000 ``[`` in ``fckpt run --config`` printed a RecursionError
    traceback. Now: exit status 2, one line naming the file, bounded memory."""
    config = tmp_path / f"c{suffix}"
    config.write_text("[" * 100_000)
    result = _child(f"out['status'] = main(['run', '--config', {str(config)!r}, '--', 'true'])")
    assert result["status"] == 2, result
    stderr = str(result["stderr"])
    assert "Traceback" not in stderr
    assert stderr.startswith("fckpt: error: --config") and stderr.count("\n") == 1, stderr
    assert "nested deeper than" in stderr
    assert float(str(result["grew_mib"])) < BOUND_MIB, result


def test_fckpt_run_refuses_a_billion_laughs_config(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(laughs(9))
    result = _child(f"out['status'] = main(['run', '--config', {str(config)!r}, '--', 'true'])")
    assert result["status"] == 2, result
    assert "counts once per use" in str(result["stderr"]), result
    assert float(str(result["grew_mib"])) < BOUND_MIB, result


def test_a_manager_config_never_expands_aliases_unboundedly(tmp_path: Path) -> None:
    """Regression: ``CheckpointManager.from_config`` of a 500-byte parsed YAML copied each
    aliased list once per reference (depth 7: 130 MiB; depth 9: out of memory). Now a
    ``ConfigError`` naming ``metadata``, before anything is opened."""
    text = laughs(9)
    assert len(text) < 600
    root = tmp_path / "root"
    result = _child(
        f"""
        cfg = yaml.safe_load({text!r})
        cfg["root"] = {str(root)!r}
        fc.CheckpointManager.from_config(cfg)
        """
    )
    assert str(result["raised"]).startswith("ConfigError: "), result
    assert "metadata" in str(result["raised"]) and "alias" in str(result["raised"]), result
    assert float(str(result["grew_mib"])) < BOUND_MIB, result
    assert not root.exists()


def test_an_honest_config_with_aliases_loads_as_before() -> None:
    text = "base: &b {lr: 0.1, betas: [0.9, 0.99]}\nrun: {<<: *b, lr: 0.2}\nother: *b\n"
    doc = documents.load(text, "c.yaml", yaml=True)
    assert doc == {
        "base": {"lr": 0.1, "betas": [0.9, 0.99]},
        "run": {"lr": 0.2, "betas": [0.9, 0.99]},
        "other": {"lr": 0.1, "betas": [0.9, 0.99]},
    }
    assert documents.load(b'{"a": [1, "x", null]}', "c.json") == {"a": [1, "x", None]}


def test_the_budgets_are_the_msgpack_decoders() -> None:
    deep: object = 0
    for _ in range(LIMITS.decode_depth):
        deep = [deep]
    documents.check_bounded(deep, "ok")  # exactly the deepest the decoder accepts
    with pytest.raises(ConfigError, match=r"metadata \(at .*\): nested deeper than 512"):
        documents.check_bounded({"x": [deep]}, "metadata")
    shared = [0] * 1000
    wide = [shared] * (LIMITS.state_file_bytes // 1000)  # one list, placed 4,000 times
    with pytest.raises(ConfigError, match="budget"):
        documents.check_bounded(wide, "metadata")
    with pytest.raises(ConfigError, match="not valid JSON"):
        documents.load("{", "f.json")
    with pytest.raises(ConfigError, match="not UTF-8"):
        documents.load(b"\xff", "f.json")


#: Modules that decode JSON or YAML themselves, with why it is not untrusted input.
PARSERS_ALLOWED: dict[tuple[str, str], tuple[int, str]] = {
    ("_src/cli/demo/__init__.py", "json.loads"): (1, "the demo's own event log"),
    ("_src/cli/tiers.py", "json.loads"): (1, "FCKPT_STORAGE_OPTIONS, the user's environment"),
    ("_src/export/files.py", "json.loads"): (1, "a live transformers config's own JSON"),
    ("_src/remote/mover.py", "json.loads"): (5, "lines between a mover and its own child"),
}

_PARSERS = {"json.loads", "json.load", "yaml.load", "yaml.safe_load", "yaml.full_load"}
_PARSERS |= {"yaml.unsafe_load", "yaml.compose", "yaml.load_all", "yaml.safe_load_all"}


def parser_calls(source: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and (name := ast.unparse(node.func)) in _PARSERS:
            found[name] = found.get(name, 0) + 1
    return found


def test_every_document_is_parsed_by_the_one_bounded_loader() -> None:
    """No module parses JSON or YAML around ``codec/documents`` (or says here why)."""
    seen: dict[tuple[str, str], int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "_src/codec/documents.py":
            continue
        for call, n in parser_calls(path.read_text()).items():
            seen[(rel, call)] = n
    assert seen == {k: n for k, (n, _) in PARSERS_ALLOWED.items()}


def test_the_parser_scan_sees_a_load_around_the_loader() -> None:
    src = "import json, yaml\nx = json.loads(b)\ny = yaml.safe_load(t)\nz = json.dumps(x)\n"
    assert parser_calls(src) == {"json.loads": 1, "yaml.safe_load": 1}


# --------------------------------------------------------------------------- fuzzing

_OPEN = {"json": ("[", "]"), "yaml": ("[", "]"), "map": ('{"k": ', "}")}


@st.composite
def _configs(draw: st.DrawFn) -> tuple[str, bool]:
    """Deep, aliased, wide or broken configs, JSON or YAML: a "billion laughs" of random
    fan-out and depth, nesting of random depth (closed or not), or random text."""
    kind = draw(st.sampled_from(["laughs", "deep", "text"]))
    if kind == "laughs":
        fan, depth = draw(st.integers(2, 12)), draw(st.integers(1, 12))
        lines = [f"a0: &a0 [{', '.join(['lol'] * fan)}]"]
        for i in range(1, depth + 1):
            lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * fan) + "]")
        return "root: r\nmetadata:\n" + "".join(f"  {line}\n" for line in lines), True
    if kind == "deep":
        opening, closing = _OPEN[draw(st.sampled_from(sorted(_OPEN)))]
        n = draw(st.integers(1, 200_000))
        closed = draw(st.booleans())
        return opening * n + "1" + (closing * n if closed else ""), draw(st.booleans())
    return draw(st.text(max_size=200)), draw(st.booleans())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_configs())
def test_fuzzed_configs_load_or_are_refused_in_one_error(config: tuple[str, bool]) -> None:
    """Every drawn config is a document within the budgets or a ``ConfigError``; a manager
    given what loaded checks it the same way (nothing else is raised)."""
    from functional_ckpt._src.manager.config import manager_arguments

    text, yaml = config
    try:
        doc = documents.load(text, "c", yaml=yaml)
    except ConfigError:
        return
    documents.check_bounded(doc, "c")
    with contextlib.suppress(ConfigError):
        manager_arguments(doc, root_given=True)
