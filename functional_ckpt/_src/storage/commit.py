"""The commit protocol: a fully written ``<name>.tmp-<id>/`` becomes a checkpoint at once."""

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
from functional_ckpt._src.format.kind import Kind, classify, strays
from functional_ckpt._src.format.naming import (
    COMMIT_MARKER,
    DCP_METADATA,
    FORMAT_NAME,
    TRASH_INFIX,
    step_in_name,
)
from functional_ckpt._src.log import done, logger
from functional_ckpt._src.native import libc_function
from functional_ckpt._src.storage.durable import fsync_dir, tmp_sibling, write_new
from functional_ckpt.errors import CheckpointExists

_RENAMEAT2 = libc_function(
    "renameat2", [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
)

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux ``renameat2``); False where unsupported."""
    if _RENAMEAT2 is None:
        return False
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def write_commit_marker(
    tmp: Path, manifest_bytes: bytes, *, version: int, sync: bool = True
) -> None:
    """The marker of a manifest of format ``version``, after an fsync of the directory
    (else a crash may keep the marker but lose a file's entry: a torn checkpoint)."""
    if sync:
        fsync_dir(tmp)
    marker = {"format": FORMAT_NAME, "version": version, "manifest_size": len(manifest_bytes)}
    marker["manifest_crc32"] = crc32(manifest_bytes)
    write_new(tmp / COMMIT_MARKER, codec.encode(marker), sync=sync)


def remove_tree(path: Path) -> None:
    """Delete a checkpoint-like directory so that no crash leaves it looking valid (the
    marker first, durably, then ``.metadata``); a link is removed itself, never followed."""
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


#: What a save, an export and a rank's part of a split checkpoint may replace (or empty).
CHECKPOINTS = frozenset({Kind.COMMITTED, Kind.UNCOMMITTED, Kind.STOCK_DCP})
EXPORTS = frozenset({Kind.EXPORT})
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
    """Make a fully written ``tmp`` visible as ``final``, atomically; with ``overwrite`` an existing
    one (of ``replaces``) stays readable until exchanged (where the OS can)."""
    t0 = time.perf_counter()
    fsync = fsync_dir if sync else (lambda path: None)
    fsync(tmp)
    parent = final.parent
    taken = CheckpointExists(
        f"{final}: a checkpoint already exists here; pass overwrite=True to replace it"
    )
    if final.exists() or final.is_symlink():
        if not overwrite:
            raise taken
        check_replaceable(final, replaces)
        if _exchange(tmp, final):
            fsync(parent)
            remove_tree(tmp)  # tmp now holds the old checkpoint
        else:
            aside = tmp_sibling(final, TRASH_INFIX)
            os.rename(final, aside)
            try:
                os.rename(tmp, final)
            except BaseException:
                os.rename(aside, final)
                raise
            fsync(parent)
            remove_tree(aside)
    else:
        try:
            os.rename(tmp, final)
        except OSError as e:  # another saver committed here since it was looked for
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise taken from e
            raise
        fsync(parent)
    seconds = time.perf_counter() - t0
    done(_LOG, "committed", final, seconds=seconds, step=step_in_name(final.name), to="as")


_LOG = logger("storage")


def check_replaceable(path: Path, kinds: frozenset[Kind] = CHECKPOINTS) -> None:
    """Refuse to replace ``path`` unless empty or one of ``kinds`` holding only its own files."""
    kind = classify(path)
    others = strays(path, kind) if kind in kinds else []
    if kind is Kind.EMPTY or (kind in kinds and not others):
        return
    noun = _NOUN.get(kinds, "one of " + ", ".join(sorted(k.value for k in kinds)))
    if others:
        found = f"holds {', '.join(others[:3])}: not a file of {noun}"
    elif kind is Kind.OTHER:
        found = f"is not {noun}: it holds other files (a root of checkpoints? a source tree?)"
    else:
        found = f"is not {noun} but {kind.value}"
    raise CheckpointExists(
        f"{path}: exists and {found}; only {noun} (or an empty directory) is replaced "
        "with overwrite=True, so it was left intact: choose another path or remove it"
    )
