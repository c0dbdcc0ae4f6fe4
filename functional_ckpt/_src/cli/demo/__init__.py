"""``fckpt demo``: spawn the training children (:mod:`.job`), watch them, compare, report
(loaded only by the command; the library never imports it)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
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
from functional_ckpt._src.cli.demo import job
from functional_ckpt._src.cli.demo.job import DemoError, Job, Schedule
from functional_ckpt._src.cli.parser import DEFAULT_STEPS
from functional_ckpt._src.cli.ui import UI, one_line
from functional_ckpt._src.format import naming
from functional_ckpt._src.policy.retention import union_parts
from functional_ckpt._src.root.listing import kept_by, root_entries

__all__ = ["DEFAULT_STEPS", "DemoError", "Schedule", "cmd_demo", "run_demo"]

SPARKS = "▁▂▃▄▅▆▇█"
ASCII_SPARKS = "_.-=+*#@"


@dataclass
class ChildLog:
    """What one child process did, read back from its event log."""

    returncode: int
    resumed_from: int | None = None
    restore_s: float = 0.0
    async_save: bool = False
    losses: dict[int, str] = field(default_factory=dict)
    saves: list[int] = field(default_factory=list)
    blocked_s: float = 0.0
    loop_s: float = 0.0
    last_step: int = 0


def read_attempt(events: Sequence[Mapping[str, Any]], returncode: int) -> ChildLog:
    att = ChildLog(returncode)
    for ev in events:
        kind = ev.get("event")
        if kind == "start":
            att.resumed_from = ev.get("resumed_from")
            att.restore_s = float(ev.get("restore_s", 0.0))
            att.async_save = bool(ev.get("async_save"))
            start = float(ev["t"])
        elif kind == "step":
            step = att.last_step = int(ev["step"])
            att.losses[step] = str(ev["loss"])
            if ev.get("saved"):
                att.saves.append(step)
            att.blocked_s += float(ev["blocked"])
            att.loop_s = float(ev["t"]) - start
        elif kind == "end":
            att.blocked_s += float(ev.get("close_s", 0.0))
            att.loop_s = float(ev["t"]) - start
    return att


class EventTail:
    """Reads the complete lines appended to an event log since the last call."""

    def __init__(self, path: Path) -> None:
        self.path, self._offset = path, 0
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
        return max((int(e["step"]) for e in self.events if e.get("event") == "step"), default=0)


@dataclass
class Heartbeat:
    """Progress as a plain line at most every ``every`` seconds where no bar is drawn
    (a CI log shows the demo is alive)."""

    label: str
    total: int
    say: Callable[[str], None]
    every: float = 5.0
    clock: Callable[[], float] = time.monotonic
    _last: float | None = field(default=None, init=False)  # when it last said a line

    def update(self, done: int) -> None:
        now = self.clock()
        if self._last is None or now - self._last >= self.every:
            self._last = now
            self.say(f"      {self.label}: step {done}/{self.total}")

    def close(self) -> None:
        """Nothing to take away: every line stays in the log."""


class Child:
    """A training subprocess of this very package (installed or not) and its event log."""

    def __init__(self, name: str, directory: Path, logs: Path, steps: int, *extra: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.name, self.log = name, logs / f"{name}.log"
        self.tail = EventTail(logs / f"{name}.{job.EVENTS}")
        cmd = [sys.executable, "-c", job.CHILD, str(directory)]
        cmd += ["--steps", str(steps), "--events", str(self.tail.path), *extra]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        here = str(Path(__file__).resolve().parents[3])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def finish(self, bar: Any, status: int = 0) -> ChildLog:
        """Wait, feeding ``bar.update(step)``; a status other than ``status`` is a
        :class:`DemoError` quoting the last line of the child's log."""
        try:
            while self.proc.poll() is None:
                bar.update(self.tail.poll())
                time.sleep(0.1)
            bar.update(self.tail.poll())
        finally:
            bar.close()
        if self.proc.returncode == status:
            return read_attempt(self.tail.events, self.proc.returncode)
        try:
            lines = [ln.strip() for ln in self.log.read_text(errors="replace").splitlines()]
        except OSError:
            lines = []
        last = next((ln for ln in reversed(lines) if ln), "no output")
        raise DemoError(
            f"the {self.name} process exited with {self.proc.returncode}: {last} (log: {self.log})"
        )


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
    kept_by: dict[int, list[str]]  # every checkpoint kept, and what keeps it
    losses_identical: bool
    replayed: int
    state_diff: list[str]
    model_tensors: int
    model_bytes: int
    wall_s: float
    plot: Path | None = None

    @property
    def identical(self) -> bool:
        return self.losses_identical and not self.state_diff


def prepare_root(root: Path) -> None:
    """Use an empty or earlier demo directory; never clobber anything else."""
    if root.exists() and not root.is_dir():
        raise ValueError(f"{root}: exists and is not a directory")
    if root.is_dir() and any(root.iterdir()):
        if not (root / job.DEMO_MARKER).is_file():
            raise ValueError(
                f"{root}: is not empty and not an earlier demo directory; pass a new --root"
            )
        for name in (job.RUN_DIR, job.REF_DIR, job.LOG_DIR, "loss.png"):
            target = root / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()
    root.mkdir(parents=True, exist_ok=True)
    (root / job.LOG_DIR).mkdir()
    (root / job.DEMO_MARKER).write_text(json.dumps({"created": time.time()}) + "\n")


def crash_step(steps: int, crash_at: int | None) -> int:
    """The step after which the first run is killed; bad arguments: ValueError, status 2."""
    default = max(1, min(steps - 1, round(steps * job.CRASH_FRACTION)))
    crash = default if crash_at is None else crash_at
    if steps < 2:
        raise ValueError(f"--steps {steps}: need at least 2 steps (one before and after the crash)")
    if not 1 <= crash < steps:
        raise ValueError(f"--crash-at {crash}: must be between 1 and {steps - 1} (--steps - 1)")
    return crash


def run_demo(
    root: Path,
    steps: int,
    crash: int,
    *,
    progress: Callable[[str, int], Any],
    say: Callable[[str], None] = print,
) -> DemoResult:
    """Run the three children and compare them (``crash``: a :func:`crash_step`)."""
    from functional_ckpt._src.restore.diff import diff_checkpoints  # reads tensors: torch

    prepare_root(root)
    started = time.perf_counter()
    logs, run_dir = root / job.LOG_DIR, root / job.RUN_DIR
    children: list[Child] = []
    try:
        children.append(ref := Child("reference", root / job.REF_DIR, logs, steps, "--reference"))
        children.append(child := Child("run-1", run_dir, logs, steps, "--crash-at", str(crash)))
        say(f"[1/3] training; this process SIGKILLs itself after step {crash}")
        bar = progress(f"run until SIGKILL at {crash}", crash)
        first = child.finish(bar, -signal.SIGKILL)
        in_flight = _in_flight(run_dir / job.CKPT_DIR)
        say(f"      killed at step {first.last_step} (exit {first.returncode}, SIGKILL)")
        children.append(child := Child("run-2", run_dir, logs, steps))
        say("[2/3] resuming in a new process from the newest checkpoint")
        second = child.finish(progress("resumed run", steps))
        say(f"      resumed from step {second.resumed_from}, finished step {second.last_step}")
        say("[3/3] waiting for the uninterrupted reference run")
        reference = ref.finish(progress("reference run", steps))
    finally:
        for c in children:
            if c.proc.poll() is None:
                c.proc.kill()
                c.proc.wait()
    wall_s = time.perf_counter() - started
    # Every loss either run logged equals the reference's, bit for bit (the steps between
    # the checkpoint resumed from and the crash were computed twice: both copies count).
    want = reference.losses
    same = all(want.get(s) == v for s, v in [*first.losses.items(), *second.losses.items()])
    full = set(first.losses) | set(second.losses) == set(want) == set(range(1, len(want) + 1))
    schedule = Schedule.for_steps(steps)
    mgr = fc.CheckpointManager(run_dir / job.CKPT_DIR, read_only=True)
    infos = mgr.infos()
    diff = diff_checkpoints(root / job.REF_DIR / "final", mgr.path(steps))
    model = [e for e in diff.same if e.key[:1] == ("model",)]
    parts = [(repr(part), part) for part in union_parts(schedule.retention())]
    head = (root, schedule, crash, first, second, reference, in_flight, kept_by(parts, infos))
    replayed, diffs = len(set(first.losses) & set(second.losses)), [str(e) for e in diff.changes]
    tail = (len(model), sum(e.nbytes for e in model), wall_s)
    return DemoResult(*head, same and full, replayed, diffs, *tail)


def _in_flight(ckpt_dir: Path) -> list[str]:
    """Temporary directories a killed save left behind (invisible to every reader)."""
    try:
        return [e.name for e in root_entries(ckpt_dir) if naming.TMP_INFIX in e.name]
    except fc.errors.CheckpointNotFound:
        return []


def _run_losses(result: DemoResult) -> list[float]:
    """The curve the crashed-and-resumed run produced: first process, then the second."""
    resumed = result.second.resumed_from or 0
    merged = {s: v for s, v in result.first.losses.items() if s <= resumed}
    merged.update(result.second.losses)
    return [float.fromhex(merged[s]) for s in sorted(merged)]


def sparkline(
    values: Sequence[float], width: int, marks: Mapping[int, str], ascii_only: bool
) -> str:
    """Mean value per column on an 8-level (log) scale, and a second line with ``marks``
    (1-based step -> a character placed under the column holding that step)."""
    if not values:
        return ""
    levels = ASCII_SPARKS if ascii_only else SPARKS
    width = max(1, min(width, len(values)))
    cols = [values[i * len(values) // width : (i + 1) * len(values) // width] for i in range(width)]
    means = [sum(c) / len(c) for c in cols if c]
    if min(means) > 0:  # losses span decades: a log scale keeps the tail visible
        means = [math.log(m) for m in means]
    lo, hi = min(means), max(means)
    span = hi - lo or 1.0
    line = "".join(levels[min(len(levels) - 1, int((m - lo) / span * len(levels)))] for m in means)
    under = [" "] * len(means)
    for step, mark in marks.items():
        under[min(len(means) - 1, max(0, (step - 1) * width // len(values)))] = mark
    return line + "\n" + "".join(under).rstrip()


def plot(result: DemoResult) -> Path | None:
    """A PNG of both loss curves with the crash and the resume marked, if matplotlib is there."""
    try:
        plt: Any = importlib.import_module("matplotlib.pyplot")
        ref = [float.fromhex(v) for _, v in sorted(result.reference.losses.items())]
        run = _run_losses(result)
        fig, ax = plt.subplots(figsize=(8, 4))
        ax.plot(range(1, len(ref) + 1), ref, lw=2.5, alpha=0.4, label="reference (never stopped)")
        ax.plot(range(1, len(run) + 1), run, lw=0.8, label="crashed and resumed")
        ax.axvline(result.first.last_step, color="red", ls="--", label="SIGKILL")
        ax.axvline(result.second.resumed_from or 0, color="green", ls=":", label="resumed from")
        ax.set(xlabel="step", ylabel="training loss", title="fckpt demo")
        ax.legend()
        out = result.root / "loss.png"
        fig.savefig(out, dpi=100)
        plt.close(fig)
        return out
    except Exception:  # optional garnish: a broken matplotlib must not fail the demo
        return None


def _kept_lines(result: DemoResult) -> list[str]:
    """One line per part of the retention policy: the steps it keeps."""
    by_label: dict[str, list[int]] = {}
    for step, labels in result.kept_by.items():
        for label in labels:
            by_label.setdefault(label, []).append(step)
    width = max((len(label) for label in by_label), default=0)
    return [f"    {k.ljust(width)}  keeps {', '.join(map(str, v))}" for k, v in by_label.items()]


def report_lines(result: DemoResult, ui: UI) -> list[str]:
    """The report as lines, coloured and drawn as ``ui`` can show them."""
    s, first, second, ascii_only = result.schedule, result.first, result.second, ui.ascii_only
    resumed = second.resumed_from or 0
    loop_s = first.loop_s + second.loop_s
    blocked = first.blocked_s + second.blocked_s
    saves = len(first.saves) + len(second.saves)
    marks = {resumed or 1: "R" if ascii_only else "↺", first.last_step: "X" if ascii_only else "✗"}
    curve = [*sparkline(_run_losses(result), 60, marks, ascii_only).splitlines(), "", ""]
    crash = f"SIGKILLed right after step {first.last_step}; " + (
        f"the save in flight was left as {result.in_flight[0]} (a temporary name: never "
        "read; on resume removed, or recovered if complete)"
        if result.in_flight
        else "no save was in flight"
    )
    n = len(result.reference.losses)
    losses = (
        f"{n}/{n} bit-identical to the reference"
        + (f", the {result.replayed} replayed steps too" if result.replayed else "")
        if result.losses_identical
        else "DIFFERENT"
    )
    lines = [
        f"fckpt demo report ({result.root})",
        f"  model       MLP {job.IN_DIM}-{job.HIDDEN}-{job.HIDDEN}-{job.CLASSES}, dropout 0.1, "
        f"AdamW, warm-up + cosine LR; {Job.param_count() / 1e6:.2f} M parameters",
        f"  save when   {s.save_policy()!r}  ({'async' if first.async_save else 'synchronous'})",
        f"  keep        {s.retention()!r}",
        f"  crash       {crash}",
        f"  resume      from step {resumed} in a new process "
        f"({second.restore_s * 1000:.0f} ms to restore), trained to step {second.last_step}",
        "",
        f"  loss  {curve[0]}",
        f"        {curve[1]}   {marks[first.last_step]} killed at {first.last_step}, "
        f"{marks[resumed or 1]} resumed from {resumed}",
        "",
        f"  steps done           {s.steps} (+{result.replayed} replayed after the resume)",
        f"  checkpoints          {saves} saves started, {saves - len(result.in_flight)} "
        f"committed, {len(result.kept_by)} kept:",
        *_kept_lines(result),
        f"  blocked on saves     {blocked:.2f} s of {loop_s:.1f} s in the training loops "
        f"({100 * blocked / max(loop_s, 1e-9):.1f} %)",
        f"  final parameters     {result.model_tensors} tensors "
        f"({result.model_bytes / 1e6:.1f} MB): "
        + ("bit-identical" if not result.state_diff else "DIFFERENT"),
        "  full training state  "
        + (
            "bit-identical (optimizer moments, LR schedule, RNGs, loader position)"
            if not result.state_diff
            else f"{len(result.state_diff)} differences: " + "; ".join(result.state_diff[:3])
        ),
        f"  per-step losses      {losses}",
        f"  wall time            {result.wall_s:.1f} s (the reference ran alongside)",
    ]
    if result.plot is not None:
        lines.append(f"  plot                 {result.plot}")
    verdict = (
        ui.paint("IDENTICAL", "ok") + ": the crashed and resumed run is, bit for bit, the run that "
        "never stopped."
        if result.identical
        else ui.paint("NOT IDENTICAL", "bad") + ": see the differences above."
    )
    ckpts = result.root / job.RUN_DIR / job.CKPT_DIR
    return [*lines, "", verdict, f"Look around: fckpt ls {ckpts}   fckpt verify {ckpts}"]


def cmd_demo(args: argparse.Namespace, ui: UI) -> int:
    crash = crash_step(args.steps, args.crash_at)  # refused before anything is made
    root = Path(args.root) if args.root else Path(tempfile.mkdtemp(prefix="fckpt-demo-"))
    say = ui.note if args.json else ui.print  # with --json, stdout holds only the document

    def progress(label: str, total: int) -> Any:
        if not ui.show_progress:  # a log: a plain line every few seconds, no bar
            return Heartbeat(label, total, say)
        return ui.progress(label, total, unit="steps").start()

    say(f"fckpt demo: train, SIGKILL, resume, compare; working in {root}")
    try:
        result = run_demo(root, args.steps, crash, progress=progress, say=say)
    except DemoError as e:
        ui.error(one_line(e))  # the answer is "no": the demo's runs could not be compared
        return 1
    result.plot = plot(result)
    if args.json:
        doc = {"root": str(result.root), "identical": result.identical}
        doc |= {k: getattr(result, k) for k in ("losses_identical", "state_diff")}
        doc |= {"steps": result.schedule.steps, "crash_at": result.crash_at}
        doc |= {"killed_at": result.first.last_step, "resumed_from": result.second.resumed_from}
        doc |= {"finished_at": result.second.last_step, "replayed": result.replayed}
        doc |= {"kept": list(result.kept_by), "kept_by": result.kept_by}  # JSON keys: str
        doc |= {"in_flight": result.in_flight, "wall_s": result.wall_s}
        ui.json({**doc, "plot": None if result.plot is None else str(result.plot)})
    else:
        ui.print("")
        ui.print("\n".join(report_lines(result, ui)))
    return 0 if result.identical else 1
