"""CheckpointManager: policies, retention, resume and locking around ``save``/``restore``.

The manager holds no checkpointing logic of its own (DESIGN principle 1). It
threads a save policy's state through ``maybe_save`` events, writes through
:func:`functional_ckpt.save`, prunes with :func:`~functional_ckpt.retention.plan_deletions`,
and on resume reads the newest checkpoint that is actually readable (a damaged one
is reported and moved aside, never silently replaced by a fresh start). What it
builds on is public: a root's layout, leftovers and writer lock in
:mod:`functional_ckpt.root` and :mod:`functional_ckpt.lock`; what each checkpoint
records (step, metrics, running time, each policy's spec and state, so a restarted
run continues its policies) in :mod:`functional_ckpt.record`; rollbacks in
:mod:`functional_ckpt.rollback`; the decisions all ranks share in
:mod:`functional_ckpt.collective`; the root's steps and records as queries in
:mod:`functional_ckpt.rootview`; which checkpoint a resume picks in
:mod:`functional_ckpt.resume`; exports off the training thread in
:mod:`functional_ckpt.exporting`.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from tensordict import TensorDict, TensorDictBase

from functional_ckpt._src.distributed.topology import topology
from functional_ckpt._src.export.exports import BackgroundExport, run_export, snapshot
from functional_ckpt._src.export.safetensors import Export
from functional_ckpt._src.format.header import MANAGER_KEY, record_of
from functional_ckpt._src.format.naming import parse_step, step_name
from functional_ckpt._src.manager.decisions import coordinator_decides, gathered, prepare_groups
from functional_ckpt._src.manager.options import check_policies, plain_metrics, remote_tier
from functional_ckpt._src.manager.provenance import (
    Provenance,
    RunningTime,
    check_metadata,
    git_commit,
    manager_record,
    stored_state,
)
from functional_ckpt._src.manager.rollback_rule import Rollback, SaveResult, Watch, roll_back
from functional_ckpt._src.paths import PathLike
from functional_ckpt._src.policy import Event, PolicyState, SavePolicy, every_steps
from functional_ckpt._src.policy.retention import RetentionPolicy, keep_all, plan_deletions
from functional_ckpt._src.restore.api import check_like_or_out, restore
from functional_ckpt._src.restore.template import Reshard
from functional_ckpt._src.root import rollback
from functional_ckpt._src.root.delete import delete, remove_all
from functional_ckpt._src.root.leftovers import open_writer
from functional_ckpt._src.root.listing import StepInfo
from functional_ckpt._src.root.lock import WriterLock
from functional_ckpt._src.root.resume import check_order, newest_readable
from functional_ckpt._src.root.view import RootView
from functional_ckpt._src.save.api import save as save_sync
from functional_ckpt._src.save.api import save_async
from functional_ckpt._src.save.incremental import Incremental
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.save.plan import DEFAULT_PER_RANK
from functional_ckpt._src.save.staging import PendingSave, Stager, Staging
from functional_ckpt.errors import (
    CheckpointError,
    CheckpointNotFound,
    CheckpointWarning,
)

__all__ = [
    "CheckpointManager",
    "CheckpointWarning",
    "MANAGER_KEY",
    "Rollback",
    "SaveResult",
    "StepInfo",
    "step_name",
]

State = TensorDictBase | Mapping[str, Any]

# --------------------------------------------------------------------------- manager


class CheckpointManager(RootView):
    """Save on a policy, keep on a retention policy, resume from the newest good checkpoint.

    ``save`` defaults to ``every_steps(1)`` (every ``maybe_save`` with a new step
    saves) and ``keep`` to ``keep_all()`` (nothing is deleted), so a manager without
    policies is a safe, plain "save each step I give you". ``metadata`` (experiment
    id, hyper-parameters; msgpack-encodable) is stored in every checkpoint next to
    the automatic keys. ``export`` adds weights-only safetensors exports on their
    own policy (see :class:`~functional_ckpt.export.Export`). ``rollback`` (a rule such
    as ``fc.policy.on_degrade``) rolls the run back when it fires (``maybe_save``).

    A writing manager locks ``root``, removes stale temporary directories and
    finishes an interrupted rollback at open; ``read_only=True`` does none of that
    and never deletes or renames anything. ``clock`` is read (only by the manager,
    never by a policy) to count the run's running time, which every event carries
    and every checkpoint records. ``incremental=True`` saves each checkpoint with
    the previous committed one as its base (see ``fc.save(base=...)``): unchanged
    bytes are shared, never written again, and every checkpoint stays
    self-contained, so retention may delete any of them. Not thread-safe: use
    one manager from one thread.
    """

    def __init__(
        self,
        root: PathLike,
        save: SavePolicy | None = None,
        keep: RetentionPolicy | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
        read_only: bool = False,
        export: Export | None = None,
        async_save: bool = False,
        staging: Staging = "copy",
        per_rank: Sequence[str] = DEFAULT_PER_RANK,
        clock: Callable[[], float] = time.monotonic,
        incremental: bool = False,
        rollback: SavePolicy | None = None,
        remote: str | None = None,
        remote_keep: RetentionPolicy | None = None,
        storage_options: Mapping[str, Any] | None = None,
        prune_unuploaded: bool = False,
    ) -> None:
        RootView.__init__(self, Path(root))
        if not callable(clock):
            raise TypeError(f"CheckpointManager(clock={clock!r}): clock must be callable")
        self._running = RunningTime(clock)
        self.per_rank = tuple(per_rank)
        self.async_save = bool(async_save)
        self.incremental = bool(incremental)
        self.staging: Staging = staging
        self._pending: PendingSave | None = None
        self._removal: threading.Thread | None = None
        self._exports = BackgroundExport()
        self._stager = Stager()
        topo = topology()
        self._distributed = topo.distributed
        self._coordinator = topo.coordinator
        if self._distributed:
            prepare_groups()  # now, on the training thread, in the same order on every rank
        self.read_only = bool(read_only)
        self.save_policy = every_steps(1) if save is None else save
        self.keep = keep_all() if keep is None else keep
        self.export = export
        self.metadata = check_metadata(metadata, f"CheckpointManager({self.root})")
        check_policies(self.save_policy, self.keep, self.export)
        self._policy_state: PolicyState = self.save_policy.init()
        self._export_state: PolicyState = export.policy.init() if export is not None else None
        self._watch = Watch(rollback)  # the rollback rule (see functional_ckpt.degradation)
        self._lock: WriterLock | None = None
        self._closed = False
        self._run = Provenance(os.getcwd())
        if not self.read_only:
            self._run.git = git_commit(self._run.cwd)  # before the lock: no child inherits it
            if self._coordinator:
                self._open_writer()  # one lock per job: the coordinator's
        args = (remote, remote_keep, storage_options, prune_unuploaded, self.read_only)
        self.remote = remote_tier(self.root, *args, lock=self._lock)  # docs/tiered.md

    def _open_writer(self) -> None:
        # Leftovers of crashed writers are recovered (warning at the CheckpointManager call).
        self._lock = open_writer(self.root, stacklevel=4)
        try:
            rollback.finish(self.root)  # a rollback a crash interrupted completes now
        except BaseException:
            self._lock.release()
            raise

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Wait for pending work and release the lock; idempotent."""
        if self._closed:
            return
        try:
            try:
                self.wait()
            finally:
                self._exports.join()
                if self.remote is not None:
                    self.remote.close()  # the uploads asked for finish, then what they
                    if self._lock is not None:  # protected from retention is pruned
                        self._prune(set())
        finally:
            self._join_removals()
            self._closed = True
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def wait(self) -> None:
        """Block until every save started so far is committed; raise if one failed.

        The retention policy runs once the save it follows has committed.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        info = pending.result()
        self._after_commit(info)

    def wait_staged(self) -> None:
        """Block until the state may be mutated again (call it before the optimizer step).

        With synchronous saves, or ``staging="copy"`` once the copy is done, this
        returns at once. With ``staging="none"`` it waits for the whole write.
        """
        if self._pending is None:
            return
        if self.staging == "none":
            self.wait()
        else:
            self._pending.wait_staged()

    def __repr__(self) -> str:
        mode = "read-only" if self.read_only else "writer"
        return (
            f"CheckpointManager({str(self.root)!r}, save={self.save_policy!r}, "
            f"keep={self.keep!r}, {mode})"
        )

    # ------------------------------------------------------------------ saving

    def _check_writable(self, what: str) -> None:
        if self._closed:
            raise CheckpointError(f"{self.root}: {what}: the manager is closed")
        if self.read_only:
            raise CheckpointError(f"{self.root}: {what}: this manager is read-only")

    def maybe_save(
        self,
        state: State,
        *,
        step: int,
        epoch: int | None = None,
        metrics: Mapping[str, Any] | None = None,
        is_final: bool = False,
        force: bool = False,
    ) -> SaveResult:
        """Build the event, ask the policy, save, commit its state with it, then prune.

        Returns whether a full checkpoint was written. ``force=True`` saves whatever
        the policy says, and the policy sees that a save happened. The export policy
        is asked on the same event and its export is written first, so a crash
        between the two can only repeat an export, never lose one. With
        ``async_save`` the export is written off the training thread instead: from
        the checkpoint of the same step once it has committed, else from a copy of
        the selected tensors taken now (a crash may then lose the export, never the
        checkpoint it is written from). Policy states
        advance only once the writes they describe succeeded, so a failed save is
        retried at the next event. A ``rollback`` rule that fires restores the checkpoint
        it points to, returned in ``.rollback`` (:mod:`functional_ckpt.degradation`).
        """
        self._check_writable("maybe_save")
        if self.remote is not None:
            self.remote.check()  # a failed upload is reported here, as a RemoteWarning
        if self._pending is not None and self._pending.done():
            self.wait()  # a background failure surfaces here, at the next call
        if self._exports.finished():
            self._exports.join()
        event = Event(
            step=step,
            epoch=epoch,
            metrics=plain_metrics(metrics, "maybe_save"),
            is_final=is_final,
            time=self.running_time(),
        )
        if event.step < 0:
            raise ValueError(f"maybe_save(step={step!r}): steps must be >= 0")
        policy, export = self.save_policy, self.export
        saved = policy.decide(self._policy_state, event) or force
        policy_state = policy.update(self._policy_state, event, saved)
        exported, export_state = False, self._export_state
        if export is not None:
            exported = export.policy.decide(export_state, event)
            export_state = export.policy.update(export_state, event, exported)
        rolls, rule_state = self._watch.vote(event, saved)
        if self._distributed:  # one decision for all ranks: the coordinator's
            decided = (saved, policy_state, exported, export_state, event.time, rolls, rule_state)
            saved, policy_state, exported, export_state, now, rolls, rule_state = (
                coordinator_decides(decided)
            )
            event = dataclasses.replace(event, time=now)
        self._watch.next = rule_state
        if saved:
            self.wait()  # at most one save in flight; the previous one must have committed
            check_order(self.root, event.step, self.latest_step())  # before any write
        background = exported and self.async_save and not self._distributed
        if exported and not background:
            self._export_weights(state, event)
        if saved:
            self._save_checkpoint(state, event, policy_state, export_state)
        if background:
            self._export_in_background(state, event, saved)
        self._policy_state = policy_state
        self._export_state = export_state
        self._watch.state = rule_state
        return roll_back(self, self._watch, state, event, saved) if rolls else SaveResult(saved)

    def running_time(self) -> float:
        """Seconds this run has been running: carried over by restores, downtime excluded."""
        return self._running()

    def _save_checkpoint(
        self, state: State, event: Event, policy_state: PolicyState, export_state: PolicyState
    ) -> CheckpointInfo | None:
        export = None if self.export is None else self.export.policy
        record = manager_record(
            event, self.save_policy, policy_state, self.keep, export, export_state
        )
        record.update(self._watch.entry())
        info = self._write(self.path(event.step), state, self._run.metadata(record, self.metadata))
        if info is not None:
            self._after_commit(info)
        return info

    def _after_commit(self, info: CheckpointInfo) -> None:
        """Retention runs only after the checkpoint it protects is committed."""
        step = parse_step(info.path.name)
        if self.remote is not None:
            self.remote.committed()  # uploaded in the background
        if self._coordinator:
            self._prune(protected={step} if step is not None else set())

    def _write(
        self, path: Path, state: State, metadata: Mapping[str, Any]
    ) -> CheckpointInfo | None:
        """The one place a checkpoint is written; None while an async save runs.

        An existing directory for the same step is replaced atomically: the newer
        save of a step supersedes the older one.
        """
        overwrite = path.exists()
        base = self._base_for(path) if self.incremental else None
        remote = self.remote
        held = remote is not None  # uploads stand still while the state is staged
        if remote is not None:
            remote.hold_uploads()
        try:
            if self.async_save:
                self._pending = save_async(
                    path,
                    state,
                    metadata=metadata,
                    overwrite=overwrite,
                    staging=self.staging,
                    stager=self._stager,
                    per_rank=self.per_rank,
                    base=base,
                )
                if remote is not None:
                    self._pending.when_staged(remote.release_uploads)
                    held = False
                return None
            return save_sync(
                path,
                state,
                metadata=metadata,
                overwrite=overwrite,
                per_rank=self.per_rank,
                base=base,
            )
        finally:
            if held and remote is not None:
                remote.release_uploads()

    def _base_for(self, path: Path) -> Incremental:
        """The base of an incremental save: the newest other committed checkpoint.

        Unreadable or gone by the time it is opened, it is not an error: the save
        is then a full one.
        """
        others = [s for s in self.steps() if self.path(s) != path]
        return Incremental(self.path(max(others)) if others else None, required=False)

    def _export_weights(self, state: State, event: Event) -> Path | None:
        assert self.export is not None
        if self._distributed:
            # Every rank takes part in gathering the sharded weights; rank 0 writes them.
            state = gathered(state, self.export.select)
            if not self._coordinator:
                return None
        return run_export(state, self.root, self.export, event.step, event.metrics or {})

    def _export_in_background(self, state: State, event: Event, saved: bool) -> None:
        """Export from the committed checkpoint of this step, or from a copy taken now."""
        export = self.export
        assert export is not None
        self._exports.join()  # one export in flight; a failed one surfaces here
        pending = self._pending if saved else None
        source: State | Path = self.path(event.step) if saved else snapshot(state, export)
        failure = None if pending is None else pending.exception
        self._exports.start(source, self.root, export, event.step, event.metrics or {}, failure)

    def wait_exports(self) -> None:
        """Block until the export running in the background is written; raise if it failed."""
        self._exports.join()

    # ------------------------------------------------------------------ deleting

    def _prune(self, protected: set[int]) -> list[int]:
        """Delete what the retention policy does not keep; never the newest or ``protected``."""
        if self._pending is not None:  # a save in flight is never a candidate
            step = parse_step(self._pending.path.name)
            protected = protected | ({step} if step is not None else set())
        if self._exports.step is not None:  # nor the checkpoint an export is reading
            protected = protected | {self._exports.step}
        if self.remote is not None:  # nor one whose remote copy is not committed yet
            protected = protected | self.remote.protected(self.steps())
        doomed = plan_deletions(self.keep, self.infos(), protected=protected)
        self._delete(doomed)
        return doomed

    def delete(self, step: int) -> None:
        """Delete one checkpoint, crash-safely (even the newest: you asked for it)."""
        self._check_writable("delete")
        if not self.path(step).is_dir():
            raise CheckpointNotFound(f"{self.path(step)}: no checkpoint for step {step}")
        self._delete([step])

    def _delete(self, steps: list[int]) -> None:
        """Crash-safely: out of sight first (:func:`~functional_ckpt.root.delete`), then removed."""
        trash = delete(self.root, [self.path(step) for step in steps])
        self._summaries.forget(steps)
        if self.async_save and trash:
            # Out of sight already; unlinking gigabytes need not stall the training loop.
            # close() waits for it; what a crash leaves, the next writer removes at open.
            self._join_removals()
            self._removal = threading.Thread(
                target=remove_all, args=(trash,), name="fc-prune", daemon=True
            )
            self._removal.start()
        else:
            remove_all(trash)

    def _join_removals(self) -> None:
        if self._removal is not None:
            self._removal.join()
            self._removal = None

    # ------------------------------------------------------------------ restoring

    def restore(
        self,
        step: int,
        like: State | None = None,
        *,
        out: State | None = None,
        reshard: Reshard | None = None,
    ) -> TensorDict:
        """Restore one step (no fallback) and continue the policies from it.

        ``like``, ``out`` and ``reshard`` are those of :func:`functional_ckpt.restore`.
        """
        check_like_or_out(like, out, "CheckpointManager.restore")
        if self._closed:
            raise CheckpointError(f"{self.root}: restore: the manager is closed")
        path = self.path(step)
        info = self.info(step)
        state = restore(path, like, out=out, reshard=reshard)
        self._adopt(info)
        return state

    def restore_latest(
        self,
        like: State | None = None,
        *,
        out: State | None = None,
        reshard: Reshard | None = None,
    ) -> TensorDict | None:
        """Restore the newest readable checkpoint; None only if the root holds none.

        Unreadable checkpoints (corrupt bytes, missing files, torn manifest) are
        reported with a :class:`CheckpointWarning` and skipped; a writing manager
        moves them aside to ``step_N.corrupt-…`` (never deletes them). A template
        that does not fit raises at once (that is a bug in the caller, not damage).
        If checkpoints exist but none is readable this raises rather than letting
        the run silently start over. The per-tensor CRCs that ``fc.restore``
        checks while reading are the validation; nothing is read twice.
        ``like``/``out`` are those of :func:`functional_ckpt.restore`: with ``like`` a
        new state is returned and ``like`` is never written.
        """
        check_like_or_out(like, out, "CheckpointManager.restore_latest")
        if self._closed:
            raise CheckpointError(f"{self.root}: restore_latest: the manager is closed")

        def read(path: Path) -> TensorDict:
            return restore(path, like, out=out, reshard=reshard)

        def local() -> tuple[StepInfo, TensorDict] | None:
            aside, depth = not self.read_only and self._coordinator, 3 if self.remote is None else 5
            return newest_readable(
                self.root, self._step_dirs, read, move_aside=aside, bad=self._bad, stacklevel=depth
            )

        if self.remote is None:
            found = local()
        else:  # the newest of both tiers; only the remote has it: downloaded, verified first
            one = lambda step: (self.info(step), read(self.path(step)))  # noqa: E731
            found = self.remote.restore_latest(local, self.steps, one, writer=not self.read_only)
        if found is None:
            return None
        info, state = found
        self._adopt(info)
        return state

    def rollback(
        self,
        step: int,
        like: State | None = None,
        *,
        newer: rollback.Newer = "branch",
        branch: str | None = None,
        reason: Mapping[str, Any] | None = None,
    ) -> TensorDict:
        """Continue the run from the older kept checkpoint ``step``, in this root.

        Restores ``step`` like :meth:`restore` (policies and running time continue
        from it), then moves every newer checkpoint out of the trunk: with
        ``newer="branch"`` to ``root/branches/<branch>/`` (default name: one naming
        the steps; see :meth:`branches`), with ``newer="delete"`` deleted. Nothing is
        moved if the restore fails. The moves are recorded durably first and each is
        an atomic rename, so a crash leaves the rollback either not started or
        finished by the next writer that opens the root. Every later checkpoint
        records the run's rollbacks under ``metadata["rollbacks"]``, with ``reason`` (plain
        data) if given, then even if nothing moved. Returns the restored state.
        """
        self._check_writable("rollback")
        rollback.check_request(newer, branch, reason)
        self.wait()  # a save in flight commits first: it may be one of the newer steps
        state = self.restore(step, like)  # raises, moving nothing, if step is unusable
        doomed = sorted(s for s, _ in self._step_dirs() if s > step)
        if self.remote is not None and self._coordinator:  # the remote trunk first (tiered.md)
            remote = self.remote.newer_than(step)
            if remote and newer == "branch":
                branch = rollback.new_branch(self.root, branch, max(remote + doomed), step)
            self.remote.set_aside(remote, branch if newer == "branch" else None)
        if not (doomed or reason) or not self._coordinator:
            return state
        self._run.rollbacks.append(rollback.run(self.root, step, doomed, newer, branch, reason))
        self._summaries.forget(doomed)
        return state

    def _adopt(self, info: StepInfo) -> None:
        """Continue the run from the restored checkpoint: policy states and running time."""
        self._restored_step = info.step
        if self.read_only:
            return  # a follower never saves: its policies are irrelevant
        self._run.resume(info.metadata)
        record = record_of(info.metadata)
        self._policy_state = stored_state(self.save_policy, record.raw, "save", info.path)
        self._watch.resume(record.raw, info.path)
        if self.export is not None:
            self._export_state = stored_state(self.export.policy, record.raw, "export", info.path)
        self._running.resume(record.running_time)
