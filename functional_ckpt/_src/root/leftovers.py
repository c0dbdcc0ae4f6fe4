"""What crashed writers leave in a root: recovered if committed (the newest, to a free
name), removed if not; nothing committed is ever deleted. Safe only under the writer
lock, which :func:`open_writer` takes first."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from functional_ckpt._src.format import naming
from functional_ckpt._src.format.kind import Kind, classify, strays
from functional_ckpt._src.format.naming import EXPORTS_DIR, QUARANTINE_INFIX, base_name, parse_step
from functional_ckpt._src.log import warn
from functional_ckpt._src.root.listing import _created, leftover_manifest
from functional_ckpt._src.root.lock import WriterLock
from functional_ckpt._src.root.run import RUN_FILE
from functional_ckpt._src.storage import commit, durable
from functional_ckpt.errors import CheckpointError, LeftoverWarning

#: Prefix of the private directories a download from the remote tier fills (never committed).
DOWNLOAD_PREFIX = ".fc-download-"


def open_writer(root: Path, *, stacklevel: int = 2) -> WriterLock:
    """Become the one writer of ``root``: create it, lock it, then recover what crashes left."""
    if root.exists() and not root.is_dir():
        raise CheckpointError(f"{root}: the checkpoint root is a file, not a directory")
    try:
        durable.make_dirs(root)
    except OSError as e:
        raise CheckpointError(f"{root}: cannot create the checkpoint root: {e}") from e
    lock = WriterLock(root)
    try:
        recover_leftovers(root, stacklevel=stacklevel + 1)
    except BaseException:
        lock.release()
        raise
    return lock


def recover_leftovers(root: Path, *, stacklevel: int = 2) -> list[Path]:
    """Recover or remove what crashed writers left in ``root``; returns what was recovered.
    Temporaries under ``exports/`` and interrupted downloads are deleted (written again)."""
    remove_downloads(root)
    groups: dict[str, list[Path]] = {}
    changed = False
    for parent in (root, root / EXPORTS_DIR):
        try:
            entries = list(os.scandir(parent))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            base = base_name(entry.name)
            if not naming.is_temporary_name(entry.name) or QUARANTINE_INFIX in entry.name:
                continue
            if parse_step(base) is None and (parent, base) != (root, RUN_FILE):
                continue  # the user's, but for a run record's temporary
            path = Path(entry.path)
            if not entry.is_dir(follow_symlinks=False):
                os.unlink(path)
                changed = True
            elif parent == root and leftover_manifest(path) is not None:
                groups.setdefault(base, []).append(path)
            else:
                commit.remove_tree(path)
                changed = True
    return _put_back(root, groups, changed, stacklevel=stacklevel + 1)


def remove_downloads(root: Path) -> None:
    """Remove what interrupted downloads left in ``root`` (never a checkpoint, no marker)."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            if entry.name.startswith(DOWNLOAD_PREFIX):
                commit.remove_tree(Path(entry.path))


def recover_beside(directory: Path, *, stacklevel: int = 2) -> list[Path]:
    """:func:`recover_leftovers` for checkpoints named freely among other files
    (Lightning's): only a temporary holding nothing but a checkpoint's files is touched."""
    groups: dict[str, list[Path]] = {}
    changed = False
    try:
        entries = list(os.scandir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for entry in entries:
        base = naming.temporary_base(entry.name)
        if base is None:
            continue
        path = Path(entry.path)
        kind = classify(path, by_name=False)
        if kind not in _LEFTOVERS or strays(path, kind):
            continue  # not what a save of this project leaves: someone else's
        if kind is Kind.COMMITTED:
            groups.setdefault(base, []).append(path)
        else:
            commit.remove_tree(path)
            changed = True
    return _put_back(directory, groups, changed, stacklevel=stacklevel + 1)


#: What a killed save or deletion leaves, from its first file to its marker.
_LEFTOVERS = frozenset({Kind.EMPTY, Kind.PART, Kind.STOCK_DCP, Kind.UNCOMMITTED, Kind.COMMITTED})


def _put_back(
    parent: Path, groups: dict[str, list[Path]], changed: bool, *, stacklevel: int
) -> list[Path]:
    """Rename the newest committed leftover (by save time) of each free name back; warn
    about the rest (an interrupted overwrite leaves two)."""
    recovered: list[Path] = []
    for base, paths in sorted(groups.items()):
        final = parent / base
        paths.sort(key=lambda p: (_created(p), naming.TMP_INFIX in p.name), reverse=True)
        if not os.path.lexists(final):
            os.rename(paths[0], final)
            durable.fsync_dir(parent)
            recovered.append(final)
            warn(
                f"{final}: recovered from {paths[0].name}, a committed checkpoint an interrupted "
                "save or deletion left behind",
                LeftoverWarning,
                stacklevel=stacklevel,
            )
            paths = paths[1:]
        for path in paths:
            warn(
                f"{path}: a committed checkpoint left behind by an interrupted save or deletion "
                f"while {final.name} exists; kept (never deleted automatically). Inspect it "
                "and delete it by hand if it is not needed",
                LeftoverWarning,
                stacklevel=stacklevel,
            )
    if changed:
        durable.fsync_dir(parent)
    return recovered
