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
import errno
import os
import shutil
import time
from pathlib import Path

from functional_ckpt._src import codec
from functional_ckpt._src.format.checksum import crc32
from functional_ckpt._src.format.kind import Kind, classify, holds_only_its_own
from functional_ckpt._src.format.naming import (
    COMMIT_MARKER,
    DCP_METADATA,
    FORMAT_NAME,
    TRASH_INFIX,
    parse_step,
)
from functional_ckpt._src.log import done, logger
from functional_ckpt._src.native import libc_function
from functional_ckpt._src.storage.durable import fsync_dir, tmp_sibling, write_new
from functional_ckpt.errors import (
    CheckpointExists,
)

_RENAMEAT2 = libc_function(
    "renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
)

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


def _no_fsync(path: Path) -> None:
    """Where a commit need not survive a power loss (a memory tier's)."""


def write_commit_marker(
    tmp: Path, manifest_bytes: bytes, *, version: int, sync: bool = True
) -> None:
    """The marker of a manifest written with format ``version`` (the manifest's own).

    The directory is fsynced first: until then the entries of the files written
    before may be lost while the marker's own reaches the disk, and a leftover
    holding a whole marker and manifest but not every file would be recovered as
    a checkpoint (``tests/test_crash_states.py``).
    """
    if sync:
        fsync_dir(tmp)
    marker = codec.encode(
        {
            "format": FORMAT_NAME,
            "version": version,
            "manifest_size": len(manifest_bytes),
            "manifest_crc32": crc32(manifest_bytes),
        }
    )
    write_new(tmp / COMMIT_MARKER, marker, sync=sync)


def remove_tree(path: Path) -> None:
    """Delete a checkpoint-like directory so that no crash leaves it looking valid.

    The marker goes first (it is what makes a directory a checkpoint), and its
    removal is made durable (an fsync of the directory) before anything else goes:
    else a crash may keep the marker and lose another file, and the leftover
    recovery would put a torn checkpoint back (``tests/test_crash_states.py``).
    Then the ``.metadata`` (without it, what is left can no longer pass for a stock
    DCP checkpoint to a reader that lists it half-deleted), then the rest. A
    symbolic link is removed itself: nothing is ever deleted through one.
    """
    if path.is_symlink():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    with contextlib.suppress(OSError):
        os.unlink(path / COMMIT_MARKER)
    with contextlib.suppress(OSError):
        fsync_dir(path)
    with contextlib.suppress(OSError):
        os.unlink(path / DCP_METADATA)
    shutil.rmtree(path, ignore_errors=True)


#: What a checkpoint save may replace (beside an empty directory).
CHECKPOINTS = frozenset({Kind.COMMITTED, Kind.UNCOMMITTED, Kind.STOCK_DCP})
#: What an export may replace.
EXPORTS = frozenset({Kind.EXPORT})
#: What a rank's part of a split checkpoint may replace: a part, or a checkpoint.
PARTS = CHECKPOINTS | {Kind.PART}

_NOUN = {
    CHECKPOINTS: "a checkpoint directory",
    EXPORTS: "a safetensors export",
    PARTS: "a checkpoint directory or a rank's part of one",
}


def commit_checkpoint(
    tmp: Path,
    final: Path,
    *,
    overwrite: bool,
    replaces: frozenset[Kind] = CHECKPOINTS,
    sync: bool = True,
) -> None:
    """Make a fully written ``tmp`` directory visible as ``final``, atomically.

    With ``overwrite`` an existing ``final`` stays readable until the new one has
    taken its place (an atomic exchange where the OS offers it; otherwise the old
    one is moved aside for the shortest possible moment and put back on failure).
    Only a directory of ``replaces`` holding nothing but its own files (or an
    empty one) is ever replaced (:func:`check_replaceable`, checked again here,
    right before the exchange). Without ``sync`` nothing is fsynced: the commit is
    atomic for every reader, durable only as far as the file system is (a memory tier).
    """
    t0 = time.perf_counter()
    _replace(tmp, final, overwrite, replaces, sync)
    seconds = time.perf_counter() - t0
    done(_LOG, "committed", final, seconds=seconds, step=parse_step(final.name), to="as")


_LOG = logger("storage")


def _replace(
    tmp: Path, final: Path, overwrite: bool, replaces: frozenset[Kind], sync: bool
) -> None:
    fsync = fsync_dir if sync else _no_fsync
    fsync(tmp)
    parent = final.parent
    if final.exists() or final.is_symlink():
        if not overwrite:
            raise CheckpointExists(
                f"{final}: a checkpoint already exists here; pass overwrite=True to replace it"
            )
        check_replaceable(final, replaces)
        if _exchange(tmp, final):
            fsync(parent)
            remove_tree(tmp)  # tmp now holds the old checkpoint
            return
        aside = tmp_sibling(final, TRASH_INFIX)
        os.rename(final, aside)
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(aside, final)
            raise
        fsync(parent)
        remove_tree(aside)
        return
    os.rename(tmp, final)
    fsync(parent)


def check_replaceable(path: Path, kinds: frozenset[Kind] = CHECKPOINTS) -> None:
    """Refuse to replace ``path`` unless it is one of ``kinds`` holding only its own files,
    or an empty directory (the one check every writer that replaces a directory makes)."""
    kind = classify(path)
    if kind is Kind.EMPTY or (kind in kinds and holds_only_its_own(path, kind)):
        return
    noun = _NOUN.get(kinds, "one of " + ", ".join(sorted(k.value for k in kinds)))
    if kind in kinds:
        found = f"{kind.value} holding other files too"
    elif kind is Kind.OTHER:
        found = f"not {noun}: it holds other files (a root of checkpoints? a source tree?)"
    else:
        found = f"not {noun} but {kind.value}"
    raise CheckpointExists(
        f"{path}: exists and is {found}; only {noun} (or an empty directory) is replaced "
        "with overwrite=True, so it was left intact: choose another path or remove it"
    )
