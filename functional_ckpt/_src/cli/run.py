"""``fckpt run``: relaunch a training command after a crash, never after success or a stop.

A relaunch waits until no process of the last attempt is left: two copies must never run
at once. The newest committed step (``--root``, or the job's ``FCKPT_PROGRESS`` file) tells a
job that progresses from one that fails at the same place every time.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shlex
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from functional_ckpt._src.cli.ui import PROG, UI, UsageError, one_line
from functional_ckpt._src.codec import documents
from functional_ckpt._src.policy import config as pc
from functional_ckpt._src.policy.config import Relaunch
from functional_ckpt._src.root.listing import newest_summary
from functional_ckpt._src.root.view import check_root
from functional_ckpt._src.storage.opener import read_file
from functional_ckpt._src.storage.progress import PROGRESS_ENV, ReportedStep, read_progress
from functional_ckpt.errors import CheckpointError, ConfigError

__all__ = ["ATTEMPT_ENV", "Attempt", "Resumable", "cmd_run", "exit_status", "outcome_text"]

#: Set in the command's environment: the attempt number, 1 for the first launch.
ATTEMPT_ENV = "FCKPT_RUN_ATTEMPT"
#: Without steps to compare, a failure this soon after launch counts as "failed the same way".
QUICK_SECONDS = 60.0
_POLL = 0.05
#: How long processes a failed command left behind get between SIGTERM and SIGKILL.
GRACE_SECONDS = 10.0
#: Signals that mean "stop": passed to the command's group, then no relaunch.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_CONFIG_LIMIT = 1 << 20


def _config(path: Path, key: str | None) -> Relaunch:
    """The ``run`` block of a manager's config file (JSON, or YAML with PyYAML) under
    ``key`` (dotted). Its ``root`` is not read: the job may be given another one."""
    try:
        text = read_file(path, limit=_CONFIG_LIMIT, what="config file")
        cfg = documents.load(
            text, f"--config {path}", yaml=path.suffix.lower() in (".yaml", ".yml")
        )
    except FileNotFoundError:
        raise UsageError(f"--config {path}: no such file") from None
    except ImportError:
        raise UsageError(
            f"--config {path}: reading YAML needs PyYAML (pip install pyyaml); or give JSON"
        ) from None
    except ConfigError as exc:
        raise UsageError(one_line(exc)) from None
    except (OSError, CheckpointError) as exc:
        raise UsageError(f"--config {path}: cannot read it ({exc})") from None
    parts = key.split(".") if key else []
    for i, part in enumerate(parts):
        if not isinstance(cfg, dict) or part not in cfg:
            raise UsageError(f"--config {path}: no key {'.'.join(parts[: i + 1])!r} in it")
        cfg = cfg[part]
    try:
        run = pc.check_keys(cfg, key or "config", pc.MANAGER_KEYS, "keys").get("run")
        return (
            Relaunch() if run is None else pc.relaunch_from_config(run, pc.at_key(key or "", "run"))
        )
    except ConfigError as exc:
        raise UsageError(f"--config {path}: {exc}") from None


def run_options(args: argparse.Namespace) -> tuple[list[str], Relaunch, Path | None]:
    """The command, the relaunch options (flags over the config's ``run`` block over the
    defaults) and the root, checked once before the first launch."""
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise UsageError("no command to run; put it after '--': fckpt run -- python train.py")
    relaunch = Relaunch()
    if args.config:
        relaunch = _config(Path(args.config), args.config_key)
    elif args.config_key:
        raise UsageError("--config-key names a key of --config FILE; give --config too")
    given = {k: getattr(args, k) for k in pc.RELAUNCH_KEYS if getattr(args, k) is not None}
    opts = dataclasses.replace(relaunch, **given)
    root = Path(args.root) if args.root else None
    if root is not None:
        try:
            check_root(root)  # the manager's own: no file, no checkpoint nor a folder in one
        except CheckpointError as e:
            raise UsageError(f"--root {e}") from None
    opts = dataclasses.replace(opts, max_backoff=max(opts.max_backoff, opts.backoff))
    return list(command), opts, root


#: The newest committed, readable checkpoint (the root's, or the one the job reported):
#: its step and save time (0.0: not known).
Resumable = ReportedStep


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
        """Work to redo after this attempt plus the pause before the next one: the work
        since the newest checkpoint it saved if the steps are known, else all of it."""
        if not self.failed:
            return self.waited
        work = self.ran
        saved = self.reached if self.reached != self.resumed_from else None
        if root_known and saved is not None and saved.time >= self.started:  # by this one
            work = max(0.0, self.ended - saved.time)
        return work + self.waited


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


def duration_text(t: float) -> str:
    if t < 60:
        return f"{t:.1f} s"
    if t < 3600:
        return f"{t / 60:.1f} min"
    return f"{t / 3600:.2f} h"


def group_alive(group: int) -> bool:
    """Whether a live (not zombie) process is left in process group ``group``."""
    try:
        names = os.listdir("/proc")
    except OSError:  # no procfs: ask the kernel (zombies count there)
        try:
            os.killpg(group, 0)
        except OSError as err:  # no permission: another user's group, alive
            return not isinstance(err, ProcessLookupError)
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


class _Supervisor:
    """Runs the attempts; passes stop signals to the running command's group."""

    def __init__(self, command: list[str], opts: Relaunch, root: Path | None, ui: UI) -> None:
        self.command, self.opts, self.root, self.ui = command, opts, root, ui
        self.progress = Path()  # where a managed job reports its newest committed step
        self.attempts: list[Attempt] = []
        self.received: int | None = None  # a stop signal that came
        self.group: int | None = None  # the process group of the running command

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        self.forward(signum)

    def forward(self, signum: int) -> None:
        if self.group is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.group, signum)

    def say(self, text: str) -> None:
        print(f"{PROG} run: {text}", file=self.ui.err, flush=True)

    def newest(self) -> Resumable | None:
        """The newest step a relaunch resumes from: the root's, or a newer one the job
        reported (a memory tier's commits are reported too, never written to the root)."""
        told = read_progress(self.progress)
        try:
            newest = None if self.root is None else newest_summary(self.root)
        except (CheckpointError, OSError):
            newest = None  # unreadable right now: nothing to report
        if newest is None or (told is not None and told.step > newest.step):
            return told
        return Resumable(newest.step, newest.time or 0.0)

    @property
    def sees_steps(self) -> bool:
        """Whether the job's steps are known: a root is read, or the job reports them."""
        return self.root is not None or any(a.reached is not None for a in self.attempts)

    def launch(self, number: int) -> Attempt:
        attempt = Attempt(number, time.time(), resumed_from=self.newest())
        start, where = attempt.resumed_from, ""
        if self.sees_steps:
            where = f", resuming from step {start.step}" if start else ", no checkpoint yet"
        total = self.opts.retries + 1
        self.say(f"attempt {number} of {total}: {shlex.join(self.command)}{where}")
        env = {**os.environ, ATTEMPT_ENV: str(number), PROGRESS_ENV: str(self.progress)}
        try:
            # A session of its own: the whole job (torchrun's workers too) is one group to
            # signal, and a terminal's Ctrl-C reaches only us, who pass it on once.
            child = subprocess.Popen(self.command, env=env, start_new_session=True)
        except FileNotFoundError:
            raise UsageError(f"{self.command[0]}: command not found") from None
        except PermissionError:
            raise UsageError(f"{self.command[0]}: permission denied") from None
        self.group = child.pid
        if self.received is not None:  # a stop arrived while it was starting
            self.forward(self.received)
        attempt.returncode = child.wait()
        attempt.ended = time.time()
        self.clear_group(child.pid)
        self.group = None
        attempt.stopped = self.received is not None
        attempt.reached = self.newest()
        self.attempts.append(attempt)
        return attempt

    def clear_group(self, group: int) -> None:
        """Wait until no process of the command's group is left: after a stop signal the
        stragglers (workers still saving) are waited for; after a failure they get
        SIGTERM, ``GRACE_SECONDS``, then SIGKILL."""
        if not group_alive(group):
            return
        if self.received is None:
            self.say(
                f"the command left processes behind: SIGTERM, then SIGKILL in {GRACE_SECONDS:.0f} s"
            )
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_SECONDS
        while group_alive(group):
            if self.received is None and time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, signal.SIGKILL)
            time.sleep(_POLL)

    def stalled(self) -> str:
        """Why the last failed attempts show the job cannot get past a point; "" if not."""
        limit = self.opts.stall_limit
        if limit <= 0 or len(self.attempts) < limit:
            return ""
        last = self.attempts[-limit:]
        if not all(a.failed and not a.stopped for a in last):
            return ""
        numbers = " and ".join([", ".join(str(a.number) for a in last[:-1]), str(last[-1].number)])
        every = "both" if limit == 2 else "all"
        if self.sees_steps:
            steps = {a.reached.step if a.reached else None for a in last}
            if len(steps) != 1:
                return ""
            step = next(iter(steps))
            where = "before the first checkpoint" if step is None else f"at step {step}"
            return (
                f"attempts {numbers} {every} failed {where} (no checkpoint saved in between): "
                "the job fails at the same place every time; see its output above"
            )
        outcomes = {a.returncode for a in last}
        if len(outcomes) != 1 or any(a.ran >= QUICK_SECONDS for a in last):
            return ""
        return (
            f"attempts {numbers} {every} failed the same way ({outcome_text(last[0].returncode)}) "
            f"within {QUICK_SECONDS:.0f} s of starting: this does not look like a passing "
            "fault; see the command's output above"
        )

    def progressed(self, attempt: Attempt) -> bool:
        if self.sees_steps:
            return attempt.reached is not None and attempt.reached != attempt.resumed_from
        return attempt.ran >= QUICK_SECONDS

    def pause(self, seconds: float) -> float:
        """Sleep ``seconds`` unless a stop signal arrives; returns the time slept."""
        start = time.monotonic()
        deadline = start + seconds
        while self.received is None and (now := time.monotonic()) < deadline:
            time.sleep(min(_POLL, deadline - now))
        return time.monotonic() - start

    def supervise(self) -> int:
        delay = self.opts.backoff
        previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}
        try:
            for number in range(1, self.opts.retries + 2):
                if self.received is not None:
                    name = signal.Signals(self.received).name
                    self.say(f"{name} received: not relaunching")
                    break
                attempt = self.launch(number)
                outcome = outcome_text(attempt.returncode)
                done = f"attempt {number} ended: {outcome} after {duration_text(attempt.ran)}"
                if self.sees_steps:
                    before, after = attempt.resumed_from, attempt.reached
                    done += f", checkpoint step {before.step if before else 'none'} -> "
                    done += f"{after.step if after else 'none'}"
                if attempt.stopped:
                    name = signal.Signals(self.received or signal.SIGTERM).name
                    self.say(f"{done}; {name} was passed on to it: not relaunching")
                    break
                if not attempt.failed:
                    self.say(done)
                    break
                if number > self.opts.retries:
                    self.say(f"{done}; no retries left")
                    break
                stalled = self.stalled()
                if stalled:
                    self.say(f"{done}; stopping early: {stalled}")
                    break
                if self.progressed(attempt):
                    delay = self.opts.backoff
                self.say(f"{done}; relaunching in {duration_text(delay)}")
                attempt.waited = self.pause(delay)
                delay = min(delay * 2, self.opts.max_backoff)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        self.summary()
        if not self.attempts:
            return 128 + (self.received or signal.SIGINT)
        return exit_status(self.attempts[-1].returncode)

    def summary(self) -> None:
        if not self.attempts:
            return
        root_known = self.sees_steps
        head = ["ATTEMPT", "RESULT", "RAN", *(["RESUMED FROM", "REACHED"] * root_known), "LOST"]
        rows, styles = [], []
        for a in self.attempts:
            cells = [str(a.number), outcome_text(a.returncode), duration_text(a.ran)]
            if root_known:
                cells += ["-" if c is None else str(c.step) for c in (a.resumed_from, a.reached)]
            cells.append(duration_text(a.lost(root_known)))
            rows.append(cells)
            style = "ok" if not a.failed else ("warn" if a.stopped else "bad")
            styles.append([""] + [style] + [""] * (len(cells) - 2))
        UI(out=self.ui.err, err=self.ui.err, stdin=self.ui.stdin).table(head, rows, styles)
        n = len(self.attempts)
        lost = sum(a.lost(root_known) for a in self.attempts)
        relaunches = f", {n - 1} relaunch{'es' if n != 2 else ''}" if n > 1 else ""
        basis = "work since the last checkpoint" if root_known else "failed attempts"
        self.say(
            f"{n} attempt{'s' if n != 1 else ''}{relaunches}; time lost {duration_text(lost)} "
            f"({basis} and pauses); exit status {exit_status(self.attempts[-1].returncode)}"
        )


def cmd_run(args: argparse.Namespace, ui: UI) -> int:
    command, opts, root = run_options(args)
    supervisor = _Supervisor(command, opts, root, ui)
    with tempfile.TemporaryDirectory(prefix="fckpt-run-") as scratch:
        supervisor.progress = Path(scratch) / "progress.json"
        return supervisor.supervise()
