"""CheckpointManager: policies, retention, resume and locking around ``save``/``restore``.

It threads policy states through ``maybe_save``; the decisions over tiers are :mod:`.tiers`'s.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

from tensordict import TensorDict

from functional_ckpt._src.arguments import flag, items, require
from functional_ckpt._src.distributed import groups
from functional_ckpt._src.distributed.topology import topology
from functional_ckpt._src.export.safetensors import Export
from functional_ckpt._src.format.header import record_of
from functional_ckpt._src.format.naming import parse_step
from functional_ckpt._src.log import done, logger
from functional_ckpt._src.manager.collective import decide, share_run, together
from functional_ckpt._src.manager.config import config_of, manager_arguments
from functional_ckpt._src.manager.memory import Memory, report_orphans
from functional_ckpt._src.manager.memory_tier import MemoryTier
from functional_ckpt._src.manager.options import (
    AsyncSave,
    Disk,
    async_option,
    check_policies,
    plain_metrics,
    tier_options,
)
from functional_ckpt._src.manager.provenance import (
    Provenance,
    RunningTime,
    check_metadata,
    git_commit,
    manager_record,
    stored_state,
)
from functional_ckpt._src.manager.rollback_rule import SaveResult, Watch, roll_back
from functional_ckpt._src.manager.tiers import (
    DiskTier,
    Tier,
    holding,
    move_newer,
    newest_in_tiers,
    plan_newer,
    progress,
    promote,
    retain,
    retained,
    to_disk,
)
from functional_ckpt._src.manager.writes import Writes, WriteSettings
from functional_ckpt._src.paths import PathLike
from functional_ckpt._src.policy.base import Event, PolicyState, SavePolicy
from functional_ckpt._src.policy.config import Relaunch
from functional_ckpt._src.policy.leaves import every_steps
from functional_ckpt._src.policy.retention import RetentionPolicy, keep_all
from functional_ckpt._src.remote import resume
from functional_ckpt._src.remote.options import Remote
from functional_ckpt._src.remote.tier import RemoteTier
from functional_ckpt._src.restore.api import check_like_or_out, restore
from functional_ckpt._src.restore.template import Reshard
from functional_ckpt._src.root import rollback
from functional_ckpt._src.root.leftovers import open_writer
from functional_ckpt._src.root.listing import StepInfo
from functional_ckpt._src.root.lock import WriterLock
from functional_ckpt._src.root.rollback import Newer, finish
from functional_ckpt._src.root.run import Cut, Run, add_cut, open_run, read_run
from functional_ckpt._src.root.view import RootView
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.save.options import DEFAULT_PER_RANK, PER_RANK
from functional_ckpt._src.state.tree import State
from functional_ckpt._src.storage import zstd
from functional_ckpt.errors import CheckpointError


class CheckpointManager(RootView):
    """Save on a policy, keep on a retention policy, resume from the newest good checkpoint.

    A writing manager locks ``root`` and recovers what crashes left at open;
    ``read_only=True`` never deletes or renames anything. Not thread-safe (docs/manager.md).
    """

    def __init__(
        self,
        root: PathLike,
        save: SavePolicy | None = None,
        keep: RetentionPolicy | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
        read_only: bool = False,
        async_save: bool | AsyncSave = False,
        export: Export | None = None,
        tiers: Sequence[Memory | Disk | Remote] = (),
        rollback: SavePolicy | None = None,
        per_rank: Sequence[str] = DEFAULT_PER_RANK,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(Path(root))
        require(callable(clock), clock, "clock", "CheckpointManager", "a callable")
        self._options = memory, disk, remote = tier_options(tiers)
        self.read_only = flag(read_only, "read_only", "CheckpointManager")
        self.save_policy = every_steps(1) if save is None else save
        self.keep = keep_all() if keep is None else keep
        self.export = export
        check_policies(self.save_policy, self.keep, self.export)
        self.metadata = check_metadata(metadata)
        topo = topology()
        self._distributed, self._coordinator = topo.distributed, topo.coordinator
        level, dist = zstd.level_of(disk.compression, "Disk"), self._distributed
        ranks = items(per_rank, "per_rank", "CheckpointManager", PER_RANK)
        settings = WriteSettings(ranks, async_option(async_save), disk.incremental,
                                 dist, self._coordinator, zstd_level=level)  # fmt: skip
        if self._distributed:
            # The loop's group now, on the training thread, in the same order on every rank
            groups.checkpoint_group(purpose="control")  # (an async save's: as it starts)
        self._running = RunningTime(clock)
        self._policy_state: PolicyState = self.save_policy.init()
        self._export_state: PolicyState = export.policy.init() if export is not None else None
        self._watch = Watch(rollback)  # the rollback rule (see .rollback_rule)
        self.restored_step: int | None = None  # what the last restore returned, if any
        self._continues: Cut | None = None
        self._lock: WriterLock | None = None
        self._closed = False
        self._run = Provenance(os.getcwd())
        run: tuple[Run, bool] | None = None
        if not self.read_only:
            self._run.git = git_commit(self._run.cwd)  # before the lock: no child inherits it
            try:  # failed on the coordinator (a damaged run.json), failed on every rank
                run = together(self._distributed, f"opening {self.root}", self._open_root)
            except BaseException:
                if self._lock is not None:
                    self._lock.release()
                raise
            if self._distributed:
                run = share_run(run)
            assert run is not None
            self._run.run, self._run.cuts = run[0].id, len(run[0].cuts)
            if run[1] and self._coordinator:  # a new run: an old one's RAM is no one's now
                report_orphans(self.root, run[0])
        self.remote = None
        try:
            if remote is not None:
                shm = Path("/dev/shm/fckpt-")  # where the default memory folder lies
                apart = [] if memory is None else [Path(memory.path or shm)]
                self.remote = RemoteTier(self.root, remote, writer=not read_only, apart=apart)
            # A reader follows the disk and remote tiers: the folder in RAM is the writer's.
            self.memory = (
                None
                if memory is None or run is None
                else MemoryTier(memory, self.root, settings, run=run[0])
            )
        except BaseException:  # the manager was not made: its lock goes
            if self.remote is not None:
                self.remote.close()
            if self._lock is not None:
                self._lock.release()
            raise
        self._writes = Writes(self, settings, self.remote)
        known = read_run(self.root) or (None if run is None else run[0])  # a reader: the root's
        self.disk = DiskTier(self, self._writes, self._after_commit, writer=not self.read_only,
                             coordinator=self._coordinator, remote=self.remote,
                             run=known)  # fmt: skip
        self.tiers: list[Tier] = [self.disk]
        if (behind := self.remote) is not None:
            self.tiers.append(behind)
            behind.prune = lambda: retain(behind, behind.keep)  # after each upload round
            behind.retained = partial(retained, behind.keep)  # what it uploads
            behind.ours = self.disk.lineage  # and whose remote checkpoint an upload leaves alone:
            self.disk.others()  # learnt before the first upload round chooses what to upload
            behind.copy_in(self.disk, 0.0)  # which resumes what a crash interrupted
        if self.memory is not None:
            self.tiers.insert(0, self.memory)
            self.memory.promote = partial(promote, self.tiers, self.memory)
            self.memory.committed = self._begun
            if held := self.memory.steps():  # killed before its first disk save: begun
                self.disk.begin(self.memory.view.info(held[-1]).metadata)
        self._relaunch: Relaunch | None = None  # the ``run`` block of from_config's config

    def _begun(self) -> None:
        """A commit, any tier's: the run has begun (see :meth:`Lineage.begin`); progress."""
        self.disk.begin({"run": self._run.line})
        progress(self.tiers)

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], **kwargs: Any) -> CheckpointManager:
        """The manager ``cfg`` (plain data, checked first) describes; ``kwargs`` replace it."""
        root, args, run = manager_arguments(cfg, root_given="root" in kwargs)
        args.update(kwargs)
        mgr = cls(args.pop("root", root), **args)
        mgr._relaunch = run
        return mgr

    def config(self) -> dict[str, Any]:
        """This manager's configuration for :meth:`from_config` (no ``storage_options``)."""
        return config_of(self)

    def _check_open(self, what: str, *, writing: bool) -> None:
        if self._closed:
            raise CheckpointError(f"{self.root}: {what}: the manager is closed")
        if writing and self.read_only:
            raise CheckpointError(f"{self.root}: {what}: this manager is read-only")

    def restore(
        self,
        step: int,
        like: State | None = None,
        *,
        out: State | None = None,
        reshard: Reshard | None = None,
    ) -> TensorDict:
        """Restore one step (no fallback) and continue the policies from it."""
        check_like_or_out(like, out, "CheckpointManager.restore")
        self._check_open("restore", writing=False)
        info = self.info(step)
        state = restore(self.path(step), like, out=out, reshard=reshard)
        self._adopt(info)
        return state

    def restore_latest(
        self,
        like: State | None = None,
        *,
        out: State | None = None,
        reshard: Reshard | None = None,
    ) -> TensorDict | None:
        """The newest intact checkpoint of this run in any tier; None only if none holds one."""
        check_like_or_out(like, out, "CheckpointManager.restore_latest")
        self._check_open("restore_latest", writing=False)
        read = partial(restore, like=like, out=out, reshard=reshard)
        t0 = time.perf_counter()
        found = newest_in_tiers(self.tiers, read, self.root)
        if found is None:
            _LOG.info(
                "no checkpoint in %s: starting fresh", self.root, extra={"path": str(self.root)}
            )
            return None
        self._adopt(found[0])
        seconds = time.perf_counter() - t0
        done(_LOG, "resumed", found[0].path, seconds=seconds, step=found[0].step, to="from")
        return found[1]

    def rollback(
        self,
        step: int,
        like: State | None = None,
        *,
        newer: Newer = "branch",
        branch: str | None = None,
        reason: Mapping[str, Any] | None = None,
    ) -> TensorDict:
        """Continue from the kept ``step``; newer ones leave the trunk if the restore works."""
        return self._rollback(step, like, newer, branch, reason)[0]

    def _rollback(
        self,
        step: int,
        like: State | None,
        newer: Newer,
        branch: str | None,
        reason: Mapping[str, Any] | None,
    ) -> tuple[TensorDict, str | None]:
        """:meth:`rollback`, and the branch the newer checkpoints went to (or None)."""
        self._check_open("rollback", writing=True)
        require(type(step) is int and step >= 0, step, "step", "rollback", "a step (an int >= 0)")
        rollback.check_request(newer, branch, reason)
        self.wait()  # a save in flight commits first: it may be one of the newer steps
        doing = f"rollback({step}) continues this run's only"
        together(self._distributed, doing, self.disk.check_ours, step, doing, CheckpointError)
        together(self._distributed, doing, holding, self.tiers, self.disk, step)
        together(self._distributed, doing, to_disk, self.tiers, self.disk, step, newer)
        if self.remote is not None:
            self.remote.hold(step)  # on the remote trunk before the newer steps leave it
        doing = f"rollback({step})"
        plan = together(
            self._distributed, doing, plan_newer, self.disk, self.remote, step, newer, branch
        )
        state = together(self._distributed, doing, self._read, step, like)
        move = partial(move_newer, self.tiers, self.disk, self.remote, step, plan, newer=newer)
        self._run.cuts += 1  # as the coordinator's rollback records it (one too many: no loss)
        done = together(self._distributed, doing, move, reason=reason)
        if done is not None:
            self._run.rollbacks.append(done)
        return state, None if done is None else done.get("branch")

    def _read(self, step: int, like: State | None) -> TensorDict:
        """Restore ``step`` as a resume finds it: in a job, a rank's root may hold only its
        part, and the remote tier the whole (fetched as each rank reads it)."""
        if self.remote is None:
            return self.restore(step, like)
        info, state = resume.one(self.remote, partial(restore, like=like), step)
        self._adopt(info)
        return state

    def _open_root(self) -> tuple[Run, bool] | None:
        """The coordinator's: the job's one lock, an interrupted rollback done, the run."""
        if not self._coordinator:
            return None
        self._lock = open_writer(self.root, stacklevel=5)
        finish(self.root)
        return open_run(self.root)

    def _adopt(self, info: StepInfo) -> None:
        """Continue the run from the restored checkpoint: policy states and running time."""
        self.restored_step = info.step
        if self.read_only:
            return  # a follower never saves: its policies are irrelevant
        self._run.resume(info.metadata)
        self._run.continued_from(info.step, info.metadata, info.path)
        self._continues = (info.step, None)  # the trunk's cut, once saved on
        record = record_of(info.metadata)
        self._policy_state = stored_state(self.save_policy, record.raw, "save", info.path)
        self._watch.resume(record.raw, info.path)
        if self.export is not None:
            self._export_state = stored_state(self.export.policy, record.raw, "export", info.path)
        self._running.resume(record.running_time)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: TracebackType | object) -> None:
        self._close(crashed=kind is not None)  # a crash keeps what a tier keeps past one

    def close(self) -> None:
        """Wait for pending work and release the lock; idempotent."""
        self._close(crashed=False)

    def _close(self, *, crashed: bool) -> None:
        if self._closed:
            return
        try:
            try:
                self.wait()
            finally:
                for tier in self.tiers:
                    tier.close(crashed=crashed)  # RAM is not held past a clean run
                self._writes.exports.join()
                if self.remote is not None and self._lock is not None:
                    self._prune(set())  # what the uploads protected from retention
        finally:
            self._writes.removed()
            # Mid-save, the lock goes once the save finished (its files are no one's leftovers).
            running = self._writes.pending
            running = None if running is None or running.done() else running
            self._closed = running is None
            if self._lock is not None and running is not None:
                running.when_finished(self._lock.release)
            elif self._lock is not None:
                self._lock.release()
                self._lock = None

    def wait(self) -> None:
        """Block until every save started is committed (not uploaded); raise if one failed."""
        for tier in self.tiers:
            if tier is not self.remote:
                tier.wait()

    def wait_staged(self) -> None:
        """Block until the state may be mutated again (call it before the optimizer step)."""
        self._writes.wait_staged()
        if self.memory is not None:
            self.memory.wait_staged()

    def wait_exports(self) -> None:
        """Block until the export running in the background is written; raise if it failed."""
        self._writes.exports.join()

    def __repr__(self) -> str:
        mode = "read-only" if self.read_only else "writer"
        where = f"{str(self.root)!r}, save={self.save_policy!r}, keep={self.keep!r}"
        return f"CheckpointManager({where}, {mode})"

    def maybe_save(
        self,
        state: State,
        *,
        step: int,
        epoch: int | None = None,
        metrics: Mapping[str, Any] | None = None,
        is_final: bool = False,
        epoch_end: bool = False,
        force: bool = False,
    ) -> SaveResult:
        """Ask the policies about this event, save, commit their states with it, prune;
        whether a disk checkpoint was written. Policy states advance only once the writes
        they describe succeeded; a rollback rule that fires returns its state in ``.rollback``.
        """
        self._check_open("maybe_save", writing=True)
        if self.remote is not None:
            self.remote.check()  # a failed upload is reported here, as a RemoteWarning
        if self._writes.finished():
            self.disk.wait()  # a background failure surfaces here, at the next call
        if self._writes.exports.finished():
            self._writes.exports.join()
        metrics = plain_metrics(metrics, "maybe_save")
        event = Event(step, epoch, metrics, is_final, self.running_time(), epoch_end=epoch_end)
        if event.step < 0:
            raise ValueError(f"maybe_save(step={step!r}): steps must be >= 0")
        export = self.export
        event, saved, policy_state, exported, export_state, rolls, rule_state = decide(
            event, force=force, save=self.save_policy, save_state=self._policy_state,
            export=None if export is None else export.policy, export_state=self._export_state,
            watch=self._watch, distributed=self._distributed,
        )  # fmt: skip
        self._watch.next = rule_state
        in_memory = self.memory is not None and self.memory.decide(event)
        if saved:
            self.disk.wait()  # at most one save in flight; the previous one must have committed
        if saved or (in_memory and self._continues is not None):  # RAM too, after a restore:
            together(self._distributed, f"save({step})", self.disk.check_save, event.step)
        if saved and not in_memory and self.memory is not None:
            self.memory.drop(event.step)
        background = exported and self._writes.settings.async_save is not None
        background = background and not self._distributed
        if exported and not background:
            assert export is not None
            self._writes.export(state, export, event)
        if saved:
            record = self._metadata(event, policy_state, export_state)
            if (info := self._writes.save(self.path(event.step), state, record)) is not None:
                self._after_commit(info)
        if in_memory:
            assert self.memory is not None
            metadata = lambda: self._metadata(event, policy_state, export_state)  # noqa: E731
            self.memory.save(state, event.step, metadata)
        if background:
            assert export is not None
            self._writes.export_in_background(state, export, event, saved)
        self._policy_state = policy_state
        self._export_state = export_state
        self._watch.state = rule_state
        if not rolls:
            return SaveResult(saved)
        self.disk.wait()  # the checkpoint of this very event commits first: it goes to the branch
        roll = lambda to, why: self._rollback(to, state, "branch", None, why)  # noqa: E731
        return roll_back(self._watch, event, saved, self.infos(), self.root, roll)

    def running_time(self) -> float:
        """Seconds this run has been running: carried over by restores, downtime excluded."""
        return self._running()

    def _metadata(
        self, event: Event, policy_state: PolicyState, export_state: PolicyState
    ) -> dict[str, Any]:
        """What a checkpoint of ``event`` records in any tier (the policy states after it)."""
        export = None if self.export is None else self.export.policy
        record = manager_record(
            event, self.save_policy, policy_state, self.keep, export, export_state
        )
        record.update(self._watch.entry())
        if self._continues is not None:  # before any tier writes one: what the run left is
            self._cut(self._continues)  # no tier's to resume
        self._continues = None
        return self._run.metadata(record, self.metadata)

    def _after_commit(self, info: CheckpointInfo) -> None:
        """Retention runs only after the checkpoint it protects is committed."""
        step = parse_step(info.path.name)
        self._begun()  # before the upload round asks whose remote step it may replace
        promote(self.tiers, self.disk, 0.0)  # uploaded in the background, if a tier is behind
        if self._coordinator:
            self._prune(protected={step} if step is not None else set())

    def _prune(self, protected: set[int]) -> list[int]:
        """Delete what retention does not keep, but ``protected``, those in use or not uploaded."""
        protected = protected | self._writes.busy_steps()
        if self.remote is not None:
            protected = protected | self.remote.protected(self.steps())
        return retain(self.disk, self.keep, protected)

    def delete(self, step: int) -> None:
        """Delete this lineage's ``step`` from every tier, crash-safely (even the newest)."""
        self._check_open("delete", writing=True)
        require(type(step) is int and step >= 0, step, "step", "delete", "a step (an int >= 0)")
        doing = f"delete({step}) takes this run's only"  # refused on one rank, on all
        together(self._distributed, doing, self.disk.check_ours, step, doing, CheckpointError)
        for tier in self.tiers:  # the remote's too: an upload in flight would commit it again
            tier.wait()
        held = together(self._distributed, doing, holding, self.tiers, self.disk, step)
        together(self._distributed, f"delete({step})", self._cut, (step - 1, step))  # first
        # from each (a resume finds any left), gone for every rank once one returns
        together(self._distributed, doing, lambda: [t.delete([step]) for t in held])

    def _cut(self, cut: Cut) -> None:
        """The trunk moves (docs/tiered.md): recorded in ``run.json`` durably before any tier
        moves (none it never reaches, RAM not open here, resumes what it left), and counted by
        every checkpoint saved from now on, on every rank."""
        self._run.cuts += 1  # (first: should the record fail, one too many never loses a save)
        if self._coordinator:
            add_cut(self.root, cut)


_LOG = logger("manager")
