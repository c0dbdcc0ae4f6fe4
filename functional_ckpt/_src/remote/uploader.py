"""Uploads off the training thread: one worker, retries with backoff, a status file.

A failed upload never raises on the training thread: it is a ``RemoteWarning`` at the
next manager call, and in ``root/.remote.json`` for ``fckpt ls``.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from functional_ckpt._src.storage import durable, opener
from functional_ckpt.errors import (
    CheckpointError,
    RemoteAccessDenied,
    RemoteBucketMissing,
    RemoteError,
    UploadFailed,
)

T = TypeVar("T")

#: Attempts of each step of an upload (listing, objects, marker) before it counts as failed.
RETRIES = 5
#: Seconds before the first retry; doubled for each next one, at most ``MAX_BACKOFF``.
BACKOFF = 0.5
MAX_BACKOFF = 30.0
#: The local root's record of the remote tier: its URL, uploads running and failed.
STATUS_FILE = ".remote.json"


def retried(fn: Callable[[], T]) -> T:
    """``fn()``, retried with backoff unless credentials or the bucket are at fault."""
    delay = BACKOFF
    for _ in range(RETRIES - 1):
        try:
            return fn()
        except (RemoteAccessDenied, RemoteBucketMissing):
            raise
        except RemoteError:
            time.sleep(delay)
            delay = min(delay * 2, MAX_BACKOFF)
    return fn()  # the last attempt: its failure is the caller's


class Worker:
    """One daemon thread running ``round()`` for the requests made before it
    (``coalesce=False``: one per request, for ranks' collectives to line up)."""

    def __init__(self, round_: Callable[[], None], *, coalesce: bool = True) -> None:
        self._round = round_
        self._coalesce = coalesce
        self._lock = threading.Condition()
        self._asked = self._done = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="fc-upload", daemon=True)
        self._thread.start()

    def request(self) -> None:
        with self._lock:
            self._asked += 1
            self._lock.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every round asked for so far has run; False on timeout."""
        with self._lock:
            return self._lock.wait_for(lambda: self._done >= self._asked, timeout)

    def stop(self) -> None:
        """Run the rounds asked for, then end the thread."""
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        self._thread.join()

    def _run(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: self._done < self._asked or self._stopping)
                if self._done >= self._asked:
                    return  # stopping, nothing asked for
                served = self._asked if self._coalesce else self._done + 1
            try:
                with contextlib.suppress(BaseException):  # the round records its own failures
                    self._round()
            finally:
                with self._lock:
                    self._done = served
                    self._lock.notify_all()


def write_status(root: Path, doc: dict[str, Any]) -> None:
    """Replace ``root/.remote.json`` durably (best effort: it is only a report)."""
    with contextlib.suppress(OSError):
        durable.replace_durably(
            root / STATUS_FILE, json.dumps(doc, indent=1, sort_keys=True).encode()
        )


def read_status(root: Path) -> dict[str, Any]:
    """What the last writer recorded about the remote tier of ``root``; {} if nothing."""
    doc = opener.read_state(root / STATUS_FILE, "remote status file")
    return doc if isinstance(doc, dict) else {}  # missing, special, oversized, garbled


def failure(step: int, err: BaseException, url: str) -> CheckpointError:
    """The :class:`UploadFailed` reported for ``step`` (``err`` is its cause)."""
    failed = UploadFailed(
        f"{url}: upload of step {step} failed ({type(err).__name__}: {err}); the local "
        "checkpoint is intact and kept until an upload succeeds (retried after the next save)"
    )
    failed.__cause__ = err
    return failed
