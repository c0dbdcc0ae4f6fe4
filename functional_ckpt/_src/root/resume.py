"""Which checkpoint a run resumes from: the newest one that is actually readable.

A damaged one is warned about and skipped (a writer moves it aside, a reader remembers
it); a template or argument that does not fit raises at once, and checkpoints that
exist but none readable raise rather than start fresh."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TypeVar

from functional_ckpt._src.log import warn
from functional_ckpt._src.root.delete import quarantine
from functional_ckpt._src.root.listing import StepInfo, dir_identity, quarantined, read_info
from functional_ckpt.errors import CheckpointError, CheckpointWarning, is_damage

T = TypeVar("T")


class _Vanished(Exception):
    """A candidate was pruned or replaced while it was read: list again."""


_RELISTS = 100  # re-list only when a follower raced a prune


def newest_readable(
    root: Path,
    candidates: Callable[[], Iterable[tuple[int, Path]]],
    read: Callable[[Path], T],
    *,
    move_aside: bool,
    stacklevel: int = 2,
    elsewhere: bool = False,
) -> tuple[tuple[StepInfo, T] | None, set[tuple[int, int]]]:
    """Read the newest of ``candidates()`` (``(step, path)``, listed again when one
    vanishes while read) that ``read`` reads: ((its summary, what ``read`` made) or None,
    the ``(step, inode)`` of each damaged one left in place). ``elsewhere``: another tier
    holds an older intact step, so none readable here is no error."""
    failures: list[str] = []
    bad: set[tuple[int, int]] = set()

    def attempt() -> tuple[StepInfo, T] | None:
        for step, path in sorted(candidates(), reverse=True):
            before = dir_identity(path)
            if before is not None and (step, before[0]) in bad:
                continue  # found damaged already, on an earlier listing
            try:
                info = read_info(path, step)
                state = read(path)
            except Exception as err:
                if not is_damage(err):
                    raise  # the template or an argument is wrong, not the checkpoint
                if before is None or dir_identity(path) != before:
                    raise _Vanished from None  # pruned or replaced by the writer we follow
                failures.append(f"  {path}: {err}")
                moved = ""  # warned about, and never picked again
                missing = isinstance(err, OSError) and err.errno == errno.ENOENT
                if move_aside and (isinstance(err, CheckpointError) or missing):
                    with contextlib.suppress(OSError):
                        moved = f"; moved aside to {quarantine(root, path).name} (not deleted)"
                if not moved:
                    with contextlib.suppress(OSError):
                        bad.add((step, os.stat(path).st_ino))
                warn(
                    f"{path}: checkpoint of step {step} is unreadable ({type(err).__name__}: {err})"
                    f"{moved}; falling back to the previous checkpoint",
                    CheckpointWarning,
                    stacklevel=stacklevel + 1,  # one frame deeper than newest_readable
                )
                continue
            return info, state
        return None

    for _ in range(_RELISTS):
        try:
            result = attempt()
            break
        except _Vanished:
            continue
    else:
        raise CheckpointError(f"{root}: checkpoints kept vanishing while restoring")
    if result is not None or elsewhere:
        return result, bad
    if failures:
        raise CheckpointError(
            f"{root}: checkpoints exist but none is readable; refusing to start "
            "fresh:\n" + "\n".join(failures)
        )
    damaged = quarantined(root)
    if damaged:
        raise CheckpointError(
            f"{root}: the only checkpoints here were found damaged earlier and moved "
            f"aside ({', '.join(damaged[:5])}); refusing to start fresh. Move or delete "
            "them to start over"
        )
    return None, bad


def check_order(root: Path, step: int, latest: int | None) -> None:
    """Refuse to save ``step`` behind the newest checkpoint: a resume would never pick it."""
    if latest is not None and step < latest:
        raise CheckpointError(
            f"{root}: cannot save step {step}: step {latest} is newer, and a "
            "resume would pick it over this one. Call restore_latest() to resume, "
            f"rollback(step) to continue from an older step (step {latest} and the "
            "others after it are kept on a branch), or fork() into a new root"
        )
