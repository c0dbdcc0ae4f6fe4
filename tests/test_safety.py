"""Hostile and damaged checkpoints: clear errors, no code run, no large allocation."""

from __future__ import annotations

import os
import pickle
import re
import resource
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src import codec
from functional_ckpt._src.format import naming
from tests import forge

MARKER_FILE = Path("/tmp/functional_ckpt_pwned")


class Hostile:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {MARKER_FILE}",))


def make(tmp_path: Path, name: str = "ck") -> Path:
    path = tmp_path / name
    fc.save(path, {"w": torch.arange(16.0), "b": torch.ones(4), "lr": 0.1})
    return path


def rewrite_manifest(path: Path, edit: Any) -> None:
    """Tamper with a manifest the way an attacker would: re-sign the commit marker."""
    manifest = codec.decode((path / naming.MANIFEST).read_bytes())
    edit(manifest)
    raw = codec.encode(manifest)
    (path / naming.MANIFEST).write_bytes(raw)
    os.unlink(path / naming.COMMIT_MARKER)
    forge.sign(path, raw)


@pytest.fixture(autouse=True)
def no_marker() -> Any:
    MARKER_FILE.unlink(missing_ok=True)
    yield
    assert not MARKER_FILE.exists(), "hostile code ran"


def test_hostile_dcp_metadata_in_our_checkpoint(tmp_path: Path) -> None:
    path = make(tmp_path)
    (path / ".metadata").write_bytes(pickle.dumps(Hostile()))
    fc.restore(path)  # for stock readers: never read by ours (no tensor comes from it)
    fc.inspect(path)
    report = fc.verify(path)
    assert not report.ok and any(".metadata" in str(p) for p in report.problems)
    assert any(re.search(r"posix\.system|os\.system", str(p)) for p in report.problems)


def test_hostile_dcp_metadata_in_stock_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "d"
    path.mkdir()
    (path / ".metadata").write_bytes(pickle.dumps(Hostile()))
    with pytest.raises(fc.errors.UnsafeCheckpoint):
        fc.restore(path, {"w": torch.zeros(2)})
    with pytest.raises(fc.errors.UnsafeCheckpoint):
        fc.inspect(path)


@pytest.mark.parametrize("name", ["../escape.distcp", "/etc/passwd", "..", "a/b", ""])
def test_manifest_paths_cannot_escape(tmp_path: Path, name: str) -> None:
    path = make(tmp_path)

    def edit(m: dict[str, Any]) -> None:
        m["files"][name] = m["files"].pop("__0_0.distcp")
        for e in m["entries"]:
            for c in e.get("chunks", []):
                c["file"] = name

    rewrite_manifest(path, edit)
    with pytest.raises(fc.errors.UnsafeCheckpoint, match="unsafe file"):
        fc.restore(path)


def test_symlinked_shard_is_refused(tmp_path: Path) -> None:
    path = make(tmp_path)
    outside = tmp_path / "outside.bin"
    shutil.move(path / "__0_0.distcp", outside)
    os.symlink(outside, path / "__0_0.distcp")
    with pytest.raises(fc.errors.UnsafeCheckpoint, match="symbolic link"):
        fc.restore(path)


def test_declared_size_beyond_file_allocates_nothing(tmp_path: Path) -> None:
    path = make(tmp_path)

    def edit(m: dict[str, Any]) -> None:
        for e in m["entries"]:
            if e.get("path") == ["w"]:
                e["shape"] = [1 << 40]
                e["chunks"][0]["sizes"] = [1 << 40]
                e["chunks"][0]["nbytes"] = 4 << 40

    rewrite_manifest(path, edit)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(fc.errors.UnsafeCheckpoint, match="beyond the end"):
        fc.restore(path)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000  # KiB


def test_declared_bytes_disagree_with_shape(tmp_path: Path) -> None:
    path = make(tmp_path)

    def edit(m: dict[str, Any]) -> None:
        for e in m["entries"]:
            if e.get("path") == ["w"]:
                e["shape"] = [1 << 30]
                e["chunks"][0]["sizes"] = [1 << 30]

    rewrite_manifest(path, edit)
    with pytest.raises(fc.errors.UnsafeCheckpoint, match="declares"):
        fc.restore(path)


def test_deeply_nested_manifest_value(tmp_path: Path) -> None:
    path = make(tmp_path)
    raw = b"\x91" * 100_000 + b"\xc0"  # 100k nested one-element arrays
    (path / naming.MANIFEST).write_bytes(raw)
    os.unlink(path / naming.COMMIT_MARKER)
    forge.sign(path, raw)
    with pytest.raises((fc.errors.UnsafeCheckpoint, fc.errors.CorruptCheckpoint)):
        fc.restore(path)


def test_bit_flip_in_manifest_is_detected(tmp_path: Path) -> None:
    path = make(tmp_path)
    raw = bytearray((path / naming.MANIFEST).read_bytes())
    raw[len(raw) // 2] ^= 0x10
    (path / naming.MANIFEST).write_bytes(bytes(raw))
    with pytest.raises(fc.errors.CorruptCheckpoint, match="manifest"):
        fc.restore(path)


def test_bit_flip_in_tensor_data_names_the_key(tmp_path: Path) -> None:
    path = make(tmp_path)
    manifest = codec.decode((path / naming.MANIFEST).read_bytes())
    entry = next(e for e in manifest["entries"] if e["path"] == ["w"])
    offset = entry["chunks"][0]["data_offset"] + 5
    with open(path / "__0_0.distcp", "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(fc.errors.CorruptCheckpoint, match=r"'w' in __0_0.distcp: checksum"):
        fc.restore(path)
    report = fc.verify(path)
    assert not report.ok and [str(p.where) for p in report.problems] == ["'w'"]


def test_bit_flip_in_blob_header_is_caught_by_verify(tmp_path: Path) -> None:
    path = make(tmp_path)
    with open(path / "__0_0.distcp", "r+b") as f:
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 1]))
    report = fc.verify(path)
    assert not report.ok and "headers" in str(report)


def test_truncated_shard_names_the_file(tmp_path: Path) -> None:
    path = make(tmp_path)
    size = (path / "__0_0.distcp").stat().st_size
    os.truncate(path / "__0_0.distcp", size - 10)
    with pytest.raises(fc.errors.CorruptCheckpoint, match=r"__0_0.distcp.*truncated"):
        fc.restore(path)
    assert not fc.verify(path).ok


def test_missing_shard(tmp_path: Path) -> None:
    path = make(tmp_path)
    os.unlink(path / "__0_0.distcp")
    with pytest.raises(fc.errors.CorruptCheckpoint, match="missing"):
        fc.restore(path)


def test_shard_swapped_from_another_checkpoint(tmp_path: Path) -> None:
    a = make(tmp_path, "a")
    b = tmp_path / "b"
    fc.save(b, {"w": torch.arange(16.0) + 1, "b": torch.ones(4), "lr": 0.1})
    shutil.copy(b / "__0_0.distcp", a / "__0_0.distcp")
    with pytest.raises(fc.errors.CorruptCheckpoint, match="checksum"):
        fc.restore(a)
    assert not fc.verify(a).ok


def test_newer_format_version(tmp_path: Path) -> None:
    path = make(tmp_path)
    rewrite_manifest(path, lambda m: m.update(version=naming.FORMAT_VERSION + 1))
    with pytest.raises(fc.errors.CorruptCheckpoint, match="newer"):
        fc.restore(path)


def test_missing_and_uncommitted(tmp_path: Path) -> None:
    with pytest.raises(fc.errors.CheckpointNotFound, match="does not exist"):
        fc.restore(tmp_path / "nope")
    path = make(tmp_path)
    os.unlink(path / naming.COMMIT_MARKER)
    with pytest.raises(fc.errors.IncompleteCheckpoint, match="never committed"):
        fc.restore(path)
    with pytest.raises(fc.errors.IncompleteCheckpoint):
        fc.verify(path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(fc.errors.CheckpointNotFound, match="is a file"):
        fc.restore(tmp_path / "file")
    with pytest.raises(fc.errors.CheckpointExists, match="not a checkpoint directory"):
        fc.save(tmp_path / "file", {"a": torch.zeros(1)})
