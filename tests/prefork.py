"""Child interpreters forked from one that has already imported torch.

A fresh ``python`` spends about 3 s of CPU importing torch (and the parts of
torch.distributed the package loads) before a test's child does anything. A test about
what a script does at its end, on a signal or as one of several ranks, and not about a
fresh interpreter's start-up or imports, starts its child here instead: ``Popen`` and
``run`` take the argv a ``subprocess`` call would (``[sys.executable, script | -c code |
-m module, *args]``), and the child has its own pid, argv, environment, working
directory, standard streams, ``sys.path`` and ``__main__``, imports the package afresh,
ends through the interpreter's whole shutdown and gives ``subprocess``'s exit status.
One server per test process (``python -m tests.prefork``) forks the children; it ends
when its test process does.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

#: What a fresh child of the suite imports anyway, before its test's code runs: torch
#: and the modules the package pulls in (not the package: its import reads the child's
#: environment).
PRELOAD = (
    "torch",
    "torch.distributed.checkpoint",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "tensordict",
    "msgpack",
    "zstandard",
)


# --- the server and its children ------------------------------------------------------


def _serve(sock: socket.socket) -> dict[str, Any]:
    """Fork a child for each request and report its pid and exit status; returns only in
    a child, with its request."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        ready = select.select([sock, wake_r], [], [])[0]
        if wake_r in ready:
            os.read(wake_r, 4096)
            with contextlib.suppress(ChildProcessError):
                while (ended := os.waitpid(-1, os.WNOHANG))[0]:
                    sock.send(f"exit {ended[0]} {os.waitstatus_to_exitcode(ended[1])}".encode())
        if sock in ready:
            msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
            if not msg:  # the test process has ended: reap what has ended, leave the rest
                with contextlib.suppress(ChildProcessError):
                    while os.waitpid(-1, os.WNOHANG)[0]:
                        pass
                os._exit(0)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wake_r, wake_w, sock.fileno()):
                    os.close(fd)
                for target, fd in enumerate(fds):
                    os.dup2(fd, target)
                for fd in fds:
                    if fd > 2:
                        os.close(fd)
                request: dict[str, Any] = json.loads(msg)
                if request["new_session"]:
                    os.setsid()
                return request
            for fd in fds:
                os.close(fd)
            sock.send(f"pid {pid}".encode())


def _become(request: dict[str, Any]) -> None:
    """Turn this fork into ``python *argv`` run in ``cwd`` with ``env``."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv: list[str] = request["argv"]
    first = {"-c": "", "-m": os.getcwd()}.get(argv[0], os.path.dirname(os.path.abspath(argv[0])))
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [first, *extra, *[p for p in sys.path[1:] if p not in extra]]
    if argv[0] == "-m":
        import runpy

        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        code = compile(argv[1], "<string>", "exec")
    else:
        sys.argv = list(argv)
        main.__file__ = argv[0]
        code = compile(Path(argv[0]).read_bytes(), argv[0], "exec")
    exec(code, main.__dict__)


# --- the test process's side ----------------------------------------------------------


class _Server:
    def __init__(self) -> None:
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.prefork", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            cwd=REPO,
            env=env,
        )
        theirs.close()
        self.lock = threading.Lock()
        self.exits: dict[int, int] = {}
        atexit.register(self.close)

    def close(self) -> None:
        """End the server (children still running go on) and reap it."""
        self.sock.close()
        self.proc.wait()

    def _read(self, timeout: float | None) -> str | None:
        """One message (``pid N`` or ``exit N CODE``), or None after ``timeout``."""
        if not select.select([self.sock], [], [], timeout)[0]:
            return None
        msg = self.sock.recv(256).decode()
        if not msg:
            raise RuntimeError(f"the prefork server ended (status {self.proc.wait()})")
        kind, pid, *code = msg.split()
        if kind == "exit":
            self.exits[int(pid)] = int(code[0])
        return msg

    def start(self, request: dict[str, Any], fds: list[int]) -> int:
        with self.lock:
            socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
            while not (msg := self._read(None) or "").startswith("pid "):
                pass
            pid = int(msg.split()[1])
            # An earlier child's, its pid given again (pids wrap): the server reported
            # that exit before this fork, and reports this child's only after its pid.
            self.exits.pop(pid, None)
            return pid

    def status(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s exit status once it ends, waiting up to ``timeout`` (None: forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self.exits:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            with self.lock:
                read = pid in self.exits or self._read(0.05 if left is None else min(left, 0.05))
            if not read and left == 0:
                return None
        return self.exits[pid]


_server: _Server | None = None


def _the_server() -> _Server:
    global _server
    if _server is None or _server.proc.poll() is not None:
        _server = _Server()
    return _server


class Popen:
    """The part of ``subprocess.Popen`` the suite uses, for a forked child."""

    def __init__(
        self,
        args: list[str],
        *,
        stdin: Any = None,
        stdout: Any = None,
        stderr: Any = None,
        text: bool = False,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        start_new_session: bool = False,
    ) -> None:
        assert args[0] == sys.executable, args
        self.args, self.text, self.returncode = args, text, None
        ours: list[int] = []  # what the child gets, closed here once it has them
        streams: list[Any] = [None, None, None]
        fds = []
        for i, how in enumerate((stdin, stdout, stderr)):
            if how == subprocess.PIPE:
                r, w = os.pipe()
                child, mine = (r, w) if i == 0 else (w, r)
                ours.append(child)
                streams[i] = os.fdopen(mine, ("w" if i == 0 else "r") + ("" if text else "b"))
                fds.append(child)
            elif how == subprocess.STDOUT:
                fds.append(fds[1])
            elif how == subprocess.DEVNULL or (i == 0 and how is None):
                ours.append(os.open(os.devnull, os.O_RDWR))
                fds.append(ours[-1])
            elif how is None:
                fds.append(i)
            else:
                fds.append(how if isinstance(how, int) else how.fileno())
        self.stdin, self.stdout, self.stderr = streams
        request = {
            "argv": args[1:],
            "env": dict(os.environ if env is None else env),
            "cwd": os.fspath(cwd or os.getcwd()),
            "new_session": start_new_session,
        }
        try:
            self.pid = _the_server().start(request, fds)
        finally:
            for fd in ours:
                os.close(fd)
        self._fds = {s: s.fileno() for s in (self.stdout, self.stderr) if s is not None}
        self._out: dict[int, list[bytes]] = {fd: [] for fd in self._fds.values()}

    def poll(self) -> int | None:
        return self.wait(0) if self.returncode is None else self.returncode

    def wait(self, timeout: float | None = None) -> int | None:
        if self.returncode is None:
            self.returncode = _the_server().status(self.pid, timeout)
            if self.returncode is None and timeout != 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout: float | None = None) -> tuple[Any, Any]:
        """Read stdout and stderr (those that are pipes) to their ends, then wait."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.stdin is not None:
            self.stdin.close()
        pipes = {fd: s for s, fd in self._fds.items() if s is not None}
        open_ = [fd for fd in pipes if not pipes[fd].closed]
        while open_:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = select.select(open_, [], [], left)[0]
            if not ready:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    self._out[fd].append(chunk)
                else:
                    open_.remove(fd)
                    pipes[fd].close()
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

        def got(stream: Any) -> Any:
            if stream is None:
                return None
            data = b"".join(self._out[self._fds[stream]])
            return data.decode().replace("\r\n", "\n") if self.text else data

        return got(self.stdout), got(self.stderr)

    def __enter__(self) -> Popen:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.returncode is None:
            self.kill()
            self.wait()


def run(
    args: list[str],
    *,
    capture_output: bool = False,
    text: bool = False,
    timeout: float | None = None,
    check: bool = False,
    **kw: Any,
) -> subprocess.CompletedProcess[Any]:
    """``subprocess.run`` for a forked child."""
    if capture_output:
        kw.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    with Popen(args, text=text, **kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    done = subprocess.CompletedProcess(args, int(proc.returncode or 0), out, err)
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    for name in PRELOAD:
        __import__(name)
    assert threading.active_count() == 1, "a fork of a process with threads is unsafe"
    _become(_serve(socket.socket(fileno=int(sys.argv[1]))))
