"""The memory tier of a manager's root: checkpoints in RAM, so that a crash costs a step.

Its folder is a root of its own, written without fsync (a power loss empties it anyway),
locked, marked with its run, removed when its manager closes cleanly. Its failures never
stop training (``MemoryTierWarning``); across nodes, see :mod:`.memory_replicas`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import FrameType
from typing import Any, ClassVar, TypeVar

from functional_ckpt._src.distributed import groups
from functional_ckpt._src.distributed.topology import topology
from functional_ckpt._src.format.kind import is_committed
from functional_ckpt._src.format.naming import step_name
from functional_ckpt._src.log import warn
from functional_ckpt._src.manager import memory as mf
from functional_ckpt._src.manager.collective import coordinator_decides
from functional_ckpt._src.manager.memory_replicas import STAGING, Replicas, fail_together
from functional_ckpt._src.manager.options import AsyncSave
from functional_ckpt._src.manager.provenance import Lineage
from functional_ckpt._src.manager.writes import Writes, WriteSettings
from functional_ckpt._src.policy.base import Event, PolicyState
from functional_ckpt._src.root.delete import delete, remove_all
from functional_ckpt._src.root.leftovers import recover_leftovers
from functional_ckpt._src.root.listing import StepInfo
from functional_ckpt._src.root.lock import LOCK_FILE, WriterLock
from functional_ckpt._src.root.run import Run
from functional_ckpt._src.root.view import RootView
from functional_ckpt._src.state.tree import State
from functional_ckpt._src.storage import durable, ram
from functional_ckpt.errors import (
    CheckpointError,
    CheckpointExists,
    MemoryTierWarning,
    RankFailed,
    is_damage,
)

__all__ = ["MemoryTier"]

T = TypeVar("T")


class RunView(RootView):
    """The folder as its run sees it: only this run's checkpoints (another's is left alone)."""

    def __init__(self, folder: Path, run: Run) -> None:
        super().__init__(folder)
        self.lineage, self._said = Lineage(run, alone=True), False  # planted, not adopted
        self.mine: set[int] = set()  # committed by this tier: this run's, no manifest read
        self.damaged: set[int] = set()  # unreadable or renamed: whoever's, a save replaces it
        self.cut: list[int] = []  # this run's, off its trunk (docs/tiered.md): never resumed
        self.listed: list[int] | None = None  # held over a save's blocking part: one listing
        self.hold = False

    def steps(self) -> list[int]:
        if self.listed is not None:
            return list(self.listed)
        found = sorted(self.candidates())
        mine: list[int] = []
        others = [s for s, p in found if not is_committed(p)]
        self.damaged, self.cut = set(), []
        for step in (s for s, p in found if is_committed(p)):
            meta: Mapping[str, Any] = {}
            try:
                meta = {} if step in self.mine else self.info(step).metadata
            except (CheckpointError, OSError) as err:
                if is_damage(err):
                    self.damaged.add(step)
                    continue
            ours = step in self.mine or self.lineage.holds(meta)
            (mine if ours else self.cut if self.lineage.cut(meta) else others).append(step)
        if others and not self._said:
            self._said = True
            warn(
                f"{self.root}: steps {sorted(others)} are not checkpoints of this run "
                f"({self.lineage.run}): the memory tier leaves them as they are (a step not "
                "of this run is never resumed, built on or deleted)",
                MemoryTierWarning,
                stacklevel=6,
            )
        if self.hold:
            self.listed = list(mine)
        return mine

    def forget(self, steps: list[int]) -> None:
        super().forget(steps)
        self.mine -= set(steps)
        if self.listed is not None:
            self.listed = [s for s in self.listed if s not in steps]


class MemoryTier:
    """The folder in RAM above one manager's root (see the module docstring)."""

    def __init__(self, option: mf.Memory, root: Path, settings: WriteSettings, *, run: Run) -> None:
        topo = topology()
        if option.replicas not in (None, 1) and not topo.distributed:
            raise CheckpointError(
                f"Memory(replicas={option.replicas}): one process is one failure domain; "
                "replicas live on ranks of other nodes (torch.distributed)"
            )
        self.option, self.root, self.folder, self.run = option, root, root, run
        self.group = groups.checkpoint_group(purpose="replicate") if topo.distributed else None
        with fail_together(self.group, f"memory tier {root}"):  # one process draws another
            self.folder, self.run = mf.claim_folder(  # where another user planted the default
                option.path, root, run, retry=not topo.distributed
            )
        self.replicas = (  # every rank owns the folder there
            Replicas(self.folder, option.replicas, option.domain, lambda: self.steps())
            if topo.distributed
            else None
        )
        self.keeper = self.replicas is None or self.replicas.keeper
        self._round: threading.Thread | None = None  # a replication off the training thread
        self._step = -1  # the save in flight
        self._round_error: BaseException | None = None
        self.policy_state: PolicyState = option.save.init()
        self._said_over = False
        self._lock: WriterLock | None = None
        self.saving, self.pid = False, os.getpid()  # a signal of promote_on promotes (here)
        #: Promotion over the manager's tiers (``manager/tiers.promote``), set by the manager.
        self.promote: Callable[[float], Path | None] = lambda within: None
        self.durable, self.local = False, True
        self.committed: Callable[[], object] = lambda: None  # progress, told over all tiers
        self.view = RunView(self.folder, self.run)  # refuses a folder that is a checkpoint
        self.steps, self.infos = self.view.steps, self.view.infos
        self.writes = Writes(  # a rank's base: this run's last step its own folder holds
            self.view,
            replace(
                settings,
                async_save=AsyncSave("write") if option.async_save else None,  # one copy
                incremental=option.incremental,
                durable=False,
                parts=settings.distributed,
                group="memory",
                zstd_level=0,
            ),
            None,
        )
        with fail_together(self.group, f"memory tier {self.folder}"):
            self.budget = mf.resolve_budget(option, self.folder)
            if self.keeper:
                self._open()

    def _open(self) -> None:
        """Lock and mark the folder as this run's, recover what its crash left, handle signals."""
        try:
            self._lock = WriterLock(self.folder)
        except CheckpointError as e:
            raise CheckpointError(f"Memory(path={str(self.folder)!r}): {e}") from None
        try:
            mf.adopt(self.folder, self.root, self.run)
            recover_leftovers(self.folder, stacklevel=6)
            self._drop_cut()
            self._write_status(open_=True)
            if threading.current_thread() is threading.main_thread():  # where signals arrive
                Promotion.hold(self)
            if self.replicas is not None:
                self.replicas.clear_staging()
        except BaseException:
            self._lock.release()
            self._lock = None
            raise

    def _drop_cut(self) -> None:
        """Remove this run's checkpoints a move of its trunk made elsewhere left behind."""
        self.steps()  # which lists them in view.cut
        if cut := self.view.cut:
            remove_all(delete(self.folder, [self.view.path(s) for s in cut]))
            why = "a rollback, a delete or a resume of an older step left them"
            warn(
                f"{self.folder}: steps {cut} are off this run's trunk ({why}): removed",
                MemoryTierWarning,
                stacklevel=7,
            )

    def close(self, *, crashed: bool = False) -> None:
        """Remove the folder: its RAM is not held past the run. After a crash it stays for
        the restart, its newest step promoted first where a signal would have."""
        self.wait(stacklevel=4)
        self.writes.removed()
        Promotion.release(self)
        if crashed and self.option.promote_on:
            self.promote(self.option.promote_within)
        if self._lock is None:
            return
        try:
            if not crashed:
                own = [step_name(s) for s in [*self.steps(), *self.view.damaged]]  # no one's
                ram.remove_folder(self.folder, [*own, mf.MARK_FILE, STAGING, LOCK_FILE])
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

    def promote_now(self) -> None:
        """The save in flight given ``promote_within`` seconds to commit (with ``keep=1``
        it replaced the only step), then the newest step promoted."""
        within = self.option.promote_within
        with contextlib.suppress(TimeoutError):  # then the newest step committed before it
            if self._round is not None:
                self._round.join(within)
            elif self.writes.pending is not None:
                self.writes.pending.exception(within)
        self.promote(within)

    def _write_status(self, *, open_: bool) -> None:
        if topology().rank != 0:
            return  # one status per job: the coordinator's
        doc: dict[str, Any] = {"path": str(self.folder), "open": open_, "pid": os.getpid()}
        doc |= {"host": socket.gethostname(), "keep": self.option.held, "budget": self.budget}
        if self.replicas is not None:
            lay = self.replicas.layout
            doc |= {"replicas": lay.replicas, "domains": len(set(lay.domains))}
        with contextlib.suppress(OSError):
            data = json.dumps(doc).encode()  # the default folder's name: owner-only
            durable.replace_durably(self.root / ram.MEMORY_STATUS, data, mode=0o600)

    def decide(self, event: Event) -> bool:
        """The tier's own policy on ``event`` (a missed memory-tier save is not made up later)."""
        due, self.policy_state = self.option.save.should_save(self.policy_state, event)
        if self.replicas is not None:  # every rank saves, or none: the coordinator decides
            due, self.policy_state = coordinator_decides((due, self.policy_state))
        return bool(due)

    def save(self, state: State, step: int, metadata: Callable[[], Mapping[str, Any]]) -> None:
        """Start the checkpoint of ``step``; a signal is handled at once (in a wait or a
        collective too) but between making room and the write's start (see ``Promotion``)."""
        try:
            self._save(state, step, metadata)
        finally:
            self._started()

    def _started(self) -> None:  # signals held back handled (a replication's thread has none)
        if threading.current_thread() is threading.main_thread():
            self.saving = False
            while Promotion.deferred:
                signum, handler = Promotion.deferred.popitem()
                handler(signum, None)

    def _save(self, state: State, step: int, metadata: Callable[[], Mapping[str, Any]]) -> None:
        """The previous checkpoint collected and room made first: at most ``keep`` in the
        folder, all its retention. Until the write starts the folder is listed once (this
        run alone writes it)."""
        replicas, self.view.hold, drop = self.replicas, True, list[int]()
        try:
            self.wait(stacklevel=4)
            self._step = step
            with fail_together(self.group, f"memory-tier step {step}"):
                mf.check_budget(self.option, self.budget, self.folder, state)
                if self.keeper:
                    steps, path = self.steps(), self.view.path(step)
                    if step not in {*steps, *self.view.damaged} and os.path.lexists(path):
                        raise CheckpointExists(
                            f"{path}: not a checkpoint of this run ({self.run.id}): a memory-"
                            f"tier save of step {step} would replace it, so nothing was written"
                        )
                    older = [s for s in steps if s < step]  # and none newer: a run went back
                    kept = {step, *older[len(older) + 1 - self.option.held :]}
                    drop = [s for s in steps if s not in kept]
                    if replicas is not None:
                        replicas.clear_staging()
            path = self.view.path(step) if replicas is None else replicas.staging(step)
            meta, main = metadata(), threading.current_thread() is threading.main_thread()
            self.saving = main and bool(drop and (self.option.async_save or self.group is None))
            with contextlib.suppress(OSError):  # (the next save removes it)
                self.delete(drop)
            info = self.writes.save(path, state, meta)
        except Exception as err:
            kinds = dict(err.failures.values()) if isinstance(err, RankFailed) else {}
            if not isinstance(err, mf.OverBudget) and mf.OverBudget.__name__ not in kinds:
                self._fail(step, err, stacklevel=4)
            elif not self._said_over:  # skipped, said once
                self._said_over = True
                warn(str(err), MemoryTierWarning, stacklevel=4)
            return
        finally:
            self.view.hold, self.view.listed = False, None
        if replicas is None:
            if info is not None:
                self._prune()
            return
        pending = self.writes.pending  # phase 2 off this thread, as phase 1's write
        self._round = threading.Thread(
            target=self._replicate, args=(step, pending), name="fc-replicate", daemon=True
        )
        self._round.start()
        self._started()
        if pending is None:  # a synchronous save: its replication too
            self.wait(stacklevel=4)

    def _replicate(self, step: int, pending: Any) -> None:
        """Phase 2 (:mod:`.memory_replicas`): a ``wait()`` returns with the step in every folder."""
        assert self.replicas is not None
        try:  # fails on every rank alike, but for a keeper's commit (returned)
            self._round_error = self.replicas.replicate(step, pending)
            if self._round_error is None and self.keeper:
                self._prune()
            groups.agree(None, self.group, f"memory-tier step {step}")
        except BaseException as e:
            self._round_error = self._round_error or e

    def _prune(self) -> None:
        """After a commit: the step is this run's, progress told over all tiers (a signal
        meanwhile waits: the run's record may be written)."""
        self.view.mine.add(self._step)
        self.saving |= threading.current_thread() is threading.main_thread()
        try:
            self.committed()
        finally:
            self._started()

    def delete(self, steps: Sequence[int]) -> None:
        """Out of sight now, removed off the training thread (freeing RAM takes as long as a
        copy); only by a folder's keeper, only this run's checkpoints."""
        mine = set(self.steps()) if steps and self.keeper else set()
        steps = [s for s in steps if s in mine]
        if steps:
            trash = delete(self.folder, [self.view.path(s) for s in steps])
            self.view.forget(steps)
            (self.writes.remove if self.replicas is None else remove_all)(trash)

    def drop(self, step: int) -> None:
        """Another tier saves ``step`` again (``force=True``): this tier's copy is the older
        save, and a tie would take it."""
        if step == self._step:
            self.wait()
        self.delete([step])

    def wait_staged(self) -> None:
        with contextlib.suppress(Exception):  # a failure is reported by the next wait()
            self.writes.wait_staged()

    def wait(self, stacklevel: int = 3) -> None:
        """Collect the save in flight: retention if it committed, a warning if it failed."""
        if self._round is not None:  # a replication, which collected the write itself
            self._round.join()
            self._round = self.writes.pending = None
        error, self._round_error = self._round_error, None
        try:
            if error is None and self.writes.wait() is not None:
                self._prune()
        except Exception as err:
            error = err
        if error is not None:
            self._fail(self._step, error, stacklevel=stacklevel + 1)

    def _fail(self, step: int, err: BaseException, stacklevel: int) -> None:
        warn(
            f"{self.folder}: the memory-tier checkpoint of step {step} failed "
            f"({type(err).__name__}: {err}); training goes on, the disk tier is unaffected",
            MemoryTierWarning,
            stacklevel=stacklevel,
        )

    def newest(self, read: Callable[[Path], T], above: int | None) -> tuple[StepInfo, T] | None:
        """The newest readable checkpoint of this run newer than ``above``; a damaged one
        is reported and removed (a cache holds nothing worth keeping aside)."""
        self.wait(stacklevel=6)
        if self.replicas is not None:
            return self.replicas.newest(read, above, topology().world)
        for step in sorted((s for s in self.steps() if above is None or s > above), reverse=True):
            path = self.view.path(step)
            try:
                return self.view.info(step), read(path)
            except Exception as err:
                if not is_damage(err):
                    raise
                why = f"{type(err).__name__}: {err}"
            with contextlib.suppress(OSError):
                self.delete([step])
                why += "; removed"
            warn(
                f"{path}: memory-tier checkpoint of step {step} is unreadable ({why}); "
                "falling back to the next tier",
                MemoryTierWarning,
                stacklevel=5,
            )
        return None

    def open(self, step: int) -> Path:
        """The folder's copy of ``step``, if it holds every rank's files (not only some)."""
        path = self.view.path(step)
        if self.replicas is not None and not ram.holds_every_file(path):
            raise CheckpointError(f"{path}: holds only some ranks' files of step {step}")
        return path

    def copy_in(self, source: object, within: float) -> None:
        """Nothing is promoted into RAM: the fastest tier, and not durable."""


class Promotion:
    """The handler of a signal for every memory tier of this process: each promotes, then
    the signal takes its course once, as without them (the handler before the first, or
    the default action). One installed above (``fc.on_signal``, say) owns what the signal
    does: reached through its chain, this one ends nothing; one left in that chain by a
    closed tier serves the next (a signal promotes once). A signal after a memory save
    made room (which may remove the only step, ``keep=1``) waits for its write to start
    (then for the write, as any): a write of one process, for its commit (a write of
    many ranks runs collectives, where a dead peer would hold the signal back)."""

    tiers: ClassVar[list[MemoryTier]] = []  # this process's, open
    deferred: ClassVar[dict[int, Promotion]] = {}  # signals that came during a save

    def __init__(self, signum: int) -> None:
        self.previous = signal.signal(signum, self)

    @classmethod
    def hold(cls, tier: MemoryTier) -> None:
        """``tier``'s signals handled: one handler anywhere in a signal's chain serves all."""
        for signum in tier.option.promote_on:
            handler = signal.getsignal(signum)
            while not isinstance(handler, Promotion | None):  # down the chain: .previous
                handler = getattr(getattr(handler, "__self__", handler), "previous", None)
            if handler is None:
                cls(signum)
        cls.tiers.append(tier)

    @classmethod
    def release(cls, tier: MemoryTier) -> None:
        """``tier`` closed: with no tier left on a signal, the one before ours (on top) is back."""
        cls.tiers[:] = [t for t in cls.tiers if t is not tier]
        for signum in tier.option.promote_on:
            top = signal.getsignal(signum)
            if isinstance(top, Promotion) and not any(
                signum in t.option.promote_on for t in cls.tiers
            ):
                with contextlib.suppress(ValueError):  # not the main thread: it stays
                    signal.signal(signum, top.previous or signal.SIG_DFL)

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        tiers = [t for t in self.tiers if signum in t.option.promote_on and t.pid == os.getpid()]
        if any(t.saving for t in tiers):  # (a forked child's tiers are its parent's)
            self.deferred.setdefault(signum, self)
            return
        for tier in tiers:
            tier.promote_now()
        if callable(self.previous):
            self.previous(signum, frame)
        elif self.previous != signal.SIG_IGN and signal.getsignal(signum) is self:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
