"""The tier protocol, and each decision a manager makes over its ordered list of tiers.

A tier is any place that holds committed checkpoints of a run: the folder in RAM
(:class:`~.memory_tier.MemoryTier`), the root on disk with its object store behind
it (:class:`DiskTier`). Each answers the few questions of :class:`Tier`; the
manager holds them fastest first, and resume (:func:`newest_in_tiers`), retention
(:func:`retain`), deletion, progress for ``fckpt run`` and closing are written
once here over that list, so no tier decides any of them on its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from functional_ckpt._src.distributed.topology import topology
from functional_ckpt._src.manager.writes import Writes
from functional_ckpt._src.policy.retention import RetentionPolicy, plan_deletions
from functional_ckpt._src.remote.resume import Found
from functional_ckpt._src.remote.tier import RemoteTier
from functional_ckpt._src.root import rollback
from functional_ckpt._src.root.delete import delete
from functional_ckpt._src.root.listing import StepInfo
from functional_ckpt._src.root.resume import newest_readable
from functional_ckpt._src.root.rollback import Newer
from functional_ckpt._src.root.view import RootView
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.storage.os_failure import machine_errors
from functional_ckpt._src.storage.progress import report_progress

__all__ = ["DiskTier", "Tier", "move_newer", "newest_in_tiers", "progress", "retain"]

T = TypeVar("T")


class Tier(Protocol):
    """What a manager asks of a tier; what the answers mean is decided here, once."""

    def steps(self) -> list[int]:
        """The committed steps the tier holds, ascending."""
        ...

    def infos(self) -> list[StepInfo]:
        """:class:`StepInfo` of each readable committed checkpoint (what retention reads)."""
        ...

    def newest(self, read: Callable[[Path], T], above: int | None) -> Found[T]:
        """The tier's newest intact checkpoint of this run newer than ``above``, read;
        a damaged one is reported and set aside by the tier's own crash-safe means."""
        ...

    def delete(self, steps: Sequence[int]) -> None:
        """Remove ``steps`` crash-safely (out of sight at once)."""
        ...

    def wait(self) -> None:
        """Collect the save in flight."""
        ...

    def close(self, *, crashed: bool) -> None:
        """The manager closes (``crashed``: an exception left it)."""
        ...


def newest_in_tiers(tiers: Sequence[Tier], read: Callable[[Path], T], root: Path) -> Found[T]:
    """The newest intact step of this run in any tier, read; None only if no tier holds one.

    This is which checkpoint a resume takes. The tiers are asked in order, fastest
    first, each for its newest intact step newer than the best found so far: a
    damaged step is passed over for the one below it, in that tier, so a damaged
    newest checkpoint never hides an intact one that came later in the run, in any
    tier. A tie goes to the faster tier.
    """
    found: Found[T] = None
    with machine_errors(root, "resuming"):  # what ran out, if anything did
        for tier in tiers:
            found = tier.newest(read, None if found is None else found[0].step) or found
    return found


def retain(tier: Tier, keep: RetentionPolicy, protected: Iterable[int] = ()) -> list[int]:
    """Delete from ``tier`` what ``keep`` does not keep (never its newest nor ``protected``)."""
    doomed = plan_deletions(keep, tier.infos(), protected=protected)
    if doomed:
        tier.delete(doomed)
    return doomed


def progress(tiers: Sequence[Tier]) -> None:
    """Tell a supervising ``fckpt run`` the newest step any tier holds (a job resuming a
    little further from RAM each time makes progress too)."""
    if topology().rank == 0:
        newest = max((s for t in tiers for s in t.steps()[-1:]), default=None)
        if newest is not None:
            report_progress(newest, time.time())


class DiskTier:
    """The manager's root, with its remote store (if any) behind it: a resume there
    downloads what only the remote holds, a writing coordinator moves damage aside."""

    def __init__(
        self,
        view: RootView,
        remote: RemoteTier | None,
        writes: Writes,
        committed: Callable[[CheckpointInfo], None],
        *,
        writer: bool,
        coordinator: bool,
    ) -> None:
        self.view, self.remote, self.writer, self.coordinator = view, remote, writer, coordinator
        self._writes, self._committed = writes, committed
        self.steps, self.infos = view.steps, view.infos

    def newest(self, read: Callable[[Path], T], above: int | None) -> Found[T]:
        view, remote = self.view, self.remote

        def local() -> Found[T]:
            newer = lambda: [(s, p) for s, p in view.candidates() if above is None or s > above]  # noqa: E731
            found, damaged = newest_readable(
                view.root,
                newer,
                read,
                move_aside=self.writer and self.coordinator,
                stacklevel=5 if remote is None or not self.writer else 6,
                elsewhere=above is not None,
            )
            view.found_unreadable(damaged)
            return found

        if remote is None or not self.writer:  # a reader follows the root alone
            return local()
        one = lambda step: (view.info(step), read(view.path(step)))  # noqa: E731
        newer = lambda: [s for s in view.steps() if above is None or s > above]  # noqa: E731
        return remote.resume.latest(local, newer, one, above)

    def delete(self, steps: Sequence[int]) -> None:
        trash = delete(self.view.root, [self.view.path(s) for s in steps])
        self.view.forget(list(steps))
        self._writes.remove(trash)

    def wait(self) -> None:
        info = self._writes.wait()
        if info is not None:
            self._committed(info)

    def close(self, *, crashed: bool) -> None:
        if self.remote is not None:
            self.remote.close()  # the uploads asked for finish


def move_newer(
    tiers: Sequence[Tier],
    disk: DiskTier,
    step: int,
    *,
    newer: Newer,
    branch: str | None,
    reason: Any,
) -> dict[str, Any] | None:
    """Every tier's steps newer than ``step`` out of the trunk, the remote one first
    (docs/tiered.md): a tier of copies drops them, the disk keeps them on a branch.
    The rollback's record (None where this rank moves nothing on disk)."""
    for tier in tiers:
        if tier is not disk:
            tier.delete([s for s in tier.steps() if s > step])
    view, remote = disk.view, disk.remote
    doomed = sorted(s for s, _ in view.candidates() if s > step)
    if remote is not None and disk.coordinator:
        gone = remote.newer_than(step)
        if gone and newer == "branch":
            branch = rollback.new_branch(view.root, branch, max(gone + doomed), step)
        remote.set_aside(gone, branch if newer == "branch" else None)
    if not (doomed or reason) or not disk.coordinator:
        return None
    done = rollback.run(view.root, step, doomed, newer, branch, reason)
    view.forget(doomed)
    return done
