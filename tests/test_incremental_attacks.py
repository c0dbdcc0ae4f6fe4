"""Incremental saves against damaged, foreign and hostile bases.

A base is only a source of bytes that may be shared: whatever is wrong with it
must never reach a new checkpoint, which has to hold exactly the state saved.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.save import incremental


def _flip_byte_of(path: Path, needle: bytes) -> None:
    """Damage one data byte of ``needle`` (a tensor's raw bytes) in the file at ``path``."""
    at = path.read_bytes().find(needle)
    assert at >= 0
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, 1, at + 10)
        os.pwrite(fd, bytes([old[0] ^ 0xFF]), at + 10)
    finally:
        os.close(fd)


def test_a_damaged_base_file_is_not_shared_into_a_new_checkpoint(tmp_path: Path) -> None:
    # The base's manifest records the CRC32 of the bytes the state still holds, but
    # the base's file no longer holds them (damage after the base was committed, or a
    # base from elsewhere whose files do not match its manifest): linking that file
    # would commit a checkpoint that is damaged although the state saved was whole.
    w = torch.arange(4096, dtype=torch.float32)
    state = {"w": w, "b": torch.ones(4), "step": 1}
    fc.save(tmp_path / "a", state)
    shutil.copytree(tmp_path / "a", tmp_path / "foreign")  # written by "another process"
    for base in ("a", "foreign"):
        _flip_byte_of(tmp_path / base / "__0_0.distcp", w.numpy().tobytes())
        assert not fc.verify(tmp_path / base).ok
        dest = tmp_path / f"from_{base}"
        fc.save(dest, state, base=tmp_path / base)
        report = fc.verify(dest)
        assert report.ok, (base, report.problems)
        back = fc.restore(dest)
        assert torch.equal(back["w"], w) and back["step"] == 1
        assert not fc.verify(tmp_path / base).ok  # the base itself stays as it was


def test_an_intact_foreign_base_is_still_shared(tmp_path: Path) -> None:
    # Checking a base this process did not write costs a read, but its intact
    # files are shared as before.
    w = torch.arange(4096, dtype=torch.float32)
    fc.save(tmp_path / "a", {"w": w, "step": 1})
    shutil.copytree(tmp_path / "a", tmp_path / "foreign")
    fc.save(tmp_path / "b", {"w": w, "step": 2}, base=tmp_path / "foreign")
    assert os.stat(tmp_path / "b" / "__0_1.distcp").st_nlink == 2
    assert fc.verify(tmp_path / "b").ok


def test_a_copied_base_file_counts_as_added(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Where no hard link is possible the base's file is copied: the save wrote those
    # bytes, and fckpt inspect/ls must not report them as shared or as not added.
    w = torch.arange(4096, dtype=torch.float32)
    fc.save(tmp_path / "a", {"w": w, "step": 1})

    def no_link(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EXDEV, "cross-device link")

    monkeypatch.setattr(incremental.os, "link", no_link)
    fc.save(tmp_path / "b", {"w": w, "step": 2}, base=tmp_path / "a")
    copied = os.stat(tmp_path / "b" / "__0_1.distcp").st_size
    info = fc.inspect(tmp_path / "b")
    assert info.shared_bytes == 0
    assert info.added_bytes is not None and info.added_bytes >= copied
