"""The tier protocol, and each decision a manager makes over its tiers, fastest first.

A tier (RAM, disk, object store) only answers :class:`Tier`'s questions, so none decides alone.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, TypeVar

from functional_ckpt._src.distributed.topology import topology
from functional_ckpt._src.log import warn
from functional_ckpt._src.manager.collective import coordinator_decides
from functional_ckpt._src.manager.provenance import Lineage
from functional_ckpt._src.manager.writes import Writes
from functional_ckpt._src.policy.retention import CheckpointLike, RetentionPolicy, plan_deletions
from functional_ckpt._src.remote.resume import Found
from functional_ckpt._src.remote.tier import RemoteTier
from functional_ckpt._src.remote.uploader import retried
from functional_ckpt._src.root import rollback
from functional_ckpt._src.root.delete import delete, quarantine
from functional_ckpt._src.root.listing import StepInfo
from functional_ckpt._src.root.resume import check_order, newest_readable
from functional_ckpt._src.root.rollback import Newer
from functional_ckpt._src.root.run import Run, read_run, record_run
from functional_ckpt._src.root.view import RootView
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.storage.os_failure import machine_errors
from functional_ckpt._src.storage.progress import report_progress
from functional_ckpt._src.storage.ram import copy_checkpoint, holds_every_file, promote_newest
from functional_ckpt.errors import CheckpointError, CheckpointExists, CheckpointNotFound
from functional_ckpt.errors import MemoryTierWarning as RamWarning

T = TypeVar("T")


class Tier(Protocol):
    """What a manager asks of a tier; what the answers mean is decided here, once."""

    #: Whether it outlives the machine's memory: promotion copies into the next such tier.
    durable: bool
    #: Whether listing it is a local directory read (progress lists it after each save).
    local: bool

    def steps(self) -> list[int]:
        """The committed steps the tier holds, ascending."""

    def infos(self) -> Sequence[CheckpointLike]:
        """Each readable committed checkpoint, as retention reads it."""

    def newest(self, read: Callable[[Path], T], above: int | None) -> Found[T]:
        """The newest intact checkpoint of this run newer than ``above``, read."""

    def open(self, step: int) -> Path:
        """The directory holding ``step`` whole; ``CheckpointError`` if it cannot be had."""

    def copy_in(self, source: Tier, within: float) -> Path | None:
        """Copy the newest step of ``source`` this tier lacks; the copy made now, if any."""

    def delete(self, steps: Sequence[int]) -> None:
        """Remove ``steps`` crash-safely (out of sight at once)."""

    def wait(self) -> object:
        """Collect the save in flight."""

    def close(self, *, crashed: bool) -> None:
        """The manager closes (``crashed``: an exception left it)."""


def newest_in_tiers(tiers: Sequence[Tier], read: Callable[[Path], T], root: Path) -> Found[T]:
    """The newest intact step of this run's lineage in any tier, read (a tie to the
    faster tier); None only if no tier holds one."""
    found: Found[T] = None
    with machine_errors(root, "resuming"):  # what ran out, if anything did
        for tier in tiers:
            found = tier.newest(read, None if found is None else found[0].step) or found
    return found


def retained(keep: RetentionPolicy, records: Sequence[CheckpointLike]) -> set[int]:
    """The steps of ``records`` a tier keeps (always the newest; what the remote uploads)."""
    return {r.step for r in records} - set(plan_deletions(keep, records))


def retain(tier: Tier, keep: RetentionPolicy, protected: Iterable[int] = ()) -> list[int]:
    """Delete from ``tier`` what ``keep`` does not keep (never its newest nor ``protected``)."""
    records = tier.infos()
    spared = retained(keep, records) | set(protected)
    doomed = sorted(r.step for r in records if r.step not in spared)
    if doomed:
        tier.delete(doomed)
    return doomed


def promote(tiers: Sequence[Tier], source: Tier, within: float) -> Path | None:
    """Copy the newest step of ``source`` into the next durable tier, and that copy on (a
    commit there, as any: the disk's is uploaded); the copy made now."""
    after = list(tiers)[list(tiers).index(source) + 1 :]
    target = next((t for t in after if t.durable), None)
    made = None if target is None else target.copy_in(source, within)
    if made is not None and target is not None and not topology().distributed:
        promote(tiers, target, within)  # (each rank's round: after the next save, or open)
    return made


def progress(tiers: Sequence[Tier]) -> None:
    """Tell ``fckpt run`` the newest step any tier holds (a RAM resume is progress too)."""
    if topology().rank == 0:  # a remote tier holds the disk's steps: not listed for this
        held = [t.steps()[-1:] for t in tiers if t.local]
        newest = max((s for steps in held for s in steps), default=None)
        if newest is not None:
            report_progress(newest, time.time())


class DiskTier:
    """The manager's root. With a writing remote tier behind it, a job of many ranks
    resumes through that tier alone (a rank's root may hold only its part)."""

    def __init__(
        self,
        view: RootView,
        writes: Writes,
        committed: Callable[[CheckpointInfo], None],
        *,
        writer: bool,
        coordinator: bool,
        remote: RemoteTier | None,
        run: Run | None,
    ) -> None:
        self.view, self.writer, self.coordinator = view, writer, coordinator
        self._writes, self._committed = writes, committed
        self.steps = view.steps
        self._behind = remote is not None and remote.writer  # the remote may hold newer
        self._defer = self._behind and topology().distributed
        self.durable = self.local = True
        self.lineage = Lineage(run)
        self._recorded = self.lineage.left()
        if writer and coordinator and self.lineage.cuts:  # a delete a crash cut short ends:
            cuts = [(i.step, self.lineage.cut(i.metadata)) for i in view.infos()]
            self.delete([s for s, c in cuts if any(b is not None for _, b in c)])  # (cut first)

    def others(self) -> set[int]:
        """The root's steps of another lineage."""
        held = self.view.infos()
        ours = self.lineage.learn(i.metadata for i in held)
        self._record()
        return {i.step for i in held if not ours(i.metadata, i.path)}

    def begin(self, metadata: Mapping[str, Any]) -> None:
        """A checkpoint of this run recording ``metadata`` is committed, in any tier: the run
        has begun (:meth:`Lineage.begin`), its lineage recorded before a crash can lose it."""
        self.lineage.begin(metadata)
        self._record()

    def _record(self) -> None:
        now = self.lineage.left()
        if self.lineage.recorded and now != self._recorded and self.writer and self.coordinator:
            self._recorded = now  # this lineage's runs and branch steps, in run.json for good
            run = read_run(self.view.root)  # as the memory tier may have renewed it
            if run is not None and run.id == self.lineage.run:
                record_run(self.view.root, replace(run, **now))

    def infos(self) -> list[StepInfo]:
        """What retention reads: this lineage's readable checkpoints."""
        others = self.others()
        return [i for i in self.view.infos() if i.step not in others]

    def latest(self) -> int | None:
        """The newest step a resume could take, none of another lineage's nor a damaged
        one (a resume moves those aside): a save must not be older."""
        return max((i.step for i in self.infos()), default=None)

    def check_save(self, step: int) -> None:
        """Before any write: refuse a step behind this lineage's newest or another lineage's."""
        check_order(self.view.root, step, self.latest())
        self.check_ours(step, f"a save of step {step} would replace it", CheckpointExists)

    def check_ours(self, step: int, doing: str, error: type[CheckpointError]) -> None:
        """Raise ``error`` if ``step`` is another lineage's, before anything is changed."""
        if step in self.others():
            info = self.view.info(step)
            raise error(
                f"{self.lineage.stranger(info.metadata, info.path)}: {doing}, so nothing was "
                "written or moved. Move it out of the root, or fork it to continue it"
            )

    def open(self, step: int) -> Path:
        return self.view.path(step)

    def copy_in(self, source: Tier, within: float) -> Path | None:
        """The coordinator's copy, none older, after the save in flight: one writer a step."""
        if not self.coordinator:
            return None
        pending, busy = self._writes.pending, set()
        try:  # its failure is reported by the next wait()
            if pending is not None:
                pending.exception(within)
        except TimeoutError:  # the step is still its save's: not written a second time
            busy = self._writes.busy_steps()
        held = (s for s in (self.latest(), *busy) if s is not None)
        newest = max(held, default=-1)  # none older than a save, a copy neither
        paths = []  # another lineage's step is no obstacle, and never copied over
        for step in source.steps():
            if step > newest and not os.path.lexists(self.view.path(step)):
                with contextlib.suppress(CheckpointError):  # held only in part there
                    paths.append(source.open(step))
        return promote_newest(self.view.root, paths, within)

    def newest(self, read: Callable[[Path], T], above: int | None) -> Found[T]:
        others = self.others()  # the lineage, learnt for the remote tier too
        if self.lineage.unrelated:
            raise CheckpointError(self.lineage.unsure(self.view.root))
        if self._defer:
            return None
        view = self.view
        newer = lambda: [  # noqa: E731
            (s, p) for s, p in view.candidates() if (above is None or s > above) and s not in others
        ]
        found, damaged = newest_readable(
            view.root,
            newer,
            read,
            move_aside=self.writer and self.coordinator,
            stacklevel=5,
            elsewhere=above is not None or self._behind,
        )
        view.found_unreadable(damaged)
        return found

    def delete(self, steps: Sequence[int]) -> None:
        trash = delete(self.view.root, [self.view.path(s) for s in steps])
        self.view.forget(list(steps))
        self._writes.remove(trash)

    def wait(self) -> None:
        info = self._writes.wait()
        if info is not None:
            self._committed(info)

    def close(self, *, crashed: bool) -> None:
        pass


def holding(tiers: Sequence[Tier], disk: DiskTier, step: int) -> list[Tier]:
    """The tiers holding this run's ``step``: the steps of a run are every tier's, as for a
    resume. The disk holds what its root has there (a link, a rank's part: ``check_ours``),
    another tier this lineage's (its ``infos``)."""

    def ours(t: Tier) -> bool:
        return step in t.steps() and any(r.step == step for r in t.infos())

    held = [t for t in tiers if (disk.view.path(step).is_dir() if t is disk else ours(t))]
    if not held:
        raise CheckpointNotFound(
            f"{disk.view.path(step)}: no checkpoint for step {step} in any tier of this run"
        )
    return held


def faster(tiers: Sequence[Tier], disk: DiskTier) -> Sequence[Tier]:
    """The tiers before the disk (RAM): what a rollback copies first, then drops."""
    return tiers[: list(tiers).index(disk)]


def to_disk(tiers: Sequence[Tier], disk: DiskTier, step: int, newer: Newer) -> None:
    """Before a rollback moves anything, what only a faster tier holds of ``step`` and (to
    branch) newer steps, into the disk, over a torn copy there (moved aside): never deleted
    with the RAM (nor for another lineage's: refused); a crash adds steps. A newer step this
    node's folder holds only in part goes with the RAM, named; ``step`` so held is refused."""
    left: list[int] = []
    for tier in faster(tiers, disk) if disk.coordinator else ():
        for s in (s for s in tier.steps() if s == step or (s > step and newer == "branch")):
            path, there = disk.view.path(s), os.path.lexists(disk.view.path(s))
            disk.check_ours(s, f"rollback({step}) would drop RAM's step {s}", CheckpointError)
            if there and (disk._defer or holds_every_file(path)):  # (a rank's root: its part)
                continue
            try:
                source = tier.open(s)
            except CheckpointError as err:
                if s == step and not there:
                    raise CheckpointError(f"rollback({step}): not on disk, and {err}") from err
                left += [] if there else [s]
                continue
            if there:
                quarantine(disk.view.root, path)
            copy_checkpoint(source, path)
    if left:
        why = f"rollback({step}) drops steps {left}: this node's RAM holds some ranks' files"
        warn(f"{disk.view.root}: {why}", RamWarning, stacklevel=5)


def plan_newer(
    disk: DiskTier, remote: RemoteTier | None, step: int, newer: Newer, branch: str | None
) -> tuple[list[int], list[int], str | None]:
    """The steps newer than ``step`` that leave the trunk, on disk and on the remote
    (committed or not), and the branch they go to: every refusal is here, before anything
    (the run's state too) moves; a ``branch`` taken, on each rank whose root (or remote) has it."""
    view, others = disk.view, disk.others()  # another lineage's stay where they are
    doomed = sorted(s for s, _ in view.candidates() if s > step and s not in others)
    listing = retried(remote.store.listing) if remote is not None and disk.coordinator else {}
    gone = remote.lineage_of(sorted(s for s in listing if s > step)) if remote else []
    if newer == "branch" and (branch is not None or ((gone or doomed) and disk.coordinator)):
        taken = retried(remote.store.branches) if remote is not None and disk.coordinator else ()
        branch = rollback.new_branch(view.root, branch, max([step, *gone, *doomed]), step, taken)
    return doomed, gone, branch


def move_newer(
    tiers: Sequence[Tier],
    disk: DiskTier,
    remote: RemoteTier | None,
    step: int,
    plan: tuple[list[int], list[int], str | None],
    *,
    newer: Newer,
    reason: Any,
) -> dict[str, Any] | None:
    """Every tier's steps newer than ``step`` out of the trunk as :func:`plan_newer` chose
    (docs/tiered.md); the rollback's record on the coordinator (None where none is made)."""
    (doomed, gone, branch), view = plan, disk.view
    own = remote is not None and remote.parts  # a rank's root of its own: its parts move too
    branch = coordinator_decides((branch,))[0] if own else branch  # the coordinator's name
    if branch is None and not disk.coordinator:  # newer parts no tier holds: a save cut short
        newer = "delete"
    for tier in faster(tiers, disk):  # (see to_disk)
        tier.delete([s for s in tier.steps() if s > step])
    if remote is not None and disk.coordinator:
        remote.set_aside(gone, branch if newer == "branch" else None)
    if not (disk.coordinator or (own and doomed)):
        return None
    done = rollback.run(view.root, step, doomed, newer, branch, reason)  # the trunk cut too
    view.forget(doomed)
    return done if disk.coordinator and (doomed or reason) else None
