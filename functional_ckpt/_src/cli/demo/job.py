"""``fckpt demo``'s children: a run SIGKILLed after ``--crash-at`` (a save may be in flight)
and resumed must be *the same run*, bit for bit, as a reference that never stopped.

They are single-threaded and deterministic: multi-threaded reductions may sum in another
order and break bit-identity for reasons that have nothing to do with checkpointing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import functional_ckpt as fc

if TYPE_CHECKING:
    import torch

#: Fraction of the steps after which the first training process is killed.
CRASH_FRACTION = 0.4
DEMO_MARKER = "fckpt-demo.json"
RUN_DIR, REF_DIR, LOG_DIR = "run", "reference", "logs"
CKPT_DIR = "checkpoints"
EVENTS = "events.jsonl"
#: A child's program: ``python -c CHILD DIR --steps N [--crash-at S | --reference]``.
CHILD = "import sys; from functional_ckpt._src.cli.demo.job import child_main as m; m(sys.argv[1:])"
IN_DIM, HIDDEN, CLASSES = 32, 512, 8
TRAIN_SAMPLES, VAL_SAMPLES, BATCH = 16384, 1024, 64
DATA_SEED, INIT_SEED = 1234, 0


class DemoError(Exception):
    """The demo could not run to its report (a child failed, or bad arguments)."""


@dataclass(frozen=True)
class Schedule:
    """Scaled so that a short CI run (``--steps 60``) still evaluates, saves on every
    policy and prunes, while the default run saves a few dozen times."""

    steps: int
    eval_every: int
    save_every: int
    warmup: int
    save_secs: float = 5.0
    keep_last: int = 3
    keep_best: int = 2

    @classmethod
    def for_steps(cls, steps: int) -> Schedule:
        eval_every = max(2, steps // 30)
        return cls(
            steps=steps,
            eval_every=eval_every,
            save_every=eval_every * 8,
            warmup=max(1, steps // 20),
        )

    def save_policy(self) -> fc.policy.SavePolicy:
        return (
            fc.every_steps(self.save_every)
            | fc.every_secs(self.save_secs)
            | fc.on_improve("val_loss", mode="min")
            | fc.on_final()
        )

    def retention(self) -> fc.policy.RetentionPolicy:
        return fc.keep_last(self.keep_last) | fc.keep_best(self.keep_best, "val_loss", mode="min")

    def lr_factor(self, step: int) -> float:
        """Linear warm-up, then cosine decay to 10 %: a schedule whose state matters."""
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress)))


class ShuffleLoader:
    """Reshuffles every epoch from a generator of its own, rebuilt from ``(seed, epoch)``: its
    state is three ints, and the order after a resume depends on nothing else the process did."""

    def __init__(self, data: torch.Tensor, targets: torch.Tensor, batch: int, seed: int) -> None:
        self.data, self.targets = data, targets
        self.batch, self.seed = batch, seed
        self.epoch, self.pos = 0, 0

    def _order(self) -> torch.Tensor:
        import torch

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
    """Inputs labelled by a random teacher network plus Gumbel noise (so it can overfit), from a
    private generator: every process builds the very same data set."""
    import torch

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
        import numpy as np
        import torch

        torch.manual_seed(INIT_SEED)
        np.random.seed(INIT_SEED)
        random.seed(INIT_SEED)  # unused by the step, but captured: it must match too
        self.schedule = schedule
        nn = torch.nn
        block = [nn.Linear(IN_DIM, HIDDEN), nn.GELU(), nn.Dropout(0.1)]
        block += [nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Dropout(0.1)]
        self.model = nn.Sequential(*block, nn.Linear(HIDDEN, CLASSES))
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
        import numpy as np
        import torch

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
        import torch

        self.model.eval()
        with torch.no_grad():
            loss = torch.nn.functional.cross_entropy(self.model(self.val_x), self.val_y)
        self.model.train()
        return float(loss.item())

    def metrics(self, step: int, loss: float) -> dict[str, float] | None:
        """Evaluated every ``eval_every`` steps and at the last one."""
        if step % self.schedule.eval_every and step != self.schedule.steps:
            return None
        return {"val_loss": self.evaluate(), "loss": loss}

    def capture(self, step: int) -> Any:
        return fc.capture(**self._live(), step=step)

    def apply(self, state: Any) -> int:
        fc.apply(state, **self._live())
        return int(state["step"])

    def _live(self) -> dict[str, Any]:
        live = {"model": self.model, "optimizer": self.opt, "scheduler": self.sched}
        return {**live, "loader": self.loader}


class EventLog:
    """JSON lines, flushed one by one, so a SIGKILL loses at most the line being written."""

    def __init__(self, path: Path) -> None:
        self._file: IO[str] = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        self._start = time.perf_counter()

    def write(self, event: str, **fields: Any) -> None:
        record = {"event": event, "t": time.perf_counter() - self._start, **fields}
        self._file.write(json.dumps(record) + "\n")  # line-buffered: written at once


def train(directory: Path, schedule: Schedule, events: Path, crash_at: int | None) -> None:
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
        restored = mgr.restore_latest(like=job.capture(0))
        step = job.apply(restored) if restored is not None else 0
        restore_s = time.perf_counter() - t0
        log.write("start", resumed_from=mgr.restored_step, restore_s=restore_s, async_save=True)
        while step < schedule.steps:
            t = time.perf_counter()
            mgr.wait_staged()  # the step below mutates parameters in place
            blocked = time.perf_counter() - t
            loss, step = job.train_step(), step + 1
            metrics, state = job.metrics(step, loss), job.capture(step)
            t = time.perf_counter()
            final = step == schedule.steps
            saved = mgr.maybe_save(state, step=step, metrics=metrics, is_final=final)
            blocked += time.perf_counter() - t
            log.write("step", blocked=blocked, saved=saved, step=step, loss=loss.hex())
            if step == crash_at:
                log.write("crash", step=step)
                os.kill(os.getpid(), signal.SIGKILL)
        t = time.perf_counter()
        mgr.wait()
        log.write("end", step=step, close_s=time.perf_counter() - t)


def train_reference(directory: Path, schedule: Schedule, events: Path) -> None:
    """The same job, never stopped and never checkpointed; its final state is saved once."""
    job = Job(schedule)
    log = EventLog(events)
    log.write("start", resumed_from=None, restore_s=0.0, async_save=False)
    for step in range(1, schedule.steps + 1):
        loss = job.train_step()
        job.metrics(step, loss)  # the same work as the run under test
        log.write("step", blocked=0.0, saved=False, step=step, loss=loss.hex())
    fc.save(directory / "final", job.capture(schedule.steps), overwrite=True)
    log.write("end", step=schedule.steps, close_s=0.0)


def child_main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="fckpt demo's child")
    ap.add_argument("directory", type=Path)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--crash-at", type=int, default=None)
    ap.add_argument("--reference", action="store_true")
    ap.add_argument("--events", type=Path, required=True, help="JSON-lines log to append to")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    schedule = Schedule.for_steps(args.steps)
    if args.reference:
        train_reference(args.directory, schedule, args.events)
    else:
        train(args.directory, schedule, args.events, args.crash_at)
    return 0
