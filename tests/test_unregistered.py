"""Checkpoints holding registered classes, read by processes that never registered them.

Real checkpoints are saved by a training script that registers a dataclass, an
Enum and a NamedTuple (defined in the script itself and in an importable module);
the command line and a fresh Python process then read them without that code:
verify, ls, inspect, diff and export work and show the values by tag and fields,
``fc.restore`` says which class to register, and a damaged tagged value is still
damage. The classes' names follow the registration rule (a script's classes are
named after its module; old ``__main__`` names still read).
"""

from __future__ import annotations

import copy
import enum
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import msgpack
import pytest

import functional_ckpt as fc
from functional_ckpt._src import cli, codec
from functional_ckpt._src.codec import table
from functional_ckpt._src.format import naming
from functional_ckpt._src.format.naming import step_name
from functional_ckpt._src.limits import LIMITS
from tests import forge, prefork

CFGMOD = '''
"""Config classes in an importable module, registered at import."""
import dataclasses
import enum
from typing import NamedTuple

import functional_ckpt as fc


@fc.codec.register
@dataclasses.dataclass(frozen=True)
class OptimCfg:
    lr: float
    betas: tuple[float, float]


@fc.codec.register
class Mode(enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


@fc.codec.register
class Span(NamedTuple):
    start: int
    stop: int
'''

TRAIN = '''
"""A training script whose config classes live in the script (``__main__``)."""
import dataclasses
import enum
import sys
from typing import NamedTuple

import torch

import functional_ckpt as fc

# "legacy": register as the code before the naming rule did, under __main__.X
LEGACY = __name__ == "__main__" and sys.argv[2:3] == ["legacy"]


@dataclasses.dataclass(frozen=True)
class OptimCfg:
    lr: float
    betas: tuple[float, float]


class Mode(enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


class Span(NamedTuple):
    start: int
    stop: int


for cls in (OptimCfg, Mode, Span):
    fc.codec.register(cls, name=f"__main__.{cls.__qualname__}" if LEGACY else None)


def state(module, mode, stop):
    hp = {
        "optim": module.OptimCfg(0.01, (0.9, 0.999)),
        "mode": mode,
        "span": module.Span(0, stop),
        "by_mode": {mode: module.Span(1, 2)},
    }
    return {"model": {"weight": torch.arange(6.0).reshape(2, 3)}, "hyper_parameters": hp}


if __name__ == "__main__":
    import cfgmod

    out = sys.argv[1]
    if sys.argv[2] == "save":
        main = sys.modules[__name__]
        fc.save(f"{out}/step_000000001", state(main, Mode.TRAIN, 10))
        fc.save(f"{out}/step_000000002", state(cfgmod, cfgmod.Mode.EVAL, 20))
    elif sys.argv[2] == "legacy":
        fc.save(out, state(sys.modules[__name__], Mode.TRAIN, 10))
    else:  # resume: the same script restores what it saved
        hp = fc.codec.to_python(fc.restore(out))["hyper_parameters"]
        assert hp["optim"] == OptimCfg(0.01, (0.9, 0.999)) and hp["mode"] is Mode.TRAIN
        assert hp["by_mode"] == {Mode.TRAIN: Span(1, 2)}
        print("resumed", type(hp["optim"]).__module__)
'''

EVAL = '''
"""An evaluation script that imports the training script's classes from its module."""
import sys

import functional_ckpt as fc
from train import Mode, OptimCfg, Span

if sys.argv[2] == "legacy":  # checkpoints that recorded the classes as __main__.X
    for cls in (OptimCfg, Mode, Span):
        fc.codec.register(cls, aliases=[f"__main__.{cls.__qualname__}"])
hp = fc.codec.to_python(fc.restore(sys.argv[1]))["hyper_parameters"]
assert type(hp["optim"]) is OptimCfg and hp["optim"] == OptimCfg(0.01, (0.9, 0.999))
assert hp["mode"] is Mode.TRAIN and hp["span"] == Span(0, 10)
print("evaluated", OptimCfg.__module__)
'''

READ = '''
"""A fresh process that never registered the classes: look, then try to restore."""
import json
import sys

import torch

import functional_ckpt as fc

path = sys.argv[1]
summary = fc.inspect(path)
optim = summary.tree["hyper_parameters"]["optim"]
out = {
    "type": type(optim).__name__,
    "tag": optim.tag,
    "fields": repr(optim.fields),
    "repr": repr(optim),
    "mode": repr(summary.tree["hyper_parameters"]["mode"]),
    "by_mode": repr(summary.tree["hyper_parameters"]["by_mode"]),
    "unregistered": list(summary.unregistered),
    "str": str(summary),
    "verify": fc.verify(path).ok,
}
try:
    fc.restore(path)
except fc.errors.UnregisteredType as e:
    out["restore"] = str(e)
    out["damage"] = fc.errors.is_damage(e)
like = {"model": {"weight": torch.empty(2, 3)}}
out["weights"] = fc.restore(path, like, partial=True)["model"]["weight"].tolist()
print(json.dumps(out))
'''


def _env() -> dict[str, str]:
    return {**os.environ, "NO_COLOR": "1"}


def python(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return prefork.run([sys.executable, *argv], capture_output=True, text=True, cwd=cwd, env=_env())


def fckpt(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The command line in a process (and a directory) that knows none of the classes."""
    return python("-m", "functional_ckpt", *argv, cwd=cwd)


def ok(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Scripts in ``code/``; checkpoints saved by ``train.py`` in ``run/`` and ``legacy``."""
    base = tmp_path_factory.mktemp("unregistered")
    code = base / "code"
    code.mkdir()
    for name, text in {"cfgmod": CFGMOD, "train": TRAIN, "eval": EVAL, "read": READ}.items():
        (code / f"{name}.py").write_text(textwrap.dedent(text))
    ok(python("train.py", str(base / "run"), "save", cwd=code))
    ok(python("train.py", str(base / "legacy"), "legacy", cwd=code))
    (base / "elsewhere").mkdir()
    return base


def test_a_script_class_is_named_after_the_script_and_an_imported_one_after_its_module(
    work: Path,
) -> None:
    one = fc.inspect(work / "run" / step_name(1)).tree["hyper_parameters"]
    two = fc.inspect(work / "run" / step_name(2)).tree["hyper_parameters"]
    assert one["optim"].tag == "train.OptimCfg" and one["mode"].tag == "train.Mode"
    assert two["optim"].tag == "cfgmod.OptimCfg" and two["span"].tag == "cfgmod.Span"
    # The legacy name in a process where no class claims it (this one may have run an
    # example registering an alias of it: the registry is the process's).
    code = (
        "import sys, functional_ckpt as fc\n"
        "tree = fc.inspect(sys.argv[1]).tree['hyper_parameters']\n"
        "print(tree['optim'].tag)\n"
    )
    out = ok(python("-c", code, str(work / "legacy"), cwd=work / "elsewhere"))
    assert out.split() == ["__main__.OptimCfg"]


def test_verify_needs_no_class(work: Path) -> None:
    proc = fckpt("verify", str(work / "run"), cwd=work / "elsewhere")
    assert "2 checkpoints intact" in ok(proc) and "DAMAGED" not in proc.stdout
    ok(fckpt("verify", str(work / "legacy"), cwd=work / "elsewhere"))


def test_ls_shows_no_damage(work: Path) -> None:
    out = ok(fckpt("ls", str(work / "run"), cwd=work / "elsewhere"))
    assert step_name(1) in out and step_name(2) in out
    assert "damaged" not in out.lower() and "2 committed checkpoints" in out


def test_inspect_shows_each_value_by_tag_and_fields(work: Path) -> None:
    out = ok(fckpt("inspect", str(work / "run" / step_name(1)), cwd=work / "elsewhere"))
    assert "train.OptimCfg(lr=0.01, betas=(0.9, 0.999))" in out
    assert "train.Mode.TRAIN" in out and "train.Span(0, 10)" in out
    assert "{train.Mode.TRAIN: train.Span(1, 2)}" in out
    assert "fc.restore of these values needs each class registered" in out
    assert "functional_ckpt.codec.register(OptimCfg, name='train.OptimCfg')" in out
    doc = json.loads(
        ok(fckpt("inspect", "--json", str(work / "run" / step_name(1)), cwd=work / "elsewhere"))
    )
    assert doc["unregistered"] == ["train.Mode", "train.OptimCfg", "train.Span"]


def test_diff_compares_values_without_their_classes(work: Path) -> None:
    a, b = str(work / "run" / step_name(1)), str(work / "run" / step_name(2))
    out = ok(fckpt("diff", a, b, cwd=work / "elsewhere"))
    assert "hyper_parameters/optim" in out
    assert "train.OptimCfg(lr=0.01, betas=(0.9, 0.999)) -> cfgmod.OptimCfg(lr=0.01" in out
    assert "train.Mode.TRAIN -> cfgmod.Mode.EVAL" in out
    same = ok(fckpt("diff", a, a, cwd=work / "elsewhere"))
    assert "the checkpoints hold identical states" in same


def test_export_of_the_weights_needs_no_class(work: Path) -> None:
    src = str(work / "run" / step_name(1))
    out = work / "elsewhere"
    ok(fckpt("export", src, str(out / "st"), cwd=out))
    assert (out / "st" / "model.safetensors").is_file()
    ok(fckpt("export", src, str(out / "model.pt"), "--format", "torch", cwd=out))
    assert (out / "model.pt").is_file()
    full = fckpt("export", src, str(out / "full.pt"), "--format", "torch", "--full", cwd=out)
    assert full.returncode != 0 and not (out / "full.pt").exists()
    assert "unknown tagged type 'train." in full.stderr
    assert "functional_ckpt.codec.register(" in full.stderr


def test_a_fresh_process_inspects_with_placeholders_and_restore_says_what_to_register(
    work: Path,
) -> None:
    got = json.loads(
        ok(python(str(work / "code" / "read.py"), str(work / "run" / step_name(1)), cwd=work))
    )
    assert got["type"] == "Unregistered" and got["tag"] == "train.OptimCfg"
    assert got["fields"] == "{'lr': 0.01, 'betas': (0.9, 0.999)}"
    assert got["repr"] == "train.OptimCfg(lr=0.01, betas=(0.9, 0.999))"
    assert got["mode"] == "train.Mode.TRAIN"
    assert got["by_mode"] == "{train.Mode.TRAIN: train.Span(1, 2)}"
    assert got["unregistered"] == ["train.Mode", "train.OptimCfg", "train.Span"]
    assert "optim: train.OptimCfg(lr=0.01, betas=(0.9, 0.999))" in got["str"]
    assert got["verify"] is True
    msg = got["restore"]
    assert "('hyper_parameters', 'optim') holds train.OptimCfg(lr=0.01" in msg
    assert "unknown tagged type 'train." in msg and "functional_ckpt.codec.register(" in msg
    assert got["damage"] is False
    assert got["weights"] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_the_script_and_an_evaluation_script_restore_the_classes(work: Path) -> None:
    code = work / "code"
    first = str(work / "run" / step_name(1))
    assert "evaluated train" in ok(python("eval.py", first, "new", cwd=code))
    # the old name __main__.X: the same script reads it as it is, an importer by alias
    assert "resumed __main__" in ok(python("train.py", str(work / "legacy"), "resume", cwd=code))
    assert "evaluated train" in ok(python("eval.py", str(work / "legacy"), "legacy", cwd=code))
    refused = python("eval.py", str(work / "legacy"), "new", cwd=code)
    assert refused.returncode != 0
    assert "aliases=['__main__.OptimCfg']" in refused.stderr


def _forge_value(ck: Path, fields_raw: bytes, tag: bytes) -> None:
    """Put a tagged value with ``tag`` and raw msgpack ``fields_raw`` where "FORGE" was."""
    raw = (ck / naming.MANIFEST).read_bytes()
    sentinel = msgpack.packb("FORGE")
    assert raw.count(sentinel) == 1
    marker = msgpack.packb(msgpack.ExtType(table.EXT_TAGGED, tag))
    raw = raw.replace(sentinel, b"\x92" + marker + fields_raw)
    (ck / naming.MANIFEST).write_bytes(raw)
    os.unlink(ck / naming.COMMIT_MARKER)
    forge.sign(ck, raw)


@pytest.mark.parametrize(
    ("tag", "fields", "problem"),
    [
        (b"gone.Cfg", msgpack.packb(1.5), "fields of type float"),
        (b"gone.Cfg", msgpack.packb({1: 2}), "key that is not a str"),
        (b"gone.Cfg", msgpack.packb(None), "fields of type NoneType"),
        (b"gone\x07Cfg", msgpack.packb({"a": 1}), "unprintable"),
        (b"g" * 300, msgpack.packb({"a": 1}), "a tag of 300 characters"),
        (b"\xff", msgpack.packb({"a": 1}), "invalid tag"),
    ],
    ids=["float-fields", "int-keys", "none-fields", "control-char-tag", "long-tag", "bad-utf8"],
)
def test_a_damaged_tagged_value_is_still_damage(
    tmp_path: Path, tag: bytes, fields: bytes, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = tmp_path / "ck"
    fc.save(ck, {"hp": {"v": "FORGE"}, "step": 1})
    _forge_value(ck, fields, tag)
    assert cli.main(["verify", str(ck)]) == 1
    out = capsys.readouterr().out
    assert "DAMAGED" in out and problem in out
    with pytest.raises(fc.errors.CorruptCheckpoint, match=problem):
        fc.inspect(ck)
    assert not fc.verify(ck).ok


def test_a_well_formed_unknown_tag_is_no_damage(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    fc.save(ck, {"hp": {"v": "FORGE"}, "step": 1})
    _forge_value(ck, msgpack.packb({"lr": 0.5, "name": "x"}), b"gone.Cfg")
    assert fc.verify(ck).ok
    shown = fc.inspect(ck).tree["hp"]["v"]
    assert shown == codec.Unregistered("gone.Cfg", {"lr": 0.5, "name": "x"})
    assert repr(shown) == "gone.Cfg(lr=0.5, name='x')"
    with pytest.raises(fc.errors.UnregisteredType, match=r"\('hp', 'v'\) holds gone\.Cfg"):
        fc.restore(ck)
    assert fc.codec.to_python(fc.restore(ck, {"step": 0}, partial=True)) == {"step": 1}


# --------------------------------------------------------------------------- the codec


def _tagged(tag: bytes, fields: object) -> list[object]:
    return [msgpack.ExtType(table.EXT_TAGGED, tag), fields]


def _raw(obj: object) -> bytes:
    return msgpack.packb(obj, use_bin_type=True, strict_types=False)


def test_decode_keeps_unknown_tags_only_when_asked() -> None:
    data = _raw({"a": _tagged(b"x.Cfg", {"lr": 0.5}), "b": [_tagged(b"x.Mode", "ON")]})
    with pytest.raises(fc.errors.UnsafeCheckpoint, match=r"unknown tagged type 'x\.Cfg'"):
        codec.decode(data)
    tags: set[str] = set()
    got = codec.decode(data, unregistered=tags)
    assert got == {
        "a": codec.Unregistered("x.Cfg", {"lr": 0.5}),
        "b": [codec.Unregistered("x.Mode", "ON")],
    }
    assert tags == {"x.Cfg", "x.Mode"}
    assert codec.find_unregistered(got) == codec.Unregistered("x.Cfg", {"lr": 0.5})
    assert codec.find_unregistered({"a": (1, [2.0])}) is None


def test_placeholders_keep_the_decoders_bounds() -> None:
    deep: object = 1
    for _ in range(LIMITS.decode_depth + 5):
        deep = [deep]
    with pytest.raises(fc.errors.UnsafeCheckpoint, match="nesting deeper"):
        codec.decode(_raw(_tagged(b"x.Deep", deep)), unregistered=set())
    # placeholders as map keys hash by identity: fields of equal hashes cannot flood
    zero = [i * (2**61 - 1) for i in range(8)]  # ints whose hash is 0
    keys = [_tagged(b"x.K", [a, b]) for a in zero for b in zero]  # 64 equal field hashes
    flood = b"\xde" + len(keys).to_bytes(2, "big") + b"".join(_raw(k) + b"\x01" for k in keys)
    assert len(codec.decode(flood, unregistered=set())) == 64  # type: ignore[arg-type]
    plain = [[a, b] for a in zero for b in zero]  # beside them, tuples still may not
    data = _raw(
        [
            msgpack.ExtType(table.EXT_SET, b""),
            *([msgpack.ExtType(table.EXT_TUPLE, b""), *k] for k in plain),
        ]
    )
    with pytest.raises(fc.errors.UnsafeCheckpoint, match="hash flood"):
        codec.decode(data, unregistered=set())


def test_a_placeholder_is_read_only_hashable_and_never_saved(tmp_path: Path) -> None:
    p = codec.Unregistered("x.Mode", "ON")
    with pytest.raises(AttributeError, match="read-only"):
        p.tag = "y"  # type: ignore[misc]
    assert {p: 1}[codec.Unregistered("x.Mode", "ON")] == 1
    assert hash(codec.Unregistered("x.C", {"a": 1, "b": 2})) == hash(
        codec.Unregistered("x.C", {"b": 2, "a": 1})
    )
    assert repr(codec.Unregistered("x.P", [1, "a"])) == "x.P(1, 'a')"
    assert repr(codec.Unregistered("x.F", 5)) == "x.F(5)"
    q = codec.Unregistered("x.C", {"a": [1]})
    assert copy.deepcopy(q) == q and copy.deepcopy(q).fields is not q.fields
    with pytest.raises(fc.errors.UnsupportedValue, match=r"placeholder.*register the class"):
        fc.save(tmp_path / "ck", {"hp": {"v": p}})


def test_a_class_of_the_main_script_is_named_after_its_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import types

    from functional_ckpt._src.codec.registration import default_name

    def named(main: types.ModuleType) -> str:
        monkeypatch.setitem(sys.modules, "__main__", main)
        cls = type("Cfg", (), {"__module__": "__main__"})
        return default_name(cls)

    script = types.ModuleType("__main__")
    script.__file__ = "/runs/exp/train.py"
    assert named(script) == "train.Cfg"
    as_module = types.ModuleType("__main__")
    as_module.__spec__ = types.SimpleNamespace(name="pkg.train")  # type: ignore[assignment]
    assert named(as_module) == "pkg.train.Cfg"
    assert named(types.ModuleType("__main__")) == "__main__.Cfg"  # -c, a REPL


def test_a_script_imported_by_its_name_too_shares_its_tags(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import types

    script = types.ModuleType("__main__")
    script.__file__ = "/runs/exp/twin_script.py"
    monkeypatch.setitem(sys.modules, "__main__", script)
    run = enum.Enum("TwinMode", "A B", module="__main__")  # type: ignore[misc]
    imported = enum.Enum("TwinMode", "A B", module="twin_script")  # type: ignore[misc]
    codec.register(run)
    codec.register(imported)  # `import twin_script` from within the script: no conflict
    assert codec.encode(imported.A) == codec.encode(run.A)
    assert codec.decode(codec.encode(imported.A)) is run.A
    other = enum.Enum("TwinMode", "A B", module="elsewhere")  # type: ignore[misc]
    with pytest.raises(fc.errors.UnsupportedValue, match="already taken"):
        codec.register(other, name="twin_script.TwinMode")


def test_register_takes_a_name_and_aliases() -> None:
    @codec.register(name="tests.unreg.Renamed", aliases=["tests.unreg.Old"])
    class Renamed(enum.Enum):
        X = 1

    assert codec.decode(codec.encode(Renamed.X)) is Renamed.X
    old = _raw(_tagged(b"tests.unreg.Old", "X"))
    assert codec.decode(old) is Renamed.X  # read under the old name
    assert b"tests.unreg.Renamed" in codec.encode(Renamed.X)  # written under the new one
    codec.register(Renamed, name="tests.unreg.Renamed", aliases=["tests.unreg.Older"])
    assert codec.decode(_raw(_tagged(b"tests.unreg.Older", "X"))) is Renamed.X

    class Other(enum.Enum):
        Y = 1

    with pytest.raises(fc.errors.UnsupportedValue, match="already taken"):
        codec.register(Other, aliases=["tests.unreg.Old"])
    with pytest.raises(fc.errors.UnsupportedValue, match="not one str"):
        codec.register(Other, aliases="tests.unreg.Y")
    with pytest.raises(fc.errors.UnsupportedValue, match="invalid alias"):
        codec.register(Other, aliases=["bad\nname"])


# ------------------------------------------------------- identity hashing, read without class

IDENT = '''
"""Instances of a class hashed by identity (its fields hold a list) in a set and as keys."""
import dataclasses
import sys

import torch

import functional_ckpt as fc


@fc.codec.register
@dataclasses.dataclass(eq=False)
class Node:
    name: str
    tags: list


with fc.CheckpointManager(sys.argv[1], save=fc.every_steps(1)) as mgr:
    for step in (1, 2):
        a, b = Node("a", [1]), Node("a", [1])  # equal fields, two members
        hp = {"nodes": {a, b}, "by_node": {a: 1, b: 2}, "pairs": frozenset({(a, 1), (b, 1)})}
        mgr.maybe_save({"w": torch.full((2,), float(step)), "hp": hp}, step=step)
'''


@pytest.fixture(scope="module")
def ident(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``root/``: two checkpoints of ``ident.Node`` members, saved by a script; ``elsewhere/``."""
    base = tmp_path_factory.mktemp("identity")
    (base / "ident.py").write_text(textwrap.dedent(IDENT))
    ok(python("ident.py", str(base / "root"), cwd=base))
    (base / "elsewhere").mkdir()
    return base


def test_identity_hashed_members_verify_without_their_class(ident: Path) -> None:
    """Regression: placeholders hashed by fields made the set unhashable (a list field), so
    ``fc.verify``, ``fckpt verify`` and ``fckpt ls`` called honest checkpoints DAMAGED."""
    root = ident / "root"
    assert fc.verify(root / step_name(2)).ok
    proc = fckpt("verify", str(root), cwd=ident / "elsewhere")
    assert "2 checkpoints intact" in ok(proc) and "DAMAGED" not in proc.stdout
    listing = ok(fckpt("ls", str(root), cwd=ident / "elsewhere"))
    assert "damaged" not in listing and listing.count(" ok ") == 2, listing


def test_identity_hashed_members_never_collapse_in_inspect(ident: Path) -> None:
    hp = fc.inspect(ident / "root" / step_name(1)).tree["hp"]
    assert len(hp["nodes"]) == 2 and len(hp["by_node"]) == 2 and len(hp["pairs"]) == 2
    assert sorted(hp["by_node"].values()) == [1, 2]
    assert {repr(n) for n in hp["nodes"]} == {"ident.Node(name='a', tags=[1])"}
    assert all(n.by_identity for n in hp["nodes"])
    out = ok(fckpt("diff", *(str(ident / "root" / step_name(s)) for s in (1, 2)), cwd=ident))
    assert "hp/" not in out  # same contents: only the tensor differs


def test_a_writing_manager_without_the_class_moves_nothing_aside(ident: Path) -> None:
    """The severe outcome: a writing manager in a program that has not registered the class
    renamed every such checkpoint aside as damaged and then refused to resume."""
    root = ident / "root"
    before = sorted(p.name for p in root.iterdir())
    with fc.CheckpointManager(root) as mgr:
        with pytest.raises(fc.errors.UnregisteredType, match=r"ident\.Node"):
            mgr.restore_latest()
        assert mgr.latest_step() == 2
    assert sorted(p.name for p in root.iterdir()) == before
    assert not any(".corrupt-" in name for name in before)


def test_placeholders_in_a_keys_place_compare_by_identity() -> None:
    same = _tagged(b"x.Node", {"tags": [1]})
    data = _raw([msgpack.ExtType(table.EXT_SET, b""), same, same])
    with pytest.raises(fc.errors.UnsafeCheckpoint, match="unknown tagged type"):
        codec.decode(data)
    members: Any = codec.decode(data, unregistered=set())
    assert len(members) == 2 and all(m.by_identity for m in members)
    pair = [msgpack.ExtType(table.EXT_TUPLE, b""), same, 1]  # inside a tuple in a key's place
    pairs: Any = codec.decode(
        _raw([msgpack.ExtType(table.EXT_FROZENSET, b""), pair, pair]), unregistered=set()
    )
    assert len(pairs) == 2
    alone = codec.decode(_raw([same]), unregistered=set())
    assert alone == [codec.Unregistered("x.Node", {"tags": [1]})]  # elsewhere: by fields
    twin = copy.deepcopy(members)
    assert len(twin) == 2
