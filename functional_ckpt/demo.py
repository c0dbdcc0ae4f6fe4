"""``fckpt demo``: train, SIGKILL, resume, and prove the result is bit-identical.

The promise of this package is that a run which crashes and resumes is *the same
run* as one that never stopped. The demo shows it end to end on an embedded job,
with nothing to download:

1. a training process (a small MLP with dropout on a generated classification
   task, AdamW, warm-up + cosine LR, a shuffling loader, per-step randomness from
   torch's and numpy's generators) checkpoints with a :class:`CheckpointManager`
   on ``every_steps | every_secs | on_improve | on_final`` and keeps
   ``keep_last | keep_best``, with async saves;
2. it SIGKILLs itself right after step ``--crash-at`` (a save may well be in
   flight: it must never become visible);
3. a new process resumes from the newest checkpoint and trains to the end;
4. a reference process, started alongside, trains the same job without ever
   stopping or checkpointing;
5. the parent compares per-step losses (as exact float hex) and the final
   states (bit for bit) and prints a report. Exit status 0 only if identical.

The children run ``python -m functional_ckpt.demo train ...`` single-threaded
with deterministic algorithms, because multi-threaded reductions may sum in a
different order from one process to the next and break bit-identity for reasons
that have nothing to do with checkpointing.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

import functional_ckpt as fc

__all__ = [
    "DEFAULT_STEPS",
    "DemoError",
    "DemoResult",
    "Job",
    "Schedule",
    "ShuffleLoader",
    "format_report",
    "main",
    "run_demo",
]

DEFAULT_STEPS = 2400
#: Fraction of the steps after which the first training process is killed.
CRASH_FRACTION = 0.4
MARKER = "fckpt-demo.json"
RUN_DIR, REF_DIR, LOG_DIR = "run", "reference", "logs"
CKPT_DIR = "checkpoints"
EVENTS = "events.jsonl"
IN_DIM, HIDDEN, CLASSES = 32, 1024, 8
TRAIN_SAMPLES, VAL_SAMPLES, BATCH = 16384, 1024, 64
DATA_SEED, INIT_SEED = 1234, 0


class DemoError(Exception):
    """The demo could not run to its report (a child failed, or bad arguments)."""


# --------------------------------------------------------------------------- the job


@dataclass(frozen=True)
class Schedule:
    """Every knob that depends on the number of steps, derived in one place.

    Scaled so that a short CI run (``--steps 60``) still evaluates, saves on every
    policy and prunes, while the default run saves a few dozen times.
    """

    steps: int
    eval_every: int
    save_every: int
    save_secs: float
    warmup: int
    keep_last: int = 3
    keep_best: int = 2

    @classmethod
    def for_steps(cls, steps: int) -> Schedule:
        eval_every = max(2, steps // 30)
        return cls(
            steps=steps,
            eval_every=eval_every,
            save_every=eval_every * 8,
            save_secs=5.0,
            warmup=max(1, steps // 20),
        )

    def save_policy(self) -> fc.SavePolicy:
        return (
            fc.every_steps(self.save_every)
            | fc.every_secs(self.save_secs)
            | fc.on_improve("val_loss", mode="min")
            | fc.on_final()
        )

    def retention(self) -> fc.RetentionPolicy:
        return fc.keep_last(self.keep_last) | fc.keep_best(self.keep_best, "val_loss", mode="min")

    def lr_factor(self, step: int) -> float:
        """Linear warm-up, then cosine decay to 10 %: a schedule whose state matters."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class ShuffleLoader:
    """Reshuffles every epoch from ``(seed, epoch)`` and resumes at any position.

    Its own generator, rebuilt from plain integers, so its state is three ints and
    the order after a resume cannot depend on anything else the process did.
    """

    def __init__(self, data: torch.Tensor, targets: torch.Tensor, batch: int, seed: int) -> None:
        self.data, self.targets = data, targets
        self.batch, self.seed = batch, seed
        self.epoch, self.pos = 0, 0

    def _order(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(len(self.data), generator=g)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos + self.batch > len(self.data):
            self.epoch, self.pos = self.epoch + 1, 0
        idx = self._order()[self.pos : self.pos + self.batch]
        self.pos += self.batch
        return self.data[idx], self.targets[idx]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.epoch, self.pos, self.seed = int(sd["epoch"]), int(sd["pos"]), int(sd["seed"])


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs labelled by a random teacher network plus Gumbel noise (so it can overfit).

    Drawn from a private generator: every process builds the very same data set.
    """
    g = torch.Generator().manual_seed(DATA_SEED)
    n = TRAIN_SAMPLES + VAL_SAMPLES
    w1 = torch.randn(IN_DIM, 64, generator=g) / math.sqrt(IN_DIM)
    w2 = torch.randn(64, CLASSES, generator=g) * 3.0
    x = torch.randn(n, IN_DIM, generator=g)
    u = torch.rand(n, CLASSES, generator=g).clamp(1e-9, 1 - 1e-9)
    y = (torch.tanh(x @ w1) @ w2 - torch.log(-torch.log(u))).argmax(dim=1)
    return x, y


class Job:
    """Model, optimizer, LR schedule, loader and validation set of the demo."""

    def __init__(self, schedule: Schedule) -> None:
        torch.manual_seed(INIT_SEED)
        np.random.seed(INIT_SEED)
        random.seed(INIT_SEED)  # unused by the step, but captured: it must match too
        self.schedule = schedule
        self.model = torch.nn.Sequential(
            torch.nn.Linear(IN_DIM, HIDDEN),
            torch.nn.GELU(),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(HIDDEN, HIDDEN),
            torch.nn.GELU(),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(HIDDEN, CLASSES),
        )
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=2e-3, weight_decay=0.01)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, schedule.lr_factor)
        x, y = make_data()
        self.val_x, self.val_y = x[TRAIN_SAMPLES:], y[TRAIN_SAMPLES:]
        self.loader = ShuffleLoader(x[:TRAIN_SAMPLES], y[:TRAIN_SAMPLES], BATCH, seed=7)

    @staticmethod
    def param_count() -> int:
        """Parameters of the model, without building it (for the report)."""
        return IN_DIM * HIDDEN + HIDDEN + HIDDEN * HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES

    def train_step(self) -> float:
        """One step; dropout and input noise use torch's RNG, a scale jitter numpy's."""
        x, y = self.loader.next_batch()
        x = x * float(np.random.uniform(0.9, 1.1)) + 0.05 * torch.randn_like(x)
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        self.sched.step()
        return float(loss.item())

    def evaluate(self) -> float:
        """Validation loss without dropout; draws nothing from any RNG."""
        self.model.eval()
        with torch.no_grad():
            loss = torch.nn.functional.cross_entropy(self.model(self.val_x), self.val_y)
        self.model.train()
        return float(loss.item())

    def capture(self, step: int) -> Any:
        return fc.capture(
            model=self.model,
            optimizer=self.opt,
            scheduler=self.sched,
            loader=self.loader,
            step=step,
        )

    def apply(self, state: Any) -> int:
        fc.apply(
            state, model=self.model, optimizer=self.opt, scheduler=self.sched, loader=self.loader
        )
        return int(state["step"])


# --------------------------------------------------------------------------- children


class EventLog:
    """JSON lines, flushed one by one, so a SIGKILL loses at most the line being written."""

    def __init__(self, path: Path) -> None:
        self._file: IO[str] = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        self._start = time.perf_counter()

    def write(self, event: str, **fields: Any) -> None:
        record = {"event": event, "t": time.perf_counter() - self._start, **fields}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _eval_metrics(job: Job, step: int, loss: float) -> dict[str, float] | None:
    s = job.schedule
    if step % s.eval_every and step != s.steps:
        return None
    return {"val_loss": job.evaluate(), "loss": loss}


def _step_fields(step: int, loss: float, metrics: Mapping[str, float] | None) -> dict[str, Any]:
    fields: dict[str, Any] = {"step": step, "loss": loss.hex()}
    if metrics is not None:
        fields["val_loss"] = metrics["val_loss"].hex()
    return fields


def train_managed(directory: Path, schedule: Schedule, crash_at: int | None, events: Path) -> None:
    """The run under test: resumes if it can, checkpoints on policies, maybe dies."""
    job = Job(schedule)
    log = EventLog(events)
    meta = {"demo": "fckpt demo", "retention": repr(schedule.retention())}
    with fc.CheckpointManager(
        directory / CKPT_DIR,
        save=schedule.save_policy(),
        keep=schedule.retention(),
        metadata=meta,
        async_save=True,  # the loop waits for a memory copy, the write runs behind it
    ) as mgr:
        t0 = time.perf_counter()
        restored = mgr.restore_latest(template=job.capture(0))
        step = job.apply(restored) if restored is not None else 0
        log.write(
            "start",
            pid=os.getpid(),
            resumed_from=mgr.restored_step,
            restore_s=time.perf_counter() - t0,
            async_save=mgr.async_save,
        )
        while step < schedule.steps:
            t = time.perf_counter()
            mgr.wait_staged()  # the step below mutates parameters in place
            blocked = time.perf_counter() - t
            loss = job.train_step()
            step += 1
            metrics = _eval_metrics(job, step, loss)
            state = job.capture(step)
            t = time.perf_counter()
            saved = mgr.maybe_save(
                state, step=step, metrics=metrics, is_final=step == schedule.steps
            )
            blocked += time.perf_counter() - t
            log.write("step", blocked=blocked, saved=saved, **_step_fields(step, loss, metrics))
            if step == crash_at:
                log.write("crash", step=step)
                os.kill(os.getpid(), signal.SIGKILL)
        t = time.perf_counter()
        mgr.wait()
        log.write("end", step=step, close_s=time.perf_counter() - t)
    log.close()


def train_reference(directory: Path, schedule: Schedule, events: Path) -> None:
    """The same job, never stopped and never checkpointed; its final state is saved once."""
    job = Job(schedule)
    log = EventLog(events)
    log.write("start", pid=os.getpid(), resumed_from=None, restore_s=0.0, async_save=False)
    for step in range(1, schedule.steps + 1):
        loss = job.train_step()
        metrics = _eval_metrics(job, step, loss)
        log.write("step", blocked=0.0, saved=False, **_step_fields(step, loss, metrics))
    fc.save(directory / "final", job.capture(schedule.steps), overwrite=True)
    log.write("end", step=schedule.steps, close_s=0.0)
    log.close()


def child_main(argv: Sequence[str]) -> int:
    """``python -m functional_ckpt.demo train DIR --steps N [--crash-at S] [--reference]``."""
    ap = argparse.ArgumentParser(prog="python -m functional_ckpt.demo train")
    ap.add_argument("directory", type=Path)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--crash-at", type=int, default=None)
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--events", type=Path, required=True, help="JSON-lines log to append to")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    args.directory.mkdir(parents=True, exist_ok=True)
    schedule = Schedule.for_steps(args.steps)
    if args.reference:
        train_reference(args.directory, schedule, args.events)
    else:
        train_managed(args.directory, schedule, args.crash_at, args.events)
    return 0


# --------------------------------------------------------------------------- parent


@dataclass
class Attempt:
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


def read_attempt(events: Sequence[Mapping[str, Any]], returncode: int) -> Attempt:
    """Fold the events of one process into an :class:`Attempt`."""
    att = Attempt(returncode)
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


@dataclass
class Child:
    """A training subprocess and the tail of its event log."""

    name: str
    proc: subprocess.Popen[bytes]
    tail: EventTail
    log: Path

    def wait(self, progress: Any | None = None) -> Attempt:
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
    here = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    return env


def spawn(name: str, directory: Path, logs: Path, steps: int, *extra: str) -> Child:
    directory.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    events = logs / f"{name}.{EVENTS}"
    cmd = [sys.executable, "-m", "functional_ckpt.demo", "train", str(directory)]
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
    first: Attempt
    second: Attempt
    reference: Attempt
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
        if not (root / MARKER).is_file():
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
    (root / MARKER).write_text(json.dumps({"created": time.time()}) + "\n")


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


def _watch(child: Child, label: str, total: int, progress: ProgressFactory | None) -> Attempt:
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
        return sorted(p.name for p in ckpt_dir.iterdir() if ".tmp-" in p.name)
    except FileNotFoundError:
        return []


# --------------------------------------------------------------------------- compare


def _compare_losses(first: Attempt, second: Attempt, reference: Attempt) -> tuple[bool, int]:
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
    first: Attempt,
    second: Attempt,
    reference: Attempt,
    in_flight: list[str],
    wall_s: float,
) -> DemoResult:
    from functional_ckpt import cli

    losses_identical, replayed = _compare_losses(first, second, reference)
    mgr = fc.CheckpointManager(root / RUN_DIR / CKPT_DIR, read_only=True)
    infos = mgr.infos()
    final = mgr.path(schedule.steps)
    ref_final = root / REF_DIR / "final"
    diff = cli.diff_checkpoints(ref_final, final)
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
        kept_by=cli.kept_by(cli.retention_parts(schedule.retention().spec) or [], infos),
        losses_identical=losses_identical,
        replayed=replayed,
        state_diff=[str(e) for e in diff.changes],
        model_tensors=len(model),
        model_bytes=sum(e.nbytes for e in model),
        wall_s=wall_s,
        num_params=Job.param_count(),
    )
    result.plot = _plot(result)
    return result


# --------------------------------------------------------------------------- report


SPARKS = "▁▂▃▄▅▆▇█"
ASCII_SPARKS = "_.-=+*#@"


def _run_losses(result: DemoResult) -> list[float]:
    """The curve the crashed-and-resumed run produced: first process, then the second."""
    resumed = result.second.resumed_from or 0
    merged = {s: v for s, v in result.first.losses.items() if s <= resumed}
    merged.update(result.second.losses)
    return [float.fromhex(merged[s]) for s in sorted(merged)]


def sparkline(
    values: Sequence[float], width: int, marks: Mapping[int, str], ascii_only: bool
) -> str:
    """Mean value per column on an 8-level (log) scale, and a second line with ``marks``.

    ``marks`` maps 1-based steps to a one-character marker placed under the
    column holding that step.
    """
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
        col = min(len(means) - 1, max(0, (step - 1) * width // len(values)))
        under[col] = mark
    return line + "\n" + "".join(under).rstrip()


def _plot(result: DemoResult) -> Path | None:
    """A PNG of both loss curves with the crash and the resume marked, if matplotlib is there."""
    try:
        plt: Any = importlib.import_module("matplotlib.pyplot")
        return _draw(plt, result)
    except Exception:  # optional garnish: a broken matplotlib must not fail the demo
        return None


def _draw(plt: Any, result: DemoResult) -> Path:
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


Colour = Callable[[str, str], str]


def _plain(text: str, _style: str) -> str:
    return text


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _kept_lines(result: DemoResult) -> list[str]:
    """One line per part of the retention policy: the steps it keeps."""
    by_label: dict[str, list[int]] = {}
    for step in result.kept:
        for label in result.kept_by.get(step, []):
            by_label.setdefault(label, []).append(step)
    width = max((len(label) for label in by_label), default=0)
    return [
        f"    {label.ljust(width)}  keeps {', '.join(map(str, steps))}"
        for label, steps in by_label.items()
    ]


def _loss_text(result: DemoResult) -> str:
    n = len(result.reference.losses)
    verdict = "bit-identical" if result.losses_identical else "DIFFERENT"
    extra = f", the {result.replayed} replayed steps too" if result.replayed else ""
    return f"{n}/{n} {verdict} to the reference{extra}" if result.losses_identical else verdict


def _crash_text(result: DemoResult) -> str:
    text = f"SIGKILLed right after step {result.first.last_step}"
    if result.in_flight:
        return text + (
            f"; the save in flight was left as {result.in_flight[0]} "
            "(a temporary name: never read, removed on resume)"
        )
    return text + "; no save was in flight"


def report_lines(
    result: DemoResult, colour: Colour = _plain, ascii_only: bool = False
) -> list[str]:
    """The report as lines; ``colour(text, style)`` decorates (or not) a fragment."""
    s, first, second = result.schedule, result.first, result.second
    resumed = second.resumed_from or 0
    loop_s = first.loop_s + second.loop_s
    blocked = first.blocked_s + second.blocked_s
    saves = len(first.saves) + len(second.saves)
    committed = saves - len(result.in_flight)
    marks = {resumed or 1: "R" if ascii_only else "↺", first.last_step: "X" if ascii_only else "✗"}
    curve = sparkline(_run_losses(result), 60, marks, ascii_only).splitlines()
    mode = "async" if first.async_save else "synchronous"
    ok = result.identical
    lines = [
        f"fckpt demo report ({result.root})",
        f"  model       MLP {IN_DIM}-{HIDDEN}-{HIDDEN}-{CLASSES}, dropout 0.1, AdamW, warm-up + "
        f"cosine LR; {result.num_params / 1e6:.2f} M parameters",
        f"  save when   {s.save_policy()!r}  ({mode})",
        f"  keep        {s.retention()!r}",
        f"  crash       {_crash_text(result)}",
        f"  resume      from step {resumed} in a new process "
        f"({second.restore_s * 1000:.0f} ms to restore), trained to step {second.last_step}",
        "",
        f"  loss  {curve[0]}",
        f"        {curve[1] if len(curve) > 1 else ''}   "
        f"{marks[first.last_step]} killed at {first.last_step}, "
        f"{marks[resumed or 1]} resumed from {resumed}",
        "",
        f"  steps done           {s.steps} (+{result.replayed} replayed after the resume)",
        f"  checkpoints          {saves} saves started, {committed} committed, "
        f"{len(result.kept)} kept:",
        *_kept_lines(result),
        f"  blocked on saves     {blocked:.2f} s of {loop_s:.1f} s in the training loops "
        f"({100 * blocked / max(loop_s, 1e-9):.1f} %)",
        f"  final parameters     {result.model_tensors} tensors ({_mb(result.model_bytes)}): "
        + ("bit-identical" if not result.state_diff else "DIFFERENT"),
        "  full training state  "
        + (
            "bit-identical (optimizer moments, LR schedule, RNGs, loader position)"
            if not result.state_diff
            else f"{len(result.state_diff)} differences: " + "; ".join(result.state_diff[:3])
        ),
        f"  per-step losses      {_loss_text(result)}",
        f"  wall time            {result.wall_s:.1f} s (the reference ran alongside)",
    ]
    if result.plot is not None:
        lines.append(f"  plot                 {result.plot}")
    verdict = (
        colour("IDENTICAL", "ok") + ": the crashed and resumed run is, bit for bit, the run that "
        "never stopped."
        if ok
        else colour("NOT IDENTICAL", "bad") + ": see the differences above."
    )
    ckpts = result.root / RUN_DIR / CKPT_DIR
    lines += ["", verdict, f"Look around: fckpt ls {ckpts}   fckpt verify {ckpts}"]
    return lines


def format_report(result: DemoResult, colour: Colour = _plain, ascii_only: bool = False) -> str:
    return "\n".join(report_lines(result, colour, ascii_only))


def default_root() -> Path:
    return Path(tempfile.mkdtemp(prefix="fckpt-demo-"))


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m functional_ckpt.demo``: the children's entry point, else ``fckpt demo``."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["train"]:
        return child_main(args[1:])
    from functional_ckpt.cli import main as cli_main

    return cli_main(["demo", *args])


if __name__ == "__main__":
    raise SystemExit(main())
