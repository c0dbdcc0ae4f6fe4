"""Recording the file-system operations of one operation on a root, in order.

The ``os`` functions the package writes through (``open`` with ``O_CREAT``,
``write``, ``pwrite``, ``ftruncate``, ``posix_fallocate``, ``copy_file_range``,
``fsync``, ``fdatasync``, ``rename``/``replace``, ``link``, ``unlink``, ``mkdir``,
``rmdir``, ``symlink``) and its two libc calls (``renameat2`` of the atomic exchange,
``sync_file_range`` of the early writeback) are wrapped in-process while the
operation runs; each call on a path under the root becomes an :class:`Op` on a model
of the tree (directories of entries, inodes of bytes), so that any crash state can
be rebuilt from the tree as it was before plus a choice of those ops.

Bytes written by code outside Python's ``os`` (a native library's own writer, a
shared memory map) are caught where they become visible: a file opened or fsynced
whose bytes differ from the model's is recorded as written just then (``observed``).
When the operation ends the model must equal the tree on disk, or the recording is
refused (:class:`RecordingGap`): an explorer that missed a write would check nothing.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from functional_ckpt._src.storage import commit, durable
from tests.crash_tree import Op, scan


class RecordingGap(AssertionError):
    """The recorded operations do not rebuild the tree the operation left."""


def _real_path(path: Any, dir_fd: int | None = None) -> str:
    p = os.fsdecode(os.fspath(path))
    if dir_fd is not None and not os.path.isabs(p):
        p = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), p)
    return os.path.abspath(p)


class Recorder:
    """While entered, every write under ``root`` is an :class:`Op` in :attr:`ops`."""

    def __init__(self, root: Path) -> None:
        self.root = os.path.abspath(root)
        self.before = scan(Path(self.root))
        self.live = self.before.copy()
        self.ops: list[Op] = []
        self._lock = threading.RLock()
        self._ino: dict[int, int] = {}  # inode number on disk -> model inode
        self._dev = os.stat(self.root).st_dev
        self._saved: list[tuple[Any, str, Any]] = []
        self.names = {ino: rel for rel, ino in self.before.walk()}  # for messages
        self._map_inodes(Path(self.root), 0)

    def _map_inodes(self, path: Path, ino: int) -> None:
        self._ino[os.lstat(path).st_ino] = ino
        for name, child in self.live.entries.get(ino, {}).items():
            if self.live.kinds[child] == "d":
                self._map_inodes(path / name, child)
            else:
                self._ino[os.lstat(path / name).st_ino] = child

    # ------------------------------------------------------------------ the model

    def rel(self, path: str) -> str | None:
        if path == self.root:
            return ""
        if path.startswith(self.root + os.sep):
            return path[len(self.root) + 1 :]
        return None

    def _where(self, path: str) -> tuple[int, str] | None:
        """(model directory, name) of an absolute path under the root."""
        rel = self.rel(path)
        if not rel:
            return None
        parent = self._ino.get(os.lstat(os.path.dirname(path)).st_ino)
        if parent is None:
            raise RecordingGap(f"{rel}: in a directory the recording never saw made")
        return parent, os.path.basename(path)

    def _fd_inode(self, fd: int) -> int | None:
        try:
            st = os.fstat(fd)
        except OSError:
            return None
        if st.st_dev != self._dev:
            return None
        return self._ino.get(st.st_ino)

    def _new_inode(self, kind: str, path: str) -> int:
        ino = len(self.live.kinds)
        while ino in self.live.kinds:
            ino += 1
        self.live.kinds[ino] = kind
        if kind == "d":
            self.live.entries[ino] = {}
        elif kind == "f":
            self.live.data[ino] = b""
        self._ino[os.lstat(path).st_ino] = ino
        self.names[ino] = self.rel(path) or path
        return ino

    def _add(self, op: Op) -> None:
        self.live.apply(op)
        self.ops.append(op)

    def _meta(self, kind: str, text: str, *changes: tuple[int, str, int | None]) -> None:
        dirs = frozenset(d for d, _, _ in changes)
        self._add(Op(kind, text, changes=tuple(changes), dirs=dirs))

    def _observe(self, fd_or_path: int | str, ino: int, why: str) -> None:
        """Record bytes that changed without a recorded call (a native writer, a map)."""
        if self.live.kinds.get(ino) != "f" or not stat.S_ISREG(os.stat(fd_or_path).st_mode):
            return
        src = f"/proc/self/fd/{fd_or_path}" if isinstance(fd_or_path, int) else fd_or_path
        with open(src, "rb") as f:
            now = f.read()
        if now != self.live.data.get(ino, b""):
            name = self._name(ino)
            if self.live.data.get(ino):
                self._add(Op("truncate", f"truncate({name}, 0) [observed {why}]", ino=ino))
            self._add(
                Op(
                    "write",
                    f"write({name}, {len(now)} B) [observed {why}]",
                    ino=ino,
                    data=now,
                    observed=True,
                )
            )

    def _name(self, ino: int) -> str:
        """Where ``ino`` is now (else where it was made), for the op's text."""
        if ino == 0:
            return "."
        for path, child in self.live.walk():
            if child == ino:
                return path
        return self.names.get(ino, f"<inode {ino}>")

    # ------------------------------------------------------------------ the wrappers

    def _wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        real = getattr(owner, name)
        self._saved.append((owner, name, real))
        setattr(owner, name, make(real))

    def __enter__(self) -> Recorder:
        w = self._wrap
        w(os, "open", self._open)
        w(os, "write", self._write)
        w(os, "pwrite", self._pwrite)
        w(os, "ftruncate", self._ftruncate)
        w(os, "posix_fallocate", self._fallocate)
        w(os, "copy_file_range", self._copy_file_range)
        w(os, "fsync", self._fsync)
        w(os, "fdatasync", self._fsync)
        w(os, "rename", self._rename)
        w(os, "replace", self._rename)
        w(os, "link", self._link)
        w(os, "unlink", self._unlink)
        w(os, "remove", self._unlink)
        w(os, "mkdir", self._mkdir)
        w(os, "rmdir", self._rmdir)
        w(os, "symlink", self._symlink)
        if commit._RENAMEAT2 is not None:
            w(commit, "_RENAMEAT2", self._renameat2)
        if durable._SYNC_FILE_RANGE is not None:
            w(durable, "_SYNC_FILE_RANGE", self._sync_file_range)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, real in reversed(self._saved):
            setattr(owner, name, real)
        self._saved.clear()
        if exc[0] is None:
            self.check_complete()

    def check_complete(self) -> None:
        """The model must be the tree on disk: no write went unrecorded."""
        on_disk, model = scan(Path(self.root)).shape(), self.live.shape()
        if on_disk != model:
            missed = sorted(set(on_disk) ^ set(model))[:6]
            raise RecordingGap(f"the recorded operations do not rebuild the tree: {missed}")

    def _open(self, real: Any) -> Any:
        def open_(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
            p = _real_path(path, dir_fd)
            rel = self.rel(p)
            if not rel:
                return int(real(path, flags, mode, dir_fd=dir_fd))
            with self._lock:
                existed = os.path.lexists(p)
                fd = int(real(path, flags, mode, dir_fd=dir_fd))
                ino = self._fd_inode(fd)
                # (a file made now may reuse the inode number of one deleted while recording)
                if (ino is None or not existed) and not (flags & os.O_DIRECTORY):
                    where = self._where(p)
                    assert where is not None
                    kind = "created" if not existed else "observed"
                    ino = self._new_inode("f", p)
                    self._meta("create", f"create({rel}) [{kind}]", (*where, ino))
                    if existed:
                        self._observe(p, ino, "at open")
                elif ino is not None and existed and flags & os.O_TRUNC:
                    self._add(Op("truncate", f"truncate({rel}, 0)", ino=ino))
                elif ino is not None:
                    self._observe(p, ino, "at open")
                return fd

        return open_

    def _data(self, fd: int, text: str, offset: int, data: bytes) -> None:
        ino = self._fd_inode(fd)
        if ino is not None:
            self._add(
                Op(
                    "write",
                    f"{text}({self._name(ino)}, {len(data)} B at {offset})",
                    ino=ino,
                    offset=offset,
                    data=data,
                )
            )

    def _write(self, real: Any) -> Any:
        def write(fd: int, data: Any) -> int:
            if self._fd_inode(fd) is None:
                return int(real(fd, data))
            with self._lock:
                at = os.lseek(fd, 0, os.SEEK_CUR)
                n = int(real(fd, data))
                self._data(fd, "write", at, bytes(memoryview(data).cast("B")[:n]))
                return n

        return write

    def _pwrite(self, real: Any) -> Any:
        def pwrite(fd: int, data: Any, offset: int) -> int:
            with self._lock:
                n = int(real(fd, data, offset))
                self._data(fd, "pwrite", offset, bytes(memoryview(data).cast("B")[:n]))
                return n

        return pwrite

    def _resize(self, fd: int, size: int, text: str) -> None:
        ino = self._fd_inode(fd)
        if ino is not None:
            self._add(Op("truncate", f"{text}({self._name(ino)}, {size})", ino=ino, offset=size))

    def _ftruncate(self, real: Any) -> Any:
        def ftruncate(fd: int, size: int) -> None:
            with self._lock:
                real(fd, size)
                self._resize(fd, size, "ftruncate")

        return ftruncate

    def _fallocate(self, real: Any) -> Any:
        def fallocate(fd: int, offset: int, length: int) -> None:
            with self._lock:
                real(fd, offset, length)
                ino = self._fd_inode(fd)
                if ino is not None and offset + length > len(self.live.data.get(ino, b"")):
                    self._resize(fd, offset + length, "posix_fallocate")

        return fallocate

    def _copy_file_range(self, real: Any) -> Any:
        def copy_file_range(
            src: int,
            dst: int,
            count: int,
            offset_src: int | None = None,
            offset_dst: int | None = None,
        ) -> int:
            with self._lock:
                at_src = os.lseek(src, 0, os.SEEK_CUR) if offset_src is None else offset_src
                at_dst = os.lseek(dst, 0, os.SEEK_CUR) if offset_dst is None else offset_dst
                n = int(real(src, dst, count, offset_src, offset_dst))
                self._data(dst, "copy_file_range", at_dst, os.pread(src, n, at_src))
                return n

        return copy_file_range

    def _fsync(self, real: Any) -> Any:
        def fsync(fd: Any) -> None:
            fd = fd if isinstance(fd, int) else fd.fileno()
            with self._lock:
                ino = self._fd_inode(fd)
                if ino is not None:
                    self._observe(fd, ino, "at fsync")
                real(fd)
                if ino is not None:
                    self._add(Op("fsync", f"fsync({self._name(ino) or '.'})", ino=ino))

        return fsync

    def _rename(self, real: Any) -> Any:
        def rename(
            src: Any, dst: Any, *, src_dir_fd: int | None = None, dst_dir_fd: int | None = None
        ) -> None:
            with self._lock:
                a, b = _real_path(src, src_dir_fd), _real_path(dst, dst_dir_fd)
                where = self._where(a) if self.rel(a) else None
                moved = self.live.entries[where[0]].get(where[1]) if where else None
                real(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
                to = self._where(b) if self.rel(b) else None
                if where and to and moved is not None:
                    text = f"rename({self.rel(a)}, {self.rel(b)})"
                    self._meta("rename", text, (*where, None), (*to, moved))

        return rename

    def _link(self, real: Any) -> Any:
        def link(
            src: Any,
            dst: Any,
            *,
            src_dir_fd: int | None = None,
            dst_dir_fd: int | None = None,
            follow_symlinks: bool = True,
        ) -> None:
            with self._lock:
                real(
                    src,
                    dst,
                    src_dir_fd=src_dir_fd,
                    dst_dir_fd=dst_dir_fd,
                    follow_symlinks=follow_symlinks,
                )
                a, b = _real_path(src, src_dir_fd), _real_path(dst, dst_dir_fd)
                to = self._where(b) if self.rel(b) else None
                if to is not None:
                    ino = self._ino.get(os.lstat(b).st_ino)
                    if ino is None:  # linked from outside the root: new bytes here
                        ino = self._new_inode("f", b)
                        self.live.data[ino] = Path(a).read_bytes()
                    self._meta("link", f"link({self.rel(a) or a}, {self.rel(b)})", (*to, ino))

        return link

    def _removal(self, real: Any, kind: str) -> Any:
        def remove(path: Any, *, dir_fd: int | None = None) -> None:
            with self._lock:
                p = _real_path(path, dir_fd)
                where = self._where(p) if self.rel(p) else None
                real(path, dir_fd=dir_fd)
                if where is not None:
                    self._meta(kind, f"{kind}({self.rel(p)})", (*where, None))

        return remove

    def _unlink(self, real: Any) -> Any:
        return self._removal(real, "unlink")

    def _rmdir(self, real: Any) -> Any:
        return self._removal(real, "rmdir")

    def _mkdir(self, real: Any) -> Any:
        def mkdir(path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
            with self._lock:
                real(path, mode, dir_fd=dir_fd)
                p = _real_path(path, dir_fd)
                where = self._where(p) if self.rel(p) else None
                if where is not None:
                    ino = self._new_inode("d", p)
                    self._meta("mkdir", f"mkdir({self.rel(p)})", (*where, ino))

        return mkdir

    def _symlink(self, real: Any) -> Any:
        def symlink(
            src: Any, dst: Any, target_is_directory: bool = False, *, dir_fd: int | None = None
        ) -> None:
            with self._lock:
                real(src, dst, target_is_directory, dir_fd=dir_fd)
                p = _real_path(dst, dir_fd)
                where = self._where(p) if self.rel(p) else None
                if where is not None:
                    ino = self._new_inode("l", p)
                    self.live.targets[ino] = os.fsdecode(src)
                    self._meta("symlink", f"symlink({src}, {self.rel(p)})", (*where, ino))

        return symlink

    def _renameat2(self, real: Any) -> Any:
        def renameat2(fd_a: int, a: bytes, fd_b: int, b: bytes, flags: int) -> int:
            with self._lock:
                pa, pb = _real_path(a), _real_path(b)
                wa, wb = self._where(pa), self._where(pb)
                rc = int(real(fd_a, a, fd_b, b, flags))
                if rc == 0 and wa is not None and wb is not None:
                    ia, ib = (
                        self.live.entries[wa[0]].get(wa[1]),
                        self.live.entries[wb[0]].get(wb[1]),
                    )
                    text = f"renameat2({self.rel(pa)}, {self.rel(pb)}, RENAME_EXCHANGE)"
                    self._meta("exchange", text, (*wa, ib), (*wb, ia))
                return rc

        return renameat2

    def _sync_file_range(self, real: Any) -> Any:
        def sync_file_range(fd: int, offset: int, length: int, flags: int) -> int:
            rc = int(real(fd, offset, length, flags))
            ino = self._fd_inode(fd)
            if ino is not None:
                with self._lock:
                    text = f"sync_file_range({self._name(ino)}, {offset}, {length}) [a hint]"
                    self._add(Op("hint", text, ino=ino))
            return rc

        return sync_file_range
