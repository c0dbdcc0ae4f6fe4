"""The one safe way to open a file of a checkpoint: no link followed, no blocking, checked size."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from functional_ckpt._src.codec import documents
from functional_ckpt._src.format.naming import is_temporary_name
from functional_ckpt._src.limits import LIMITS
from functional_ckpt._src.storage.os_failure import os_failure, ran_out
from functional_ckpt.errors import (
    CheckpointError,
    CheckpointNotFound,
    CorruptCheckpoint,
    IncompleteCheckpoint,
    UnsafeCheckpoint,
)

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


_KINDS = (
    (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
    (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link"),
)  # fmt: skip


def file_kind(mode: int) -> str:
    """What a directory entry of ``mode`` is, in words (for an error naming it)."""
    return next((words for test, words in _KINDS if test(mode)), "not a regular file")


def _check_mode(mode: int, where: Path, what: str) -> None:
    if stat.S_ISLNK(mode):
        raise UnsafeCheckpoint(f"{where}: checkpoint files may not be symbolic links ({what})")
    if not stat.S_ISREG(mode):
        raise UnsafeCheckpoint(
            f"{where}: the {what} is {file_kind(mode)}, not a regular file; the checkpoint is "
            "damaged or hostile (a special file would block or mislead a reader)"
        )


def open_member(
    dir_fd: int, name: str, where: Path, *, size: int | None = None, what: str = "file"
) -> int:
    """Open one file of a checkpoint to read; ``FileNotFoundError`` is the caller's (replaced?)."""
    _check_mode(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode, where, what)
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeCheckpoint(f"{where}: checkpoint files may not be symbolic links") from None
        if e.errno in (errno.ENXIO, errno.EISDIR, errno.ENOTDIR):
            raise UnsafeCheckpoint(f"{where}: the {what} is not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        _check_mode(st.st_mode, where, what)
        if size is not None and st.st_size != size:
            raise CorruptCheckpoint(
                f"{where}: file is {st.st_size} bytes, the manifest recorded {size} "
                "(truncated or replaced)"
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(dir_fd: int, name: str, where: Path, limit: int, what: str) -> bytes:
    """The whole of a small file, at most ``limit`` bytes, through :func:`open_member`."""
    fd = open_member(dir_fd, name, where, what=what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CorruptCheckpoint(
                f"{where}: the {what} is {size} bytes, more than the {limit} recorded or allowed"
            )
        return read_exact(fd, size, where)
    finally:
        os.close(fd)


def read_file(path: Path, *, limit: int, what: str = "file") -> bytes:
    """:func:`read_small` of a file kept beside checkpoints."""
    dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return read_small(dir_fd, path.name, path, limit, what)
    finally:
        os.close(dir_fd)


def read_state(path: Path, what: str) -> object | None:
    """A state file's JSON document, or None when none is to be trusted (it only informs)."""
    try:
        doc: object = documents.load(
            read_file(path, limit=LIMITS.state_file_bytes, what=what), str(path)
        )
    except (OSError, CheckpointError):
        return None
    return doc


def read_exact(fd: int, size: int, where: Path) -> bytes:
    """All ``size`` bytes of an opened file (its size was checked when it was opened)."""
    parts: list[bytes] = []
    done = 0
    while done < size:
        chunk = os.pread(fd, min(size - done, 16 << 20), done)
        if not chunk:
            raise CorruptCheckpoint(f"{where}: only {done} of {size} bytes could be read")
        parts.append(chunk)
        done += len(chunk)
    return b"".join(parts)


def exists_at(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def open_directory(path: Path) -> int:
    """A descriptor of the checkpoint directory ``path`` (the caller closes it)."""
    if is_temporary_name(path.name):
        raise IncompleteCheckpoint(
            f"{path}: a temporary directory (an unfinished save or a deletion in progress), "
            "never a checkpoint"
        )
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointNotFound(f"{path}: no checkpoint here (the path does not exist)") from None
    except NotADirectoryError:
        raise CheckpointNotFound(f"{path}: not a checkpoint directory (it is a file)") from None
    except OSError as e:
        if ran_out(e):
            raise os_failure(e, path, "reading") from e
        raise CheckpointNotFound(f"{path}: cannot open the checkpoint directory: {e}") from None
