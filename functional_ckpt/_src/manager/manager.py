"""CheckpointManager: policies, retention, resume and locking around ``save``/``restore``.

No checkpointing logic of its own: it threads a save policy's state through
``maybe_save`` events, writes through :mod:`.writes`, prunes by retention, and resumes
from the newest readable checkpoint (:mod:`..root.resume`: damage is reported and moved
aside, never silently replaced by a fresh start). Provenance is :mod:`.provenance`'s,
the rollback rule :mod:`.rollback_rule`'s, what all ranks do together
:mod:`.collective`'s, the root's steps and records its :class:`~..root.view.RootView`'s.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from functional_ckpt._src.distributed.topology import topology
from functional_ckpt._src.export.safetensors import Export
from functional_ckpt._src.format.naming import parse_step
from functional_ckpt._src.manager.collective import prepare_groups, share_run
from functional_ckpt._src.manager.config import config_of, manager_arguments
from functional_ckpt._src.manager.decide import decide
from functional_ckpt._src.manager.memory import Memory
from functional_ckpt._src.manager.memory_tier import MemoryTier
from functional_ckpt._src.manager.options import (
    AsyncSave,
    async_option,
    check_policies,
    plain_metrics,
)
from functional_ckpt._src.manager.provenance import (
    Provenance,
    RunningTime,
    check_metadata,
    git_commit,
    manager_record,
)
from functional_ckpt._src.manager.reading import ReadSide
from functional_ckpt._src.manager.rollback_rule import SaveResult, Watch, roll_back
from functional_ckpt._src.manager.writes import Writes, WriteSettings
from functional_ckpt._src.paths import PathLike
from functional_ckpt._src.policy import Event, PolicyState, SavePolicy, every_steps
from functional_ckpt._src.policy.config import Relaunch
from functional_ckpt._src.policy.retention import RetentionPolicy, keep_all, plan_deletions
from functional_ckpt._src.remote.options import Remote
from functional_ckpt._src.root import rollback
from functional_ckpt._src.root.delete import delete
from functional_ckpt._src.root.leftovers import open_writer
from functional_ckpt._src.root.listing import StepInfo
from functional_ckpt._src.root.lock import WriterLock
from functional_ckpt._src.root.resume import check_order
from functional_ckpt._src.root.run import Run, open_run
from functional_ckpt._src.root.view import RootView
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.save.options import DEFAULT_PER_RANK
from functional_ckpt._src.state.tree import State
from functional_ckpt._src.storage import zstd
from functional_ckpt._src.storage.progress import report_progress
from functional_ckpt.errors import CheckpointNotFound

__all__ = ["CheckpointManager"]


class CheckpointManager(ReadSide):
    """Save on a policy, keep on a retention policy, resume from the newest good checkpoint.

    ``save`` defaults to ``every_steps(1)`` and ``keep`` to ``keep_all()``: a manager
    without policies is a plain "save each step I give you". ``metadata`` is stored in
    every checkpoint beside the automatic keys. One option value per concern:
    ``async_save`` (True or ``fc.manager.AsyncSave``), ``incremental`` (each save on
    the previous one, unchanged bytes shared), ``export`` (``fc.manager.Export``),
    ``remote`` (``fc.manager.Remote``), ``memory`` (``fc.manager.Memory``: a tier in
    RAM above the root, saved on its own policy), ``rollback`` (a rule such as
    ``fc.policy.on_degrade``), ``per_rank`` (the subtrees stored per rank),
    ``compression`` (as for ``fc.save``; by default the remote tier's). A writing
    manager locks ``root``, recovers or removes what crashes left and finishes an
    interrupted rollback at open; ``read_only=True`` never deletes or renames
    anything. Only the manager reads ``clock`` (the run's running time, which every
    event carries), never a policy. Not thread-safe. See docs/manager.md.
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
        incremental: bool = False,
        export: Export | None = None,
        remote: Remote | None = None,
        memory: Memory | None = None,
        rollback: SavePolicy | None = None,
        per_rank: Sequence[str] = DEFAULT_PER_RANK,
        clock: Callable[[], float] = time.monotonic,
        compression: str | None = None,
    ) -> None:
        self.view = RootView(Path(root))
        self.root = self.view.root
        if not callable(clock):
            raise TypeError(f"CheckpointManager(clock={clock!r}): clock must be callable")
        if remote is not None and not isinstance(remote, Remote):
            raise TypeError(
                f"CheckpointManager(remote={remote!r}): expected fc.manager.Remote(url, ...)"
            )
        if memory is not None and not isinstance(memory, Memory):
            raise TypeError(
                f"CheckpointManager(memory={memory!r}): expected fc.manager.Memory(...)"
            )
        self.read_only = bool(read_only)
        self.save_policy = every_steps(1) if save is None else save
        self.keep = keep_all() if keep is None else keep
        self.export = export
        check_policies(self.save_policy, self.keep, self.export)
        self.metadata = check_metadata(metadata, f"CheckpointManager({self.root})")
        topo = topology()
        self._distributed, self._coordinator = topo.distributed, topo.coordinator
        settings = WriteSettings(
            tuple(per_rank),
            async_option(async_save),
            bool(incremental),
            self._distributed,
            self._coordinator,
            zstd_level=zstd.level_of(
                compression if compression is not None or remote is None else remote.compression,
                "CheckpointManager",
            ),
        )
        if self._distributed:
            prepare_groups()  # now, on the training thread, in the same order on every rank
        self._running = RunningTime(clock)
        self._policy_state: PolicyState = self.save_policy.init()
        self._export_state: PolicyState = export.policy.init() if export is not None else None
        self._watch = Watch(rollback)  # the rollback rule (see .rollback_rule)
        self._restored_step: int | None = None
        self._lock: WriterLock | None = None
        self._closed = False
        self._run = Provenance(os.getcwd())
        run: tuple[Run, bool] | None = None
        if not self.read_only:
            self._run.git = git_commit(self._run.cwd)  # before the lock: no child inherits it
            if self._coordinator:
                run = self._open_writer()  # one lock per job: the coordinator's
            if self._distributed:
                run = share_run(run)
            assert run is not None
            self._run.run = run[0].id
        self.remote = None
        try:
            self.remote = None if remote is None else remote.open(self.root, writer=not read_only)
            # A reader follows the disk and remote tiers: the folder in RAM is the writer's.
            self.memory = (
                None
                if memory is None or run is None
                else MemoryTier(memory, self.root, settings, run=run[0], made=run[1])
            )
        except BaseException:  # the manager was not made: its lock goes
            if self.remote is not None:
                self.remote.close()
            if self._lock is not None:
                self._lock.release()
            raise
        self._writes = Writes(self.view, settings, self.remote)
        if self.memory is not None:
            self.memory.settle = lambda within: (p := self._writes.pending) and p.exception(within)
        self._remote_option = remote
        self._memory_option = memory
        self._relaunch: Relaunch | None = None  # the ``run`` block of from_config's config

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], **kwargs: Any) -> CheckpointManager:
        """The manager that configuration ``cfg`` (plain data: a dict, parsed YAML or JSON,
        a ``DictConfig``) describes; see docs/manager.md, "Configuration as data".

        Every key is checked first, so a bad one raises :class:`~..errors.ConfigError`
        naming it before anything is opened. ``kwargs`` are constructor arguments that
        replace the config's (what is no data: ``clock``, an ``Export`` with a live
        ``config`` object). The ``run`` block is ``fckpt run``'s and is kept for
        :meth:`config`.
        """
        root, args, run = manager_arguments(cfg, root_given="root" in kwargs)
        args.update(kwargs)
        mgr = cls(args.pop("root", root), **args)
        mgr._relaunch = run
        return mgr

    def config(self) -> dict[str, Any]:
        """This manager's configuration, every value spelled: plain data (for YAML, JSON
        or a checkpoint's metadata) from which :meth:`from_config` builds it again.

        A remote tier's ``storage_options`` are left out (they may be credentials);
        what has no plain form (a policy defined outside this package, a ``rename``
        function) raises :class:`~..errors.ConfigError`.
        """
        plan = self._writes.plan
        return config_of(
            root=str(self.root),
            save=self.save_policy,
            keep=self.keep,
            metadata=self.metadata,
            read_only=self.read_only,
            async_save=plan.async_save,
            incremental=plan.incremental,
            export=self.export,
            remote=self._remote_option,
            memory=self._memory_option,
            rollback=self._watch.rule,
            per_rank=plan.per_rank,
            run=self._relaunch,
        )

    def _open_writer(self) -> tuple[Run, bool]:
        """Lock the root, finish what crashes left, and say which run it holds (made now?)."""
        # Leftovers of crashed writers are recovered (warning at the CheckpointManager call).
        self._lock = open_writer(self.root, stacklevel=4)
        try:
            rollback.finish(self.root)  # a rollback a crash interrupted completes now
            return open_run(self.root)
        except BaseException:
            self._lock.release()
            raise

    # ------------------------------------------------------------------ the root

    def path(self, step: int) -> Path:
        """Where the checkpoint of ``step`` lives (whether or not it exists)."""
        return self.view.path(step)

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints, ascending (half-written ones never appear)."""
        return self.view.steps()

    def latest_step(self) -> int | None:
        """The newest committed step, excluding any this manager found unreadable."""
        return self.view.latest_step()

    def info(self, step: int) -> StepInfo:
        """Step, time, metrics, epoch, size and full metadata of one checkpoint."""
        return self.view.info(step)

    def infos(self) -> list[StepInfo]:
        """:meth:`info` of every readable committed checkpoint, ascending by step."""
        return self.view.infos()

    def best_step(self, metric: str, mode: str = "min") -> int | None:
        """The step ``keep_best(1, metric, mode)`` would keep (ties go to the newer step)."""
        return self.view.best_step(metric, mode)

    def branches(self) -> dict[str, list[int]]:
        """Branches left by :meth:`rollback`, each with its committed steps (a root each)."""
        return self.view.branches()

    def branch_root(self, name: str) -> Path:
        """Where branch ``name`` lives (a root of its own)."""
        return self.view.branch_root(name)

    @property
    def restored_step(self) -> int | None:
        """The step the last ``restore``/``restore_latest`` returned, if any."""
        return self._restored_step

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close(crashed=exc_type is not None)

    def close(self) -> None:
        """Wait for pending work and release the lock; idempotent. The memory tier's
        folder goes too (an exception leaving the ``with`` block keeps it)."""
        self._close(crashed=False)

    def _close(self, *, crashed: bool) -> None:
        if self._closed:
            return
        try:
            try:
                self.wait()
            finally:
                if self.memory is not None:
                    self.memory.close(crashed=crashed)  # RAM is not held past a clean run
                self._writes.exports.join()
                if self.remote is not None:
                    self.remote.close()  # the uploads asked for finish, then what they
                    if self._lock is not None:  # protected from retention is pruned
                        self._prune(set())
        finally:
            self._writes.join_removals()
            # Interrupted while a save runs, the lock is released only once it has
            # finished (a second writer would take its files for leftovers), and a
            # second close() waits for it again.
            running = self._writes.running()
            self._closed = running is None
            if self._lock is not None and running is not None:
                running.when_finished(self._lock.release)
            elif self._lock is not None:
                self._lock.release()
                self._lock = None

    def wait(self) -> None:
        """Block until every save started so far is committed; raise if one failed.

        The retention policy runs once the save it follows has committed. A failed
        memory-tier save is reported as a ``MemoryWarning`` instead.
        """
        if self.memory is not None:
            self.memory.wait()
        self._wait_disk()

    def _wait_disk(self) -> None:
        """The disk tier's save in flight, committed (its error raised), then retention."""
        info = self._writes.wait()
        if info is not None:
            self._after_commit(info)

    def wait_staged(self) -> None:
        """Block until the state may be mutated again (call it before the optimizer step).

        With synchronous saves, or ``staging="copy"`` once the copy is done, this
        returns at once. With ``staging="none"`` it waits for the whole write.
        """
        self._writes.wait_staged()
        if self.memory is not None:
            self.memory.wait_staged()

    def wait_exports(self) -> None:
        """Block until the export running in the background is written; raise if it failed."""
        self._writes.exports.join()

    def __repr__(self) -> str:
        mode = "read-only" if self.read_only else "writer"
        return (
            f"CheckpointManager({str(self.root)!r}, save={self.save_policy!r}, "
            f"keep={self.keep!r}, {mode})"
        )

    # ------------------------------------------------------------------ saving

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
        """Build the event, ask the policies, save, commit their states with it, then prune.

        Returns whether a checkpoint was written (``force=True`` saves whatever the
        policy says). ``epoch_end=True`` marks the step that finishes an epoch, where
        ``every_epochs`` saves; ``epoch`` is only recorded. An export due on the same
        event is written first (off the training thread with ``async_save``, from this
        step's checkpoint or a copy of its tensors). Policy states advance only once
        the writes they describe succeeded. A memory tier saves on its own policy, after
        the disk tier (and only the disk tier's save counts in the result). A rollback
        rule that fires returns the state it went back to in ``.rollback``.
        """
        self._check_open("maybe_save", writing=True)
        if self.remote is not None:
            self.remote.check()  # a failed upload is reported here, as a RemoteWarning
        if self._writes.finished():
            self._wait_disk()  # a background failure surfaces here, at the next call
        if self._writes.exports.finished():
            self._writes.exports.join()
        event = Event(
            step=step,
            epoch=epoch,
            metrics=plain_metrics(metrics, "maybe_save"),
            is_final=is_final,
            time=self.running_time(),
            epoch_end=epoch_end,
        )
        if event.step < 0:
            raise ValueError(f"maybe_save(step={step!r}): steps must be >= 0")
        export = self.export
        d = decide(
            event, force=force, save=self.save_policy, save_state=self._policy_state,
            export=None if export is None else export.policy, export_state=self._export_state,
            watch=self._watch, distributed=self._distributed,
        )  # fmt: skip
        event, saved, exported, rolls = d.event, d.saved, d.exported, d.rolls
        policy_state, export_state, rule_state = d.policy_state, d.export_state, d.rule_state
        self._watch.next = rule_state
        if saved:
            self._wait_disk()  # at most one save in flight; the previous one must have committed
            check_order(self.root, event.step, self.latest_step())  # before any write
        background = exported and self._writes.plan.async_save is not None
        background = background and not self._distributed
        if exported and not background:
            assert export is not None
            self._writes.export(state, export, event)
        if saved:
            self._save_checkpoint(state, event, policy_state, export_state)
        if self.memory is not None and self.memory.decide(event):
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
        self._wait_disk()  # the checkpoint of this very event commits first: it goes to the branch
        roll = lambda to, why: self._rollback(to, state, "branch", None, why)  # noqa: E731
        return roll_back(self._watch, event, saved, self.infos(), self.root, roll)

    def running_time(self) -> float:
        """Seconds this run has been running: carried over by restores, downtime excluded."""
        return self._running()

    def _metadata(
        self, event: Event, policy_state: PolicyState, export_state: PolicyState
    ) -> dict[str, Any]:
        """What a checkpoint of ``event`` records, in whichever tier it is written: the
        policy states after the event, so a resume from any tier continues them alike."""
        export = None if self.export is None else self.export.policy
        record = manager_record(
            event, self.save_policy, policy_state, self.keep, export, export_state
        )
        record.update(self._watch.entry())
        return self._run.metadata(record, self.metadata)

    def _save_checkpoint(
        self, state: State, event: Event, policy_state: PolicyState, export_state: PolicyState
    ) -> None:
        metadata = self._metadata(event, policy_state, export_state)
        info = self._writes.save(self.path(event.step), state, metadata)
        if info is not None:
            self._after_commit(info)

    def _after_commit(self, info: CheckpointInfo) -> None:
        """Retention runs only after the checkpoint it protects is committed."""
        step = parse_step(info.path.name)
        if self.remote is not None:
            self.remote.committed()  # uploaded in the background
        if self._coordinator:
            if step is not None:
                report_progress(step, info.created)  # to a supervising ``fckpt run``
            self._prune(protected={step} if step is not None else set())

    # ------------------------------------------------------------------ deleting

    def _prune(self, protected: set[int]) -> list[int]:
        """Delete what retention does not keep; never the newest, ``protected``, one a save
        or an export uses, or one whose remote copy is not committed yet."""
        protected = protected | self._writes.busy_steps()
        if self.remote is not None:
            protected = protected | self.remote.protected(self.steps())
        doomed = plan_deletions(self.keep, self.infos(), protected=protected)
        self._delete(doomed)
        return doomed

    def delete(self, step: int) -> None:
        """Delete one checkpoint, crash-safely (even the newest: you asked for it)."""
        self._check_open("delete", writing=True)
        if not self.path(step).is_dir():
            raise CheckpointNotFound(f"{self.path(step)}: no checkpoint for step {step}")
        self._delete([step])
        if self.memory is not None:
            self.memory.drop(step)  # or a resume would still find it there

    def _delete(self, steps: list[int]) -> None:
        """Crash-safely: out of sight first (:func:`~..root.delete.delete`), then removed."""
        trash = delete(self.root, [self.path(step) for step in steps])
        self.view.forget(steps)
        self._writes.remove(trash)
