"""The package's background threads, one per purpose (the staging copies excepted): the
work is ordered (checksums beside a write, fsyncs, page faults ahead of reads) and runs
without the GIL."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

__all__ = ["BackgroundThread", "wait_quietly"]


class BackgroundThread:
    """A single background thread (or ``workers`` of them), named ``name``, started on first use."""

    def __init__(self, name: str, workers: int = 1) -> None:
        self.name = name
        self.workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        os.register_at_fork(after_in_child=self._forget)

    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix=self.name)
            return self._pool

    def _forget(self) -> None:
        self._pool = None
        self._lock = threading.Lock()


def wait_quietly(fut: Future[Any]) -> None:
    """Until ``fut`` has finished, whatever interrupts the wait (its outcome dropped):
    a background job reading memory must be done before that memory's owner unwinds."""
    while True:
        try:
            wait([fut])
            return
        except BaseException:  # Ctrl-C again: still wait, then unwind
            continue
