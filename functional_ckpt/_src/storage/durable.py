"""Durable file primitives: every byte written, fsynced, renamed into place.

Every writer of the project (checkpoints, recordings, rollback plans, state files
of the tiers) writes through these, so "durable" means the same everywhere: a new
file is written whole and fsynced at its final size; a replacement is written as
a temporary sibling and renamed over the old one; every new directory entry is
made durable by an fsync of its directory.
"""

from __future__ import annotations

import errno
import os
import uuid
from pathlib import Path

from functional_ckpt._src.format.naming import TMP_INFIX


def tmp_sibling(path: Path, infix: str = TMP_INFIX) -> Path:
    """A hidden-by-name sibling of ``path`` that no reader mistakes for a checkpoint."""
    return path.with_name(f"{path.name}{infix}{uuid.uuid4().hex[:12]}")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes) -> None:
    """Write a whole small file and fsync it; refuses to overwrite."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path) -> None:
    """``mkdir -p`` whose every newly created directory is durable in its parent."""
    missing: list[Path] = []
    probe = path
    while not probe.is_dir():
        if probe.exists() or probe.is_symlink():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(probe))
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            if not d.is_dir():
                raise
            continue
        fsync_dir(d.parent)


def write_all(fd: int, data: memoryview | bytes | bytearray) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]
