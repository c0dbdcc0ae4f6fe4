"""The process group ``fckpt run``'s command runs in: stop signals passed on to all
of it, and whether any of it is still alive.

The command runs in a session of its own, so a launcher's workers (``torchrun``'s)
hear a stop signal too, and a relaunch waits until none of the previous attempt's
processes is left: two copies of a job must never run at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = ["STOP_SIGNALS", "StopSignals", "group_alive"]

#: Signals that mean "stop": passed to the command's group, then no relaunch.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def group_alive(group: int) -> bool:
    """Whether a live (not zombie) process is left in process group ``group``."""
    try:
        names = os.listdir("/proc")
    except OSError:  # no procfs: ask the kernel (zombies count there)
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if len(fields) > 2 and fields[0] != b"Z" and int(fields[2]) == group:
            return True
    return False


class StopSignals:
    """Passes stop signals to the running command's group and remembers that one came."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.group: int | None = None  # the process group of the running command
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        self.forward(signum)

    def forward(self, signum: int) -> None:
        if self.group is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.group, signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopSignals]:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        try:
            yield self
        finally:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)
