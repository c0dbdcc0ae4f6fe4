"""What do asynchronous checkpoints cost a training loop? Throughput with and without.

A model of about 100M parameters (a residual stack of Linear-GELU-Linear blocks)
trains on the CPU with AdamW (fused kernel), on a fixed batch of 16 rows, for a
fixed number of steps. The same loop runs in blocks that alternate between
*baseline* (no checkpoints) and *async* (a checkpoint of model + optimizer + RNG
state every K steps), A B A B ..., so slow drift of a shared machine hits both
variants alike; the throughput of each block is steps / wall time and the median
over the blocks of a variant is reported.

The optimizer mutates the state in place, so the async loop calls ``wait_staged()``
right before ``optimizer.step()``: a checkpoint started at the end of step n is
staged (copied into reusable buffers) while step n+1 runs its forward and backward
pass, and the write proceeds in the background thread.

K is chosen from measurements, not guessed: before the blocks run, the script
times a training step and one durable save of the state (sync ``fc.save`` and the
commit time of an async save), and takes the smallest K whose interval is at least
``--interval-factor`` (default 10) times the write time. Checkpoints are saved after
steps 0, K, 2K, ... of each async block; each block ends by waiting for its last
checkpoint to commit (inside the timing), so every async block pays for all of its
checkpoints. Time spent blocked on checkpoints (``wait_staged``, the save call, the
final wait) is reported too. Target: overhead <= 3%.

The checkpoints go through ``fc.CheckpointManager(..., async_save=True)`` when the
installed package has that option (``--mode auto``), else through
``fc.save_async`` with one pending save at a time (two slots, ``overwrite=True``).

Usage::

    python benchmarks/train_overhead.py [--quick] [--blocks N] [--saves-per-block N]
                                        [--interval-factor F] [--k K] [--dir DIR]
                                        [--json PATH] [--mode auto|manager|save_async]
"""

from __future__ import annotations

import argparse
import inspect
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _common import (
    REPO_ROOT,
    MiB,
    Table,
    add_run_args,
    bench_parser,
    check_not_tmpfs,
    environment,
    finish,
    fmt_ms,
    fmt_pct,
    fmt_seconds,
    median,
    remove_path,
    scratch_dir,
    settle,
    timed,
    verdict,
)

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import functional_ckpt as fc

TARGET_OVERHEAD_PCT = 3.0


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- model


class Block(torch.nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, hidden)
        self.down = torch.nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.nn.functional.gelu(self.up(x)))
        return out


def build_model(d: int, hidden: int, blocks: int) -> torch.nn.Module:
    return torch.nn.Sequential(*(Block(d, hidden) for _ in range(blocks)))


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@dataclass
class Trainer:
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor

    def forward_backward(self) -> None:
        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        loss.backward()  # type: ignore[no-untyped-call]

    def optimizer_step(self) -> None:
        self.opt.step()  # mutates parameters and moments in place
        self.opt.zero_grad(set_to_none=True)

    def state(self, step: int) -> Any:
        return fc.capture(model=self.model, optimizer=self.opt, step=step)


def make_trainer(args: argparse.Namespace) -> Trainer:
    torch.manual_seed(0)
    model = build_model(args.d, args.hidden, args.blocks_model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # the fast CPU kernel
    x = torch.randn(args.batch, args.d)
    y = torch.randn(args.batch, args.d)
    return Trainer(model, opt, x, y)


# --------------------------------------------------------------------------- checkpointers


def manager_has_async() -> bool:
    return "async_save" in inspect.signature(fc.CheckpointManager).parameters


class Checkpointer:
    """The async-save side of the loop; ``blocked`` sums the time the loop waited on it."""

    kind = ""

    def __init__(self) -> None:
        self.blocked = 0.0
        self.blocked_by = {"wait_staged": 0.0, "save call": 0.0, "block-end wait": 0.0}
        self.stalls: list[float] = []  # wait_staged right after each save started
        self.saves = 0
        self._fresh = False

    def wait_staged(self) -> None:
        raise NotImplementedError

    def after_step(self, trainer: Trainer, step: int, due: bool) -> bool:
        """Called after every optimizer step; returns whether a save was started."""
        raise NotImplementedError

    def wait(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def last_path(self) -> Path | None:
        raise NotImplementedError

    def reset_counters(self) -> None:
        self.blocked, self.saves, self.stalls, self._fresh = 0.0, 0, [], False
        self.blocked_by = dict.fromkeys(self.blocked_by, 0.0)

    def timed_wait_staged(self) -> None:
        seconds, _ = timed(self.wait_staged)
        self.blocked += seconds
        self.blocked_by["wait_staged"] += seconds
        if self._fresh:
            self.stalls.append(seconds)
            self._fresh = False

    def timed_after_step(self, trainer: Trainer, step: int, due: bool) -> None:
        seconds, saved = timed(lambda: self.after_step(trainer, step, due))
        self.blocked += seconds
        self.blocked_by["save call"] += seconds
        if saved:
            self.saves += 1
            self._fresh = True

    def timed_wait(self) -> None:
        seconds, _ = timed(self.wait)
        self.blocked += seconds
        self.blocked_by["block-end wait"] += seconds


class DirectCheckpointer(Checkpointer):
    """``fc.save_async`` with one pending save at a time, alternating two slots."""

    kind = "fc.save_async (one pending save, reused fc.checkpoint.Stager)"

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root
        self.stager = fc.checkpoint.Stager()
        self.pending: fc.checkpoint.PendingSave | None = None
        self.committed: Path | None = None
        self.count = 0

    def wait_staged(self) -> None:
        if self.pending is not None:
            self.pending.wait_staged()

    def after_step(self, trainer: Trainer, step: int, due: bool) -> bool:
        if not due:
            return False
        self.wait()  # at most one save in flight
        slot = self.root / f"slot{self.count % 2}"
        self.count += 1
        self.pending = fc.save_async(slot, trainer.state(step), overwrite=True, stager=self.stager)
        return True

    def wait(self) -> None:
        if self.pending is not None:
            self.committed = self.pending.result().path
            self.pending = None

    def close(self) -> None:
        self.wait()

    def last_path(self) -> Path | None:
        return self.committed


class ManagerCheckpointer(Checkpointer):
    """``fc.CheckpointManager(..., async_save=True)`` with ``every_steps(k)``."""

    kind = "fc.CheckpointManager(async_save=True)"

    def __init__(self, root: Path, k: int) -> None:
        super().__init__()
        kwargs: dict[str, Any] = {"async_save": True}
        self.mgr = fc.CheckpointManager(
            root, save=fc.every_steps(k), keep=fc.keep_last(2), **kwargs
        )

    def wait_staged(self) -> None:
        self.mgr.wait_staged()

    def after_step(self, trainer: Trainer, step: int, due: bool) -> bool:
        # Called every step, as a real loop would; the every_steps(k) policy decides.
        return self.mgr.maybe_save(trainer.state(step), step=step)

    def wait(self) -> None:
        self.mgr.wait()

    def close(self) -> None:
        self.mgr.close()

    def last_path(self) -> Path | None:
        step = self.mgr.latest_step()
        return None if step is None else self.mgr.path(step)


# --------------------------------------------------------------------------- calibration


@dataclass
class Calibration:
    step_s: float
    sync_save_s: float
    async_stall_s: float
    async_commit_s: float
    state_bytes: int

    @property
    def write_s(self) -> float:
        return max(self.sync_save_s, self.async_commit_s)

    def pick_k(self, factor: float) -> int:
        return max(1, math.ceil(factor * self.write_s / self.step_s))


def tensor_bytes(state: Any) -> int:
    total = 0
    for leaf in state.values(include_nested=True, leaves_only=True):
        if isinstance(leaf, torch.Tensor):
            total += leaf.numel() * leaf.element_size()
    return total


def calibrate(trainer: Trainer, workdir: Path, timed_steps: int) -> Calibration:
    """Time a training step and one durable save of the state (sync and async)."""
    for _ in range(2):  # untimed: first-touch allocations, kernel selection
        trainer.forward_backward()
        trainer.optimizer_step()
    step_times = []
    for _ in range(timed_steps):
        t0 = time.perf_counter()
        trainer.forward_backward()
        trainer.optimizer_step()
        step_times.append(time.perf_counter() - t0)
    state = trainer.state(0)
    dest = workdir / "calibrate"
    stager = fc.checkpoint.Stager()
    fc.save_async(dest, state, stager=stager).result()  # allocates the buffers
    remove_path(dest)
    settle()
    sync_s, _ = timed(lambda: fc.save(dest, state))
    remove_path(dest)
    settle()
    t0 = time.perf_counter()
    pending = fc.save_async(dest, state, stager=stager)
    pending.wait_staged()
    stall = time.perf_counter() - t0
    pending.result()
    commit = time.perf_counter() - t0
    remove_path(dest)
    settle()
    # The fastest step: on a shared machine the others were slowed by someone else's
    # load, and the fastest one gives the largest (safest) K.
    return Calibration(min(step_times), sync_s, stall, commit, tensor_bytes(state))


# --------------------------------------------------------------------------- blocks


@dataclass
class BlockResult:
    variant: str  # "baseline" | "async"
    steps: int
    seconds: float
    cpu: float = 0.0  # process CPU time (all threads, the writer's included)
    blocked: float = 0.0
    saves: int = 0

    @property
    def throughput(self) -> float:
        return self.steps / self.seconds

    @property
    def cpu_per_step(self) -> float:
        return self.cpu / self.steps


def run_block(
    trainer: Trainer, steps: int, first_step: int, k: int, ckpt: Checkpointer | None
) -> BlockResult:
    """``steps`` training steps; with ``ckpt``, a checkpoint after every K-th step."""
    if ckpt is None:
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(steps):
            trainer.forward_backward()
            trainer.optimizer_step()
        seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
        return BlockResult("baseline", steps, seconds, cpu)
    blocked0, saves0 = ckpt.blocked, ckpt.saves
    c0, t0 = time.process_time(), time.perf_counter()
    for i in range(steps):
        trainer.forward_backward()
        ckpt.timed_wait_staged()  # before the first in-place mutation of the state
        trainer.optimizer_step()
        ckpt.timed_after_step(trainer, first_step + i, i % k == 0)
    ckpt.timed_wait()  # the block pays for all of its checkpoints
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    blocked, saves = ckpt.blocked - blocked0, ckpt.saves - saves0
    return BlockResult("async", steps, seconds, cpu, blocked, saves)


@dataclass
class Run:
    blocks: list[BlockResult] = field(default_factory=list)

    def throughputs(self, variant: str) -> list[float]:
        return [b.throughput for b in self.blocks if b.variant == variant]

    def median_throughput(self, variant: str) -> float:
        return median(self.throughputs(variant))

    def overhead_pct(self) -> float:
        base, ckpt = self.median_throughput("baseline"), self.median_throughput("async")
        return (1.0 - ckpt / base) * 100.0

    def median_cpu_per_step(self, variant: str) -> float:
        return median([b.cpu_per_step for b in self.blocks if b.variant == variant])

    def cpu_overhead_pct(self) -> float:
        """Extra process CPU time per step: less sensitive to other processes' load."""
        base, ckpt = self.median_cpu_per_step("baseline"), self.median_cpu_per_step("async")
        return (ckpt / base - 1.0) * 100.0

    def paired_overheads_pct(self) -> list[float]:
        """Overhead of each async block against the baseline block right before it."""
        out = []
        for prev, cur in zip(self.blocks, self.blocks[1:], strict=False):
            if prev.variant == "baseline" and cur.variant == "async":
                out.append((1.0 - cur.throughput / prev.throughput) * 100.0)
        return out


def run_blocks(
    trainer: Trainer,
    nblocks: int,
    steps_per_block: int,
    k: int,
    make_ckpt: Callable[[], Checkpointer],
) -> tuple[Run, Checkpointer]:
    ckpt = make_ckpt()
    # Warm the checkpointer (allocates its staging buffers) outside the measurement.
    ckpt.timed_after_step(trainer, 0, True)
    ckpt.timed_wait()
    ckpt.reset_counters()
    run = Run()
    step = k  # checkpoints land on multiples of k; step 0 was the warm-up
    try:
        for b in range(nblocks):
            variant = "baseline" if b % 2 == 0 else "async"
            settle()
            res = run_block(trainer, steps_per_block, step, k, ckpt if variant == "async" else None)
            step += steps_per_block
            run.blocks.append(res)
            log(
                f"  block {b + 1}/{nblocks} {variant:8s}: {res.throughput:.3f} steps/s"
                + (f", blocked {res.blocked:.3f} s over {res.saves} saves" if res.saves else "")
            )
    finally:
        ckpt.close()
    return run, ckpt


# --------------------------------------------------------------------------- report


def render_blocks(run: Run) -> str:
    headers = ["block", "variant", "steps", "time", "steps/s", "CPU s/step", "saves", "blocked"]
    table = Table(headers)
    for i, b in enumerate(run.blocks):
        table.add(
            i + 1,
            b.variant,
            b.steps,
            fmt_seconds(b.seconds),
            f"{b.throughput:.3f}",
            f"{b.cpu_per_step:.3f}",
            b.saves if b.variant == "async" else "-",
            fmt_seconds(b.blocked) if b.variant == "async" else "-",
        )
    return table.render()


def summary_rows(run: Run, ckpt: Checkpointer, cal: Calibration, k: int) -> list[list[str]]:
    base, asy = run.median_throughput("baseline"), run.median_throughput("async")
    async_time = sum(b.seconds for b in run.blocks if b.variant == "async")
    blocked = sum(b.blocked for b in run.blocks if b.variant == "async")
    saves = sum(b.saves for b in run.blocks if b.variant == "async")
    overhead = run.overhead_pct()
    paired = run.paired_overheads_pct()
    return [
        ["baseline throughput (median of blocks)", f"{base:.3f} steps/s", ""],
        ["async-checkpoint throughput (median of blocks)", f"{asy:.3f} steps/s", ""],
        [
            "checkpoint interval (calibration)",
            f"K={k} steps = {fmt_seconds(k * cal.step_s)}",
            f"{k * cal.step_s / cal.write_s:.1f}x the write time ({fmt_seconds(cal.write_s)})",
        ],
        [
            "checkpoint interval (baseline blocks)",
            fmt_seconds(k / base),
            f"{k / base / cal.write_s:.1f}x the write time",
        ],
        ["checkpoints written (measured blocks)", str(saves), ""],
        [
            "time blocked on checkpoints",
            fmt_seconds(blocked),
            f"{blocked / async_time * 100:.2f}% of async-block time" if async_time else "",
        ],
        [
            "  of which",
            ", ".join(f"{name} {fmt_seconds(v)}" for name, v in ckpt.blocked_by.items()),
            "save call: capture + maybe_save (plan, start, prune)",
        ],
        [
            "wait_staged stall per checkpoint (median)",
            fmt_ms(median(ckpt.stalls) if ckpt.stalls else None),
            "the forward/backward pass hides the rest of the copy",
        ],
        [
            "overhead (1 - async / baseline)",
            fmt_pct(overhead),
            f"target <= {TARGET_OVERHEAD_PCT:.0f}%: {verdict(overhead, TARGET_OVERHEAD_PCT)}",
        ],
        [
            "CPU time per step, async vs baseline (medians)",
            fmt_pct(run.cpu_overhead_pct()),
            "process CPU incl. the writer thread; info only",
        ],
        [
            "paired overheads (each async block vs the one before)",
            ", ".join(map(fmt_pct, paired)),
            f"median {fmt_pct(median(paired))}: less sensitive to slow drift",
        ],
    ]


def render_summary(rows: list[list[str]]) -> str:
    table = Table(["measure", "value", "note"])
    for r in rows:
        table.add(*r)
    return table.render()


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    p.add_argument("--d", type=int, default=None, help="model width (default 1024)")
    p.add_argument("--hidden", type=int, default=None, help="hidden width (default 4 d)")
    p.add_argument("--blocks-model", type=int, default=None, help="residual blocks (12)")
    p.add_argument("--batch", type=int, default=None, help="rows per batch (default 16)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--blocks", type=int, default=None, help="A/B blocks (default 12, quick 4)")
    p.add_argument(
        "--saves-per-block", type=int, default=None, help="checkpoints per async block (default 2)"
    )
    p.add_argument(
        "--interval-factor",
        type=float,
        default=10.0,
        help="checkpoint interval >= this many times the write time (default 10)",
    )
    p.add_argument("--k", type=int, default=None, help="force the checkpoint interval K")
    p.add_argument("--mode", choices=["auto", "manager", "save_async"], default="auto")
    add_run_args(p, "train_overhead", strict="the target")
    args = p.parse_args(argv)
    quick = args.quick
    args.d = args.d or (64 if quick else 1024)
    args.hidden = args.hidden or 4 * args.d
    args.blocks_model = args.blocks_model or (2 if quick else 12)
    args.batch = args.batch or (8 if quick else 16)
    args.blocks = args.blocks or (4 if quick else 12)
    args.saves_per_block = args.saves_per_block or (2 if quick else 1)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    fstype = check_not_tmpfs(args.dir, allow=args.allow_tmpfs)
    workdir = scratch_dir(args.dir)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    if args.mode == "manager" and not manager_has_async():
        raise SystemExit("--mode manager: fc.CheckpointManager has no async_save option yet")
    use_manager = args.mode == "manager" or (args.mode == "auto" and manager_has_async())
    trainer = make_trainer(args)
    params = num_params(trainer.model)
    log(f"model: {params / 1e6:.1f}M parameters, batch {args.batch}, {args.threads} threads")
    try:
        cal = calibrate(trainer, workdir, timed_steps=20 if args.quick else 6)
        k = args.k or cal.pick_k(args.interval_factor)
        if args.quick and not args.k:
            k = min(k, 5)  # bounded smoke-test length whatever the calibration says
        steps_per_block = k * args.saves_per_block
        print(
            f"calibration: step {fmt_seconds(cal.step_s)}; state {cal.state_bytes / MiB:.0f} MiB; "
            f"sync fc.save {fmt_seconds(cal.sync_save_s)}; async stall "
            f"{fmt_seconds(cal.async_stall_s)}, commit {fmt_seconds(cal.async_commit_s)}; "
            f"write time {fmt_seconds(cal.write_s)} -> K = {k} steps "
            f"({k * cal.step_s / cal.write_s:.1f}x the write time); "
            f"{args.blocks} blocks x {steps_per_block} steps",
            flush=True,
        )
        ckpt_root = workdir / "ckpt"

        def make_ckpt() -> Checkpointer:
            if use_manager:
                return ManagerCheckpointer(ckpt_root, k)
            return DirectCheckpointer(ckpt_root)

        run, ckpt = run_blocks(trainer, args.blocks, steps_per_block, k, make_ckpt)
        last = ckpt.last_path()
        verified = bool(last is not None and fc.verify(last).ok)
    finally:
        remove_path(workdir)

    summary = summary_rows(run, ckpt, cal, k)
    overhead = run.overhead_pct()
    print(
        f"\nfunctional_ckpt training-overhead benchmark ({started}): {params / 1e6:.1f}M "
        f"parameters (d={args.d}, hidden={args.hidden}, {args.blocks_model} blocks), fused AdamW, "
        f"batch {args.batch}, {args.threads} threads; checkpoints via {ckpt.kind} into "
        f"{args.dir} ({fstype}), fsynced; state {cal.state_bytes / MiB:.0f} MiB "
        f"(model + optimizer + rng)."
    )
    print(
        f"calibration: step {fmt_seconds(cal.step_s)}, "
        f"sync fc.save {fmt_seconds(cal.sync_save_s)}, "
        f"async commit {fmt_seconds(cal.async_commit_s)} (stall {fmt_seconds(cal.async_stall_s)})"
    )
    print("\n" + render_blocks(run))
    print("\n" + render_summary(summary))
    print(f"last checkpoint verified: {verified}")
    if args.quick:
        print("(--quick: the model is too small for the target to mean anything)")

    payload = {
        "benchmark": "train_overhead",
        "started": started,
        "config": {
            "quick": args.quick,
            "params": params,
            "d": args.d,
            "hidden": args.hidden,
            "model_blocks": args.blocks_model,
            "batch": args.batch,
            "threads": args.threads,
            "blocks": args.blocks,
            "saves_per_block": args.saves_per_block,
            "interval_factor": args.interval_factor,
            "k": k,
            "steps_per_block": steps_per_block,
            "checkpointer": ckpt.kind,
            "manager_async": use_manager,
            "dir": str(args.dir),
            "filesystem": fstype,
        },
        "calibration": {
            "step_s": cal.step_s,
            "sync_save_s": cal.sync_save_s,
            "async_stall_s": cal.async_stall_s,
            "async_commit_s": cal.async_commit_s,
            "write_s": cal.write_s,
            "state_bytes": cal.state_bytes,
            "interval_s": k * cal.step_s,
        },
        "blocks": [
            {
                "variant": b.variant,
                "steps": b.steps,
                "seconds": b.seconds,
                "steps_per_s": b.throughput,
                "cpu_s": b.cpu,
                "saves": b.saves,
                "blocked_s": b.blocked,
            }
            for b in run.blocks
        ],
        "baseline_steps_per_s": run.median_throughput("baseline"),
        "async_steps_per_s": run.median_throughput("async"),
        "overhead_pct": overhead,
        "paired_overheads_pct": run.paired_overheads_pct(),
        "median_paired_overhead_pct": median(run.paired_overheads_pct()),
        "cpu_overhead_pct": run.cpu_overhead_pct(),
        "blocked_s": sum(b.blocked for b in run.blocks),
        "blocked_by_s": ckpt.blocked_by,
        "wait_staged_stalls_s": ckpt.stalls,
        "last_checkpoint_verified": verified,
        "target": {
            "name": "overhead_pct",
            "limit": TARGET_OVERHEAD_PCT,
            "value": overhead,
            "result": verdict(overhead, TARGET_OVERHEAD_PCT),
        },
        "environment": environment(),
    }
    return finish(args, payload, failed=overhead > TARGET_OVERHEAD_PCT)


if __name__ == "__main__":
    sys.exit(main())
