"""What this process knows of the checkpoints it committed.

An incremental save may trust a base's data file to hold what its manifest says
only if this process wrote (or compared) that very file; and a tensor whose
version counter moved since this process saved the base is known to have changed
without a checksum pass.
"""

from __future__ import annotations

import os
import re
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from functional_ckpt._src.storage import checkpoint, opener
from functional_ckpt.errors import CheckpointError

#: A chunk's identity across saves: the tensor's DCP key and the box's offsets.
Key = tuple[str, tuple[int, ...]]
#: Where a source tensor's bytes live and its version counter, when it was saved.
Ident = tuple[int, int]

#: One data file as this process left it: device, inode, size, modification time.
FileIdent = tuple[int, int, int, int]


@dataclass(frozen=True)
class _Memory:
    """What this process knows of a checkpoint it committed: the version counters
    of what it saved, and the data files it wrote or checked, as it left them."""

    seen: dict[Key, Ident]
    files: dict[str, FileIdent]


_SEEN: OrderedDict[tuple[int, ...], _Memory] = OrderedDict()

_SEEN_LOCK = threading.Lock()

#: Checkpoints whose version counters a process remembers.
_SEEN_MAX = 8


def _identity(dir_fd: int, path: Path) -> tuple[int, ...]:
    """One committed checkpoint: its directory's inode and its marker's manifest CRC32
    and size (an inode alone may be reused once a checkpoint is deleted)."""
    held = os.fstat(dir_fd)
    try:
        marker = checkpoint.read_marker(dir_fd, path)
        crc, size = int(marker["manifest_crc32"]), int(marker["manifest_size"])
    except (CheckpointError, OSError, KeyError, TypeError, ValueError):
        crc = size = -1
    return (held.st_dev, held.st_ino, crc, size)


def _file_ident(dir_fd: int, name: str) -> FileIdent | None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def remember(dest: Path, seen: dict[Key, Ident], rank: int = 0) -> None:
    """After a commit: which bytes and versions the checkpoint at ``dest`` holds, and
    the data files of ``rank`` (this process wrote them, or checked the reused ones)."""
    try:
        dir_fd = opener.open_directory(dest)
    except (CheckpointError, OSError):
        return
    try:
        key = _identity(dir_fd, dest)
        own = re.compile(rf"__{rank}_\d+\.distcp")
        files = {
            n: fid
            for n in os.listdir(dir_fd)
            if own.fullmatch(n) and (fid := _file_ident(dir_fd, n)) is not None
        }
    finally:
        os.close(dir_fd)
    with _SEEN_LOCK:
        _SEEN[key] = _Memory(seen, files)
        _SEEN.move_to_end(key)
        while len(_SEEN) > _SEEN_MAX:
            _SEEN.popitem(last=False)
