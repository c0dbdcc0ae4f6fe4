"""The memory tier of a manager's root: checkpoints in RAM, so that a crash costs a step.

Its folder is a root of its own, written through the manager's write path without
fsync (a power loss empties it anyway), locked, marked with its run
(:mod:`.memory_folder`), and removed when its manager closes cleanly. Its failures
never stop training: they are :class:`~functional_ckpt.errors.MemoryTierWarning`.
Under ``torch.distributed`` each node's folder also holds replicas of other nodes'
parts (:mod:`.memory_replicas`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from functional_ckpt._src.distributed import groups
from functional_ckpt._src.distributed.topology import topology
from functional_ckpt._src.format.naming import base_name, is_temporary_name, parse_step
from functional_ckpt._src.log import warn
from functional_ckpt._src.manager import memory_folder as mf
from functional_ckpt._src.manager.collective import coordinator_decides
from functional_ckpt._src.manager.memory import Memory, OverBudget, over_budget, resolve_budget
from functional_ckpt._src.manager.memory_promote import OnSignals
from functional_ckpt._src.manager.memory_replicas import STAGING, Replicas
from functional_ckpt._src.manager.options import AsyncSave
from functional_ckpt._src.manager.provenance import run_of
from functional_ckpt._src.manager.tiers import retain
from functional_ckpt._src.manager.writes import Writes, WriteSettings
from functional_ckpt._src.policy import Event, PolicyState
from functional_ckpt._src.policy.retention import RetentionPolicy, keep_last
from functional_ckpt._src.root.delete import delete, remove_all
from functional_ckpt._src.root.leftovers import recover_leftovers
from functional_ckpt._src.root.listing import StepInfo, read_info
from functional_ckpt._src.root.lock import LOCK_FILE, WriterLock
from functional_ckpt._src.root.run import Run, open_run
from functional_ckpt._src.root.view import RootView
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.state.tree import State
from functional_ckpt._src.storage import durable, ram
from functional_ckpt.errors import CheckpointError, MemoryTierWarning, RankFailed, is_damage

__all__ = ["MemoryTier"]

T = TypeVar("T")


class MemoryTier:
    """The folder in RAM above one manager's root (see the module docstring)."""

    def __init__(
        self, option: Memory, root: Path, settings: WriteSettings, *, run: Run, made: bool
    ) -> None:
        self.option, self.root, self.run = option, root, run
        topo = topology()
        if option.replicas not in (None, 1) and not topo.distributed:
            raise CheckpointError(
                f"Memory(replicas={option.replicas}): one process is one failure domain; "
                "replicas live on ranks of other nodes (torch.distributed)"
            )
        self.folder = Path(option.path) if option.path is not None else mf.default_folder(root, run)
        if option.path is not None:
            mf.check_apart(self.folder, root)
        elif made and topo.coordinator:
            mf.report_others(root, run, stacklevel=5)
        self.replicas: Replicas | None = None
        if topo.distributed:  # every rank owns the folder there
            self.replicas = Replicas.open(
                self.folder, option.replicas, option.domain, private=option.path is None
            )
        else:
            self._own()
        self.keeper = self.replicas is None or self.replicas.keeper
        self._round: threading.Thread | None = None  # a replication off the training thread
        self._step = -1  # the step of the save in flight
        self._round_error: BaseException | None = None
        self.policy_state: PolicyState = option.save.init()
        self._said_over = self._said_others = False
        self._lock: WriterLock | None = None
        self._signals = OnSignals(option.promote_on, lambda: self.promote(option.promote_within))
        #: Promotion over the manager's tiers (``manager/tiers.promote``), set by the manager.
        self.promote: Callable[[float], Path | None] = lambda within: None
        self.durable, self.local = False, True
        self.committed: Callable[[], object] = lambda: None  # progress, told over all tiers
        keep = option.keep
        self.keep = keep if isinstance(keep, RetentionPolicy) else keep_last(option.held)
        self.view = RootView(self.folder)  # refuses a folder that is itself a checkpoint
        self.steps, self.infos = self.view.steps, self.view.infos
        error: BaseException | None = None
        try:
            self.budget = resolve_budget(self.option, self.folder)
            if self.keeper:
                self._open()
        except BaseException as e:
            error = e
        if self.replicas is not None:
            groups.agree(error, self.replicas.group, f"memory tier {self.folder}")
        elif error is not None:
            raise error
        self.writes = Writes(
            self.view,
            WriteSettings(
                settings.per_rank,
                AsyncSave("write") if option.async_save else None,  # one copy, into RAM
                option.incremental,  # a rank's base: the last step its own folder holds
                distributed=topo.distributed,
                coordinator=topo.coordinator,
                durable=False,
                parts=topo.distributed,
                group="memory",
            ),
            None,
        )

    def __repr__(self) -> str:
        return f"MemoryTier({str(self.folder)!r}, keep={self.option.held})"

    def _own(self) -> None:
        """Own the folder; one planted where this run's secret name pointed is left
        alone and a new secret, a new folder, used."""
        try:
            mf.own_folder(self.folder, private=self.option.path is None)
        except CheckpointError as e:
            if self.option.path is not None:
                raise
            warn(f"{e}; it is left alone, a new one used", MemoryTierWarning, stacklevel=6)
            self.run = open_run(self.root, new_secret=True)[0]
            self.folder = mf.default_folder(self.root, self.run)
            mf.own_folder(self.folder, private=True)

    def _open(self) -> None:
        """Lock and mark the folder (this run's only), then recover what a crash of this
        run left (never in a folder refused as another's), handle signals."""
        try:
            self._lock = WriterLock(self.folder)
        except CheckpointError as e:
            raise CheckpointError(f"Memory(path={str(self.folder)!r}): {e}") from None
        try:
            mf.adopt(self.folder, self.root, self.run)
            recover_leftovers(self.folder, stacklevel=6)
            self._write_status(open_=True)
            self._signals.install()
            if self.replicas is not None:
                self.replicas.clear_staging()
        except BaseException:
            self._lock.release()
            self._lock = None
            raise

    def _skipped(self, err: BaseException, stacklevel: int) -> bool:
        """Whether ``err`` is a save over the budget (any rank's): skipped, said once."""
        over = isinstance(err, OverBudget) or (
            isinstance(err, RankFailed)
            and any(kind == OverBudget.__name__ for kind, _ in err.failures.values())
        )
        if over and not self._said_over:
            self._said_over = True
            warn(str(err), MemoryTierWarning, stacklevel=stacklevel)
        return over

    def close(self, *, crashed: bool = False) -> None:
        """Wait for the save in flight, then remove the folder: its RAM is not held past the
        run. After a crash (an exception leaving the manager) the folder stays for the
        restart, its newest step promoted to the disk first where a signal would have."""
        self.wait(stacklevel=4)
        self.writes.join_removals()
        self._signals.uninstall()
        if crashed and self.option.promote_on:
            self.promote(self.option.promote_within)
        if self._lock is None:
            return
        try:
            if not crashed:
                names = sorted(os.listdir(self.folder))
                own = [
                    n
                    for n in names
                    if is_temporary_name(n) and parse_step(base_name(n)) is not None
                ]
                own += [self.view.path(s).name for s in self._mine(parse_step(n) for n in names)]
                own += [mf.MARK_FILE, STAGING, LOCK_FILE]  # the lock last
                ram.remove_folder(self.folder, own)
            self._write_status(open_=False)
        except OSError as e:
            warn(
                f"{self.folder}: the memory tier could not be removed ({e})",
                MemoryTierWarning,
                stacklevel=4,
            )
        finally:
            self._lock.release()
            self._lock = None

    def _write_status(self, *, open_: bool) -> None:
        if topology().rank != 0:
            return  # one status per job: the coordinator's
        doc: dict[str, Any] = {"path": str(self.folder), "open": open_, "pid": os.getpid()}
        doc |= {"host": socket.gethostname(), "keep": self.option.held, "budget": self.budget}
        if self.replicas is not None:
            lay = self.replicas.layout
            doc |= {"replicas": lay.replicas, "domains": len(set(lay.domains))}
        with contextlib.suppress(OSError):
            durable.replace_durably(self.root / ram.MEMORY_STATUS, json.dumps(doc).encode())

    def decide(self, event: Event) -> bool:
        """The tier's own policy on ``event`` (its state advances at once: a missed save
        of the memory tier is not made up later)."""
        policy = self.option.save
        due = policy.decide(self.policy_state, event)
        state = policy.update(self.policy_state, event, due)
        if self.replicas is not None:  # every rank saves, or none: the coordinator decides
            due, state = coordinator_decides((due, state))
        self.policy_state = state
        return bool(due)

    def save(self, state: State, step: int, metadata: Callable[[], Mapping[str, Any]]) -> None:
        """Start the checkpoint of ``step`` (off the training thread by default), the
        previous one collected and room made first: at most ``keep`` in the folder."""
        self.wait(stacklevel=4)
        replicas, self._step = self.replicas, step
        error: BaseException | None = over_budget(self.option, self.budget, self.folder, state)
        try:
            if self.keeper and error is None:
                self._make_room(step)
                if replicas is not None:
                    replicas.clear_staging()
        except Exception as e:
            error = e
        try:
            if replicas is not None:
                groups.agree(error, replicas.group, f"memory-tier step {step}")
            elif error is not None:
                raise error
            path = self.view.path(step) if replicas is None else replicas.staging(step)
            info = self.writes.save(path, state, metadata())
        except Exception as err:
            if not self._skipped(err, stacklevel=4):
                self._fail(step, err, stacklevel=4)
            return
        if replicas is None:
            if info is not None:
                self._prune()
            return
        pending = self.writes.pending  # phase 2 off this thread, as phase 1's write
        if pending is None:  # a synchronous save: its replication too
            self._replicate(step, None)
            self.wait(stacklevel=4)
            return
        self._round = threading.Thread(
            target=self._replicate, args=(step, pending), name="fc-replicate", daemon=True
        )
        self._round.start()

    def _replicate(self, step: int, pending: Any) -> None:
        """Phase 2 (see :mod:`.memory_replicas`), then the keeper's retention."""
        assert self.replicas is not None
        error: BaseException | None = None
        try:
            if pending is not None:
                pending.result()
        except BaseException as e:
            error = e
        try:
            self.replicas.replicate(step, error)
            if self.keeper:
                self._prune()
        except BaseException as e:
            self._round_error = e

    def _make_room(self, step: int) -> None:
        steps = self.steps()
        newer = [s for s in steps if s > step]  # a run that went back (rollback, older resume)
        older = sorted(s for s in steps if s < step)
        kept = older[-(self.option.held - 1) :] if self.option.held > 1 else []
        self.delete(newer + [s for s in older if s not in kept])

    def _prune(self) -> None:
        """After a commit: retention and progress, as :mod:`.tiers` decides them."""
        retain(self, self.keep)
        self.committed()

    def _mine(self, steps: Iterable[int | None]) -> list[int]:
        """Of ``steps``, the committed checkpoints recording this run: the only ones the
        tier deletes (anything else in its folder is the user's, or another run's, and is
        left alone, reported once)."""
        mine: list[int] = []
        others: list[int] = []
        for step in (s for s in steps if s is not None):
            try:
                ok = run_of(read_info(self.view.path(step), step).metadata) == self.run.id
            except (CheckpointError, OSError):
                ok = False
            (mine if ok else others).append(step)
        if others and not self._said_others:
            self._said_others = True
            warn(
                f"{self.folder}: steps {others} are not checkpoints of this run "
                f"({self.run.id}); the memory tier leaves them as they are",
                MemoryTierWarning,
                stacklevel=5,
            )
        return mine

    def delete(self, steps: Sequence[int], *, damaged: bool = False) -> None:
        """Out of sight now, the files removed off the training thread (freeing RAM takes
        as long as a copy); only the keeper of a shared folder deletes, and only this
        run's checkpoints (``damaged``: one this run found unreadable)."""
        steps = steps if damaged or not steps else self._mine(steps)
        if steps and self.keeper:
            steps = list(steps)
            trash = delete(self.folder, [self.view.path(s) for s in steps])
            self.view.forget(steps)
            if self.replicas is None:
                self.writes.remove(trash)
            else:
                remove_all(trash)

    def wait_staged(self) -> None:
        with contextlib.suppress(Exception):  # a failure is reported by the next wait()
            self.writes.wait_staged()

    def wait(self, stacklevel: int = 3) -> None:
        """Collect the save in flight: retention if it committed, a warning if it failed."""
        if self._round is not None:  # a replication, which collected the write itself
            self._round.join()
            self._round = self.writes.pending = None
        error, self._round_error = self._round_error, None
        info: CheckpointInfo | None = None
        try:
            info = self.writes.wait() if error is None else None
        except Exception as err:
            error = err
        if error is not None:
            self._fail(self._step, error, stacklevel=stacklevel + 1)
        elif info is not None:
            self._prune()

    def _fail(self, step: int, err: BaseException, stacklevel: int) -> None:
        warn(
            f"{self.folder}: the memory-tier checkpoint of step {step} failed "
            f"({type(err).__name__}: {err}); training goes on, the disk tier is unaffected",
            MemoryTierWarning,
            stacklevel=stacklevel,
        )

    def newest(
        self, read: Callable[[Path], T], above: int | None, stacklevel: int = 5
    ) -> tuple[StepInfo, T] | None:
        """The newest readable checkpoint of this run newer than ``above``; a damaged one
        is reported and removed (a cache holds nothing worth keeping aside)."""
        self.wait(stacklevel=stacklevel + 1)
        if self.replicas is not None:
            return self.replicas.newest(read, above, topology().world, stacklevel + 1)
        for step in sorted((s for s in self.steps() if above is None or s > above), reverse=True):
            path = self.view.path(step)
            try:
                info = read_info(path, step)
                if run_of(info.metadata) == self.run.id:  # else written by hand, or planted
                    return info, read(path)
                why = f"is not of this run ({self.run.id}); left as it is, not resumed"
            except Exception as err:
                if not is_damage(err):
                    raise
                why = f"is unreadable ({type(err).__name__}: {err})"
                with contextlib.suppress(OSError):
                    self.delete([step], damaged=True)
                    why += "; removed"
                why += "; falling back to the next tier"
            warn(
                f"{path}: memory-tier checkpoint of step {step} {why}",
                MemoryTierWarning,
                stacklevel=stacklevel,
            )
        return None

    # ------------------------------------------------------------------ preemption

    def open(self, step: int) -> Path:
        """The folder's copy of ``step``, if it holds every rank's files (a folder of many
        ranks may hold only some)."""
        path = self.view.path(step)
        if self.replicas is not None and not ram.holds_every_file(path):
            raise CheckpointError(f"{path}: holds only some ranks' files of step {step}")
        return path

    def copy_in(self, source: object, within: float) -> None:
        """Nothing is promoted into RAM: it is the fastest tier, and not durable."""
