"""Durable file primitives, so "durable" means the same for every writer; no link followed."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import uuid
from concurrent.futures import Future
from pathlib import Path

from functional_ckpt._src.format.naming import TMP_INFIX
from functional_ckpt._src.native import libc_function
from functional_ckpt._src.threads import BackgroundThread

#: Flags of every new file: created here, never an existing one, never through a link.
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
COPY_BLOCK = 32 << 20  # bytes copied per call, and handed to the disk per start_writeback
#: Where the kernel cannot copy between two files: copied through memory instead.
NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP)

_SYNC_FILE_RANGE_WRITE = 2  # start writing out the range's dirty pages; do not wait

_SYNC_FILE_RANGE = libc_function(
    "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
)

_FSYNC = BackgroundThread("fc-fsync")  # fsyncs while the writer goes on (drops the GIL)


def start_writeback(fd: int, offset: int, length: int) -> bool:
    """Ask the kernel to start writing a range of ``fd`` to disk, else it idles until the fsync."""
    if _SYNC_FILE_RANGE is None or length <= 0:
        return False
    return bool(_SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE) == 0)


class Appender:
    """A new file written front to back, handed to the disk every :data:`COPY_BLOCK` bytes."""

    __slots__ = ("end", "fd", "handed", "sync")

    def __init__(self, fd: int, *, sync: bool) -> None:
        self.fd = fd
        self.sync = sync
        self.end = self.handed = 0  # bytes written, and handed to the disk

    def write(self, data: memoryview | bytes | bytearray) -> None:
        write_all(self.fd, data)
        self.end += len(data)
        if self.sync and self.end - self.handed >= COPY_BLOCK:
            start_writeback(self.fd, self.handed, self.end - self.handed)
            self.handed = self.end


def copy_range(src: int, out: int, size: int, *, writeback: bool = False) -> int:
    """Copy ``size`` bytes of ``src`` to ``out`` (by the kernel where it can); the bytes copied."""
    done = 0
    kernel = True
    while done < size:
        want = min(COPY_BLOCK, size - done)
        if kernel:
            try:
                n = os.copy_file_range(src, out, want, done, done)
            except OSError as e:
                if e.errno not in NO_KERNEL_COPY:
                    raise
                kernel = False  # across file systems on older kernels
                continue
        else:
            block = os.pread(src, want, done)
            n = len(block) and os.pwrite(out, block, done)
        if n == 0:
            break
        if writeback:
            start_writeback(out, done, n)
        done += n
    return done


def tmp_sibling(path: Path, infix: str = TMP_INFIX) -> Path:
    """A hidden-by-name sibling of ``path`` that no reader mistakes for a checkpoint."""
    return path.with_name(f"{path.name}{infix}{uuid.uuid4().hex[:12]}")


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (new files, renames) durable."""
    fsync_and_close(os.open(path, os.O_RDONLY | os.O_DIRECTORY))


def write_all(fd: int, data: memoryview | bytes | bytearray) -> None:
    """Write every byte of ``data`` to ``fd`` (``os.write`` may write fewer)."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def open_new(path: Path, *, mapped: bool = False) -> int:
    """A new file at ``path`` (never an existing one or a link); ``mapped``: readable too."""
    flags = (NEW_FILE & ~os.O_WRONLY) | os.O_RDWR if mapped else NEW_FILE
    return os.open(path, flags, 0o644)


def fsync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def close_new(fd: int, sync: bool, background: list[Future[None]] | None = None) -> None:
    """Close a file written whole, fsynced first with ``sync`` (``background``: on its thread)."""
    if not sync:
        os.close(fd)
    elif background is None:
        fsync_and_close(fd)
    else:
        background.append(_FSYNC.pool().submit(fsync_and_close, fd))


def write_new(
    path: Path,
    data: bytes,
    *,
    sync: bool = True,
    background: list[Future[None]] | None = None,
    mode: int = 0o644,
) -> None:
    """Write a whole new file (never over anything) and close it as :func:`close_new`."""
    fd = os.open(path, NEW_FILE, mode)
    try:
        write_all(fd, data)
    except BaseException:
        os.close(fd)
        raise
    close_new(fd, sync, background)


def replace_durably(path: Path, data: bytes, *, sync: bool = True, mode: int = 0o644) -> None:
    """Replace the file at ``path`` atomically (``sync``: durably) by a new one of ``mode``
    (made so: an owner-only file is never readable by others); a link is replaced itself."""
    tmp = tmp_sibling(path)
    try:
        write_new(tmp, data, sync=sync, mode=mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync:
        fsync_dir(path.parent)


def make_dirs(path: Path) -> None:
    """``mkdir -p`` whose every newly created directory is durable in its parent."""
    if path.is_dir():
        return
    if path.parent != path:
        make_dirs(path.parent)
    try:
        path.mkdir()
    except FileExistsError:
        if path.is_dir():
            return  # another process made it just now (ranks sharing a node's folder)
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(path)) from None
    fsync_dir(path.parent)
