"""Deleting checkpoints so that no crash leaves half of one readable: renamed out of
sight first, the marker unlinked, then the files removed; a damaged one is moved
aside, never deleted."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from pathlib import Path

from functional_ckpt._src.format import naming
from functional_ckpt._src.format.kind import classify, strays
from functional_ckpt._src.format.naming import QUARANTINE_INFIX, base_name, step_in_name
from functional_ckpt._src.log import done, logger
from functional_ckpt._src.storage import commit, durable
from functional_ckpt.errors import CheckpointError, CheckpointNotFound


def quarantine(root: Path, path: Path) -> Path:
    """Move a damaged checkpoint aside to ``step_N.corrupt-<id>`` (kept, never deleted)."""
    aside = durable.tmp_sibling(path, QUARANTINE_INFIX)
    os.rename(path, aside)
    durable.fsync_dir(root)
    return aside


def delete(root: Path, paths: Iterable[Path]) -> list[Path]:
    """Take checkpoints out of sight crash-safely; returns the trash left to remove (a
    crash leaves uncommitted leftovers). Of a symbolic link only the link goes."""
    trash: list[Path] = []
    t0 = time.perf_counter()
    for path in paths:
        if path.is_symlink():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # the link only: what it points to is not ours
            continue
        aside = durable.tmp_sibling(path, naming.TRASH_INFIX)
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            continue
        trash.append(aside)
    if trash:
        durable.fsync_dir(root)
        for aside in trash:
            with contextlib.suppress(OSError):
                os.unlink(aside / naming.COMMIT_MARKER)
    seconds = time.perf_counter() - t0
    for aside in trash:  # what retention prunes, a memory tier drops, a user removes
        path = aside.with_name(base_name(aside.name))
        done(_LOG, "deleted", path, seconds=seconds, step=step_in_name(path.name), to="at")
    return trash


_LOG = logger("root")


def remove_all(paths: Iterable[Path]) -> None:
    for path in paths:
        commit.remove_tree(path)


def remove_checkpoint(path: str | os.PathLike[str], *, missing_ok: bool = False) -> None:
    """Delete one checkpoint directory so that no crash leaves half of it readable;
    anything but a checkpoint raises ``CheckpointError`` and is left intact."""
    path = Path(path)
    if not os.path.lexists(path):
        if missing_ok:
            return
        raise CheckpointNotFound(f"{path}: no such checkpoint to remove")
    if path.is_symlink():
        raise CheckpointError(
            f"{path}: a symbolic link, not a checkpoint directory; neither it nor what it "
            "points to is removed (remove the link itself if that is what you meant)"
        )
    found = classify(path)
    if found not in commit.CHECKPOINTS or strays(path, found):
        raise CheckpointError(
            f"{path}: not a checkpoint directory but {found.value} (only a directory holding "
            "a checkpoint's files, and nothing else, is removed); left intact"
        )
    remove_all(delete(path.parent, [path]))
