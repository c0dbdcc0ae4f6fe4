"""Which tier a manager resumes from, and what a rollback moves in each tier.

A resume reads the newest intact step of this run that any tier holds
(:func:`newest_in_tiers`, the one place that decides it): a damaged step is
passed over for the step below it, in every tier alike. A rollback moves
every step newer than its target out of each tier's trunk, the remote one first
(docs/tiered.md), so that no tier can resume past it. Both are functions of the
tiers they are given: the manager only holds them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
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
    """The newest intact step of this run in any tier, read; None only if no tier holds one.

    This is which checkpoint a resume takes. The tiers are asked in order, fastest
    first (memory, then the disk with the remote behind it), each for its newest
    intact step newer than the best found so far: a damaged step is reported and the
    one below it tried, in that tier, so a damaged newest checkpoint never hides an
    intact one that came later in the run, in any tier. A tie goes to the faster
    tier. The memory tier holds this run's checkpoints only (:mod:`.memory_folder`);
    the disk and remote tiers are the root's own. A writing coordinator renames
    damaged disk checkpoints aside (never deletes them); a writer downloads what
    only the remote tier holds.
    """
    root, move_aside = view.root, writer and coordinator

    def in_memory(above: int | None) -> _Found | None:
        assert memory is not None
        return memory.newest(read, None if above is None else above + 1, stacklevel=6)

    def local(above: int | None) -> _Found | None:
        depth = 4 if remote is None else 7
        newer = lambda: [(s, p) for s, p in view.candidates() if above is None or s > above]  # noqa: E731
        found, damaged = newest_readable(
            root, newer, read, move_aside=move_aside, stacklevel=depth, elsewhere=above is not None
        )
        view.found_unreadable(damaged)
        return found

    def local_and_remote(above: int | None) -> _Found | None:
        assert remote is not None
        one = lambda step: (view.info(step), read(view.path(step)))  # noqa: E731
        newer = lambda: [s for s in view.steps() if above is None or s > above]  # noqa: E731
        return remote.restore_latest(partial(local, above), newer, one, writer=writer, above=above)

    tiers = [in_memory] if memory is not None else []
    tiers.append(local if remote is None else local_and_remote)
    found: _Found | None = None
    with machine_errors(root, "resuming"):  # what ran out, if anything did
        for tier in tiers:
            found = tier(None if found is None else found[0].step) or found
    return found


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
