"""Tensor tables: many plain tensors of a manifest as columns, read back as strictly as entries.

A save writes runs of plain tensors (one whole chunk each, in one file) as one
table; every row must pass the checks a tensor entry of its own passes, and a
forged table is refused with the entry at fault named, never read.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.format import naming
from functional_ckpt._src.format.table_rows import TABLE_KIND, TABLE_MIN_ROWS
from functional_ckpt._src.storage import committed
from functional_ckpt.errors import CorruptCheckpoint, UnsafeCheckpoint
from tests.exact import assert_exact
from tests.forge import resign


def _state(n: int = 100) -> dict[str, Any]:
    """Many small tensors of several dtypes and ranks, nested, with ties and values
    that break the runs, and tensors that require grad."""
    g = torch.Generator().manual_seed(3)
    layers: dict[str, Any] = {}
    for i in range(n):
        kind = i % 5
        if kind == 0:
            t = torch.randn(3, 4, generator=g)
        elif kind == 1:
            t = torch.randint(0, 100, (7,), generator=g)
        elif kind == 2:
            t = torch.randn(2, 1, 3, generator=g).to(torch.bfloat16)
        elif kind == 3:
            t = torch.tensor(float(i))  # 0-d
        else:
            t = torch.zeros(0, 5)  # empty
        layers[f"l{i}"] = {"w": t.requires_grad_(True) if t.is_floating_point() and i % 3 else t}
    tied = layers["l0"]["w"]
    return {
        "model": layers,
        "tied": tied,  # an alias: not a table row
        "step": 7,
        "more": {f"b{i}": torch.full((2,), i, dtype=torch.int16) for i in range(TABLE_MIN_ROWS)},
        "flags": torch.tensor([True, False]),
    }


def _tables(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    return [e for e in manifest["entries"] if e.get("kind") == TABLE_KIND]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_many_tensors_are_written_as_tables_and_restored_exactly(tmp_path: Path) -> None:
    state = _state()
    path = fc.save(tmp_path / "ck", state).path
    manifest = committed.read_manifest(path)
    assert manifest["version"] == naming.TABLES_VERSION
    tables = _tables(manifest)
    # the model's nodes and tensors in one, up to the tie; then "more" and "flags"
    assert [len(t["fqn"]) for t in tables] == [100, TABLE_MIN_ROWS + 1]
    assert [len(t["is_node"]) for t in tables] == [201, TABLE_MIN_ROWS + 2]
    assert all(e.get("kind") != "tensor" or "alias" in e for e in manifest["entries"])
    back = fc.restore(path, state)
    assert_exact(fc.codec.to_python(back), state)
    back = fc.restore(path)  # no template: requires_grad as saved
    assert back["model"]["l2"]["w"].requires_grad and not back["model"]["l0"]["w"].requires_grad
    assert back["tied"] is back["model"]["l0"]["w"]
    assert fc.verify(path).ok
    import torch.distributed.checkpoint as dcp

    plain = {f"model.l{i}.w": torch.empty_like(state["model"][f"l{i}"]["w"]) for i in range(100)}
    dcp.load(plain, checkpoint_id=str(path))  # stock DCP reads .metadata, as before
    assert all(
        torch.equal(plain[f"model.l{i}.w"], state["model"][f"l{i}"]["w"]) for i in range(100)
    )


def test_few_tensors_keep_the_version_older_readers_know(tmp_path: Path) -> None:
    state = {f"t{i}": torch.ones(2) for i in range(TABLE_MIN_ROWS - 1)}
    path = fc.save(tmp_path / "ck", state).path
    manifest = committed.read_manifest(path)
    assert manifest["version"] == naming.ONE_MANIFEST_VERSION and not _tables(manifest)
    assert committed.check_committed(path)["version"] == naming.ONE_MANIFEST_VERSION


def test_a_reader_of_version_2_refuses_tables_as_newer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = fc.save(tmp_path / "ck", _state()).path
    monkeypatch.setattr(committed, "FORMAT_VERSION", naming.PARTS_VERSION)
    with pytest.raises(CorruptCheckpoint, match=r"newer format .*upgrade functional_ckpt"):
        fc.restore(path)


def _u(width: int, *values: int) -> bytes:
    return struct.pack("<" + "BHIQ"[[1, 2, 4, 8].index(width)] * len(values), *values)


def _table_edit(edit: Callable[[dict[str, Any], dict[str, Any]], None]) -> Callable[..., None]:
    def apply(m: dict[str, Any]) -> None:
        edit(m, _tables(m)[0])

    return apply


def _set(field: str, value: Any) -> Callable[..., None]:
    return _table_edit(lambda m, t: t.__setitem__(field, value))


def _row(field: str, width: int, value: int, row: int) -> Callable[..., None]:
    def edit(m: dict[str, Any], t: dict[str, Any]) -> None:
        at = row * width
        t[field] = t[field][:at] + _u(width, value) + t[field][at + width :]

    return _table_edit(edit)


def _row0(field: str, width: int, value: int) -> Callable[..., None]:
    return _row(field, width, value, 0)


def _dup_row(m: dict[str, Any], t: dict[str, Any]) -> None:
    t["keys"][1] = t["keys"][0]  # rows 0 and 1 share a one-key path


def _plain_twin(m: dict[str, Any], t: dict[str, Any]) -> None:
    m["entries"].append({"path": [t["keys"][0]], "kind": "value", "value": 1})


def _key_under_row(m: dict[str, Any], t: dict[str, Any]) -> None:
    m["entries"].append({"path": [t["keys"][0], "x"], "kind": "value", "value": 1})


def _row_under_value(m: dict[str, Any], t: dict[str, Any]) -> None:
    m["entries"].insert(0, {"path": ["v"], "kind": "value", "value": 1})
    t["keys"][0] = "v"
    t["keys"].insert(1, "under")
    t["path_len"] = _u(2, 2) + t["path_len"][2:]


def _table_as_per_rank(m: dict[str, Any], t: dict[str, Any]) -> None:
    m["ranks"][0]["entries"].append(t)


FORGERIES: dict[str, tuple[Callable[..., None], type[Exception], str]] = {
    "a field missing": (_table_edit(lambda m, t: t.pop("hcrc32")), CorruptCheckpoint, "fields"),
    "a field added": (_set("extra", 1), CorruptCheckpoint, "invalid tensor table"),
    "an unknown file": (_set("file", "__9_0.distcp"), CorruptCheckpoint, "unknown file"),
    "the .metadata as file": (_set("file", ".metadata"), CorruptCheckpoint, "unknown file"),
    "a key not a string": (
        _table_edit(lambda m, t: t["keys"].__setitem__(0, 5)),
        CorruptCheckpoint,
        "key paths",
    ),
    "a DCP key not a string": (
        _table_edit(lambda m, t: t["fqn"].__setitem__(3, None)),
        CorruptCheckpoint,
        "DCP keys",
    ),
    "an unknown dtype": (
        _set("dtypes", ["float32", "nope", "bfloat16", "int64"]),
        CorruptCheckpoint,
        "dtype",
    ),
    "a short column": (
        _table_edit(lambda m, t: t.__setitem__("offset", t["offset"][:-8])),
        CorruptCheckpoint,
        "offset",
    ),
    "a column not bytes": (_set("crc32", [1, 2]), CorruptCheckpoint, "crc32"),
    "a path of no keys": (_row0("path_len", 2, 0), CorruptCheckpoint, "key path lengths"),
    "paths longer than the keys": (
        _row0("path_len", 2, 3),
        CorruptCheckpoint,
        "key path lengths",
    ),
    "a dtype index out of range": (_row0("dtype", 1, 9), CorruptCheckpoint, "dtype"),
    "requires_grad neither 0 nor 1": (
        _row0("requires_grad", 1, 2),
        CorruptCheckpoint,
        "requires_grad",
    ),
    "65 dimensions": (_row0("ndim", 1, 65), CorruptCheckpoint, "rank"),
    "a huge shape": (
        _table_edit(lambda m, t: t.__setitem__("shape", _u(8, 1 << 61) + t["shape"][8:])),
        UnsafeCheckpoint,
        "row 0: 't0' declares an impossible shape",
    ),
    "bytes past the file": (_row0("offset", 8, 1 << 40), UnsafeCheckpoint, "beyond the end"),
    "data before the blob": (_row("data_offset", 8, 0, 1), UnsafeCheckpoint, "row 1"),
    "a blob past the file": (_row0("length", 8, 1 << 50), UnsafeCheckpoint, "beyond the end"),
    "two rows of one key": (_table_edit(_dup_row), CorruptCheckpoint, "duplicate key"),
    "a row and an entry of one key": (
        _table_edit(_plain_twin),
        CorruptCheckpoint,
        "duplicate key",
    ),
    "a key under a row": (_table_edit(_key_under_row), CorruptCheckpoint, "leaf"),
    "a row under a value": (_table_edit(_row_under_value), CorruptCheckpoint, "under the leaf"),
    "a table among a rank's entries": (
        _table_edit(_table_as_per_rank),
        CorruptCheckpoint,
        "rank 0 entry 3: invalid key path",
    ),
    "a row's is_node neither 0 nor 1": (_row0("is_node", 1, 2), CorruptCheckpoint, "is_node"),
    "a tensor row made a node": (_row0("is_node", 1, 1), CorruptCheckpoint, "DCP keys for"),
}


@pytest.mark.parametrize("name", sorted(FORGERIES))
def test_a_forged_table_is_refused_naming_the_entry(tmp_path: Path, name: str) -> None:
    state: dict[str, Any] = {f"t{i}": torch.full((3, 4), float(i)) for i in range(40)}
    state["loader"] = {"pos": 1, "epoch": 0}  # a per-rank subtree
    path = fc.save(tmp_path / "ck", state).path
    edit, error, words = FORGERIES[name]
    resign(path, edit)
    with pytest.raises(error, match=words) as got:
        fc.restore(path, state)
    assert "manifest.msgpack" in str(got.value) and "entry" in str(got.value), str(got.value)
    assert not fc.verify(path).ok  # the checker refuses it the same way
