"""The commit protocol: a fully written directory becomes a checkpoint at once.

A checkpoint is written as ``<name>.tmp-<id>/``; every file is fsynced, the commit
marker is written last (it records the manifest's size and checksum, so a torn or
altered manifest is caught), the directory is fsynced, renamed into place (an
atomic exchange when replacing one) and its parent fsynced. Only a checkpoint (or
an empty directory) may ever be replaced.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from functional_ckpt._src import codec
from functional_ckpt._src.format.checksum import crc32
from functional_ckpt._src.format.naming import (
    COMMIT_MARKER,
    DCP_METADATA,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    TRASH_INFIX,
)
from functional_ckpt._src.storage.durable import fsync_dir, tmp_sibling, write_file_durably
from functional_ckpt.errors import (
    CheckpointExists,
)


def _renameat2_exchange() -> Any:
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _renameat2_exchange()

_AT_FDCWD = -100

_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux ``renameat2``); False where unsupported."""
    if _RENAMEAT2 is None:
        return False
    rc = _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def write_commit_marker(tmp: Path, manifest_bytes: bytes) -> None:
    marker = codec.encode(
        {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "manifest_size": len(manifest_bytes),
            "manifest_crc32": crc32(manifest_bytes),
        }
    )
    write_file_durably(tmp / COMMIT_MARKER, marker)


def remove_tree(path: Path) -> None:
    """Delete a checkpoint-like directory so that no crash leaves it looking valid.

    The marker goes first (it is what makes a directory a checkpoint), then the rest.
    """
    with contextlib.suppress(OSError):
        os.unlink(path / COMMIT_MARKER)
    shutil.rmtree(path, ignore_errors=True)


def commit_checkpoint(
    tmp: Path,
    final: Path,
    *,
    overwrite: bool,
    replaceable: Callable[[Path], None] | None = None,
) -> None:
    """Make a fully written ``tmp`` directory visible as ``final``, atomically.

    With ``overwrite`` an existing ``final`` stays readable until the new one has
    taken its place (an atomic exchange where the OS offers it; otherwise the old
    one is moved aside for the shortest possible moment and put back on failure).
    ``replaceable(final)`` raises if what is there may not be replaced (checked
    again here, right before the exchange).
    """
    fsync_dir(tmp)
    parent = final.parent
    if final.exists() or final.is_symlink():
        if not overwrite:
            raise CheckpointExists(
                f"{final}: a checkpoint already exists here; pass overwrite=True to replace it"
            )
        if replaceable is not None:
            replaceable(final)
        elif not final.is_dir() or final.is_symlink():
            raise CheckpointExists(f"{final}: exists and is not a checkpoint directory")
        if _exchange(tmp, final):
            fsync_dir(parent)
            remove_tree(tmp)  # tmp now holds the old checkpoint
            return
        aside = tmp_sibling(final, TRASH_INFIX)
        os.rename(final, aside)
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(aside, final)
            raise
        fsync_dir(parent)
        remove_tree(aside)
        return
    os.rename(tmp, final)
    fsync_dir(parent)


def checkpoint_like(path: Path) -> bool:
    """Is the directory ``path`` something a checkpoint save may replace?

    A committed checkpoint of this format, an uncommitted one (only our files), a
    stock DCP checkpoint (``.metadata`` and ``*.distcp`` files only), or nothing.
    A directory holding anything else (a manager root, a source tree) is not.
    """
    try:
        names = os.listdir(path)
    except OSError:
        return False
    ours = {COMMIT_MARKER, MANIFEST, DCP_METADATA}
    for name in names:
        if name in ours or (name.endswith(".distcp") and "/" not in name):
            try:
                st = os.lstat(path / name)
            except OSError:
                return False
            if not stat.S_ISREG(st.st_mode):
                return False
            continue
        return False
    return not names or DCP_METADATA in names or MANIFEST in names


def check_replaceable(path: Path) -> None:
    """Refuse to replace anything at ``path`` but a checkpoint or an empty directory."""
    if path.is_symlink() or not path.is_dir():
        raise CheckpointExists(f"{path}: exists and is not a checkpoint directory; left intact")
    if not checkpoint_like(path):
        raise CheckpointExists(
            f"{path}: exists and is not a checkpoint (it holds other files, e.g. a "
            "checkpoint root or a source tree); overwrite=True replaces only a checkpoint or "
            "an empty directory, so it was left intact: choose another path or remove it"
        )
