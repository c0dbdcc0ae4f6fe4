"""Durable file primitives: every byte written, fsynced, renamed into place.

Every writer of the project (checkpoints, exports, recordings, rollback plans, the
state files of the tiers) writes through these, so "durable" means the same
everywhere: a new file is written whole and fsynced at its final size
(:func:`write_new`); a replacement is written as a temporary sibling and renamed
over the old one, and the rename is made durable by an fsync of the directory
(:func:`replace_durably`); every new directory is durable in its parent
(:func:`make_dirs`). Nothing here follows a link where the file it writes is.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from pathlib import Path

from functional_ckpt._src.format.naming import TMP_INFIX

#: Flags of every new file: created here, never an existing one, never through a link.
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def tmp_sibling(path: Path, infix: str = TMP_INFIX) -> Path:
    """A hidden-by-name sibling of ``path`` that no reader mistakes for a checkpoint."""
    return path.with_name(f"{path.name}{infix}{uuid.uuid4().hex[:12]}")


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: memoryview | bytes | bytearray) -> None:
    """Write every byte of ``data`` to ``fd`` (``os.write`` may write fewer)."""
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def open_new(path: Path, *, mapped: bool = False) -> int:
    """A new file at ``path`` for writing; refuses an existing file or a link there.

    ``mapped``: readable too, as a file filled through a shared memory map must be."""
    flags = (NEW_FILE & ~os.O_WRONLY) | os.O_RDWR if mapped else NEW_FILE
    return os.open(path, flags, 0o644)


def write_new(path: Path, data: bytes, *, sync: bool = True) -> None:
    """Write a whole new file and (``sync``) fsync it; refuses to overwrite anything."""
    fd = open_new(path)
    try:
        write_all(fd, data)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(path: Path, data: bytes, *, sync: bool = True) -> None:
    """Replace the file at ``path`` with ``data``, atomically: a reader sees the old
    bytes or the new ones, never a mix, and (``sync``) a crash keeps one of them.

    The bytes go to a temporary sibling first; the rename over ``path`` replaces a
    link there by the new file, never writing through it.
    """
    tmp = tmp_sibling(path)
    try:
        write_new(tmp, data, sync=sync)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync:
        fsync_dir(path.parent)


def make_dirs(path: Path) -> None:
    """``mkdir -p`` whose every newly created directory is durable in its parent."""
    missing: list[Path] = []
    probe = path
    while not probe.is_dir():
        if probe.exists() or probe.is_symlink():
            if probe.is_dir():
                break  # another process made it just now (ranks sharing a node's folder)
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
