"""The memory tier of a manager's root: checkpoints in RAM, so that a crash costs a step.

Its folder is a root of its own, written through the manager's own write path
(:class:`~.writes.Writes`) with durability off: the same files, manifest, checksums
and commit protocol, but no fsync, since a power loss empties the folder anyway.
It is locked like a disk root (one writer per folder), marked with the disk root
it belongs to (a folder left by another root's run is emptied, never resumed
from), holds the newest ``keep`` checkpoints, and is removed when its manager
closes. Its failures never stop training: they are reported as
:class:`~functional_ckpt.errors.MemoryWarning`, and the disk tier goes on. Under
``torch.distributed`` each node's folder also holds replicas of other nodes' parts
(:mod:`.memory_replicas`); the lowest rank of a folder keeps it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import threading
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from functional_ckpt._src.distributed import groups
from functional_ckpt._src.distributed.topology import topology
from functional_ckpt._src.format.naming import base_name, parse_step
from functional_ckpt._src.log import warn
from functional_ckpt._src.manager.collective import coordinator_decides
from functional_ckpt._src.manager.memory import Memory
from functional_ckpt._src.manager.memory_promote import OnSignals, promote_newest
from functional_ckpt._src.manager.memory_replicas import STAGING, Replicas
from functional_ckpt._src.manager.options import AsyncSave
from functional_ckpt._src.manager.writes import Writes, WriteSettings
from functional_ckpt._src.policy import Event, PolicyState
from functional_ckpt._src.root.delete import delete, remove_all
from functional_ckpt._src.root.leftovers import open_writer
from functional_ckpt._src.root.listing import StepInfo, committed_steps, read_info
from functional_ckpt._src.root.lock import LOCK_FILE, WriterLock
from functional_ckpt._src.root.view import RootView
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.state.tree import State, leaves_of
from functional_ckpt._src.storage import durable, opener, ram
from functional_ckpt.errors import CheckpointError, LeftoverWarning, MemoryWarning, is_damage

__all__ = ["MARK_FILE", "MemoryTier", "default_folder"]

T = TypeVar("T")

#: In the tier's folder: the disk root it belongs to (its path and identity).
MARK_FILE = ".memory-tier.json"


def default_folder(root: Path) -> Path:
    """One folder per root and user under ``/dev/shm``: a restarted run finds it again."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        raise CheckpointError(
            f"CheckpointManager({root}, memory=fc.manager.Memory()): this machine has no "
            "/dev/shm; give the tier a folder in RAM with Memory(path=...)"
        )
    digest = hashlib.sha256(os.fsencode(os.path.realpath(root))).hexdigest()[:16]
    return shm / f"fckpt-{os.getuid()}-{digest}"


def _identity(root: Path) -> dict[str, Any]:
    st = os.stat(root)
    return {"root": os.path.realpath(root), "dev": st.st_dev, "ino": st.st_ino}


def state_bytes(state: State) -> int:
    """The tensor bytes of ``state`` (what one checkpoint of it holds, values aside)."""
    return sum(
        leaf.value.numel() * leaf.value.element_size()
        for leaf in leaves_of(state)
        if leaf.kind == "tensor"
    )


class MemoryTier:
    """The folder in RAM above one manager's root (see the module docstring)."""

    def __init__(
        self, option: Memory, root: Path, settings: WriteSettings, *, writer: bool
    ) -> None:
        self.option = option
        self.root = root
        self.folder = Path(option.path) if option.path is not None else default_folder(root)
        topo = topology()
        self.replicas: Replicas | None = None
        if topo.distributed:
            self.replicas = Replicas.open(self.folder, option.replicas, option.domain)
        elif option.replicas not in (None, 1):
            raise CheckpointError(
                f"Memory(replicas={option.replicas}): one process is one failure domain; "
                "replicas live on ranks of other nodes (torch.distributed)"
            )
        self.writer = writer
        self.keeper = self.replicas is None or self.replicas.keeper
        self._round: threading.Thread | None = None  # a replication off the training thread
        self._round_step = -1
        self._round_error: BaseException | None = None
        self.policy_state: PolicyState = option.save.init()
        self.budget = 0
        self._checked = False
        self._lock: WriterLock | None = None
        self._signals = OnSignals(option.promote_on, lambda: self.promote(option.promote_within))
        self._check_apart()
        self.view = RootView(self.folder)  # refuses a folder that is itself a checkpoint
        error: BaseException | None = None
        try:
            if writer and self.keeper:
                self._open()
                if self.replicas is not None:
                    self.replicas.clear_staging()
            elif self.replicas is not None:
                self.budget = self._resolve_budget()
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
        return f"MemoryTier({str(self.folder)!r}, keep={self.option.keep})"

    def _check_apart(self) -> None:
        """The folder and the disk root must not hold one another (retention of one
        would delete the other's checkpoints)."""
        a, b = os.path.realpath(self.folder), os.path.realpath(self.root)
        if a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep):
            raise CheckpointError(
                f"Memory(path={str(self.folder)!r}): the disk root {self.root} and the memory "
                "tier's folder must be apart (neither inside the other)"
            )

    # ------------------------------------------------------------------ open and close

    def _open(self) -> None:
        """Lock the folder, drop what is not this root's, check the budget, handle signals."""
        try:
            self._lock = open_writer(self.folder, stacklevel=6)
        except CheckpointError as e:
            raise CheckpointError(f"Memory(path={str(self.folder)!r}): {e}") from None
        try:
            self._adopt_folder()
            self.budget = self._resolve_budget()
            self._write_status(open_=True)
            self._signals.install()
        except BaseException:
            self._lock.release()
            self._lock = None
            raise

    def _adopt_folder(self) -> None:
        mark = self.folder / MARK_FILE
        mine = _identity(self.root)
        theirs = opener.read_state(mark, "memory tier mark")
        stale = committed_steps(self.folder)
        if theirs != mine and stale:
            warn(
                f"{self.folder}: {len(stale)} memory-tier checkpoint(s) of another root "
                f"({theirs.get('root', 'unknown') if isinstance(theirs, dict) else 'unknown'}) "
                f"removed; this folder now holds the memory tier of {self.root}",
                LeftoverWarning,
                stacklevel=7,
            )
            remove_all(delete(self.folder, list(stale.values())))
        if theirs != mine:
            durable.replace_durably(mark, json.dumps(mine).encode(), sync=False)

    def _resolve_budget(self) -> int:
        held = ram.held_bytes(self.folder)  # a crashed run's checkpoints: pruned at the next save
        room = ram.available_bytes(self.folder) + held
        budget = self.option.budget
        if isinstance(budget, float):
            return int(room * budget)
        if budget > room:
            raise CheckpointError(
                f"Memory(budget={budget}): {self.folder} can take at most {room} bytes now "
                "(free space there, capped by the memory available); lower the budget or "
                "give the tier a larger folder with Memory(path=...)"
            )
        return budget

    def check_budget(self, state: State) -> None:
        """Refuse, before anything is written, a state whose ``keep`` checkpoints do not fit."""
        if self._checked:
            return
        need = self.option.keep * state_bytes(state)
        if need > self.budget:
            raise CheckpointError(
                f"Memory(budget={self.option.budget!r}): {self.option.keep} checkpoint(s) of "
                f"this state need {need} bytes in {self.folder}, more than the budget of "
                f"{self.budget} bytes; raise budget=, lower keep= (1 holds one checkpoint), "
                "or leave the memory tier out"
            )
        self._checked = True

    def close(self) -> None:
        """Wait for the save in flight, then remove the folder: its RAM is not held past the run."""
        self.wait(stacklevel=4)
        self.writes.join_removals()
        self._signals.uninstall()
        if self._lock is None:
            return
        try:
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
                MemoryWarning,
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
            "keep": self.option.keep,
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
        self.check_budget(state)
        if self.replicas is not None:
            self._save_replicated(state, step, metadata)
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
        error: BaseException | None = None
        try:
            if self.keeper:
                self._make_room(step)
                replicas.clear_staging()
        except Exception as e:
            error = e
        try:
            groups.agree(error, replicas.group, f"memory-tier step {step}")
            self.writes.save(replicas.staging(step), state, metadata())
        except Exception as err:
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
        kept = older[-(self.option.keep - 1) :] if self.option.keep > 1 else []
        self._delete(newer + [s for s in older if s not in kept])

    def _prune(self) -> None:
        steps = self.steps()
        self._delete(steps[: -self.option.keep])

    def _delete(self, steps: list[int]) -> None:
        """Out of sight now; the files (freeing their RAM takes as long as a copy of
        them) are removed off the training thread, and the next save's write waits."""
        if steps:
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
            MemoryWarning,
            stacklevel=stacklevel,
        )

    def drop_newer(self, step: int) -> None:
        """A rollback to ``step``: the tier's newer checkpoints are no longer the run's."""
        self.wait()
        if self.keeper:
            self._delete([s for s in self.steps() if s > step])

    def drop(self, step: int) -> None:
        """The manager deleted ``step``: its copy here goes too."""
        self.wait()
        if self.keeper:
            self._delete([s for s in self.steps() if s == step])

    # ------------------------------------------------------------------ restoring

    def newest(
        self, read: Callable[[Path], T], at_least: int | None, stacklevel: int
    ) -> tuple[StepInfo, T] | None:
        """The newest readable checkpoint of the tier not older than ``at_least``.

        A damaged one is reported as a :class:`MemoryWarning` and removed by a writer
        (a cache holds nothing worth keeping aside); the previous one is tried.
        """
        self.wait(stacklevel=stacklevel + 1)
        if self.replicas is not None:
            return self._newest_replicated(read, at_least, stacklevel + 1)
        for step in sorted(self.steps(), reverse=True):
            if at_least is not None and step < at_least:
                break
            path = self.view.path(step)
            try:
                info = read_info(path, step)
                state = read(path)
            except Exception as err:
                if not is_damage(err):
                    raise
                gone = ""
                if self.writer:
                    with contextlib.suppress(OSError):
                        self._delete([step])
                        gone = "; removed"
                warn(
                    f"{path}: memory-tier checkpoint of step {step} is unreadable "
                    f"({type(err).__name__}: {err}){gone}; falling back to the next tier",
                    MemoryWarning,
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
                MemoryWarning,
                stacklevel=stacklevel,
            )
        return None

    # ------------------------------------------------------------------ preemption

    def promote(self, within: float) -> Path | None:
        """Copy the newest checkpoint of the tier to the disk root, unless the disk already
        holds a step as new; gives up after ``within`` seconds. Returns the new checkpoint."""
        if self.replicas is not None and topology().rank != 0:
            return None  # one copy to the disk tier per job: the coordinator's
        disk = max(committed_steps(self.root), default=-1)
        steps = [s for s in self.steps() if s > disk]
        if self.replicas is not None:  # a folder may hold only some ranks' files
            steps = [s for s in steps if self.replicas.complete(self.view.path(s))]
        return promote_newest(self.folder, self.root, [self.view.path(s) for s in steps], within)


def _with_info(read: Callable[[Path], T], step: int, path: Path) -> tuple[StepInfo, T]:
    """``read(path)`` with the step's info, as :meth:`MemoryTier.newest` returns it."""
    return read_info(path, step), read(path)
