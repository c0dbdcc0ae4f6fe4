"""What a process knows of the checkpoints it committed: a base's file is trusted without a
byte comparison only if this process wrote it and it is unchanged (every byte keeps its CRC32)."""

from __future__ import annotations

import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from functional_ckpt._src.format.naming import parse_shard
from functional_ckpt._src.storage import committed, opener
from functional_ckpt.errors import CheckpointError

#: A chunk's identity across saves: the tensor's DCP key and the box's offsets.
Key = tuple[str, tuple[int, ...]]
#: Where a source tensor's bytes live and its version counter, when it was saved.
Ident = tuple[int, int]
#: One data file as this process left it: device, inode, size, modification time.
FileIdent = tuple[int, int, int, int]
#: One committed checkpoint: its directory's device and inode, its manifest's CRC32 and
#: size (an inode alone may be reused once a checkpoint is deleted).
CheckpointIdent = tuple[int, int, int, int]


class Seen:
    """Each saved chunk's tensor identity and version, tabled on first lookup."""

    def __init__(self, keys: Sequence[Key], idents: Sequence[Ident | None]) -> None:
        self._keys, self._idents = tuple(keys), tuple(idents)
        self._table: dict[Key, Ident] | None = None

    def get(self, key: Key) -> Ident | None:
        if self._table is None:  # two threads racing here build the same table
            pairs = zip(self._keys, self._idents, strict=True)
            self._table = {k: i for k, i in pairs if i is not None}
        return self._table.get(key)


@dataclass(frozen=True)
class Recollection:
    """One checkpoint's saved versions, and its data files as this process left them."""

    seen: Seen
    files: Mapping[str, FileIdent]

    def trusted(self, dir_fd: int) -> set[str]:
        """The remembered files that are still the files this process left."""
        return {n for n, fid in self.files.items() if file_ident(dir_fd, n) == fid}


class TrustMemory:
    """The last few checkpoints this process committed (thread-safe); a manager owns one."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._known: OrderedDict[CheckpointIdent, Recollection] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, dest: Path, seen: Seen, rank: int = 0) -> None:
        """After a commit: what ``dest`` holds, and the data files of ``rank`` there."""
        try:
            dir_fd = opener.open_directory(dest)
        except (CheckpointError, OSError):
            return
        try:
            key = checkpoint_ident(dir_fd, dest)
            mine = [n for n in os.listdir(dir_fd) if (parse_shard(n) or (-1,))[0] == rank]
            files = {n: fid for n in mine if (fid := file_ident(dir_fd, n)) is not None}
        finally:
            os.close(dir_fd)
        with self._lock:
            self._known[key] = Recollection(seen, files)
            self._known.move_to_end(key)
            while len(self._known) > self.capacity:
                self._known.popitem(last=False)

    def clear(self) -> None:
        """Forget every checkpoint (what is trusted is then compared byte for byte)."""
        with self._lock:
            self._known.clear()

    def recall(self, dir_fd: int, path: Path) -> Recollection | None:
        """What this memory holds of the checkpoint held open as ``dir_fd``."""
        key = checkpoint_ident(dir_fd, path)
        with self._lock:
            return self._known.get(key)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def idents(tensors: Sequence[torch.Tensor]) -> tuple[Ident | None, ...]:
    """Where each tensor's bytes are and its version counter; None for one that has none."""
    out: list[Ident | None] = []
    add = out.append
    for t in tensors:
        try:
            shard = t if type(t) in _PLAIN or not hasattr(t, "to_local") else t.to_local()
            add((shard.data_ptr(), t._version))
        except (RuntimeError, AttributeError):
            add(None)
    return tuple(out)


def checkpoint_ident(dir_fd: int, path: Path) -> CheckpointIdent:
    """The identity of the committed checkpoint held open as ``dir_fd``."""
    held = os.fstat(dir_fd)
    try:
        marker = committed.read_marker(dir_fd, path)
        crc, size = int(marker["manifest_crc32"]), int(marker["manifest_size"])
    except (CheckpointError, OSError, KeyError, TypeError, ValueError):
        crc = size = -1
    return (held.st_dev, held.st_ino, crc, size)


def file_ident(dir_fd: int, name: str) -> FileIdent | None:
    """A regular file of the directory held open as ``dir_fd``, as it is now."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
