"""What ran out: an ``OSError`` of the machine as a clear error, never taken for damage."""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator
from pathlib import Path

from functional_ckpt.errors import _RESOURCES, CheckpointError


def ran_out(e: BaseException) -> bool:
    """Whether ``e`` is the machine running out of descriptors, memory or disk."""
    return isinstance(e, OSError) and e.errno in _RESOURCES


def os_failure(e: OSError, where: Path, doing: str) -> CheckpointError:
    """``e`` (while ``doing`` at ``where``) as the error that says what ran out."""
    if e.errno == errno.ENOSPC:
        return CheckpointError(f"{where}: no space left on the device while {doing} ({e})")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return CheckpointError(f"{where}: permission denied while {doing} ({e})")
    if e.errno in (errno.EMFILE, errno.ENFILE):
        return CheckpointError(
            f"{where}: this process ran out of file descriptors while {doing} ({e}); "
            "raise the limit (ulimit -n) or close files"
        )
    if e.errno == errno.ENOMEM:
        return CheckpointError(f"{where}: out of memory while {doing} ({e})")
    return CheckpointError(f"{where}: {doing} failed: {e}")


@contextlib.contextmanager
def machine_errors(where: Path, doing: str) -> Iterator[None]:
    """Raise the machine running out (:func:`ran_out`) inside as :func:`os_failure`."""
    try:
        yield
    except OSError as e:
        if ran_out(e):
            raise os_failure(e, where, doing) from e
        raise
