"""``fckpt run``: relaunch a training command after a crash, never after success or a stop.

A supervisor, not a scheduler: it starts the command in its own process group,
waits, and on a non-zero exit or a death by signal starts it again (after a
growing pause), so the job resumes from its newest checkpoint. A SIGTERM, SIGINT
or SIGHUP sent to the supervisor is passed to the whole group (so a job with an
``on_signal`` policy saves, and ``torchrun``'s workers hear it too) and means
"stop": the command is not started again. Between attempts the supervisor learns
the job's newest committed step, from the checkpoint root (``--root``, read only)
or from the progress file a job's ``CheckpointManager`` writes after each commit
(named in ``FCKPT_PROGRESS``), to report the step each attempt resumed from and
reached, and to tell a job that makes progress (relaunched as often as asked) from
one that fails at the same place every time (stopped instead of burning every
retry). ``--config`` takes the relaunch options from a config file's ``run`` block.

This module is the supervisor's loop; what it was asked (:mod:`.run_options`),
each attempt's record (:mod:`.attempts`) and the command's process group
(:mod:`.process_group`) are modules of their own.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from functional_ckpt._src.cli.attempts import (
    Attempt,
    Resumable,
    duration_text,
    exit_status,
    outcome_text,
    resumable,
    step_text,
)
from functional_ckpt._src.cli.common import UsageError
from functional_ckpt._src.cli.process_group import StopSignals, group_alive
from functional_ckpt._src.cli.run_options import RunOptions, run_options
from functional_ckpt._src.cli.ui import PROG, UI
from functional_ckpt._src.storage.progress import PROGRESS_ENV, read_progress

__all__ = ["ATTEMPT_ENV", "QUICK_SECONDS", "cmd_run"]

#: Set in the command's environment: the attempt number, 1 for the first launch.
ATTEMPT_ENV = "FCKPT_RUN_ATTEMPT"
#: Without steps to compare, a failure this soon after launch counts as "failed the same way".
QUICK_SECONDS = 60.0
_POLL = 0.05
#: How long processes a failed command left behind get between SIGTERM and SIGKILL.
GRACE_SECONDS = 10.0


class _Supervisor:
    def __init__(self, opts: RunOptions, ui: UI, progress: Path) -> None:
        self.opts = opts
        self.ui = ui
        self.progress = progress  # where a managed job reports its newest committed step
        self.attempts: list[Attempt] = []
        self.signals = StopSignals()
        self.gave_up = ""

    def say(self, text: str) -> None:
        print(f"{PROG} run: {text}", file=self.ui.err, flush=True)

    def newest(self) -> Resumable | None:
        """The newest step a relaunch resumes from: the root's, or a newer one the job
        reported (a memory tier's commits are reported too, never written to the root)."""
        reported = read_progress(self.progress)
        told = None if reported is None else Resumable(reported.step, reported.time)
        found = None if self.opts.root is None else resumable(self.opts.root)
        if found is None or (told is not None and told.step > found.step):
            return told
        return found

    @property
    def sees_steps(self) -> bool:
        """Whether the job's steps are known: a root is read, or the job reports them."""
        return self.opts.root is not None or any(a.reached is not None for a in self.attempts)

    def launch(self, number: int) -> Attempt:
        attempt = Attempt(number, time.time(), resumed_from=self.newest())
        total = self.opts.retries + 1
        where = ""
        if self.sees_steps:
            where = (
                f", resuming from step {attempt.resumed_from.step}"
                if attempt.resumed_from
                else ", no checkpoint yet"
            )
        self.say(f"attempt {number} of {total}: {shlex.join(self.opts.command)}{where}")
        env = {**os.environ, ATTEMPT_ENV: str(number), PROGRESS_ENV: str(self.progress)}
        try:
            # A session of its own: the whole job (torchrun's workers too) is one group to
            # signal, and a terminal's Ctrl-C reaches only us, who pass it on once.
            child = subprocess.Popen(self.opts.command, env=env, start_new_session=True)
        except FileNotFoundError:
            raise UsageError(f"{self.opts.command[0]}: command not found") from None
        except PermissionError:
            raise UsageError(f"{self.opts.command[0]}: permission denied") from None
        self.signals.group = child.pid
        if self.signals.received is not None:  # a stop arrived while it was starting
            self.signals.forward(self.signals.received)
        attempt.returncode = child.wait()
        attempt.ended = time.time()
        self.clear_group(child.pid)
        self.signals.group = None
        attempt.stopped = self.signals.received is not None
        attempt.reached = self.newest()
        self.attempts.append(attempt)
        return attempt

    def clear_group(self, group: int) -> None:
        """Wait until no process of the command's group is left, so that two copies of
        the job never run at once.

        After a stop signal the stragglers (a launcher's workers still saving) are
        waited for; after a failure they get SIGTERM, ``GRACE_SECONDS``, then SIGKILL.
        """
        if not group_alive(group):
            return
        if self.signals.received is None:
            self.say(
                f"the command left processes behind: SIGTERM, then SIGKILL in {GRACE_SECONDS:.0f} s"
            )
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, signal.SIGTERM)
        deadline = time.monotonic() + GRACE_SECONDS
        while group_alive(group):
            if self.signals.received is None and time.monotonic() > deadline:
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
        while self.signals.received is None and (now := time.monotonic()) < deadline:
            time.sleep(min(_POLL, deadline - now))
        return time.monotonic() - start

    def supervise(self) -> int:
        delay = self.opts.backoff
        with self.signals.installed():
            for number in range(1, self.opts.retries + 2):
                if self.signals.received is not None:
                    name = signal.Signals(self.signals.received).name
                    self.say(f"{name} received: not relaunching")
                    break
                attempt = self.launch(number)
                outcome = outcome_text(attempt.returncode)
                steps = ""
                if self.sees_steps:
                    before, after = attempt.resumed_from, attempt.reached
                    steps = (
                        f", checkpoint step {before.step if before else 'none'} -> "
                        f"{after.step if after else 'none'}"
                    )
                done = (
                    f"attempt {number} ended: {outcome} after {duration_text(attempt.ran)}{steps}"
                )
                if attempt.stopped:
                    name = signal.Signals(self.signals.received or signal.SIGTERM).name
                    self.say(f"{done}; {name} was passed on to it: not relaunching")
                    break
                if not attempt.failed:
                    self.say(done)
                    break
                if number > self.opts.retries:
                    self.say(f"{done}; no retries left")
                    break
                self.gave_up = self.stalled()
                if self.gave_up:
                    self.say(f"{done}; stopping early: {self.gave_up}")
                    break
                if self.progressed(attempt):
                    delay = self.opts.backoff
                self.say(f"{done}; relaunching in {duration_text(delay)}")
                attempt.waited = self.pause(delay)
                delay = min(delay * 2, self.opts.max_backoff)
        self.summary()
        if not self.attempts:
            return 128 + (self.signals.received or signal.SIGINT)
        return exit_status(self.attempts[-1].returncode)

    def summary(self) -> None:
        if not self.attempts:
            return
        root_known = self.sees_steps
        head = ["ATTEMPT", "RESULT", "RAN"]
        if root_known:
            head += ["RESUMED FROM", "REACHED"]
        head.append("LOST")
        rows, styles = [], []
        for a in self.attempts:
            cells = [str(a.number), outcome_text(a.returncode), duration_text(a.ran)]
            if root_known:
                cells += [step_text(a.resumed_from), step_text(a.reached)]
            cells.append(duration_text(a.lost(root_known)))
            rows.append(cells)
            style = "ok" if not a.failed else ("warn" if a.stopped else "bad")
            styles.append([""] + [style] + [""] * (len(cells) - 2))
        err_ui = UI(out=self.ui.err, err=self.ui.err, stdin=self.ui.stdin)
        err_ui.table(head, rows, styles)
        n = len(self.attempts)
        lost = sum(a.lost(root_known) for a in self.attempts)
        relaunches = f", {n - 1} relaunch{'es' if n != 2 else ''}" if n > 1 else ""
        basis = "work since the last checkpoint" if root_known else "failed attempts"
        self.say(
            f"{n} attempt{'s' if n != 1 else ''}{relaunches}; time lost {duration_text(lost)} "
            f"({basis} and pauses); exit status {exit_status(self.attempts[-1].returncode)}"
        )


def cmd_run(args: argparse.Namespace, ui: UI) -> int:
    opts = run_options(args)
    with tempfile.TemporaryDirectory(prefix="fckpt-run-") as scratch:
        return _Supervisor(opts, ui, Path(scratch) / "progress.json").supervise()
