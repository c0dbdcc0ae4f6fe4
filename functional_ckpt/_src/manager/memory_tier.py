"""The memory tier of a manager's root: checkpoints in RAM, so that a crash costs a step.

Its folder is a root of its own, written through the manager's own write path
(:class:`~.writes.Writes`) with durability off: the same files, manifest, checksums
and commit protocol, but no fsync, since a power loss empties the folder anyway.
It is locked like a disk root (one writer per folder), marked with the disk root
it belongs to (a folder left by another root's run is emptied, never resumed
from), holds the newest ``keep`` checkpoints, and is removed when its manager
closes. Its failures never stop training: they are reported as
:class:`~functional_ckpt.errors.MemoryWarning`, and the disk tier goes on.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import socket
import threading
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from functional_ckpt._src.distributed.topology import topology
from functional_ckpt._src.format.naming import base_name, parse_step, step_name
from functional_ckpt._src.manager.memory import Memory
from functional_ckpt._src.manager.options import AsyncSave
from functional_ckpt._src.manager.writes import Writes, WriteSettings
from functional_ckpt._src.policy import Event, PolicyState
from functional_ckpt._src.root.delete import delete, remove_all
from functional_ckpt._src.root.leftovers import open_writer
from functional_ckpt._src.root.listing import StepInfo, committed_steps, read_info
from functional_ckpt._src.root.lock import LOCK_FILE, WriterLock
from functional_ckpt._src.root.view import RootView
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.state.tree import State, as_state, iter_leaves
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
        for leaf in iter_leaves(as_state(state))
        if leaf.kind == "tensor"
    )


class MemoryTier:
    """The folder in RAM above one manager's root (see the module docstring)."""

    def __init__(
        self, option: Memory, root: Path, settings: WriteSettings, *, writer: bool
    ) -> None:
        if topology().world > 1:
            raise CheckpointError(
                f"CheckpointManager({root}, memory=...): the memory tier runs in one process "
                "only for now (not under torch.distributed); leave memory=None there"
            )
        self.option = option
        self.root = root
        self.folder = Path(option.path) if option.path is not None else default_folder(root)
        self.writer = writer
        self.policy_state: PolicyState = option.save.init()
        self.budget = 0
        self._checked = False
        self._lock: WriterLock | None = None
        self._previous: dict[int, Any] = {}  # each handled signal's handler before ours
        self._installed = False
        self._check_apart()
        self.view = RootView(self.folder)  # refuses a folder that is itself a checkpoint
        if writer:
            self._open()
        self.writes = Writes(
            self.view,
            WriteSettings(
                settings.per_rank,
                AsyncSave() if option.async_save else None,
                option.incremental,
                distributed=False,
                coordinator=True,
                durable=False,
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
            self._install()
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
            warnings.warn(
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
        self._uninstall()
        if self._lock is None:
            return
        try:
            own = [
                e.name
                for e in os.scandir(self.folder)
                if parse_step(base_name(e.name)) is not None or e.name == MARK_FILE
            ]
            ram.remove_folder(self.folder, [*sorted(own), LOCK_FILE])
            self._write_status(open_=False)
        except OSError as e:
            warnings.warn(
                f"{self.folder}: the memory tier could not be removed ({e})",
                MemoryWarning,
                stacklevel=4,
            )
        finally:
            self._lock.release()
            self._lock = None

    def _write_status(self, *, open_: bool) -> None:
        doc = {
            "path": str(self.folder),
            "open": open_,
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "keep": self.option.keep,
            "budget": self.budget,
        }
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
        self.policy_state = policy.update(self.policy_state, event, due)
        return due

    def save(self, state: State, step: int, metadata: Callable[[], Mapping[str, Any]]) -> None:
        """Start the checkpoint of ``step`` (off the training thread by default).

        The previous one is collected first and retention makes room, so the folder
        never holds more than ``keep`` checkpoints (counting the one being written).
        """
        self.wait(stacklevel=4)
        self.check_budget(state)
        try:
            self._make_room(step)
            info = self.writes.save(self.view.path(step), state, metadata())
        except Exception as err:
            self._fail(step, err, stacklevel=4)
            return
        if info is not None:
            self._prune()

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
        if steps:
            remove_all(delete(self.folder, [self.view.path(s) for s in steps]))
            self.view.forget(steps)

    def wait_staged(self) -> None:
        with contextlib.suppress(Exception):  # a failure is reported by the next wait()
            self.writes.wait_staged()

    def wait(self, stacklevel: int = 3) -> None:
        """Collect the save in flight: retention if it committed, a warning if it failed."""
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
        warnings.warn(
            f"{self.folder}: the memory-tier checkpoint of step {step} failed "
            f"({type(err).__name__}: {err}); training goes on, the disk tier is unaffected",
            MemoryWarning,
            stacklevel=stacklevel,
        )

    def drop_newer(self, step: int) -> None:
        """A rollback to ``step``: the tier's newer checkpoints are no longer the run's."""
        self.wait()
        self._delete([s for s in self.steps() if s > step])

    def drop(self, step: int) -> None:
        """The manager deleted ``step``: its copy here goes too."""
        self.wait()
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
                warnings.warn(
                    f"{path}: memory-tier checkpoint of step {step} is unreadable "
                    f"({type(err).__name__}: {err}){gone}; falling back to the next tier",
                    MemoryWarning,
                    stacklevel=stacklevel,
                )
                continue
            return info, state
        return None

    # ------------------------------------------------------------------ preemption

    def promote(self, within: float) -> Path | None:
        """Copy the newest checkpoint of the tier to the disk root, unless the disk already
        holds a step as new; gives up after ``within`` seconds. Returns the new checkpoint."""
        disk = max(committed_steps(self.root), default=-1)
        steps = [s for s in self.steps() if s > disk]
        if not steps:
            return None
        step = steps[-1]
        dest = self.root / step_name(step)
        if os.path.lexists(dest):
            return None
        failed: list[BaseException] = []

        def copy() -> None:
            nonlocal step, dest
            for step in reversed(steps):  # the newest, or the next if it went meanwhile
                dest = self.root / step_name(step)
                try:
                    ram.copy_checkpoint(self.view.path(step), dest)
                    failed.clear()
                    return
                except BaseException as e:
                    failed.append(e)

        worker = threading.Thread(target=copy, name="fc-promote", daemon=True)
        worker.start()
        worker.join(within)
        if worker.is_alive() or failed:
            why = f"not done within {within} s" if not failed else f"{failed[0]}"
            warnings.warn(
                f"{self.folder}: promoting step {step} to {self.root} failed ({why}); the "
                "disk tier keeps its own newest checkpoint",
                MemoryWarning,
                stacklevel=2,
            )
            return None
        return dest

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only: promote() stays available
        for signum in self.option.promote_on:
            self._previous[signum] = signal.signal(signum, self._handle)
        self._installed = True

    def _uninstall(self) -> None:
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._installed = False  # a later handler chaining to ours now just passes it on
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, signal.SIG_DFL if previous is None else previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """Promote, then let the signal do what it did before (by default: end the process).

        A handler installed on top of this one (``fc.on_signal``, say) owns what the
        signal does: reached through its chain, this one promotes and ends nothing.
        """
        if self._installed:
            self.promote(self.option.promote_within)
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN and signal.getsignal(signum) == self._handle:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
