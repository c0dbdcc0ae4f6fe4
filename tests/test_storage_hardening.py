"""The storage layer against an outside attacker: durability order, derived files,
the stock-DCP unpickler, special files on every read path, readers racing an
overwrite, and what ``overwrite=True`` may replace."""

from __future__ import annotations

import collections
import copyreg
import os
import pathlib
import pickle
import stat
import sys
import textwrap
import threading
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

import functional_ckpt as fc
from functional_ckpt._src import codec
from functional_ckpt._src.format import dcp_metadata, dcp_values, naming, unpickler
from functional_ckpt._src.format.view import parse_checkpoint
from functional_ckpt._src.storage import commit
from tests import forge, prefork
from tests.patience import HANG

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


def make_state(v: float) -> dict[str, Any]:
    return {
        "model": {"w": torch.full((64, 8), v), "b": torch.full((8,), v)},
        "opt": {"m": torch.full((100,), v)},
        "step": int(v),
    }


def check_state(state: Any, v: float) -> None:
    assert int(fc.codec.to_python(state["step"])) == int(v)
    for t in state.values(include_nested=True, leaves_only=True):
        if isinstance(t, torch.Tensor) and t.dim():
            assert bool((t == v).all())


def resign(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit the manifest and re-sign it, as an attacker owning the files would."""
    manifest = codec.decode((path / naming.MANIFEST).read_bytes())
    assert isinstance(manifest, dict)
    edit(manifest)
    raw = codec.encode(manifest)
    (path / naming.MANIFEST).write_bytes(raw)
    os.unlink(path / naming.COMMIT_MARKER)
    forge.sign(path, raw)


def install_metadata(path: Path, raw: bytes) -> None:
    """Replace ``.metadata`` and record its size and CRC in a re-signed manifest."""
    (path / naming.DCP_METADATA).write_bytes(raw)

    def edit(m: dict[str, Any]) -> None:
        m["files"][naming.DCP_METADATA] = {"size": len(raw), "crc32": zlib.crc32(raw)}

    resign(path, edit)


# --------------------------------------------------------------------------- durability


class FsyncSpy:
    """Records, in order, file creations, fsyncs (path and size then) and renames."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.events: list[tuple[str, str, int]] = []
        real_fsync, real_open, real_rename = os.fsync, os.open, os.rename
        real_mkdir = pathlib.Path.mkdir

        def fsync(fd: Any) -> None:
            fd = fd if isinstance(fd, int) else fd.fileno()
            real_fsync(fd)
            name = os.readlink(f"/proc/self/fd/{fd}")
            st = os.fstat(fd)
            self.events.append(("fsync", name, -1 if stat.S_ISDIR(st.st_mode) else st.st_size))

        def open_(path: Any, flags: int, *a: Any, **k: Any) -> int:
            if flags & os.O_CREAT:
                self.events.append(("create", os.path.abspath(path), 0))
            return real_open(path, flags, *a, **k)

        def rename(a: Any, b: Any, *args: Any, **kwargs: Any) -> None:
            real_rename(a, b, *args, **kwargs)
            self.events.append(("rename", os.path.abspath(a), 0))
            self.events.append(("renamed", os.path.abspath(b), 0))

        def mkdir(self_: Path, *a: Any, **k: Any) -> None:
            real_mkdir(self_, *a, **k)
            self.events.append(("mkdir", str(self_.absolute()), 0))

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "open", open_)
        monkeypatch.setattr(os, "rename", rename)
        monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)

    def index(self, kind: str, pred: Callable[[str, int], bool]) -> int:
        for i, (k, name, size) in enumerate(self.events):
            if k == kind and pred(name, size):
                return i
        raise AssertionError(f"no {kind} event matching; events: {self.events}")


def check_durable_commit(spy: FsyncSpy, dest: Path, created: list[Path]) -> None:
    """Every file fsynced at its final size before the marker, dir before rename, parent after."""
    marker_created = spy.index("create", lambda n, _: n.endswith("/" + naming.COMMIT_MARKER))
    tmp = Path(spy.events[marker_created][1]).parent
    for f in dest.iterdir():
        size = f.stat().st_size
        at = spy.index("fsync", lambda n, s, f=f, size=size: n == str(tmp / f.name) and s == size)
        if f.name != naming.COMMIT_MARKER:
            assert at < marker_created, f"{f.name} fsynced only after the marker was written"
    marker_synced = spy.index("fsync", lambda n, _: n == str(tmp / naming.COMMIT_MARKER))
    dir_syncs = [
        i for i, (k, n, s) in enumerate(spy.events) if k == "fsync" and n == str(tmp) and s == -1
    ]
    # the files' entries are durable before the marker's is made, and the marker's
    # before the rename
    assert any(i < marker_created for i in dir_syncs), "directory not fsynced before the marker"
    dir_synced = min(i for i in dir_syncs if i > marker_synced)
    renamed = spy.index("renamed", lambda n, _: n == str(dest.absolute()))
    parent_synced = max(
        i
        for i, (k, n, _) in enumerate(spy.events)
        if k == "fsync" and n == str(dest.parent.absolute())
    )
    assert marker_synced < dir_synced < renamed < parent_synced
    for d in created:
        made = spy.index("mkdir", lambda n, _, d=d: n == str(d.absolute()))
        synced = [
            i
            for i, (k, n, _) in enumerate(spy.events)
            if k == "fsync" and n == str(d.parent.absolute()) and i > made
        ]
        assert synced and synced[0] < marker_created, f"new directory {d} never made durable"


@pytest.mark.parametrize("mode", ["save", "save_async", "manager"])
def test_every_file_and_new_ancestor_is_fsynced_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """Regression: DCP's finish fsynced .metadata while empty; new parents were never fsynced."""
    spy = FsyncSpy(monkeypatch)
    a = tmp_path / "a"
    if mode == "manager":
        with fc.CheckpointManager(a / "b", save=fc.every_steps(1)) as mgr:
            mgr.maybe_save(make_state(1.0), step=1)
        dest = next((a / "b").glob("step_*"))
        created = [a, a / "b"]
    else:
        dest = a / "b" / "ck"
        if mode == "save":
            fc.save(dest, make_state(1.0))
        else:
            fc.save_async(dest, make_state(1.0)).result()
        created = [a, a / "b"]
    assert (dest / naming.DCP_METADATA).stat().st_size > 0
    check_durable_commit(spy, dest, created)


def test_overwrite_is_durable_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "ck"
    fc.save(dest, make_state(1.0))
    spy = FsyncSpy(monkeypatch)
    fc.save(dest, make_state(2.0), overwrite=True)
    marker = spy.index("create", lambda n, _: n.endswith("/" + naming.COMMIT_MARKER))
    tmp = Path(spy.events[marker][1]).parent
    for f in dest.iterdir():
        size = f.stat().st_size
        spy.index("fsync", lambda n, s, f=f, size=size: n == str(tmp / f.name) and s == size)
    check_state(fc.restore(dest), 2.0)


# --------------------------------------------------------------------------- derived .metadata


def test_metadata_is_derived_from_the_manifest(tmp_path: Path) -> None:
    fc.save(tmp_path / "a", make_state(1.0))
    fc.save(tmp_path / "b", make_state(2.0))
    raw = (tmp_path / "a" / naming.DCP_METADATA).read_bytes()
    manifest = codec.decode((tmp_path / "a" / naming.MANIFEST).read_bytes())
    assert isinstance(manifest, dict)
    once = parse_checkpoint(manifest, Path("."))
    values = dcp_values.parse_byte_entries(manifest, once.shared.file_sizes, Path("."))
    assert raw == dcp_metadata.derive(once.groups(), values)
    assert raw == (tmp_path / "b" / naming.DCP_METADATA).read_bytes()  # same layout, same bytes
    md = pickle.loads(raw)  # what stock DCP does with it
    assert isinstance(md, Metadata) and set(md.state_dict_metadata) == {
        "model.w",
        "model.b",
        "opt.m",
        "step",  # a value, as a DCP byte entry for stock readers
    }
    assert isinstance(md.state_dict_metadata["step"], BytesStorageMetadata)


def test_our_readers_never_unpickle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "step_000000003"
    fc.save(path, make_state(3.0))

    def refuse(*a: Any, **k: Any) -> Any:
        raise AssertionError("unpickled")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    # verify reads .metadata through the vetted unpickler only (into plain stand-ins)
    assert fc.verify(path).ok
    monkeypatch.setattr(pickle, "_Unpickler", refuse)
    check_state(fc.restore(path), 3.0)
    assert fc.inspect(path).num_tensors == 3
    assert fc.verify(path).ok
    with fc.CheckpointManager(tmp_path, read_only=True) as mgr:
        check_state(mgr.restore_latest(), 3.0)


def test_verify_catches_metadata_sending_dcp_elsewhere(tmp_path: Path) -> None:
    """Regression (finding 9): a re-signed .metadata pointing at an absolute path."""
    path = tmp_path / "ck"
    fc.save(path, make_state(1.0))
    elsewhere = tmp_path / "elsewhere.distcp"
    elsewhere.write_bytes((path / "__0_0.distcp").read_bytes())
    md = pickle.loads((path / naming.DCP_METADATA).read_bytes())
    for info in md.storage_data.values():
        info.relative_path = str(elsewhere)
    install_metadata(path, pickle.dumps(md, protocol=4))
    check_state(fc.restore(path), 1.0)  # our reader uses the manifest only
    report = fc.verify(path)
    assert not report.ok
    assert any(
        p.where == naming.DCP_METADATA and str(elsewhere) in p.detail for p in report.problems
    )


def test_verify_accepts_honestly_different_metadata_bytes(tmp_path: Path) -> None:
    """Another torch may pickle the same metadata differently: compared field by field."""
    path = tmp_path / "ck"
    fc.save(path, make_state(1.0))
    md = pickle.loads((path / naming.DCP_METADATA).read_bytes())
    raw = pickle.dumps(md, protocol=2)
    assert raw != (path / naming.DCP_METADATA).read_bytes()
    install_metadata(path, raw)
    assert fc.verify(path).ok


@pytest.mark.parametrize(
    "edit",
    ["dtype", "size", "chunk", "length", "planner", "extra"],
)
def test_verify_reports_each_field_disagreement(tmp_path: Path, edit: str) -> None:
    path = tmp_path / "ck"
    fc.save(path, make_state(1.0))
    md = pickle.loads((path / naming.DCP_METADATA).read_bytes())
    smd = md.state_dict_metadata["model.w"]
    if edit == "dtype":
        smd.properties.dtype = torch.float64
    elif edit == "size":
        md.state_dict_metadata["model.w"] = type(smd)(smd.properties, torch.Size([8, 64]), [])
    elif edit == "chunk":
        smd.chunks[0].sizes = torch.Size([1, 8])
    elif edit == "length":
        next(iter(md.storage_data.values())).length += 1
    elif edit == "planner":
        md.planner_data["model.w"] = ("other",)
    else:
        md.state_dict_metadata["extra"] = smd
    install_metadata(path, pickle.dumps(md, protocol=2))
    report = fc.verify(path)
    assert not report.ok and any(p.where == naming.DCP_METADATA for p in report.problems)


@pytest.mark.parametrize("damage", ["garbage", "empty", "folder"])
def test_verify_names_a_bad_marker_not_the_manifest_it_authenticates(
    tmp_path: Path, damage: str
) -> None:
    fc.save(tmp_path / "ck", {"w": torch.ones(3)})
    marker = tmp_path / "ck" / naming.COMMIT_MARKER
    marker.unlink()
    if damage == "folder":
        marker.mkdir()
    else:
        marker.write_bytes(b"hello\n" if damage == "garbage" else b"")
    report = fc.verify(tmp_path / "ck")
    assert not report.ok and [p.where for p in report.problems] == [naming.COMMIT_MARKER]


# --------------------------------------------------------------------------- hardened unpickler


def _snapshot() -> dict[str, Any]:
    """Every attribute of every allow-listed class, function and the classes they use."""
    out: dict[str, Any] = {}
    seen: set[int] = set()
    for key, obj in unpickler.ALLOWED.items():
        for o in (obj, type(obj)):
            if id(o) in seen:
                continue
            seen.add(id(o))
            d = getattr(o, "__dict__", None)
            if d is not None:
                out[f"{key}:{id(o)}"] = {k: (id(v), repr(v)[:80]) for k, v in dict(d).items()}
            for attr in ("__code__", "__defaults__", "__kwdefaults__"):
                if hasattr(o, attr):
                    out[f"{key}:{attr}"] = id(getattr(o, attr))
    import torch.serialization as ser

    out["layout-cache"] = dict(getattr(ser._get_layout, "cache", {}))
    for member in unpickler._MEM_FORMAT_ENCODING:
        out[f"enum:{member.name}"] = dict(vars(member))
    return out


def _genuine(tmp_path: Path) -> bytes:
    fc.save(tmp_path / "genuine", make_state(1.0))
    md = pickle.loads((tmp_path / "genuine" / naming.DCP_METADATA).read_bytes())
    return pickle.dumps(md, protocol=2)[2:]  # without PROTO: spliced after an attack


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _str(s: str) -> bytes:
    b = s.encode()
    return b"X" + len(b).to_bytes(4, "little") + b


ATTACKS: dict[str, bytes] = {
    # BUILD with (None, {"__truediv__": OrderedDict}) on the PosixPath class
    "patch PosixPath.__truediv__": _global("pathlib", "PosixPath")
    + b"N}"
    + _str("__truediv__")
    + _global("collections", "OrderedDict")
    + b"s\x86b0",
    # BUILD with a dict state on the function: poisons its __dict__["cache"]
    "poison torch.serialization layout cache": _global("torch.serialization", "_get_layout")
    + b"}"
    + _str("cache")
    + b"}"
    + _str("torch.strided")
    + _global("torch", "sparse_coo")
    + b"ssb0",
    # BUILD on the shared enum singleton returned by a REDUCE
    "patch an enum member": _global("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING")
    + b"K\x00\x85R}"
    + _str("_value_")
    + b"K\x07sb0",
    # BUILD with slot state on a DCP class itself
    "patch Metadata class": _global("torch.distributed.checkpoint.metadata", "Metadata")
    + b"N}"
    + _str("__eq__")
    + _global("torch", "Size")
    + b"s\x86b0",
    # SETITEM on a class (not a dict)
    "setitem on OrderedDict class": _global("collections", "OrderedDict") + _str("x") + b"Ns0",
    # a plain callable that is not on the list
    "os.system": _global("os", "system") + _str("true") + b"\x85R0",
    # copyreg's reconstructor (how protocol 0/1 build arbitrary objects)
    "copyreg reconstructor": _global("copyreg", "_reconstructor") + b"0",
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_unpickler_attack_changes_nothing(tmp_path: Path, name: str) -> None:
    """Regression (finding 8): BUILD used to set attributes on allowed classes/functions."""
    raw = b"\x80\x02" + ATTACKS[name] + _genuine(tmp_path)
    before = _snapshot()
    with pytest.raises(fc.errors.UnsafeCheckpoint):
        unpickler.load_foreign(raw, tmp_path / ".metadata")
    stock = tmp_path / "stock"
    stock.mkdir()
    (stock / naming.DCP_METADATA).write_bytes(raw)
    with pytest.raises(fc.errors.UnsafeCheckpoint):
        fc.restore(stock, {"model": {"w": torch.zeros(64, 8)}}, partial=True)
    with pytest.raises(fc.errors.UnsafeCheckpoint):
        fc.inspect(stock)
    ours = tmp_path / "ours"
    fc.save(ours, make_state(1.0))
    install_metadata(ours, raw)
    report = fc.verify(ours)
    assert not report.ok
    assert _snapshot() == before
    assert (pathlib.PosixPath("/a") / "b") == pathlib.PosixPath("/a/b")
    assert copyreg is not None and collections.OrderedDict is not None


def _torch_allowed() -> dict[tuple[str, str], Any]:
    """The globals a ``.metadata`` may name, as torch itself has them."""
    import torch.serialization
    from torch.distributed.checkpoint import metadata as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    found: dict[tuple[str, str], Any] = {}
    for cls in (
        dcp.Metadata,
        dcp.TensorStorageMetadata,
        dcp.BytesStorageMetadata,
        dcp.ChunkStorageMetadata,
        dcp.TensorProperties,
        dcp.MetadataIndex,
        dcp.StorageMeta,
        dcp._MEM_FORMAT_ENCODING,
    ):
        found[("torch.distributed.checkpoint.metadata", cls.__name__)] = cls
    found[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = _StorageInfo
    found[("torch", "Size")] = torch.Size
    found[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    found[("collections", "OrderedDict")] = collections.OrderedDict
    for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        found[("pathlib", name)] = getattr(pathlib, name)
        found[("pathlib._local", name)] = getattr(pathlib, name)
    for name in dir(torch):
        obj = getattr(torch, name, None)
        if isinstance(obj, torch.dtype | torch.layout | torch.memory_format):
            found[("torch", name)] = obj
    return found


def test_the_stand_ins_allow_exactly_what_torch_has() -> None:
    from functional_ckpt._src.format import dcp_standins as sd

    real = _torch_allowed()
    assert set(unpickler.ALLOWED) == set(real)
    kinds = {torch.dtype: sd.DType, torch.layout: sd.Layout, torch.memory_format: sd.MemoryFormat}
    for key, obj in real.items():
        standin = unpickler.ALLOWED[key]
        if type(obj) in kinds:
            assert type(standin) is kinds[type(obj)], key
            assert repr(standin) == str(obj), key  # torch.float is torch.float32
        elif isinstance(obj, type) and key[0].startswith("torch."):
            assert standin.__name__ == obj.__name__, key
    members = {m.name: m.value for m in unpickler._MEM_FORMAT_ENCODING}
    assert members == {m.name: m.value for m in real[(sd.DCP_MODULE, "_MEM_FORMAT_ENCODING")]}


def test_the_stand_ins_have_dcps_fields_and_defaults() -> None:
    import dataclasses

    from functional_ckpt._src.format import dcp_standins as sd

    real = _torch_allowed()
    for cls in sd.DATA_CLASSES:
        module = sd.STORAGE_MODULE if cls.__name__ == "_StorageInfo" else sd.DCP_MODULE
        dcp_cls = real[(module, cls.__name__)]
        assert tuple(f.name for f in dataclasses.fields(dcp_cls)) == cls.FIELDS
        for name in cls.FIELDS:  # a missing field reads as it does on DCP's class
            here, there = vars(cls).get(name, KeyError), vars(dcp_cls).get(name, KeyError)
            assert repr(here) == repr(there), (cls.__name__, name)


def test_a_stock_reader_gets_dcps_own_metadata(tmp_path: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    fc.save(tmp_path / "ours", make_state(1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"a": torch.arange(6.0), "n": 3}, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    for path in (tmp_path / "ours", tmp_path / "d"):
        raw = (path / naming.DCP_METADATA).read_bytes()
        got = unpickler.load_foreign(raw, path / naming.DCP_METADATA)
        assert type(got) is Metadata and got == pickle.loads(raw)  # field for field


def test_extension_codes_are_refused_even_when_cached() -> None:
    """copyreg's extension cache returns an object for an EXT opcode without asking
    ``find_class``: a process that once registered and loaded a code would hand any
    pickle that names the code that object (here ``print``)."""
    code = 0xF0
    copyreg.add_extension("builtins", "print", code)
    try:
        assert pickle.loads(b"\x80\x02\x82\xf0.") is print  # now in the cache
        with pytest.raises(fc.errors.UnsafeCheckpoint, match="extension"):
            unpickler.RestrictedUnpickler(b"\x80\x02\x82\xf0.").load()
    finally:
        copyreg.remove_extension("builtins", "print", code)
        copyreg.clear_extension_cache()


def test_attack_would_work_without_the_vetting(tmp_path: Path) -> None:
    """The attack pickles are real: an unpickler filtering only globals (the old one) is fooled.

    It returns a genuine ``Metadata`` after ``PosixPath.__truediv__`` was replaced.
    """
    raw = b"\x80\x02" + ATTACKS["patch PosixPath.__truediv__"] + _genuine(tmp_path)
    code = textwrap.dedent(
        f"""
        import io, pathlib, pickle
        from functional_ckpt._src.format import unpickler

        class GlobalsOnly(pickle.Unpickler):
            def find_class(self, module, name):
                return unpickler.ALLOWED[(module, name)]

        md = GlobalsOnly(io.BytesIO({raw!r})).load()
        print(type(md).__name__, pathlib.PosixPath.__truediv__ is not pathlib.PurePath.__truediv__)
        """
    )
    out = prefork.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=HANG
    )
    assert out.stdout.split() == ["Metadata", "True"], out.stderr[-2000:]


def test_stock_dcp_metadata_still_loads(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    sd = {"a": torch.arange(6.0), "b": {"c": torch.ones(2, 3)}}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(tmp_path / "d"), no_dist=True)
    out = fc.restore(tmp_path / "d", {"a": torch.zeros(6), "b": {"c": torch.zeros(2, 3)}})
    assert torch.equal(out["a"], sd["a"]) and torch.equal(out["b"]["c"], sd["b"]["c"])
    assert fc.inspect(tmp_path / "d").num_tensors == 2


# --------------------------------------------------------------------------- special files


def _special(path: Path, name: str, kind: str) -> None:
    target = path / name
    os.unlink(target)
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "dir":
        target.mkdir()
    else:
        os.symlink("/dev/zero", target)


_PROBE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import functional_ckpt as fc
    path = Path(sys.argv[1])
    out = {}
    for what, fn in (
        ("restore", lambda: fc.restore(path)),
        ("inspect", lambda: fc.inspect(path)),
        ("verify", lambda: fc.verify(path)),
        ("manager", lambda: fc.CheckpointManager(path.parent, read_only=True).restore_latest()),
    ):
        try:
            value = fn()
            ok = getattr(value, "ok", True)
            detail = "" if ok else " ".join(str(p) for p in value.problems)
            out[what] = ["ok" if ok else "reported", detail]
        except Exception as e:
            out[what] = [type(e).__name__, str(e)]
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        (naming.DCP_METADATA, "fifo"),
        (naming.DCP_METADATA, "dir"),
        ("__0_0.distcp", "fifo"),
        (naming.MANIFEST, "fifo"),
        (naming.COMMIT_MARKER, "fifo"),
        ("__0_0.distcp", "link"),
    ],
)
def test_special_file_never_hangs(tmp_path: Path, name: str, kind: str) -> None:
    """Regression (finding 10): a FIFO named .metadata hung restore, inspect and the manager."""
    import json

    path = tmp_path / "run" / "step_000000001"
    fc.save(path, make_state(1.0))
    _special(path, name, kind)
    proc = prefork.run(
        [sys.executable, "-c", _PROBE, str(path)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=HANG,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    unread = name == naming.DCP_METADATA  # for stock readers: only verify reads it
    for what in ("restore", "inspect", "verify", "manager"):
        kind_, msg = out[what]
        if kind_ == "ok" and (
            what == "manager"  # fell back: nothing else to restore
            or (unread and what != "verify")
            or (what == "inspect" and name not in (naming.MANIFEST, naming.COMMIT_MARKER))
        ):
            continue  # never read: inspect reads the marker and the manifest alone
        assert kind_ in ("UnsafeCheckpoint", "CorruptCheckpoint", "CheckpointError", "reported"), (
            what,
            out[what],
        )
        assert name in msg, (what, msg)
    cli = prefork.run(
        [sys.executable, "-m", "functional_ckpt", "inspect", str(path)],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=HANG,
    )
    assert "Traceback" not in cli.stderr
    if name in (naming.MANIFEST, naming.COMMIT_MARKER):
        assert cli.returncode in (1, 2), cli.stdout + cli.stderr
        assert name in cli.stdout + cli.stderr


def test_stock_dcp_with_a_fifo_never_hangs(tmp_path: Path) -> None:
    d = tmp_path / "d"
    d.mkdir()
    os.mkfifo(d / naming.DCP_METADATA)
    code = (
        "import sys, functional_ckpt as fc, torch\n"
        "for fn in (lambda: fc.inspect(sys.argv[1]), "
        "lambda: fc.restore(sys.argv[1], {'w': torch.zeros(2)})):\n"
        "    try: fn(); print('ok')\n"
        "    except fc.CheckpointError as e: print(type(e).__name__, e)\n"
    )
    proc = prefork.run(
        [sys.executable, "-c", code, str(d)], capture_output=True, text=True, env=ENV, timeout=HANG
    )
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 2 and all(ln.startswith("UnsafeCheckpoint") for ln in lines), proc


# --------------------------------------------------------------------------- racing an overwrite


def test_reader_racing_overwrite_never_sees_corruption(tmp_path: Path) -> None:
    """Regression (finding 15): about 10% of reads racing overwrite=True said "corrupt"."""
    path = tmp_path / "ck"
    fc.save(path, make_state(1.0))
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        v = 2.0
        try:
            while not stop.is_set():
                fc.save(path, make_state(v), overwrite=True)
                v = 3.0 - v + 1.0 if v != 1.0 else 2.0  # alternate 2, 1, 2, 1 ...
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    t = threading.Thread(target=writer)
    t.start()
    reads = replaced = 0
    try:
        while reads < 60:  # about 2,000 reads race the writer's swaps on an idle machine
            assert t.is_alive(), errors
            try:
                state = fc.restore(path)
            except fc.errors.CheckpointNotFound as e:
                assert "replaced" in str(e)
                replaced += 1
                continue
            v = float(fc.codec.to_python(state["step"]))
            assert v in (1.0, 2.0)
            check_state(state, v)
            reads += 1
            try:
                report = fc.verify(path)
            except fc.errors.CheckpointNotFound:
                replaced += 1
                continue
            assert report.ok, str(report)
    finally:
        stop.set()
        t.join()
    assert not errors, errors
    assert replaced <= reads


def test_a_listing_of_the_replaced_directory_is_not_taken_for_stock_dcp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: a reader that listed the old directory while its deletion was half
    done (marker and manifest gone, ``.metadata`` left) took it for a stock DCP
    checkpoint and refused it ("pass a template"); it must read the new checkpoint."""
    from functional_ckpt._src.format import kind

    path = tmp_path / "ck"
    fc.save(path, make_state(1.0))
    real_entries = kind._entries
    raced = []

    def listing_during_the_deletion(p: Path) -> dict[str, bool]:
        entries = real_entries(p)
        if p == path and not raced:
            raced.append(p)
            fc.save(path, make_state(2.0), overwrite=True)
            return {
                n: f for n, f in entries.items() if n not in (naming.COMMIT_MARKER, naming.MANIFEST)
            }
        return entries

    monkeypatch.setattr(kind, "_entries", listing_during_the_deletion)
    state = fc.restore(path)
    assert raced
    check_state(state, 2.0)


def test_no_half_deleted_checkpoint_looks_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every state a deletion passes through is uncommitted, a part or empty: never a
    checkpoint, nor a stock DCP one (whatever order the directory lists its files in)."""
    from functional_ckpt._src.format.kind import Kind, classify

    path = tmp_path / "ck"
    fc.save(path, make_state(1.0))
    assert (path / naming.DCP_METADATA).exists()
    seen: list[Kind] = []
    real_unlink = os.unlink

    def unlink(p: Any, *, dir_fd: int | None = None) -> None:
        real_unlink(p, dir_fd=dir_fd)
        seen.append(classify(path))

    monkeypatch.setattr(os, "unlink", unlink)
    commit.remove_tree(path)
    monkeypatch.undo()
    assert not path.exists()
    assert seen and not {Kind.COMMITTED, Kind.STOCK_DCP} & set(seen), seen


# --------------------------------------------------------------------------- overwrite scope


@pytest.fixture
def manager_root(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    with fc.CheckpointManager(root, save=fc.every_steps(1), keep=fc.keep_last(5)) as mgr:
        for step in (1, 2, 3):
            mgr.maybe_save(make_state(float(step)), step=step)
    (root / "notes.txt").write_text("mine")
    return root


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_save_overwrite_refuses_a_manager_root(manager_root: Path) -> None:
    """Regression (finding 6): overwrite=True deleted three checkpoints, notes and the lock."""
    before = _listing(manager_root)
    with pytest.raises(fc.errors.CheckpointExists, match="not a checkpoint"):
        fc.save(manager_root, make_state(9.0), overwrite=True)
    assert _listing(manager_root) == before


def test_save_overwrite_refuses_a_source_tree(tmp_path: Path) -> None:
    src = tmp_path / "project"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "__init__.py").write_text("x = 1\n")
    (src / "README.md").write_text("hi")
    before = _listing(src)
    with pytest.raises(fc.errors.CheckpointExists, match=str(src)):
        fc.save(src, make_state(9.0), overwrite=True)
    with pytest.raises(fc.errors.CheckpointExists):
        fc.save_async(src, make_state(9.0), overwrite=True).result()
    assert _listing(src) == before


@pytest.mark.parametrize("kind", ["checkpoint", "empty", "stock", "uncommitted"])
def test_save_overwrite_replaces_checkpoints(tmp_path: Path, kind: str) -> None:
    dest = tmp_path / "ck"
    if kind == "empty":
        dest.mkdir()
    elif kind == "stock":
        import warnings

        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"w": torch.ones(2)}, checkpoint_id=str(dest), no_dist=True)
    else:
        fc.save(dest, make_state(1.0))
        if kind == "uncommitted":
            os.unlink(dest / naming.COMMIT_MARKER)
    fc.save(dest, make_state(5.0), overwrite=True)
    check_state(fc.restore(dest), 5.0)


def test_export_overwrite_scope(tmp_path: Path) -> None:
    state = {"model": {"w": torch.ones(4)}}
    out = tmp_path / "export"
    fc.export_safetensors(state, out)
    fc.export_safetensors({"model": {"w": torch.zeros(4)}}, out, overwrite=True)
    empty = tmp_path / "empty"
    empty.mkdir()
    fc.export_safetensors(state, empty, overwrite=True)
    src = tmp_path / "project"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("x = 1\n")
    before = _listing(src)
    with pytest.raises(fc.errors.CheckpointExists, match="not a safetensors export"):
        fc.export_safetensors(state, src, overwrite=True)
    assert _listing(src) == before


def test_cli_export_overwrite_keeps_a_source_tree(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    fc.save(ck, {"model": {"w": torch.ones(4)}})
    src = tmp_path / "project"
    src.mkdir()
    (src / "main.py").write_text("print(1)\n")
    proc = prefork.run(
        [sys.executable, "-m", "functional_ckpt", "export", str(ck), str(src), "--overwrite"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=HANG,
    )
    assert proc.returncode != 0
    assert (src / "main.py").read_text() == "print(1)\n"
    assert "Traceback" not in proc.stderr


@pytest.fixture
def no_exchange(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(commit, "_exchange", lambda a, b: False)
    yield


def test_a_saver_that_loses_the_race_for_a_path_is_refused_and_the_winner_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another saver commits to the path after this one looked and before it renamed: the
    loser gets ``CheckpointExists`` (not the rename's bare "Directory not empty"), its own
    files are gone and the winner is whole."""
    dest = tmp_path / "ck"
    real_exists = pathlib.Path.exists

    def winner_commits_after_the_look(self: Path, *args: Any, **kwargs: Any) -> bool:
        seen = real_exists(self, *args, **kwargs)
        if self == dest and any(naming.is_temporary_name(p.name) for p in tmp_path.iterdir()):
            if not seen:  # the loser's files are written: the winner lands now
                monkeypatch.setattr(pathlib.Path, "exists", real_exists)
                fc.save(dest, make_state(1.0))
            return False
        return seen

    monkeypatch.setattr(pathlib.Path, "exists", winner_commits_after_the_look)
    with pytest.raises(fc.errors.CheckpointExists, match="already exists"):
        fc.save(dest, make_state(2.0))
    monkeypatch.undo()
    assert fc.verify(dest).ok
    assert torch.equal(fc.restore(dest)["model"]["w"], make_state(1.0)["model"]["w"])
    assert not [p for p in tmp_path.iterdir() if naming.is_temporary_name(p.name)]


def test_overwrite_scope_checked_again_at_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory that became a non-checkpoint during the save is still left intact."""
    dest = tmp_path / "ck"
    fc.save(dest, make_state(1.0))
    real = commit.commit_checkpoint

    def late(tmp: Path, final: Path, **kw: Any) -> None:
        (final / "notes.txt").write_text("arrived meanwhile")
        real(tmp, final, **kw)

    monkeypatch.setattr(commit, "commit_checkpoint", late)
    with pytest.raises(fc.errors.CheckpointExists):
        fc.save(dest, make_state(2.0), overwrite=True)
    assert (dest / "notes.txt").exists()
    assert not [p for p in tmp_path.iterdir() if naming.is_temporary_name(p.name)]


@pytest.mark.parametrize("block", [1 << 10, 4 << 20])
def test_crc_range_checksums_exactly_the_bytes_of_the_range(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    """``fc.verify`` stands on it: the same CRC as zlib over the same bytes, short at EOF."""
    from functional_ckpt._src.storage import verify

    monkeypatch.setattr(verify, "CRC_BLOCK", block)
    data = os.urandom(3 * 4096 + 17)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, length, start in [
            (0, len(data), 0),
            (5, 4000, 0),
            (1023, 2050, 0xDEADBEEF),
            (len(data) - 3, 3, 7),
            (100, 0, 0),
        ]:
            want = zlib.crc32(data[offset : offset + length], start)
            assert verify.crc_range(fd, offset, length, start) == (want, length)
        crc, n = verify.crc_range(fd, len(data) - 10, 100)  # past the end: what is there
        assert (crc, n) == (zlib.crc32(data[-10:]), 10)
    finally:
        os.close(fd)


#: Integer keys that all hash to 0 (CPython reduces ints modulo 2**61 - 1): a dict or
#: set built from them costs quadratic time.
FLOOD = [k * (2**61 - 1) for k in range(1, 400)]


def _flood_pickles() -> dict[str, bytes]:
    from torch.distributed.checkpoint.metadata import Metadata

    md = Metadata(state_dict_metadata={})
    md.state_dict_metadata = dict.fromkeys(FLOOD)  # type: ignore[assignment]
    return {
        **{
            f"dict, protocol {p}": pickle.dumps(dict.fromkeys(FLOOD, 0), protocol=p)
            for p in range(6)
        },
        "set (ADDITEMS)": pickle.dumps(set(FLOOD), protocol=4),
        "frozenset (FROZENSET)": pickle.dumps(frozenset(FLOOD), protocol=4),
        "one SETITEM per key": b"\x80\x02}"
        + b"".join(pickle.dumps(k, protocol=2)[2:-1] + b"Ns" for k in FLOOD)
        + b".",
        "inside Metadata": pickle.dumps(md, protocol=2),
    }


@pytest.mark.parametrize("name", sorted(_flood_pickles()))
def test_a_hash_flood_in_a_metadata_pickle_is_refused(tmp_path: Path, name: str) -> None:
    """Keys sharing one hash are refused as the msgpack decoder refuses them, whatever
    opcodes build the table (before this, 30,000 such keys took longer than 12 s)."""
    raw = _flood_pickles()[name]
    with pytest.raises(fc.errors.UnsafeCheckpoint, match="share one hash value"):
        unpickler.load_foreign(raw, tmp_path / ".metadata")
    stock = tmp_path / "stock"
    stock.mkdir()
    (stock / naming.DCP_METADATA).write_bytes(raw)
    with pytest.raises(fc.errors.UnsafeCheckpoint, match="share one hash value"):
        fc.inspect(stock)
    ours = tmp_path / "ours"
    fc.save(ours, make_state(1.0))
    install_metadata(ours, raw)
    report = fc.verify(ours)
    assert not report.ok and any("hash" in str(p) for p in report.problems)


def test_a_few_colliding_keys_are_still_read(tmp_path: Path) -> None:
    """The bound is the msgpack decoder's: up to LIMITS.equal_hashes keys may collide."""
    from functional_ckpt._src.limits import LIMITS

    keys = FLOOD[: LIMITS.equal_hashes]
    raw = pickle.dumps(dict.fromkeys(keys, 0), protocol=2)
    got = unpickler.RestrictedUnpickler(raw).load()
    assert got == dict.fromkeys(keys, 0)
