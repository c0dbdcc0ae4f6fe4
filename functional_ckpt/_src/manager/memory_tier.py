"""The memory tier of a manager's root: checkpoints in RAM, so that a crash costs a step.

Its folder is a root of its own, written through the manager's own write path
(:class:`~.writes.Writes`) with durability off: the same files, manifest, checksums
and commit protocol, but no fsync, since a power loss empties the folder anyway.
It is locked like a disk root (one writer per folder), marked with the run it
belongs to (:mod:`.memory_folder`: a folder of another run is refused, never
emptied nor resumed from), holds the newest ``keep`` checkpoints, and is removed
when its manager closes. Its failures never stop training: they are reported as
:class:`~functional_ckpt.errors.MemoryTierWarning`, and the disk tier goes on. Under
``torch.distributed`` each node's folder also holds replicas of other nodes' parts
(:mod:`.memory_replicas`); the lowest rank of a folder keeps it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from functional_ckpt._src.distributed import groups
from functional_ckpt._src.distributed.topology import topology
from functional_ckpt._src.format.naming import base_name, parse_step
from functional_ckpt._src.log import warn
from functional_ckpt._src.manager.collective import coordinator_decides
from functional_ckpt._src.manager.memory import Memory, OverBudget, over_budget, resolve_budget
from functional_ckpt._src.manager.memory_folder import (
    MARK_FILE,
    adopt,
    check_apart,
    default_folder,
    own_folder,
    report_others,
)
from functional_ckpt._src.manager.memory_promote import OnSignals
from functional_ckpt._src.manager.memory_replicas import STAGING, Replicas
from functional_ckpt._src.manager.options import AsyncSave
from functional_ckpt._src.manager.provenance import run_of
from functional_ckpt._src.manager.tiers import retain
from functional_ckpt._src.manager.writes import Writes, WriteSettings
from functional_ckpt._src.policy import Event, PolicyState
from functional_ckpt._src.policy.retention import RetentionPolicy, keep_last
from functional_ckpt._src.root.delete import delete, remove_all
from functional_ckpt._src.root.leftovers import open_writer
from functional_ckpt._src.root.listing import StepInfo, read_info
from functional_ckpt._src.root.lock import LOCK_FILE, WriterLock
from functional_ckpt._src.root.run import Run, open_run
from functional_ckpt._src.root.view import RootView
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.state.tree import State
from functional_ckpt._src.storage import durable, ram
from functional_ckpt.errors import CheckpointError, MemoryTierWarning, RankFailed, is_damage

__all__ = ["MARK_FILE", "MemoryTier"]

T = TypeVar("T")


class MemoryTier:
    """The folder in RAM above one manager's root (see the module docstring)."""

    def __init__(
        self, option: Memory, root: Path, settings: WriteSettings, *, run: Run, made: bool
    ) -> None:
        self.option = option
        self.root = root
        self.run = run
        self.folder = Path(option.path) if option.path is not None else default_folder(root, run)
        if option.path is not None:
            check_apart(self.folder, root)
        topo = topology()
        self.replicas: Replicas | None = None
        if topo.distributed:
            self.replicas = Replicas.open(
                self.folder, option.replicas, option.domain, private=option.path is None
            )
        elif option.replicas not in (None, 1):
            raise CheckpointError(
                f"Memory(replicas={option.replicas}): one process is one failure domain; "
                "replicas live on ranks of other nodes (torch.distributed)"
            )
        self.keeper = self.replicas is None or self.replicas.keeper
        self._round: threading.Thread | None = None  # a replication off the training thread
        self._round_step = -1
        self._round_error: BaseException | None = None
        self.policy_state: PolicyState = option.save.init()
        self.budget = 0
        self._said_over = False
        self._lock: WriterLock | None = None
        self._signals = OnSignals(option.promote_on, lambda: self.promote(option.promote_within))
        #: Promotion over the manager's tiers (``manager/tiers.promote``), set by the manager.
        self.promote: Callable[[float], Path | None] = lambda within: None
        self.durable = False
        self.committed: Callable[[], object] = lambda: None  # progress, told over all tiers
        keep = option.keep
        self.keep = keep if isinstance(keep, RetentionPolicy) else keep_last(option.held)
        if option.path is None and made and topo.coordinator:
            report_others(root, run, stacklevel=5)
        self.view = RootView(self.folder)  # refuses a folder that is itself a checkpoint
        error: BaseException | None = None
        try:
            if self.keeper:
                self._open()
                if self.replicas is not None:
                    self.replicas.clear_staging()
            elif self.replicas is not None:
                self.budget = resolve_budget(self.option, self.folder)
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

    # ------------------------------------------------------------------ open and close

    def _open(self) -> None:
        """Own and lock the folder (this run's only), check the budget, handle signals."""
        try:
            own_folder(self.folder, private=self.option.path is None)
        except CheckpointError as e:
            if self.option.path is not None or self.replicas is not None:
                raise
            # Planted where this run's secret name pointed: a new secret, a new folder.
            warn(f"{e}; it is left alone, a new one used", MemoryTierWarning, stacklevel=6)
            self.run = open_run(self.root, new_secret=True)[0]
            self.folder = default_folder(self.root, self.run)
            self.view = RootView(self.folder)
            own_folder(self.folder, private=True)
        try:
            self._lock = open_writer(self.folder, stacklevel=6)
        except CheckpointError as e:
            raise CheckpointError(f"Memory(path={str(self.folder)!r}): {e}") from None
        try:
            adopt(self.folder, self.root, self.run)
            self.budget = resolve_budget(self.option, self.folder)
            self._write_status(open_=True)
            self._signals.install()
        except BaseException:
            self._lock.release()
            self._lock = None
            raise

    def _skipped(self, err: BaseException, stacklevel: int) -> bool:
        """Whether ``err`` is a save over the budget (any rank's): skipped, said once."""
        if isinstance(err, RankFailed):
            over = any(kind == OverBudget.__name__ for kind, _ in err.failures.values())
        else:
            over = isinstance(err, OverBudget)
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
                own = [
                    e.name
                    for e in os.scandir(self.folder)
                    if parse_step(base_name(e.name)) is not None or e.name in (MARK_FILE, STAGING)
                ]
                ram.remove_folder(self.folder, [*sorted(own), LOCK_FILE])
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
        doc: dict[str, Any] = {
            "path": str(self.folder),
            "open": open_,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "keep": self.option.held,
            "budget": self.budget,
        }
        if self.replicas is not None:
            lay = self.replicas.layout
            doc["replicas"] = lay.replicas
            doc["domains"] = len(set(lay.domains))
        with contextlib.suppress(OSError):
            durable.replace_durably(self.root / ram.MEMORY_STATUS, json.dumps(doc).encode())

    # ------------------------------------------------------------------ saving

    def steps(self) -> list[int]:
        """Committed steps in the tier, ascending."""
        return self.view.steps()

    def infos(self) -> list[StepInfo]:
        return self.view.infos()

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
        """Start the checkpoint of ``step`` (off the training thread by default).

        The previous one is collected first and retention makes room, so the folder
        never holds more than ``keep`` checkpoints (counting the one being written).
        """
        self.wait(stacklevel=4)
        if self.replicas is not None:
            self._save_replicated(state, step, metadata)
            return
        over = over_budget(self.option, self.budget, self.folder, state)
        if over is not None:
            self._skipped(over, stacklevel=4)
            return
        try:
            self._make_room(step)
            info = self.writes.save(self.view.path(step), state, metadata())
        except Exception as err:
            self._fail(step, err, stacklevel=4)
            return
        if info is not None:
            self._prune()

    def _save_replicated(
        self, state: State, step: int, metadata: Callable[[], Mapping[str, Any]]
    ) -> None:
        """Phase 1 on this thread (staged, written by DCP off it), phase 2 after it."""
        replicas = self.replicas
        assert replicas is not None
        error: BaseException | None = over_budget(self.option, self.budget, self.folder, state)
        try:
            if self.keeper and error is None:
                self._make_room(step)
                replicas.clear_staging()
        except Exception as e:
            error = e
        try:
            groups.agree(error, replicas.group, f"memory-tier step {step}")
            self.writes.save(replicas.staging(step), state, metadata())
        except Exception as err:
            if not self._skipped(err, stacklevel=5):
                self._fail(step, err, stacklevel=5)
            return
        pending = self.writes.pending
        self._round_step = step
        if pending is None:  # a synchronous save: its replication too
            self._replicate(step, None)
            self.wait(stacklevel=5)
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
        """After a commit: retention (:func:`~.tiers.retain`), and progress told."""
        retain(self, self.keep)
        self.committed()

    def delete(self, steps: Sequence[int]) -> None:
        """Out of sight now; the files (freeing their RAM takes as long as a copy of
        them) are removed off the training thread, and the next save's write waits.
        Only the keeper of a shared folder deletes."""
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
        if self.replicas is not None:
            if self._round is not None:
                self._round.join()
                self._round = None
            self.writes.pending = None
            error, self._round_error = self._round_error, None
            if error is not None:
                self._fail(self._round_step, error, stacklevel=stacklevel + 1)
            return
        pending = self.writes.pending
        try:
            info: CheckpointInfo | None = self.writes.wait()
        except Exception as err:
            step = -1 if pending is None else parse_step(pending.path.name)
            self._fail(-1 if step is None else step, err, stacklevel=stacklevel + 1)
            return
        if info is not None:
            self._prune()

    def _fail(self, step: int, err: BaseException, stacklevel: int) -> None:
        """Report a failed save (``stacklevel`` counted from this function)."""
        warn(
            f"{self.folder}: the memory-tier checkpoint of step {step} failed "
            f"({type(err).__name__}: {err}); training goes on, the disk tier is unaffected",
            MemoryTierWarning,
            stacklevel=stacklevel,
        )

    # ------------------------------------------------------------------ restoring

    def newest(
        self, read: Callable[[Path], T], above: int | None, stacklevel: int = 5
    ) -> tuple[StepInfo, T] | None:
        """The newest readable checkpoint of this run in the tier newer than ``above``.

        A damaged one is reported as a :class:`MemoryTierWarning` and removed by a writer
        (a cache holds nothing worth keeping aside); the previous one is tried.
        """
        at_least = None if above is None else above + 1
        self.wait(stacklevel=stacklevel + 1)
        if self.replicas is not None:
            return self._newest_replicated(read, at_least, stacklevel + 1)
        for step in sorted(self.steps(), reverse=True):
            if at_least is not None and step < at_least:
                break
            path = self.view.path(step)
            try:
                info = read_info(path, step)
                if run_of(info.metadata) != self.run.id:  # written by hand, or planted
                    warn(
                        f"{path}: memory-tier checkpoint of step {step} is not of this run "
                        f"({self.run.id}); left as it is, not resumed",
                        MemoryTierWarning,
                        stacklevel=stacklevel,
                    )
                    continue
                state = read(path)
            except Exception as err:
                if not is_damage(err):
                    raise
                gone = ""
                with contextlib.suppress(OSError):
                    self.delete([step])
                    gone = "; removed"
                warn(
                    f"{path}: memory-tier checkpoint of step {step} is unreadable "
                    f"({type(err).__name__}: {err}){gone}; falling back to the next tier",
                    MemoryTierWarning,
                    stacklevel=stacklevel,
                )
                continue
            return info, state
        return None

    def _newest_replicated(
        self, read: Callable[[Path], T], at_least: int | None, stacklevel: int
    ) -> tuple[StepInfo, T] | None:
        """Every rank: the agreed step, gathered into each folder, then read by all.

        The first try takes every copy as it is (the read checks every byte it
        takes); a read that finds damage is tried once more with every copy checked
        first, each file taken from an intact one.
        """
        assert self.replicas is not None
        for verified in (False, True):
            step = self.replicas.resume(at_least, topology().world, verified=verified)
            if step is None:
                return None
            path = self.view.path(step)
            found, damage = self.replicas.read_together(path, partial(_with_info, read, step))
            if found is not None:
                return found
            then = (
                "falling back to the next tier"
                if verified
                else "every copy is checked and the step gathered again"
            )
            warn(
                f"{path}: memory-tier checkpoint of step {step} is unreadable ({damage}); {then}",
                MemoryTierWarning,
                stacklevel=stacklevel,
            )
        return None

    # ------------------------------------------------------------------ preemption

    def open(self, step: int) -> Path:
        """The folder's copy of ``step``, if it holds every rank's files (a folder of many
        ranks may hold only some)."""
        path = self.view.path(step)
        if self.replicas is not None and not self.replicas.complete(path):
            raise CheckpointError(f"{path}: holds only some ranks' files of step {step}")
        return path

    def copy_in(self, source: object, within: float) -> None:
        """Nothing is promoted into RAM: it is the fastest tier, and not durable."""


def _with_info(read: Callable[[Path], T], step: int, path: Path) -> tuple[StepInfo, T]:
    """``read(path)`` with the step's info, as :meth:`MemoryTier.newest` returns it."""
    return read_info(path, step), read(path)
