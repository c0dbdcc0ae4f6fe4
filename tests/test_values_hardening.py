"""Values a save must store exactly or refuse by name, and manifests a reader must refuse.

Covers lazy conj/neg views, writes that bypass version counters during an unstaged
save, the format's limits (refused at save exactly where a load would refuse),
hostile manifests (hash floods, memory bombs, overlapping chunks) and raw errors
on unsupported states.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import math
import os
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path
from types import ModuleType
from typing import Any

import msgpack
import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src import codec, limits
from functional_ckpt._src.codec import encoding, table
from functional_ckpt._src.format import entries, keys, naming, view
from functional_ckpt._src.format.checksum import crc32
from functional_ckpt._src.format.table_rows import TABLE_MIN_ROWS
from functional_ckpt._src.limits import LIMITS
from functional_ckpt._src.save import plan, staging
from functional_ckpt._src.storage import committed
from functional_ckpt.errors import (
    CorruptCheckpoint,
    ModifiedDuringSave,
    UnsafeCheckpoint,
    UnsupportedValue,
)
from tests import prefork
from tests.patience import HANG, eventually

P = 2**61 - 1  # hash(k * P) == hash(0) for every int k


def entries_of(path: Path) -> dict[tuple[str, ...], dict[str, Any]]:
    raw = codec.decode((path / naming.MANIFEST).read_bytes())
    assert isinstance(raw, dict)
    return {tuple(e["path"]): e for e in raw["entries"]}


def rewrite_manifest(path: Path, edit: Any) -> None:
    """Apply ``edit`` to the decoded manifest and re-sign it in the commit marker."""
    raw = codec.decode((path / naming.MANIFEST).read_bytes())
    edit(raw)
    write_signed(path, codec.encode(raw))


def write_signed(path: Path, data: bytes) -> None:
    """Replace the manifest with ``data`` and re-sign it, as anyone with write access can."""
    (path / naming.MANIFEST).write_bytes(data)
    marker = codec.decode((path / naming.COMMIT_MARKER).read_bytes())
    assert isinstance(marker, dict)
    marker.update(manifest_size=len(data), manifest_crc32=crc32(data))
    (path / naming.COMMIT_MARKER).write_bytes(codec.encode(marker))


def nothing_written(parent: Path) -> bool:
    return not parent.exists() or not any(parent.iterdir())


# --------------------------------------------------------------------------- conj / neg views


def complex_tensor() -> torch.Tensor:
    return torch.complex(torch.arange(6.0), torch.arange(6.0) + 10).reshape(2, 3)


@pytest.mark.parametrize("mode", ["sync", "copy", "write", "none"])
def test_conj_view_and_its_base_keep_their_own_values(tmp_path: Path, mode: str) -> None:
    z = complex_tensor()
    state = {"z": z, "z_conj": z.conj(), "imag_neg": z.conj().imag}
    assert state["imag_neg"].is_neg()
    dest = tmp_path / "c"
    if mode == "sync":
        fc.save(dest, state)
    else:
        fc.save_async(dest, state, staging=mode).result()  # type: ignore[arg-type]
    out = fc.restore(dest)
    assert torch.equal(out["z"], z)
    assert torch.equal(out["z_conj"], z.conj().resolve_conj())
    assert torch.equal(out["imag_neg"], -torch.arange(6.0).reshape(2, 3) - 10)
    assert not out["z_conj"].is_conj() and not out["imag_neg"].is_neg()
    assert fc.verify(dest).ok
    assert all("alias" not in e for e in entries_of(dest).values())


def test_a_conj_view_alone_saves(tmp_path: Path) -> None:
    z = complex_tensor()
    fc.save(tmp_path / "c", {"zc": z.conj()})
    assert torch.equal(fc.restore(tmp_path / "c")["zc"], z.conj().resolve_conj())


def test_identical_views_still_share_one_copy(tmp_path: Path) -> None:
    z = complex_tensor()
    fc.save(tmp_path / "c", {"a": z.conj(), "b": z.conj(), "c": z})
    entries = entries_of(tmp_path / "c")
    assert entries[("b",)]["alias"] == ["a"]
    assert "alias" not in entries[("c",)]
    out = fc.restore(tmp_path / "c")
    assert torch.equal(out["b"], z.conj().resolve_conj())
    assert torch.equal(out["c"], z)


# --------------------------------------------------------------------------- unstaged writes


def _mutate_during_write(monkeypatch: pytest.MonkeyPatch, mutate: Any, at: int) -> None:
    """Run ``mutate`` on the writing thread once tensor ``at`` is written."""
    original = staging.version_guard

    def guard(*args: Any) -> tuple[Any, Any, Any]:
        after_each, check, moved = original(*args)

        def hook(i: int) -> None:
            after_each(i)
            if i == at:
                mutate()

        return hook, check, moved

    monkeypatch.setattr(staging, "version_guard", guard)


@pytest.mark.parametrize("how", ["data", "numpy"])
@pytest.mark.parametrize("at", [0, 1])
def test_unstaged_save_refuses_writes_that_bypass_version_counters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, at: int
) -> None:
    p = torch.nn.Parameter(torch.zeros(1000))
    q = torch.ones(10)
    before = p._version

    def mutate() -> None:
        if how == "data":
            p.data.add_(1)
        else:
            p.detach().numpy()[:] += 1

    _mutate_during_write(monkeypatch, mutate, at)
    dest = tmp_path / "ckpt" / "s"
    error = fc.save_async(dest, {"p": p, "q": q}, staging="none").exception()
    assert p._version == before  # the version counter saw nothing
    assert isinstance(error, ModifiedDuringSave), error
    assert "'p'" in str(error) and "'q'" not in str(error)
    assert not dest.exists() and list(dest.parent.iterdir()) == []


def test_unstaged_save_of_an_untouched_state_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = torch.arange(1000.0)
    _mutate_during_write(monkeypatch, lambda: None, 0)
    fc.save_async(tmp_path / "s", {"p": p, "q": torch.ones(3)}, staging="none").result()
    assert torch.equal(fc.restore(tmp_path / "s")["p"], p)


# --------------------------------------------------------------------------- limits


def deep(depth: int, leaf: Any) -> dict[str, Any]:
    state: Any = leaf
    for i in range(depth - 1):
        state = {f"k{i}": state}
    return {"top": state}


def test_one_table_of_limits() -> None:
    assert committed.MAX_MANIFEST_BYTES == LIMITS.manifest_bytes <= 1 << 28
    assert table.MAX_ENCODE_DEPTH == LIMITS.encode_depth < LIMITS.decode_depth
    for private in ("MAX_TREE_DEPTH", "MAX_DIM"):
        assert not hasattr(view, private)
    assert dataclasses.is_dataclass(limits.Limits)
    with pytest.raises(dataclasses.FrozenInstanceError):
        LIMITS.key_depth = 1  # type: ignore[misc]


def test_key_paths_at_the_limit_round_trip(tmp_path: Path) -> None:
    state = deep(LIMITS.key_depth, torch.ones(2))
    fc.save(tmp_path / "ok", state)
    out = fc.restore(tmp_path / "ok")
    assert len(next(iter(out.keys(include_nested=True, leaves_only=True)))) == LIMITS.key_depth


@pytest.mark.parametrize(
    ("state", "fragment"),
    [
        (deep(LIMITS.key_depth + 1, torch.ones(2)), "257 levels deep"),
        ({"t": torch.empty([1] * (LIMITS.tensor_ndim + 1))}, "65 dimensions"),
        ({"t": torch.empty(0, 2**62)}, "dimension of 4611686018427387904"),
        ({"t": torch.empty(0, 2**61, dtype=torch.float64)}, None),
    ],
)
def test_save_refuses_what_load_would_refuse(
    tmp_path: Path, state: dict[str, Any], fragment: str | None
) -> None:
    if fragment is None:  # within the limits: saved and loaded back
        fc.save(tmp_path / "c" / "s", state)
        assert fc.restore(tmp_path / "c" / "s")["t"].shape == state["t"].shape
        return
    with pytest.raises(UnsupportedValue, match=fragment) as info:
        fc.save(tmp_path / "c" / "s", state)
    assert "state[" in str(info.value)
    assert nothing_written(tmp_path / "c")
    with pytest.raises(UnsupportedValue, match=fragment):
        fc.save_async(tmp_path / "c" / "s", state)
    assert nothing_written(tmp_path / "c")


def test_load_refuses_each_limit_one_past_it(tmp_path: Path) -> None:
    fc.save(tmp_path / "c", {"t": torch.ones(2)})

    def too_deep(raw: dict[str, Any]) -> None:
        raw["entries"][0]["path"] = ["k"] * (LIMITS.key_depth + 1)

    rewrite_manifest(tmp_path / "c", too_deep)
    with pytest.raises(CorruptCheckpoint, match="invalid key path"):
        fc.restore(tmp_path / "c")


def test_values_too_large_for_a_manifest_are_refused_before_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(plan, "LIMITS", dataclasses.replace(LIMITS, manifest_bytes=1 << 20))
    state = {"small": b"x" * 100, "big": b"x" * (1 << 20), "t": torch.ones(1)}
    with pytest.raises(UnsupportedValue, match=r"state\['big'\]"):
        fc.save(tmp_path / "c" / "s", state)
    many = {f"t{i}": torch.ones(1) for i in range(5000)}  # entries alone: about 1.3 MB
    with pytest.raises(UnsupportedValue, match="5000 entries need more than"):
        fc.save(tmp_path / "c" / "s", many)
    assert nothing_written(tmp_path / "c")


def test_a_manifest_grown_past_the_limit_by_its_chunks_is_never_committed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A multi-rank save's chunks (one per rank of every sharded tensor) are known only
    # to its coordinator, after the plan passed: the commit refuses what a reader would.
    from functional_ckpt._src.save import local

    monkeypatch.setattr(local, "LIMITS", dataclasses.replace(LIMITS, manifest_bytes=4000))
    # within the plan's bound; fewer than a tensor table's rows, so one map per chunk
    state = {f"t{i}": torch.ones(1) for i in range(TABLE_MIN_ROWS - 1)}
    with pytest.raises(UnsupportedValue, match="more than the 4000 a reader accepts"):
        fc.save(tmp_path / "c" / "s", state)
    assert nothing_written(tmp_path / "c")


def test_values_dense_in_containers_are_refused_at_save(tmp_path: Path) -> None:
    state = {"t": torch.ones(1), "lists": [[] for _ in range(200_000)]}
    with pytest.raises(UnsupportedValue, match="decode budget"):
        fc.save(tmp_path / "c" / "s", state)
    assert nothing_written(tmp_path / "c")


# --------------------------------------------------------------------------- hostile decoding


def ext_array(code: int, items: list[bytes]) -> bytes:
    """A msgpack array opened by an empty container-marker ext (tuple, set, ...)."""
    header = b"\xdd" + struct.pack(">I", len(items) + 1)
    return header + b"\xc7\x00" + bytes([code]) + b"".join(items)


def packed_int(n: int) -> bytes:
    return bytes(msgpack.packb(n, default=encoding._default))


FLOOD = [k * P for k in range(1, 20_001)]


@pytest.mark.parametrize("kind", ["map", "set", "frozenset", "OrderedDict"])
def test_hash_flood_is_refused(kind: str) -> None:
    keys = [packed_int(k) for k in FLOOD]
    if kind == "map":
        data = b"\xdf" + struct.pack(">I", len(keys)) + b"".join(k + b"\x00" for k in keys)
    elif kind == "OrderedDict":
        data = ext_array(table.EXT_ORDERED_DICT, [b for k in keys for b in (k, b"\x00")])
    else:
        code = table.EXT_SET if kind == "set" else table.EXT_FROZENSET
        data = ext_array(code, keys)
    with pytest.raises(UnsafeCheckpoint, match="share one hash value"):
        codec.decode(data, source="m")


def test_a_few_equal_hashes_are_fine_and_a_flood_is_refused_at_save() -> None:
    few = {k * P: k for k in range(1, LIMITS.equal_hashes + 1)}
    assert codec.decode(codec.encode(few)) == few
    assert codec.decode(codec.encode(set(few))) == set(few)
    with pytest.raises(UnsupportedValue, match="share one hash value"):
        codec.encode(set(FLOOD[:100]))
    with pytest.raises(UnsupportedValue, match="share one hash value"):
        codec.check_encodable({"m": dict.fromkeys(FLOOD[:100], 0)})


def test_a_flooded_manifest_is_refused_by_restore_and_verify(tmp_path: Path) -> None:
    fc.save(tmp_path / "c", {"t": torch.ones(2), "v": 1})
    placeholder = b"the flood goes here"

    def mark(raw: dict[str, Any]) -> None:
        raw["entries"][-1]["value"] = placeholder

    rewrite_manifest(tmp_path / "c", mark)
    # encode() refuses a flood (and building one is quadratic): write its bytes directly
    flood = ext_array(table.EXT_SET, [packed_int(k) for k in FLOOD])
    data = (tmp_path / "c" / naming.MANIFEST).read_bytes()
    write_signed(tmp_path / "c", data.replace(msgpack.packb(placeholder), flood))
    with pytest.raises(UnsafeCheckpoint, match="hash flood"):
        fc.restore(tmp_path / "c")
    assert not fc.verify(tmp_path / "c").ok


def test_int_keyed_nodes_refuse_a_flood_at_save_and_at_load(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedValue, match=r"state\['d'\]: .*share one hash value"):
        fc.save(tmp_path / "c", {"d": {k: torch.ones(1) for k in FLOOD[:100]}})
    fc.save(tmp_path / "c", {"d": {i: torch.ones(1) for i in range(100)}})

    def flood(raw: dict[str, Any]) -> None:
        for e in raw["entries"]:  # the 100 tensors lie in a table, without "path"
            if e.get("path", [None])[-1] == keys.NODE_KEY:
                e["value"]["keys"] = FLOOD[:100]

    rewrite_manifest(tmp_path / "c", flood)
    with pytest.raises(UnsafeCheckpoint, match="hash flood"):
        fc.codec.to_python(fc.restore(tmp_path / "c"))


def test_empty_container_bomb_is_refused_within_a_memory_budget() -> None:
    n = 4 << 20
    for body in (b"\x80", b"\x90"):  # empty maps, empty arrays
        data = b"\xdd" + struct.pack(">I", n) + body * n
        tracemalloc.start()
        try:
            with pytest.raises(UnsafeCheckpoint, match="decode budget"):
                codec.decode(data, source="m")
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 32 * len(data), peak / len(data)


_READ_BOMB = """\
import sys
import functional_ckpt as fc
from functional_ckpt._src.restore import api  # everything a read imports, before the baseline
fc.restore, fc.verify
def status(key):  # this process's own (getrusage's maxrss may be its parent's, from fork)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key))
base = status("VmRSS:")
out = []
try:
    fc.restore(sys.argv[1])
    out.append("restored")
except fc.CheckpointError as e:
    out.append(type(e).__name__ + ": " + str(e))
report = fc.verify(sys.argv[1])
out.append("verify ok" if report.ok else "verify not ok: " + str(report))
grew = (status("VmHWM:") - base) / 1024
print(grew)
print("\\n".join(out))
"""


@pytest.mark.parametrize("cell", [b"\x80", b"\x90", b"\x91\x00"], ids=["maps", "arrays", "ones"])
def test_a_hostile_4_mib_manifest_is_refused_in_under_64_mib(tmp_path: Path, cell: bytes) -> None:
    """Regression: 4 MiB of empty maps inside a real, re-signed manifest was refused only
    after the decoder built about a million containers (one per 4 bytes): peak RSS +77 MB.
    The budget is one per 8 bytes: refused by ``restore`` and ``verify`` within 64 MiB,
    measured in a child process (peak RSS above its baseline; no timing)."""
    path = tmp_path / "c"
    fc.save(path, {"t": torch.ones(1)})
    raw = codec.decode((path / naming.MANIFEST).read_bytes())
    assert isinstance(raw, dict)
    raw["metadata"]["bomb"] = b"bomb goes here"
    n = (4 << 20) // len(cell)
    bomb = b"\xdd" + struct.pack(">I", n) + cell * n
    write_signed(path, codec.encode(raw).replace(msgpack.packb(b"bomb goes here"), bomb))
    done = subprocess.run(
        [sys.executable, "-c", _READ_BOMB, str(path)],
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    assert done.returncode == 0, done.stderr
    grew, outcome = done.stdout.split("\n", 1)
    restored, verified = outcome.split("\nverify ", 1)
    assert restored.startswith("UnsafeCheckpoint: ") and "memory bomb" in restored, outcome
    assert verified.startswith("not ok") and "memory bomb" in verified, outcome
    assert float(grew) < 64, f"peak RSS grew by {grew} MiB"


def test_the_container_budget_matches_between_encode_and_decode() -> None:
    free = LIMITS.decode_free_containers
    fits: list[list[int]] = [[] for _ in range(free)]
    assert codec.decode(codec.encode(fits)) == fits
    bomb: list[list[int]] = [[] for _ in range(2 * free)]
    with pytest.raises(UnsupportedValue, match="decode budget"):
        codec.encode(bomb)
    with pytest.raises(UnsafeCheckpoint, match="decode budget"):
        codec.decode(msgpack.packb(bomb))


# --------------------------------------------------------------------------- chunk coverage


def parse_chunks(tmp_path: Path, shape: list[int], boxes: list[tuple[list[int], list[int]]]) -> Any:
    """Parse a manifest whose one float32 tensor is stored as ``boxes`` (offsets, sizes)."""
    size = 4 * max(1, max(math.prod(s) for _, s in boxes))
    (tmp_path / "f").write_bytes(b"\0" * size)
    chunks = [
        {
            "offsets": o,
            "sizes": s,
            "file": "f",
            "offset": 0,
            "length": size,
            "data_offset": 0,
            "nbytes": 4 * math.prod(s),
            "crc32": 0,
            "hcrc32": 0,
        }
        for o, s in boxes
    ]
    raw = {
        "files": {"f": {"size": size}},
        "entries": [
            {
                "path": ["w"],
                "kind": "tensor",
                "fqn": "w",
                "dtype": "float32",
                "shape": shape,
                "chunks": chunks,
            }
        ],
    }
    return view.parse_checkpoint(raw, tmp_path).view(0)


def test_real_layouts_cover_their_tensor(tmp_path: Path) -> None:
    quadrants = [([r, c], [2, 3]) for r in (0, 2) for c in (0, 3)]
    assert len(parse_chunks(tmp_path, [4, 6], quadrants).tensors[("w",)].chunks) == 4
    # bricks: rows split unevenly, each row band split at different columns
    bricks = [([0, 0], [1, 2]), ([0, 2], [1, 4]), ([1, 0], [3, 5]), ([1, 5], [3, 1])]
    parse_chunks(tmp_path, [4, 6], bricks)
    rows = [([i], [1]) for i in range(1000)]
    parse_chunks(tmp_path, [1000], rows)
    parse_chunks(tmp_path, [4], [([0], [4]), ([2], [0])])  # an empty chunk covers nothing


@pytest.mark.parametrize("count", [2, 65, 1000])
def test_overlapping_chunks_are_refused_however_many(tmp_path: Path, count: int) -> None:
    # every chunk covers elements 0-1; the element counts add up to the tensor's
    boxes = [([0], [2]) for _ in range(count)]
    with pytest.raises(CorruptCheckpoint, match="chunks of 'w' overlap"):
        parse_chunks(tmp_path, [2 * count], boxes)


def test_overlap_hiding_a_hole_is_refused(tmp_path: Path) -> None:
    # 4 + 4 + 1 elements of a 3x3 tensor: (1, 1) twice and (2, 0) never
    boxes = [([0, 0], [2, 2]), ([1, 1], [2, 2]), ([0, 2], [1, 1])]
    with pytest.raises(CorruptCheckpoint, match="chunks of 'w' overlap"):
        parse_chunks(tmp_path, [3, 3], boxes)


def test_coverage_of_a_pathological_grid_is_bounded() -> None:
    n = 3000  # each row split at its own column: 3000 x 3000 cells for 6000 chunks
    boxes = [b for i in range(1, n) for b in (([i, 0], [1, i]), ([i, i], [1, n - i]))]
    boxes.append(([0, 0], [1, n]))
    with pytest.raises(UnsafeCheckpoint, match="pieces"):
        entries.check_coverage([n, n], boxes, "chunks of 'w'")
    entries.check_coverage([n, n], [([i, 0], [1, n]) for i in range(n)], "chunks of 'w'")


def test_65_overlapping_chunks_in_a_real_checkpoint(tmp_path: Path) -> None:
    n = 65
    fc.save(tmp_path / "c", {"w": torch.arange(2.0 * n)})

    def overlap(raw: dict[str, Any]) -> None:
        (entry,) = (e for e in raw["entries"] if e["path"] == ["w"])
        (chunk,) = entry["chunks"]
        blob = (tmp_path / "c" / chunk["file"]).read_bytes()[
            chunk["offset"] : chunk["offset"] + chunk["length"]
        ]
        at = chunk["data_offset"] - chunk["offset"]
        # every chunk is elements 0-1, with checksums that match the bytes it names
        crc = crc32(blob[at : at + 8])
        hcrc = crc32(blob[at + 8 :], crc32(blob[:at]))
        box = {"offsets": [0], "sizes": [2], "nbytes": 8, "crc32": crc, "hcrc32": hcrc}
        entry["chunks"] = [dict(chunk, **box) for _ in range(n)]

    rewrite_manifest(tmp_path / "c", overlap)
    with pytest.raises(CorruptCheckpoint, match="chunks of 'w' overlap"):
        fc.restore(tmp_path / "c")
    report = fc.verify(tmp_path / "c")
    assert not report.ok


# --------------------------------------------------------------------------- unsupported states


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: torch.eye(3).to_sparse(), "sparse_coo"),
        (lambda: torch.eye(3).to_sparse_csr(), "sparse_csr"),
        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested"),
        (lambda: torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8), "quantized"),
    ],
)
def test_unsupported_tensors_are_refused_by_name(tmp_path: Path, make: Any, fragment: str) -> None:
    t = make()
    for state in ({"x": {"y": t}}, {"x": {"y": t}, "alias": t}):
        with pytest.raises(UnsupportedValue, match=rf"state\[\('x', 'y'\)\].*{fragment}"):
            fc.save(tmp_path / "c" / "s", state)
    assert nothing_written(tmp_path / "c")


def test_recursive_containers_are_refused_by_name(tmp_path: Path) -> None:
    with_tensor: list[Any] = [torch.ones(1)]
    with_tensor.append(with_tensor)
    cfg: dict[str, Any] = {"a": 1}
    cfg["self"] = cfg
    plain: list[Any] = [1]
    plain.append(plain)
    for state, fragment in (
        ({"x": with_tensor}, r"state\[\('x', '1'\)\]: the container contains itself"),
        ({"cfg": cfg}, r"state\[\('cfg', 'self'\)\]: the container contains itself"),
        ({"v": plain}, r"state\['v'\].*nested deeper than"),
    ):
        with pytest.raises(UnsupportedValue, match=fragment):
            fc.save(tmp_path / "c" / "s", state)
    assert nothing_written(tmp_path / "c")


def test_a_metric_too_large_for_a_float_is_refused_by_name(tmp_path: Path) -> None:
    with fc.CheckpointManager(tmp_path / "run", save=fc.every_steps(1)) as mgr:
        with pytest.raises(UnsupportedValue, match=r"metrics\['x'\]"):
            mgr.maybe_save({"t": torch.ones(1)}, step=1, metrics={"x": 10**400})
        assert mgr.maybe_save({"t": torch.ones(1)}, step=2, metrics={"x": 1.0})


# --------------------------------------------------------------------------- the fault classes


def test_fault_classes_find_nothing_wrong(tmp_path: Path) -> None:
    repo = Path(__file__).resolve().parent.parent
    script = repo / "benchmarks" / "faults_values.py"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]),
    }
    out = tmp_path / "faults.json"
    classes = ["view-bit-aliasing", "limit-symmetry", "chunk-coverage", "unstaged-bypass"]
    prefork.run(
        [sys.executable, str(script), "--quick", "--json", str(out), "--classes", *classes],
        check=True,
        capture_output=True,
        timeout=HANG,
        env=env,
    )
    report = json.loads(out.read_text())
    assert [r["name"] for r in report["results"]] == classes
    for r in report["results"]:
        assert r["trials"] > 0 and r["wrong"] == 0 and r["raw"] == 0, r


@functools.cache
def faults_values() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "faults_values.py"
    spec = importlib.util.spec_from_file_location("fc_faults_values", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fc_faults_values"] = module  # for its dataclasses
    spec.loader.exec_module(module)
    return module


def test_unstaged_bypass_commits_a_writer_stopped_mid_add(tmp_path: Path) -> None:
    """Regression: on a loaded machine the class's writer thread was descheduled in the
    middle of a numpy add for a whole save; the save rightly committed the half-added
    tensor its memory held, and the class counted it wrong (a torn tensor restored)."""
    fv = faults_values()
    p = torch.nn.Parameter(torch.zeros(1 << 20))
    a = p.detach().numpy()
    half = a.size // 2
    a[:half] += 1  # the first add, stopped halfway until the save has committed
    path = tmp_path / "ck"
    stopped = [True]

    def add() -> None:
        if stopped:
            stopped.clear()
            eventually(path.exists, "the commit")
            a[half:] += 1
        else:
            a[:] += 1

    res = fv.ClassResult("unstaged-bypass")
    fv.bypass(res, path, p, add, "stopped mid-add")
    assert (res.ok, res.wrong, res.raw) == (1, 0, 0), res.problems
    assert res.notes == {"committed in the middle of one add": 1}


@pytest.mark.parametrize(
    ("values", "floor", "ceiling", "held"),
    [
        ([2, 2], 1, 3, True),
        ([3, 2], 1, 3, True),  # add 3 under way
        ([1, 3], 0, 3, False),  # two adds apart: a mix of two moments
        ([2, 2], 3, 5, False),  # older than the adds finished before the save
        ([3, 2], 0, 2, False),  # add 3 began after the save
        ([2, 2.5], 0, 3, False),
    ],
)
def test_unstaged_bypass_accepts_only_states_the_memory_held(
    values: list[float], floor: int, ceiling: int, held: bool
) -> None:
    assert faults_values().held(torch.tensor(values), floor, ceiling) is held


@pytest.mark.parametrize("order", ["value after the tensor", "value before the tensor"])
def test_a_key_under_a_leaf_is_refused(tmp_path: Path, order: str) -> None:
    """Regression: a re-signed manifest with a value entry at ``a/z`` under the tensor
    ``a`` was accepted, and the tensor silently disappeared from the restored state."""
    from tests.forge import resign

    path = tmp_path / "ck"
    fc.save(path, {"a": torch.arange(3.0), "b": 1})

    def edit(m: dict[str, Any]) -> None:
        hidden = {"kind": "value", "path": ["a", "z"], "value": 5}
        at = next(i for i, e in enumerate(m["entries"]) if e["path"] == ["a"])
        m["entries"].insert(at + 1 if order == "value after the tensor" else at, hidden)

    resign(path, edit)
    with pytest.raises(fc.errors.CorruptCheckpoint, match="under"):
        fc.restore(path)
    with pytest.raises(fc.errors.CorruptCheckpoint, match="under"):
        fc.inspect(path)
    assert not fc.verify(path).ok


def test_a_tensorclass_is_refused_with_the_way_to_store_it(tmp_path: Path) -> None:
    from tensordict import tensorclass

    @tensorclass
    class Obs:
        x: torch.Tensor
        step: int

    obs = Obs(x=torch.arange(6.0).reshape(3, 2), step=4, batch_size=[3])
    advice = r"Obs is a tensorclass.*obj\.to_tensordict\(\).*Obs\.from_tensordict"
    # Not "a dataclass that is not registered; register it": registering cannot help.
    for state, where in (({"obs": obs}, r"\['obs'\]"), ({"obs": [obs]}, r"\['obs'\]\[0\]")):
        with pytest.raises(UnsupportedValue, match=rf"state{where}.*{advice}"):
            fc.save(tmp_path / "c", state)
    with pytest.raises(UnsupportedValue, match=rf"register\(.*Obs\): .*{advice}"):
        codec.register(Obs)
    assert not (tmp_path / "c").exists()

    # What the message says works, batch size included.
    fc.save(tmp_path / "c", {"obs": obs.to_tensordict()})
    back = Obs.from_tensordict(fc.restore(tmp_path / "c")["obs"])
    assert isinstance(back, Obs) and back.batch_size == (3,) and back.step == 4
    assert torch.equal(back.x, obs.x)
