"""No background thread outlives the memory it reads: a save or restore that raises has
finished every checksum job it started (the caller frees that memory as it unwinds)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.storage import durable, shards


class SlowChecksums:
    """``shards.crc_chunks`` that starts once the caller has begun to fail (``failing``),
    then holds on until the caller either waits for it or has left ``function``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, function: str) -> None:
        self.failing = threading.Event()
        self.outlived: bool | None = None  # whether the caller left before it finished
        caller = threading.get_ident()
        original = shards.crc_chunks

        def crc(view: memoryview, start: int = 0) -> int:
            self.failing.wait()
            while self.outlived is None:
                frame: Any = sys._current_frames().get(caller)
                names = set()
                while frame is not None:
                    names.add(frame.f_code.co_name)
                    frame = frame.f_back
                if "wait_quietly" in names:
                    self.outlived = False
                elif function not in names:
                    self.outlived = True
                time.sleep(0.001)
            return original(view, start)

        monkeypatch.setattr(shards, "crc_chunks", crc)


def state() -> dict[str, Any]:
    return {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(3)}  # 4 MiB each


def test_a_save_that_raises_has_finished_its_checksums(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    slow = SlowChecksums(monkeypatch, "write_shard")
    write_all = durable.write_all

    def disk_full(fd: int, data: Any) -> None:
        if len(memoryview(data)) >= shards.SMALL_TENSOR:
            slow.failing.set()
            raise OSError(28, "No space left on device (injected)")
        write_all(fd, data)

    monkeypatch.setattr(durable, "write_all", disk_full)
    with pytest.raises(fc.CheckpointError, match="No space left"):
        fc.save(tmp_path / "ck", state())
    assert slow.outlived is False


def test_a_restore_interrupted_has_finished_its_checksums(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fc.save(tmp_path / "ck", state())
    slow = SlowChecksums(monkeypatch, "read_tensors")
    read_into = shards.read_into
    large = []

    def interrupted(fd: int, offset: int, dest: memoryview) -> int:
        if len(dest) >= shards.SMALL_TENSOR:
            large.append(offset)
            if len(large) == 2:  # the first tensor is being checksummed: Ctrl-C now
                slow.failing.set()
                raise KeyboardInterrupt
        return read_into(fd, offset, dest)

    monkeypatch.setattr(shards, "read_into", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fc.restore(tmp_path / "ck")
    assert slow.outlived is False
