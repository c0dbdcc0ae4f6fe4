"""The files of a manager's memory tier: how much RAM there is, promotion, emptying it.

A promotion copies a checkpoint from RAM to the disk durably before visibly (every
file fsynced, the marker last, the directory renamed into place).
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from functional_ckpt._src.format.naming import COMMIT_MARKER
from functional_ckpt._src.storage import commit, committed, durable, opener
from functional_ckpt.errors import CheckpointError

#: In a disk root: where its memory tier is and whether its manager is open (``fckpt ls``).
MEMORY_STATUS = ".memory.json"


def read_memory_status(root: Path) -> dict[str, Any]:
    """What the last writer of ``root`` recorded about its memory tier; {} if nothing."""
    doc = opener.read_state(root / MEMORY_STATUS, "memory tier status")
    return doc if isinstance(doc, dict) else {}


def available_bytes(folder: Path) -> int:
    """Bytes the folder can still take: its file system's free space, at most the memory
    the machine has available (a tmpfs larger than the RAM left would swap or be killed)."""
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo", "rb") as f:
        for line in f:
            if line.startswith(b"MemAvailable:"):
                return min(free, int(line.split()[1]) * 1024)
    return free


def files_held(path: Path) -> tuple[dict[str, int], set[str]]:
    """The files the manifest of the committed checkpoint ``path`` lists, with their sizes,
    and those of them present at that size (a node's folder may hold only some ranks')."""
    files = committed.every_file(path)
    listed = {str(n): int(i["size"]) for n, i in files.items() if isinstance(i, dict)}
    have = set()
    for name, size in listed.items():
        with contextlib.suppress(OSError):
            if os.stat(path / name, follow_symlinks=False).st_size == size:
                have.add(name)
    return listed, have


def holds_every_file(path: Path) -> bool:
    """Whether the memory tier's checkpoint ``path`` is whole in this folder."""
    try:
        listed, have = files_held(path)
    except (CheckpointError, OSError):
        return False
    return have == set(listed)


def copy_checkpoint(src: Path, dest: Path) -> None:
    """Copy the committed checkpoint ``src`` to the free name ``dest``, durably, the marker
    last (a crash leaves a temporary the root's next writer deletes); no link followed."""
    tmp = durable.tmp_sibling(dest)
    durable.make_dirs(dest.parent)
    dir_fd = opener.open_directory(src)
    try:
        tmp.mkdir()
        names = sorted(n for n in os.listdir(dir_fd) if n != COMMIT_MARKER)
        for name in [*names, COMMIT_MARKER]:
            _copy_file(dir_fd, src / name, tmp / name)
        commit.commit_checkpoint(tmp, dest, overwrite=False)
    except BaseException:
        commit.remove_tree(tmp)
        raise
    finally:
        os.close(dir_fd)


def _copy_file(dir_fd: int, src: Path, dst: Path) -> None:
    fd = opener.open_member(dir_fd, src.name, src)
    try:
        out = durable.open_new(dst)
        try:
            size = os.fstat(fd).st_size
            if durable.copy_range(fd, out, size, writeback=True) != size:
                raise OSError(errno.EIO, f"{src}: shorter than it was a moment ago")
            os.fsync(out)
        finally:
            os.close(out)
    finally:
        os.close(fd)


def remove_folder(folder: Path, own: Iterable[str]) -> None:
    """Remove the entries ``own`` of ``folder``, then the folder if nothing else (the
    user's) is left in it."""
    for name in own:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            commit.remove_tree(path)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(folder)
