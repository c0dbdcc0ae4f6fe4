"""How long a test waits for what should happen: a guard against hangs, never a speed limit.

Tests pass on a slow or loaded machine: a subprocess, a child or a condition gets
``HANG`` seconds before it is taken for hung (minutes longer than it ever needs),
and the wait ends as soon as what it waits for happens. Speed is measured by the
scripts in ``benchmarks/``, never here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

#: Seconds after which a subprocess or a waited-for condition is taken for hung.
HANG = 1800.0


def eventually(
    condition: Callable[[], object],
    what: str,
    *,
    alive: Callable[[], bool] = lambda: True,
    poll: float = 0.01,
) -> None:
    """Wait until ``condition()`` holds; fail if ``alive()`` turns false first (what was
    to make it hold died) or after :data:`HANG` seconds (it hung)."""
    deadline = time.monotonic() + HANG
    while not condition():
        assert alive(), f"{what}: what it waited for died first"
        assert time.monotonic() < deadline, f"{what}: still not so after {HANG:.0f} s (hung?)"
        time.sleep(poll)


def finished(proc: Any) -> int:
    """The exit code of a ``multiprocessing`` child, once it ends; killed and failed if
    it runs :data:`HANG` seconds."""
    proc.join(HANG)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise AssertionError("the job hung")
    code: int = proc.exitcode
    return code
