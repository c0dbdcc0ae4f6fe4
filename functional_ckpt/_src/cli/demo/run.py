"""The parent of ``fckpt demo``: spawn the children, watch them, compare what they did."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import functional_ckpt as fc
from functional_ckpt._src.cli.demo.job import (
    CKPT_DIR,
    CRASH_FRACTION,
    DEFAULT_STEPS,
    DEMO_MARKER,
    EVENTS,
    LOG_DIR,
    REF_DIR,
    RUN_DIR,
    DemoError,
    Job,
    Schedule,
)
from functional_ckpt._src.format import naming
from functional_ckpt._src.root.listing import kept_by, root_entries

# --------------------------------------------------------------------------- parent


@dataclass
class ChildLog:
    """What one child process did, read back from its event log."""

    returncode: int
    resumed_from: int | None = None
    restore_s: float = 0.0
    async_save: bool = False
    losses: dict[int, str] = field(default_factory=dict)
    val_losses: dict[int, str] = field(default_factory=dict)
    saves: list[int] = field(default_factory=list)
    blocked_s: float = 0.0
    loop_s: float = 0.0
    last_step: int = 0


def read_attempt(events: Sequence[Mapping[str, Any]], returncode: int) -> ChildLog:
    """Fold the events of one process into an :class:`Attempt`."""
    att = ChildLog(returncode)
    for ev in events:
        kind = ev.get("event")
        if kind == "start":
            att.resumed_from = ev.get("resumed_from")
            att.restore_s = float(ev.get("restore_s", 0.0))
            att.async_save = bool(ev.get("async_save"))
            start = float(ev["t"])
        elif kind == "step":
            step = int(ev["step"])
            att.losses[step] = str(ev["loss"])
            if "val_loss" in ev:
                att.val_losses[step] = str(ev["val_loss"])
            if ev.get("saved"):
                att.saves.append(step)
            att.blocked_s += float(ev["blocked"])
            att.last_step = step
            att.loop_s = float(ev["t"]) - start
        elif kind == "end":
            att.blocked_s += float(ev.get("close_s", 0.0))
            att.loop_s = float(ev["t"]) - start
    return att


class EventTail:
    """Reads the complete lines appended to an event log since the last call."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self.events: list[dict[str, Any]] = []

    def poll(self) -> int:
        """Read new events; return the highest step seen so far."""
        with contextlib.suppress(FileNotFoundError), open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
            end = data.rfind(b"\n") + 1
            self._offset += end
            for line in data[:end].splitlines():
                with contextlib.suppress(ValueError):
                    self.events.append(json.loads(line))
        steps = [int(e["step"]) for e in self.events if e.get("event") == "step"]
        return max(steps, default=0)


ProgressFactory = Callable[[str, int], Any]


class Heartbeat:
    """Progress as plain lines, at most one per ``every`` seconds, for output that is
    not a terminal: a CI log or ``fckpt demo > log`` shows the demo is alive and
    where it is without the redraws of a bar."""

    def __init__(
        self,
        label: str,
        total: int,
        say: Callable[[str], None],
        every: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.label, self.total, self.say, self.every, self.clock = label, total, say, every, clock
        self._last: float | None = None

    def update(self, done: int) -> None:
        now = self.clock()
        if self._last is not None and now - self._last < self.every:
            return
        self._last = now
        self.say(f"      {self.label}: step {done}/{self.total}")

    def close(self) -> None:
        """Nothing to take away: every line stays in the log."""


@dataclass
class Child:
    """A training subprocess and the tail of its event log."""

    name: str
    proc: subprocess.Popen[bytes]
    tail: EventTail
    log: Path

    def wait(self, progress: Any | None = None) -> ChildLog:
        """Wait for the process, feeding ``progress.update(step)`` while it runs."""
        while self.proc.poll() is None:
            step = self.tail.poll()
            if progress is not None:
                progress.update(step)
            time.sleep(0.1)
        step = self.tail.poll()
        if progress is not None:
            progress.update(step)
        return read_attempt(self.tail.events, self.proc.returncode)

    def failure(self) -> str:
        """The last meaningful line of the child's log, for a one-line error."""
        try:
            lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            lines = []
        last = lines[-1].strip() if lines else "no output"
        return (
            f"the {self.name} process exited with {self.proc.returncode}: {last} (log: {self.log})"
        )


def _child_env() -> dict[str, str]:
    """Single-threaded children that import this very package, installed or not."""
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    return env


def spawn(name: str, directory: Path, logs: Path, steps: int, *extra: str) -> Child:
    directory.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    events = logs / f"{name}.{EVENTS}"
    cmd = [sys.executable, "-m", "functional_ckpt._src.cli.demo", "train", str(directory)]
    cmd += ["--steps", str(steps), "--events", str(events), *extra]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_child_env())
    return Child(name, proc, EventTail(events), log)


@dataclass
class DemoResult:
    """Everything the report says, computed from the children's logs and the disk."""

    root: Path
    schedule: Schedule
    crash_at: int
    first: ChildLog
    second: ChildLog
    reference: ChildLog
    in_flight: list[str]
    kept: list[int]
    kept_by: dict[int, list[str]]
    losses_identical: bool
    replayed: int
    state_diff: list[str]
    model_tensors: int
    model_bytes: int
    wall_s: float
    plot: Path | None = None
    num_params: int = 0

    @property
    def identical(self) -> bool:
        return self.losses_identical and not self.state_diff


def prepare_root(root: Path) -> None:
    """Use an empty or earlier demo directory; never clobber anything else."""
    if root.exists() and not root.is_dir():
        raise ValueError(f"{root}: exists and is not a directory")
    if root.is_dir() and any(root.iterdir()):
        if not (root / DEMO_MARKER).is_file():
            raise ValueError(
                f"{root}: is not empty and not an earlier demo directory; pass a new --root"
            )
        for name in (RUN_DIR, REF_DIR, LOG_DIR, "loss.png"):
            target = root / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    root.mkdir(parents=True, exist_ok=True)
    (root / LOG_DIR).mkdir()
    (root / DEMO_MARKER).write_text(json.dumps({"created": time.time()}) + "\n")


def default_crash_at(steps: int) -> int:
    return max(1, min(steps - 1, round(steps * CRASH_FRACTION)))


def check_args(steps: int, crash_at: int) -> None:
    """Bad arguments are the caller's error (exit status 2), not a failed demo."""
    if steps < 2:
        raise ValueError(f"--steps {steps}: need at least 2 steps (one before and after the crash)")
    if not 1 <= crash_at < steps:
        raise ValueError(f"--crash-at {crash_at}: must be between 1 and {steps - 1} (--steps - 1)")


def run_demo(
    root: Path,
    steps: int = DEFAULT_STEPS,
    crash_at: int | None = None,
    *,
    progress: ProgressFactory | None = None,
    say: Callable[[str], None] = print,
) -> DemoResult:
    """Run the three children and compare them; see the module docstring."""
    crash = default_crash_at(steps) if crash_at is None else crash_at
    check_args(steps, crash)
    prepare_root(root)
    started = time.perf_counter()
    logs, run_dir = root / LOG_DIR, root / RUN_DIR
    children: list[Child] = []
    try:
        ref = spawn("reference", root / REF_DIR, logs, steps, "--reference")
        children.append(ref)
        first_child = spawn("run-1", run_dir, logs, steps, "--crash-at", str(crash))
        children.append(first_child)
        say(f"[1/3] training; this process SIGKILLs itself after step {crash}")
        first = _watch(first_child, f"run until SIGKILL at {crash}", crash, progress)
        if first.returncode != -signal.SIGKILL:
            raise DemoError(first_child.failure())
        in_flight = _in_flight(run_dir / CKPT_DIR)
        say(f"      killed at step {first.last_step} (exit {first.returncode}, SIGKILL)")
        second_child = spawn("run-2", run_dir, logs, steps)
        children.append(second_child)
        say("[2/3] resuming in a new process from the newest checkpoint")
        second = _watch(second_child, "resumed run", steps, progress)
        if second.returncode != 0:
            raise DemoError(second_child.failure())
        say(f"      resumed from step {second.resumed_from}, finished step {second.last_step}")
        say("[3/3] waiting for the uninterrupted reference run")
        reference = _watch(ref, "reference run", steps, progress)
        if reference.returncode != 0:
            raise DemoError(ref.failure())
    finally:
        for child in children:
            if child.proc.poll() is None:
                child.proc.kill()
                child.proc.wait()
    return _compare(
        root,
        Schedule.for_steps(steps),
        crash,
        first,
        second,
        reference,
        in_flight,
        time.perf_counter() - started,
    )


def _watch(child: Child, label: str, total: int, progress: ProgressFactory | None) -> ChildLog:
    if progress is None:
        return child.wait()
    bar = progress(label, total)
    try:
        return child.wait(bar)
    finally:
        bar.close()


def _in_flight(ckpt_dir: Path) -> list[str]:
    """Temporary directories a killed save left behind (invisible to every reader)."""
    try:
        return [e.name for e in root_entries(ckpt_dir) if naming.TMP_INFIX in e.name]
    except fc.errors.CheckpointNotFound:
        return []


# --------------------------------------------------------------------------- compare


def _compare_losses(first: ChildLog, second: ChildLog, reference: ChildLog) -> tuple[bool, int]:
    """Every loss either run process logged equals the reference's, bit for bit.

    The steps between the checkpoint resumed from and the crash were computed twice
    (before the kill and again after the resume); both copies must match.
    """
    ref = reference.losses
    logged = [*first.losses.items(), *second.losses.items()]
    same = all(ref.get(step) == loss for step, loss in logged)
    covered = set(first.losses) | set(second.losses)
    full = covered == set(ref) and set(ref) == set(range(1, len(ref) + 1))
    return same and full, len(set(first.losses) & set(second.losses))


def _compare(
    root: Path,
    schedule: Schedule,
    crash_at: int,
    first: ChildLog,
    second: ChildLog,
    reference: ChildLog,
    in_flight: list[str],
    wall_s: float,
) -> DemoResult:
    from functional_ckpt._src.restore.diff import diff_checkpoints  # reads tensors: torch

    losses_identical, replayed = _compare_losses(first, second, reference)
    mgr = fc.CheckpointManager(root / RUN_DIR / CKPT_DIR, read_only=True)
    infos = mgr.infos()
    final = mgr.path(schedule.steps)
    ref_final = root / REF_DIR / "final"
    diff = diff_checkpoints(ref_final, final)
    model = [e for e in diff.same if e.key[:1] == ("model",)]
    result = DemoResult(
        root=root,
        schedule=schedule,
        crash_at=crash_at,
        first=first,
        second=second,
        reference=reference,
        in_flight=in_flight,
        kept=[i.step for i in infos],
        kept_by=kept_by(schedule.retention_parts(), infos),
        losses_identical=losses_identical,
        replayed=replayed,
        state_diff=[str(e) for e in diff.changes],
        model_tensors=len(model),
        model_bytes=sum(e.nbytes for e in model),
        wall_s=wall_s,
        num_params=Job.param_count(),
    )
    return result


def default_root() -> Path:
    return Path(tempfile.mkdtemp(prefix="fckpt-demo-"))
