"""Which tier a manager resumes from, and what a rollback moves in each tier.

A resume reads the newest step that some tier holds readable: the memory tier
first, unless the disk or remote tier holds a newer step, then the newest of the
disk and remote tiers (the remote one downloaded and verified). A rollback moves
every step newer than its target out of each tier's trunk, the remote one first
(docs/tiered.md), so that no tier can resume past it. Both are functions of the
tiers they are given: the manager only holds them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tensordict import TensorDict

from functional_ckpt._src.manager.memory_tier import MemoryTier
from functional_ckpt._src.remote.tier import RemoteTier
from functional_ckpt._src.root import rollback
from functional_ckpt._src.root.listing import StepInfo
from functional_ckpt._src.root.resume import newest_readable
from functional_ckpt._src.root.rollback import Newer
from functional_ckpt._src.root.view import RootView
from functional_ckpt._src.storage.os_failure import machine_errors
from functional_ckpt.errors import CheckpointError

__all__ = ["move_newer", "newest_in_tiers"]

_Found = tuple[StepInfo, TensorDict]


def newest_in_tiers(
    view: RootView,
    memory: MemoryTier | None,
    remote: RemoteTier | None,
    read: Callable[[Path], TensorDict],
    *,
    writer: bool,
    coordinator: bool,
) -> _Found | None:
    """The newest readable step of any tier, read; None only if no tier holds one.

    A writing coordinator renames damaged disk checkpoints aside (never deletes
    them); a writer downloads what only the remote tier holds.
    """
    root, move_aside = view.root, writer and coordinator

    def local() -> _Found | None:
        depth = 4 if remote is None else 6
        found, damaged = newest_readable(
            root, view.candidates, read, move_aside=move_aside, stacklevel=depth
        )
        view.found_unreadable(damaged)
        return found

    with machine_errors(root, "resuming"):  # what ran out, if anything did
        if memory is not None:
            others = view.steps()
            if remote is not None:
                with contextlib.suppress(CheckpointError):  # the remote resume reports it
                    others = others + remote.steps()
            found = memory.newest(read, max(others, default=None), stacklevel=5)
            if found is not None:
                return found
        if remote is None:
            return local()
        # The newest of both tiers; only the remote has it: downloaded, verified.
        one = lambda step: (view.info(step), read(view.path(step)))  # noqa: E731
        return remote.restore_latest(local, view.steps, one, writer=writer)


def move_newer(
    view: RootView,
    memory: MemoryTier | None,
    remote: RemoteTier | None,
    step: int,
    *,
    newer: Newer,
    branch: str | None,
    reason: Any,
    coordinator: bool,
) -> dict[str, Any] | None:
    """Every tier's steps newer than ``step`` out of the trunk; the rollback's record
    (None where this rank moves nothing on disk)."""
    if memory is not None:
        memory.drop_newer(step)
    doomed = sorted(s for s, _ in view.candidates() if s > step)
    if remote is not None and coordinator:  # the remote trunk first (tiered.md)
        gone = remote.newer_than(step)
        if gone and newer == "branch":
            branch = rollback.new_branch(view.root, branch, max(gone + doomed), step)
        remote.set_aside(gone, branch if newer == "branch" else None)
    if not (doomed or reason) or not coordinator:
        return None
    done = rollback.run(view.root, step, doomed, newer, branch, reason)
    view.forget(doomed)
    return done
