"""Promotion into the disk tier (``manager/tiers.promote``), and the signals that ask for it.

A preempted job gets a signal (SIGTERM) some seconds before it is killed; in those
seconds the newest checkpoint in RAM is copied to disk, durably
(:func:`~..storage.ram.copy_checkpoint`), within a bound of time, and the signal
then takes its course.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from functional_ckpt._src.format.naming import parse_step
from functional_ckpt._src.log import done as finished
from functional_ckpt._src.log import logger, warn
from functional_ckpt._src.storage import ram
from functional_ckpt.errors import MemoryTierWarning

__all__ = ["OnSignals", "promote_newest"]


def promote_newest(root: Path, paths: Sequence[Path], within: float) -> Path | None:
    """Copy the newest of the checkpoints ``paths`` (ascending) into ``root``, or the next
    if it went meanwhile; give up after ``within`` seconds. Returns the new checkpoint."""
    if not paths:
        return None
    steps = list(paths)
    dest = root / steps[-1].name
    if os.path.lexists(dest):
        return None
    failed: list[BaseException] = []
    done: list[Path] = []

    def copy() -> None:
        for path in reversed(steps):
            try:
                ram.copy_checkpoint(path, root / path.name)
                failed.clear()
                done.append(root / path.name)
                return
            except BaseException as e:
                failed.append(e)

    worker = threading.Thread(target=copy, name="fc-promote", daemon=True)
    t0 = time.perf_counter()
    worker.start()
    worker.join(within)
    if worker.is_alive() or failed or not done:
        why = f"not done within {within} s" if not failed else f"{failed[0]}"
        warn(
            f"{steps[-1].parent}: promoting {steps[-1].name} to {root} failed ({why}); the "
            "disk tier keeps its own newest checkpoint",
            MemoryTierWarning,
            stacklevel=4,
        )
        return None
    step = parse_step(done[0].name)
    finished(_LOG, "promoted", done[0], seconds=time.perf_counter() - t0, step=step)
    return done[0]


_LOG = logger("manager")


class OnSignals:
    """Run ``action`` on each of ``signums``, then let the signal do what it did before."""

    def __init__(self, signums: Sequence[int], action: Callable[[], object]) -> None:
        self.signums = tuple(signums)
        self.action = action
        self._previous: dict[int, Any] = {}  # each handled signal's handler before ours
        self._installed = False

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach the main thread only: promote() stays available
        for signum in self.signums:
            self._previous[signum] = signal.signal(signum, self._handle)
        self._installed = True

    def uninstall(self) -> None:
        if not self._installed or threading.current_thread() is not threading.main_thread():
            return
        self._installed = False  # a later handler chaining to ours now just passes it on
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handle:
                signal.signal(signum, signal.SIG_DFL if previous is None else previous)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """Act, then let the signal do what it did before (by default: end the process).

        A handler installed on top of this one (``fc.on_signal``, say) owns what the
        signal does: reached through its chain, this one acts and ends nothing.
        """
        if self._installed:
            self.action()
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN and signal.getsignal(signum) == self._handle:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
