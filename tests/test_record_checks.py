"""Records of many tensors are checked in line, and every fault is still named.

A manifest of thousands of tensors is checked record by record without a call
per field; a record that fails any of those checks goes through the full checks,
which name the entry and the fault. Each fault here sits in one record in the
middle of many sound ones, in a real checkpoint re-signed as an attacker could.
The save side batches small blobs into one buffer and patches their CRC32
fields in place: the bytes must be those of the blob template, readable by
``torch.load`` as DCP reads them.
"""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.format.blobs import blob_template
from functional_ckpt._src.format.checksum import crc32
from functional_ckpt._src.storage.shards import write_shard
from functional_ckpt.errors import CorruptCheckpoint, UnsafeCheckpoint
from tests.forge import resign

MIDDLE = "t05"


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    state: dict[str, Any] = {f"t{i:02d}": torch.randn(4, generator=gen) for i in range(11)}
    state["step"] = 7
    return state


def _saved(tmp_path: Path) -> Path:
    ck = tmp_path / "ck"
    fc.save(ck, _state())
    return ck


def _record(manifest: dict[str, Any], key: str) -> tuple[int, dict[str, Any]]:
    for i, e in enumerate(manifest["entries"]):
        if e["path"] == [key]:
            return i, e
    raise AssertionError(key)


def _refused(ck: Path, index: int, error: type[Exception], phrase: str) -> None:
    with pytest.raises(error) as info:
        fc.restore(ck)
    message = str(info.value)
    assert f"entry {index}: " in message, message
    assert phrase in message, message


CHUNK_FAULTS = [
    ("offset", -1, CorruptCheckpoint, "invalid offset -1"),
    ("offset", True, CorruptCheckpoint, "invalid offset True"),
    ("length", "16", CorruptCheckpoint, "invalid length '16'"),
    ("data_offset", None, CorruptCheckpoint, "invalid data offset None"),
    ("crc32", 1.5, CorruptCheckpoint, "invalid checksum 1.5"),
    ("hcrc32", -3, CorruptCheckpoint, "invalid checksum -3"),
    ("nbytes", 8, UnsafeCheckpoint, "chunk [4] (16 bytes) but records 8 bytes"),
    ("length", 1 << 40, UnsafeCheckpoint, "declares bytes beyond the end of"),
    ("file", "elsewhere.distcp", CorruptCheckpoint, "stored in an unknown file 'elsewhere"),
    ("file", ".metadata", CorruptCheckpoint, "stored in an unknown file '.metadata'"),
    ("file", 3, CorruptCheckpoint, "stored in an unknown file 3"),
    ("sizes", [5], UnsafeCheckpoint, "a chunk of 't05' lies outside it"),
    ("sizes", [2], UnsafeCheckpoint, "chunk [2] (8 bytes) but records 16 bytes"),
    ("sizes", [True], CorruptCheckpoint, "invalid chunk size True"),
    ("offsets", [0, 0], CorruptCheckpoint, "chunk box does not match the tensor's rank"),
    ("offsets", [1], UnsafeCheckpoint, "a chunk of 't05' lies outside it"),
    ("offsets", (0,), CorruptCheckpoint, "chunk box does not match the tensor's rank"),
]


@pytest.mark.parametrize(("field", "bad", "error", "phrase"), CHUNK_FAULTS)
def test_a_bad_chunk_field_in_the_middle_is_named(
    tmp_path: Path, field: str, bad: Any, error: type[Exception], phrase: str
) -> None:
    ck = _saved(tmp_path)
    found: list[int] = []

    def edit(m: dict[str, Any]) -> None:
        i, e = _record(m, MIDDLE)
        found.append(i)
        e["chunks"][0][field] = bad

    resign(ck, edit)
    _refused(ck, found[0], error, phrase)


def test_a_chunk_that_starts_after_its_data_is_refused(tmp_path: Path) -> None:
    ck = _saved(tmp_path)
    found: list[int] = []

    def edit(m: dict[str, Any]) -> None:
        i, e = _record(m, MIDDLE)
        found.append(i)
        chunk = e["chunks"][0]
        chunk["offset"] = chunk["data_offset"] + 1

    resign(ck, edit)
    _refused(ck, found[0], UnsafeCheckpoint, "declares bytes beyond the end of")


@pytest.mark.parametrize("missing", ["offset", "nbytes", "crc32", "file", "sizes"])
def test_a_missing_chunk_field_in_the_middle_is_named(tmp_path: Path, missing: str) -> None:
    ck = _saved(tmp_path)
    found: list[int] = []

    def edit(m: dict[str, Any]) -> None:
        i, e = _record(m, MIDDLE)
        found.append(i)
        del e["chunks"][0][missing]

    resign(ck, edit)
    error = CorruptCheckpoint
    with pytest.raises(error) as info:
        fc.restore(ck)
    assert f"entry {found[0]}: " in str(info.value)


RECORD_FAULTS = [
    ("shape", [4, -1], CorruptCheckpoint, "invalid dimension -1"),
    ("shape", [True], CorruptCheckpoint, "invalid dimension True"),
    ("shape", [1 << 62], UnsafeCheckpoint, "'t05' declares an impossible shape"),
    ("shape", [8], CorruptCheckpoint, "chunks of 't05' do not cover the tensor"),
    ("path", [], CorruptCheckpoint, "invalid key path []"),
    ("path", ["t05", 3], CorruptCheckpoint, "invalid key path ['t05', 3]"),
    ("chunks", ["x"], CorruptCheckpoint, "invalid chunk"),
    ("chunks", [], CorruptCheckpoint, "chunks of 't05' do not cover the tensor"),
    ("dtype", "float99", CorruptCheckpoint, "unknown dtype 'float99'"),
]


@pytest.mark.parametrize(("field", "bad", "error", "phrase"), RECORD_FAULTS)
def test_a_bad_tensor_record_in_the_middle_is_named(
    tmp_path: Path, field: str, bad: Any, error: type[Exception], phrase: str
) -> None:
    ck = _saved(tmp_path)
    found: list[int] = []

    def edit(m: dict[str, Any]) -> None:
        i, e = _record(m, MIDDLE)
        found.append(i)
        e[field] = bad

    resign(ck, edit)
    _refused(ck, found[0], error, phrase)


def test_sound_records_around_a_re_signed_manifest_restore(tmp_path: Path) -> None:
    """The control: re-signing alone changes nothing, every tensor comes back."""
    ck = _saved(tmp_path)
    resign(ck, lambda m: None)
    got = fc.restore(ck)
    for k, v in _state().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(got[k], v), k


def test_small_blobs_batched_on_save_are_the_template_bytes(tmp_path: Path) -> None:
    """Interleaved specs, one buffer: each blob is head + data + the patched tail."""
    gen = torch.Generator().manual_seed(5)
    tensors = [
        torch.randn(3, 4, generator=gen) if i % 2 else torch.randn(7, generator=gen).double()
        for i in range(9)
    ]
    path = tmp_path / "shard.distcp"
    chunks = write_shard(path, tensors).chunks
    data = path.read_bytes()
    assert len(data) == sum(c.length for c in chunks)
    for t, c in zip(tensors, chunks, strict=True):
        tpl = blob_template(t.dtype, tuple(t.shape))
        raw = t.numpy().tobytes()
        assert c.crc32 == crc32(raw)
        expected = tpl.head + raw + tpl.patch(crc32(raw))
        blob = data[c.offset : c.offset + c.length]
        assert blob == expected
        assert c.hcrc32 == crc32(blob[c.data_offset - c.offset + c.nbytes :], crc32(tpl.head))
        zipfile.ZipFile(io.BytesIO(blob)).testzip()  # every CRC32 field agrees
        assert torch.equal(torch.load(io.BytesIO(blob), weights_only=True), t)
    os.unlink(path)
