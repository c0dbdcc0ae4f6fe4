"""Files handed to the disk as they are written (``storage/durable.start_writeback``),
and one file copy for every copier (``storage/durable.copy_range``).

The hint changes no byte and promises nothing (only fsync does), so these tests
check what it must not break and that every byte of a file to be fsynced is handed
over exactly once; the speed it buys is the benchmarks' business.
"""

from __future__ import annotations

import ast
import errno
import os
from pathlib import Path

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.storage import durable, shards

PACKAGE = Path(__file__).resolve().parent.parent / "functional_ckpt"

Calls = list[tuple[int, int, int]]


def _spy(monkeypatch: pytest.MonkeyPatch) -> Calls:
    calls: Calls = []
    real = durable.start_writeback

    def spy(fd: int, offset: int, length: int) -> bool:
        calls.append((fd, offset, length))
        return real(fd, offset, length)

    monkeypatch.setattr(durable, "start_writeback", spy)
    return calls


def _covered(calls: Calls) -> int:
    """The bytes the calls cover, asserting they follow one another from 0."""
    end = 0
    for _, offset, length in calls:
        assert offset == end, f"a gap or overlap at {offset} (expected {end})"
        assert length > 0
        end += length
    return end


def test_writeback_of_a_written_range_is_taken_and_changes_nothing(tmp_path: Path) -> None:
    data = os.urandom(3 << 20)
    fd = durable.open_new(tmp_path / "f")
    try:
        durable.write_all(fd, data)
        taken = durable.start_writeback(fd, 0, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)
    assert taken == hasattr(os, "sched_getaffinity")  # Linux has sync_file_range
    assert (tmp_path / "f").read_bytes() == data


def test_writeback_where_it_cannot_be_done_is_silent() -> None:
    r, w = os.pipe()
    try:
        os.write(w, b"x" * 100)
        assert durable.start_writeback(w, 0, 100) is False  # ESPIPE: no error
        assert durable.start_writeback(w, 0, 0) is False  # nothing to hand over
    finally:
        os.close(r)
        os.close(w)


def test_a_synced_shard_is_handed_to_the_disk_a_block_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(durable, "COPY_BLOCK", 256 << 10)  # a large tensor in blocks
    calls = _spy(monkeypatch)
    tensors = [
        torch.arange(1000, dtype=torch.float32),
        torch.randn(3 << 18),  # 3 MiB: written in 12 blocks
        torch.arange(10, dtype=torch.int64),
        torch.randn(1 << 18),  # 1 MiB: exactly at the small-tensor limit
        *[torch.randn(5000) for _ in range(100)],  # 2 MB of small ones, in batches
    ]
    path = tmp_path / "__0_0.distcp"
    chunks = shards.write_shard(path, tensors).chunks
    size = path.stat().st_size
    handed = _covered(calls)
    assert 0 <= size - handed < 256 << 10  # only the last partial block is the fsync's
    assert len(calls) >= 12
    assert all(length >= 256 << 10 for _, _, length in calls)
    fd = os.open(path, os.O_RDONLY)
    try:
        outs = [torch.empty_like(t) for t in tensors]
        results = shards.read_tensors(fd, list(zip(chunks, outs, strict=True)))
    finally:
        os.close(fd)
    assert results == [None] * len(tensors)
    for t, out in zip(tensors, outs, strict=True):
        assert torch.equal(t, out)


def test_a_small_file_is_left_to_its_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Handing a file smaller than a block over early would only move the kernel's
    work from the thread that fsyncs to the one that writes."""
    calls = _spy(monkeypatch)
    state = {"w": torch.randn(1 << 19), "b": torch.ones(7), "step": 3}
    fc.save(tmp_path / "ck", state)
    assert calls == []
    out = fc.restore(tmp_path / "ck", state)
    assert torch.equal(out["w"], state["w"]) and out["step"] == 3


def test_a_shard_that_is_not_synced_is_not_handed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(durable, "COPY_BLOCK", 64 << 10)
    calls = _spy(monkeypatch)
    shards.write_shard(tmp_path / "f", [torch.randn(1 << 19), torch.ones(10)], sync=False)
    assert calls == []


def test_a_large_save_hands_its_shard_over_and_reads_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(durable, "COPY_BLOCK", 1 << 20)
    calls = _spy(monkeypatch)
    state = {"w": torch.randn(3 << 20), "b": torch.ones(7), "step": 3}  # 12 MiB
    fc.save(tmp_path / "ck", state)
    shard = next((tmp_path / "ck").glob("*.distcp"))
    assert shard.stat().st_size - _covered(calls) < 1 << 20
    assert len(calls) >= 12
    fc.verify(tmp_path / "ck")
    out = fc.restore(tmp_path / "ck", state)
    assert torch.equal(out["w"], state["w"]) and out["step"] == 3


@pytest.mark.parametrize("kernel", [True, False])
def test_copy_range_copies_exactly_in_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: bool
) -> None:
    monkeypatch.setattr(durable, "COPY_BLOCK", 64 << 10)
    calls = _spy(monkeypatch)
    if not kernel:

        def refuse(*args: object) -> int:
            raise OSError(errno.EXDEV, "cross-device")

        monkeypatch.setattr(os, "copy_file_range", refuse)
    data = os.urandom((1 << 20) + 12345)
    (tmp_path / "src").write_bytes(data)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    out = durable.open_new(tmp_path / "dst")
    try:
        assert durable.copy_range(src, out, len(data), writeback=True) == len(data)
        assert durable.copy_range(src, out, 0) == 0
    finally:
        os.close(src)
        os.close(out)
    assert (tmp_path / "dst").read_bytes() == data
    assert _covered(calls) == len(data)
    assert all(length <= 64 << 10 for _, _, length in calls)


def test_copy_range_of_a_shorter_source_says_how_much_it_copied(tmp_path: Path) -> None:
    (tmp_path / "src").write_bytes(b"abc" * 1000)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    out = durable.open_new(tmp_path / "dst")
    try:
        assert durable.copy_range(src, out, 5000) == 3000
    finally:
        os.close(src)
        os.close(out)
    assert (tmp_path / "dst").read_bytes() == b"abc" * 1000


def test_copy_range_refuses_an_unexpected_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: object) -> int:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "copy_file_range", broken)
    (tmp_path / "src").write_bytes(b"x" * 10)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    out = durable.open_new(tmp_path / "dst")
    try:
        with pytest.raises(OSError, match="I/O error"):
            durable.copy_range(src, out, 10)
    finally:
        os.close(src)
        os.close(out)


def test_files_are_copied_and_handed_to_the_disk_only_through_durable() -> None:
    """One copier for every file copy (incremental bases, memory-tier promotion)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else None
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                name = node.value  # a libc call loaded by name (native.libc_function)
            if name in ("copy_file_range", "sync_file_range", "sendfile"):
                found.append((rel, name))
    assert sorted(found) == [
        ("_src/storage/durable.py", "copy_file_range"),
        ("_src/storage/durable.py", "sync_file_range"),
    ]


def test_a_libc_call_is_loaded_with_its_signature_or_is_none() -> None:
    import ctypes
    import sys

    from functional_ckpt._src.native import libc_function

    getpid = libc_function("getpid", [])
    if sys.platform.startswith("linux"):
        assert getpid is not None and getpid() == os.getpid()
    else:
        assert getpid is None
    assert libc_function("no_such_call_in_any_libc", [ctypes.c_int]) is None
