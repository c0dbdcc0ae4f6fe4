"""One writer per root: an exclusive ``flock`` on ``root/.lock``, which the kernel
drops when the holder dies, however it dies (an O_EXCL file would outlive a crash)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from pathlib import Path

from functional_ckpt._src.codec import documents
from functional_ckpt.errors import CheckpointError

LOCK_FILE = ".lock"

#: A dead writer's lock can outlive it briefly: children it forked (data loader
#: workers, a subprocess before its exec) hold the descriptor until they exit.
LOCK_GRACE_S = 3.0


def _flock_with_grace(fd: int) -> None:
    deadline = time.monotonic() + LOCK_GRACE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _open_lock_file(root: Path, path: Path) -> int:
    """Open (or create) the lock file without following a link or blocking on a FIFO."""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(
                f"{root}: the writer lock {path} is a symbolic link; refusing to follow it "
                "(its target is left untouched). Remove the link and try again"
            ) from None
        raise CheckpointError(
            f"{root}: cannot take the writer lock {path} ({e}); on a read-only "
            "location open the manager with read_only=True"
        ) from e
    st = os.fstat(fd)
    why = None if stat.S_ISREG(st.st_mode) else "is not a regular file"
    if why is None and st.st_nlink != 1:  # writing the holder's name would change another file
        why = (
            f"has {st.st_nlink} hard links, so it is shared with another file that taking "
            "the lock would overwrite"
        )
    if why is not None:
        os.close(fd)
        raise CheckpointError(f"{root}: the writer lock {path} {why}; remove it and try again")
    return fd


class WriterLock:
    """An exclusive ``flock`` on ``root/.lock`` for a writer's lifetime. The file (its
    holder, for messages) is never removed, lest another process lock a fresh inode."""

    def __init__(self, root: Path) -> None:
        self.path = root / LOCK_FILE
        fd = _open_lock_file(root, self.path)
        try:
            _flock_with_grace(fd)
        except OSError as e:
            holder = _holder_text(fd, self.path)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CheckpointError(f"{root}: cannot lock {self.path}: {e}") from e
            raise CheckpointError(
                f"{root}: another writing CheckpointManager holds the lock "
                f"({holder}); only one writer per root is allowed. Stop it, use "
                "another root, or open this one with read_only=True to follow it"
            ) from None
        self.fd: int | None = fd
        info = {"pid": os.getpid(), "hostname": socket.gethostname(), "since": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = None

    def __del__(self) -> None:  # a writer dropped without release() still unlocks
        with contextlib.suppress(Exception):
            self.release()


def _holder_text(fd: int, path: Path) -> str:
    try:
        info = documents.load(os.pread(fd, 4096, 0), str(path))
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
        return f"pid {info['pid']} on {info['hostname']} since {since}; see {path}"
    except (OSError, ValueError, KeyError, TypeError, OverflowError):
        return f"holder unknown; see {path}"
