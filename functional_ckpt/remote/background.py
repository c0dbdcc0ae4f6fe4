"""Background work at a lower CPU priority, so uploads use the CPU training leaves idle.

On a machine whose cores the training loop keeps busy, an upload competes with
the loop (and with the saves it waits for) for CPU time. The threads that do an
upload's work (the upload worker, and the event loop that an asynchronous
fsspec file system such as s3fs runs its requests on) therefore lower their own
scheduling priority. Linux schedules threads individually, so a thread's nice
value is its own; elsewhere, or where the system refuses, nothing changes.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading

__all__ = ["NICENESS", "background_loop", "lower_priority"]

#: The nice increment of the threads that upload (19 is the lowest priority).
NICENESS = 10

_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def lower_priority() -> None:
    """Lower the calling thread's CPU priority by :data:`NICENESS` (best effort)."""
    if not sys.platform.startswith("linux"):
        return  # elsewhere a priority is the whole process's: never lower the training's
    try:
        tid = threading.get_native_id()
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + NICENESS))
    except (AttributeError, OSError):
        pass


def background_loop() -> asyncio.AbstractEventLoop:
    """One event loop for asynchronous file systems' uploads, on a low-priority thread.

    fsspec's own loop serves every asynchronous file system of the process,
    restores included (which the training waits for); uploads get this one.
    """
    global _loop
    with _loop_lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                lower_priority()
                asyncio.set_event_loop(loop)
                ready.set()
                loop.run_forever()

            threading.Thread(target=run, name="fc-upload-io", daemon=True).start()
            ready.wait()
            _loop = loop
        return _loop
