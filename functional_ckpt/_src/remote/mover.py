"""Uploads' bytes moved by a helper process, which stands still while a save stages.

An object store's client would compete for the GIL and the cores with the loop, so the
bulk ``put`` runs in a niced child (this file, fed through a pipe) stopped while a save stages.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

#: A failure across the pipe: its classes' names, errno and text (:func:`facts_of`).
Facts = dict[str, Any]

#: The helper's CPU priority below the training process's: it takes idle cores first.
NICENESS = 10
#: Seconds the child may take to start (import fsspec and the store's client).
HELLO_TIMEOUT = 120.0
#: Seconds the child gets to exit once asked (then it is killed).
STOP_GRACE = 5.0


def facts_of(err: BaseException) -> Facts:
    """What the store's error mapping needs to know of ``err``."""
    number = getattr(err, "errno", None)
    return {
        "names": [c.__name__ for c in type(err).__mro__],
        "errno": number if isinstance(number, int) else None,
        "text": f"{type(err).__name__}: {err}",
        "message": str(err),
    }


class _MovedFailure(Exception):
    """A transfer that failed in the helper process (or the helper process itself)."""

    def __init__(self, facts: Facts) -> None:
        super().__init__(str(facts.get("message", "")))
        self.facts = facts


def reaches(fs: Any) -> bool:
    """Whether another process reaches what ``fs`` holds (and gains anything by it)."""
    if getattr(fs, "local_file", False):
        return False
    return not any(c.__name__ == "MemoryFileSystem" for c in type(fs).__mro__)


class Mover:
    """One helper process that runs ``fs.put``; ``pause``/``resume`` nest, from any thread."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None) -> None:
        """``storage_options`` None, or not round-tripping through JSON: no process."""
        self.url = url
        options = dict(storage_options or {})
        try:
            encoded = json.dumps(options)
            exact = storage_options is not None and json.loads(encoded) == options
        except (TypeError, ValueError):
            encoded, exact = "", False
        self._setup = encoded if exact else None
        self._proc: subprocess.Popen[str] | None = None
        self._broken = False  # the process could not start: no second try
        self._lock = threading.Lock()  # one request at a time
        self._state = threading.Lock()  # the process and the pause count
        self._paused = 0
        self._finalizer: weakref.finalize[Any, Mover] | None = None

    @property
    def usable(self) -> bool:
        return self._setup is not None and not self._broken

    @property
    def pid(self) -> int | None:
        """The helper process's pid while it runs."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self) -> bool:
        """Start the helper process now, whether it runs (a failed start is not retried)."""
        with self._lock:
            return self._started()

    def put(self, lpaths: Sequence[str], rpaths: Sequence[str]) -> None:
        """``fs.put(lpaths, rpaths)`` in the helper process; _MovedFailure if it failed."""
        with self._lock:
            if not self._started():
                raise _MovedFailure(_facts("the upload process could not start"))
            proc = self._proc
            assert proc is not None
            reply = _ask(proc, {"put": [list(lpaths), list(rpaths)]})
            if reply.get("ok") is True:
                return
            if "error" not in reply:  # the process is gone: the next put starts another
                self.close()
                code = proc.poll()
                raise _MovedFailure(_facts(f"the upload process exited (code {code})"))
            raise _MovedFailure(dict(reply["error"]))

    def _started(self) -> bool:
        """(Under ``_lock``.) A process started while a save holds the uploads is held too."""
        if self._proc is not None and self._proc.poll() is None:
            return True
        if not self.usable:
            return False
        assert self._setup is not None
        try:
            proc = subprocess.Popen(
                [sys.executable, "-c", _LAUNCH, os.path.abspath(__file__), str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                bufsize=1,
            )
        except OSError:
            self._broken = True
            return False
        with self._state:
            self._proc = proc
            self._finalizer = weakref.finalize(self, _stop, proc, os.getpid())
            if self._paused:
                _signal(proc, _SIGSTOP)
        hello = {"url": self.url, "options": self._setup, "path": [p for p in sys.path if p]}
        if _ask(proc, hello, patience=self._patience()).get("ready") is not True:
            self.close()
            self._broken = True
            return False
        return True

    def _patience(self) -> Callable[[float], bool]:
        """Whether to wait on for a start: ``HELLO_TIMEOUT`` seconds, not counting holds."""
        held = last = 0.0

        def more(seconds: float) -> bool:
            nonlocal held, last
            if self._paused:
                held += seconds - last
            last = seconds
            return seconds - held < HELLO_TIMEOUT

        return more

    def pause(self) -> None:
        """Stop the helper process where it is (its transfers wait) until ``resume``."""
        with self._state:
            self._paused += 1
            if self._paused == 1 and self._proc is not None:
                _signal(self._proc, _SIGSTOP)

    def resume(self) -> None:
        with self._state:
            self._paused = max(0, self._paused - 1)
            if self._paused == 0 and self._proc is not None:
                _signal(self._proc, _SIGCONT)

    def close(self) -> None:
        """End the helper process (a later ``put`` starts a new one)."""
        with self._state:
            proc, self._proc = self._proc, None
            finalizer, self._finalizer = self._finalizer, None
        if finalizer is not None:
            finalizer.detach()
        if proc is not None:
            _stop(proc, os.getpid())


#: The child's command: this file as ``__main__``, with no cwd or this file's directory
#: on ``sys.path`` (their modules would shadow the ones the child imports).
_LAUNCH = (
    "import runpy, sys; sys.path = [p for p in sys.path if p]; "
    "runpy.run_path(sys.argv[1], run_name='__main__')"
)

_SIGSTOP = getattr(signal, "SIGSTOP", None)
_SIGCONT = getattr(signal, "SIGCONT", None)


def _signal(proc: subprocess.Popen[str], sig: int | None) -> None:
    if sig is not None and proc.poll() is None:
        with contextlib.suppress(OSError):
            proc.send_signal(sig)


def _facts(message: str) -> Facts:
    return {"names": ["_MovedFailure"], "errno": None, "text": message, "message": message}


def _ask(
    proc: subprocess.Popen[str],
    request: dict[str, Any],
    patience: Callable[[float], bool] | None = None,
) -> dict[str, Any]:
    """The reply to one request; {} if the process is gone or, past ``patience``, killed."""
    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(json.dumps(request) + "\n")
        proc.stdin.flush()
        if patience is not None:
            began = time.monotonic()
            while not select.select([proc.stdout], [], [], 1.0)[0]:
                if proc.poll() is not None or not patience(time.monotonic() - began):
                    proc.kill()
                    return {}
        line = proc.stdout.readline()
    except (OSError, ValueError):
        return {}
    try:
        reply = json.loads(line) if line else {}
    except ValueError:
        return {}
    return reply if isinstance(reply, dict) else {}


def _stop(proc: subprocess.Popen[str], owner: int) -> None:
    """Let the process end (its stdin closed), else kill it; only in the process that
    started it (a fork inherits this object, not the child)."""
    if os.getpid() != owner:
        return
    _signal(proc, _SIGCONT)
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            with contextlib.suppress(OSError):
                stream.close()
    try:
        proc.wait(STOP_GRACE)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _die_with(parent: int) -> None:
    """End this process when ``parent`` ends (at once on Linux; else within a second)."""
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(0)
            threading.Event().wait(1.0)

    threading.Thread(target=watch, daemon=True).start()


def _serve(parent: int) -> None:
    """The child process: one ``fs.put`` per request line, one reply line each."""
    _die_with(parent)
    with contextlib.suppress(OSError):
        os.nice(NICENESS)
    replies: IO[str] = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever a library prints goes to stderr, not into the replies

    def reply(doc: dict[str, Any]) -> None:
        replies.write(json.dumps(doc) + "\n")
        replies.flush()

    hello = json.loads(sys.stdin.readline() or "{}")
    try:
        sys.path[:] = [str(p) for p in hello["path"]]
        import fsspec  # type: ignore[import-untyped]

        options = json.loads(hello["options"])
        fs, _ = fsspec.core.url_to_fs(hello["url"], **options)
    except Exception as e:
        reply({"error": facts_of(e)})
        return
    reply({"ready": True})
    for line in sys.stdin:
        lpaths, rpaths = json.loads(line)["put"]
        try:
            fs.put(lpaths, rpaths)
        except Exception as e:
            reply({"error": facts_of(e)})
        else:
            reply({"ok": True})


if __name__ == "__main__":
    _serve(int(sys.argv[-1]))
