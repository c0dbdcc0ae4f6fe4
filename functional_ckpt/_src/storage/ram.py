"""The files of a manager's memory tier: how much RAM there is, promotion, emptying it.

A memory tier is a folder in RAM (``/dev/shm``) holding ordinary checkpoints. Its
budget is measured against what the machine can still give it; its newest
checkpoint is *promoted* to the disk tier by a copy that is durable before it is
visible (every file fsynced, the marker last, the directory renamed into place);
its folder is emptied when its manager closes, so RAM is not held past the run.
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


def _mem_available() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_bytes(folder: Path) -> int:
    """Bytes the folder can still take: its file system's free space, at most the memory
    the machine has available (a tmpfs larger than the RAM left would swap or be killed)."""
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    ram = _mem_available()
    return free if ram is None else min(free, ram)


def held_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (each inode once: incremental saves share files)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.stat(os.path.join(dirpath, name), follow_symlinks=False)
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_size
    return total


def listed_files(path: Path) -> dict[str, int]:
    """The files the manifest of the committed checkpoint ``path`` lists, with their sizes."""
    files = committed.every_file(path)
    return {str(n): int(i["size"]) for n, i in files.items() if isinstance(i, dict)}


def present_files(path: Path, listed: dict[str, int]) -> set[str]:
    """The ``listed`` files that are in ``path`` at their recorded size."""
    out = set()
    for name, size in listed.items():
        with contextlib.suppress(OSError):
            if os.stat(path / name, follow_symlinks=False).st_size == size:
                out.add(name)
    return out


def holds_every_file(path: Path) -> bool:
    """Whether a memory tier's checkpoint ``path`` is whole on this node: a node's folder
    may hold only its ranks' parts and the replicas it keeps for others."""
    try:
        listed = listed_files(path)
    except (CheckpointError, OSError):
        return False
    return present_files(path, listed) == set(listed)


def copy_checkpoint(src: Path, dest: Path) -> None:
    """Copy the committed checkpoint ``src`` to the free name ``dest``, durably.

    Every file but the marker is copied and fsynced, then the marker: a crash midway
    leaves an uncommitted temporary that the next writer of ``dest``'s root deletes.
    Nothing is followed through a link on either side.
    """
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
    """Remove the entries ``own`` of ``folder`` (checkpoints first, then the tier's files),
    then the folder itself if nothing else is left in it (anything else is the user's)."""
    for name in own:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            commit.remove_tree(path)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(folder)
