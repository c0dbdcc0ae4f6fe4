"""One launch of ``fckpt run``'s command and how it ended, and how that is reported.

What the supervisor learns of each attempt (when it ran, how it ended, the
checkpoint step it resumed from and reached) is a value of its own, so that the
relaunch decisions, the summary table and the time lost are computed from the
same record.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

from functional_ckpt._src.root.listing import newest_summary
from functional_ckpt.errors import CheckpointError

__all__ = [
    "Attempt",
    "Resumable",
    "duration_text",
    "exit_status",
    "outcome_text",
    "resumable",
    "step_text",
]


@dataclass(frozen=True)
class Resumable:
    """The newest committed, readable checkpoint of a root: its step and save time."""

    step: int
    time: float | None


@dataclass
class Attempt:
    """One launch of the command and how it ended."""

    number: int
    started: float
    resumed_from: Resumable | None = None
    ended: float = 0.0
    returncode: int = 0
    reached: Resumable | None = None
    stopped: bool = False  # a stop signal was passed on during this attempt
    waited: float = 0.0  # backoff after it

    @property
    def ran(self) -> float:
        return max(0.0, self.ended - self.started)

    @property
    def failed(self) -> bool:
        return self.returncode != 0

    def lost(self, root_known: bool) -> float:
        """Work to redo after this attempt plus the pause before the next one.

        With the job's steps known (a root read, or the steps the job reported), the
        work since the newest checkpoint this attempt saved (its save time; the saved
        state is the one at that moment), or all of it if it saved none; without
        them, all of a failed attempt (an upper bound).
        """
        if not self.failed:
            return self.waited
        work = self.ran
        if root_known and self.reached is not None and self.reached.time is not None:
            saved_here = self.reached != self.resumed_from and self.reached.time >= self.started
            if saved_here:
                work = max(0.0, self.ended - self.reached.time)
        return work + self.waited


def resumable(root: Path) -> Resumable | None:
    """The newest checkpoint a job resuming from ``root`` would find; None if none (yet)."""
    try:
        newest = newest_summary(root)
    except (CheckpointError, OSError):
        return None  # unreadable right now: nothing to report
    return None if newest is None else Resumable(newest.step, newest.time or None)


def exit_status(returncode: int) -> int:
    """A child's return code as a shell reports it: 128 + N for a death by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def outcome_text(returncode: int) -> str:
    if returncode >= 0:
        return f"exit {returncode}"
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


def step_text(ckpt: Resumable | None) -> str:
    return "-" if ckpt is None else str(ckpt.step)


def duration_text(t: float) -> str:
    if t < 60:
        return f"{t:.1f} s"
    if t < 3600:
        return f"{t / 60:.1f} min"
    return f"{t / 3600:.2f} h"
