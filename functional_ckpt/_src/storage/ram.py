"""The files of a manager's memory tier: how much RAM there is, what a folder holds of a
checkpoint, promotion to disk (within a bound of time, durable before visible: a
preempted job has some seconds after SIGTERM), emptying the folder."""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from functional_ckpt._src.format.naming import (
    COMMIT_MARKER,
    MANIFEST,
    base_name,
    is_temporary_name,
    parse_step,
)
from functional_ckpt._src.log import done as finished
from functional_ckpt._src.log import logger, warn
from functional_ckpt._src.storage import commit, committed, durable, opener
from functional_ckpt.errors import CheckpointError, MemoryTierWarning

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
    """Every file of the committed checkpoint ``path`` with its size (its manifest's list,
    the manifest and the marker), and those present at that size (a node's folder may
    hold only some ranks')."""
    files = committed.every_file(path)
    listed = {str(n): int(i["size"]) for n, i in files.items() if isinstance(i, dict)}
    listed |= {n: os.lstat(path / n).st_size for n in (MANIFEST, COMMIT_MARKER)}
    sizes = {e.name: e.stat(follow_symlinks=False).st_size for e in os.scandir(path)}
    return listed, {n for n, size in listed.items() if sizes.get(n) == size}


def holds_every_file(path: Path) -> bool:
    """Whether the memory tier's checkpoint ``path`` is whole in this folder."""
    try:
        listed, have = files_held(path)
    except (CheckpointError, OSError):
        return False
    return have == set(listed)


def promote_newest(root: Path, paths: Sequence[Path], within: float) -> Path | None:
    """Copy the newest of the checkpoints ``paths`` (ascending) into ``root``, or the next
    if it went meanwhile; give up after ``within`` seconds. Returns the new checkpoint."""
    if not paths or os.path.lexists(root / paths[-1].name):
        return None
    outcome: list[Any] = []  # the copy made first, else each failure

    def copy() -> None:
        for path in reversed(paths):
            try:
                copy_checkpoint(path, root / path.name)
                outcome.insert(0, root / path.name)
                return
            except BaseException as e:
                outcome.append(e)

    worker = threading.Thread(target=copy, name="fc-promote", daemon=True)
    t0 = time.perf_counter()
    worker.start()
    worker.join(within)
    done = None if worker.is_alive() else outcome[0]
    if not isinstance(done, Path):
        why = f"not done within {within} s" if done is None else f"{done}"
        warn(
            f"{paths[-1].parent}: promoting {paths[-1].name} to {root} failed ({why}); the "
            "disk tier keeps its own newest checkpoint",
            MemoryTierWarning,
            stacklevel=4,
        )
        return None
    seconds, step = time.perf_counter() - t0, parse_step(done.name)
    finished(logger("manager"), "promoted", done, seconds=seconds, step=step)
    return done


def copy_checkpoint(src: Path, dest: Path) -> None:
    """Copy the committed checkpoint ``src`` to the free name ``dest``, durably, the marker
    last (a crash leaves a temporary the root's next writer deletes); no link followed."""
    tmp = durable.tmp_sibling(dest)
    durable.make_dirs(dest.parent)
    dir_fd = opener.open_directory(src)
    try:
        tmp.mkdir()
        for name in sorted(os.listdir(dir_fd), key=lambda n: (n == COMMIT_MARKER, n)):
            fd = opener.open_member(dir_fd, name, src / name)
            try:
                out = durable.open_new(tmp / name)
                try:
                    size = os.fstat(fd).st_size
                    if durable.copy_range(fd, out, size, writeback=True) != size:
                        raise OSError(errno.EIO, f"{src / name}: shorter than a moment ago")
                    os.fsync(out)
                finally:
                    os.close(out)
            finally:
                os.close(fd)
        commit.commit_checkpoint(tmp, dest, overwrite=False)
    except BaseException:
        commit.remove_tree(tmp)
        raise
    finally:
        os.close(dir_fd)


def remove_folder(folder: Path, own: Iterable[str]) -> None:
    """Remove the entries ``own`` of ``folder`` and what unfinished saves of steps left,
    then the folder if nothing else (the user's) is left in it."""
    temporary = (n for n in os.listdir(folder) if is_temporary_name(n))
    left = [n for n in temporary if parse_step(base_name(n)) is not None]
    for name in [*left, *own]:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            commit.remove_tree(path)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    with contextlib.suppress(OSError):
        os.rmdir(folder)
