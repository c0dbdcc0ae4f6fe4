"""The memory tier: a checkpoint every step into RAM, against no checkpointing at all.

The state is ``--size`` bytes of float32 in ``TENSORS`` equal tensors, every one
updated in place each step (as an optimizer step would), after ``--compute``
matmuls standing in for the forward and backward pass (by default as many as make
a step at least 20x a plain copy of the state). Measured, interleaved, ``--reps``
times:

copy
  *plain torch copy*: the state copied into buffers allocated beforehand
  (``Tensor.copy_``), the floor of any save that does not hold the loop back longer.
loop
  *no checkpoints*: ``--steps`` training steps;
  *memory tier every step*: the same steps with ``CheckpointManager(save=never(),
  tiers=(Memory(),))``: a memory save every step, off the training thread
  (``wait_staged`` after the compute, before the in-place update; ``wait`` at the
  end). *Blocking per save* is the median time the loop spends in ``maybe_save`` and
  ``wait_staged`` per step.
resume
  *from memory*: ``restore_latest(like)`` of a manager whose memory tier holds the
  newest step; *from disk*: ``restore_latest(like)`` of a read-only manager of the
  same root, whose disk tier holds the same step, with the page cache dropped first
  (``/proc/sys/vm/drop_caches`` where this process may write it, else each file's
  pages through ``posix_fadvise``; the output says which), as after a restart;
  *resume floor*: tensors like the state's allocated and filled by a plain copy
  (what any resume into new tensors pays before it reads a checkpoint).

replication (four ranks as two nodes of two, ``benchmarks/_replication.py``)
  *memory tier*: phase 2 of a memory-tier save: each rank's shard file (a quarter
  of ``--size``) sent to its holder on the other node and committed in every
  folder; *plain gloo*: the same bytes between the same ranks, one ``dist.send``
  per file into buffers allocated beforehand (the floor); *plain gloo into new
  files in RAM*: the same sends, each received straight into a new file in the
  receiver's folder (what landing a replica in RAM costs, with nothing else);
  *resume from replicas*: node b's folder deleted (a lost node), ``restore_latest``
  (node b's shards fetched from node a, every byte checked); *resume from disk*:
  ``restore_latest`` of the same step from the disk tier; *floor*: node b's files sent
  by plain gloo into buffers allocated beforehand, plus every rank's new tensors filled
  by a plain copy (each part timed on its own: what any resume of a lost node pays
  here before it checks a byte).

Each pair runs back to back, in the order A B, then B A; the loop's compute runs on
one thread (``torch.set_num_threads(1)``), the saves beside it. Medians are
reported with their ratios. Targets:

- where one training step takes at least 20x a plain memory copy of the state, the
  loop with an every-step async memory save is slowed by at most 5% against no
  checkpointing;
- each save blocks the loop for at most 1.2x a plain memory copy of the state;
- resume from the memory tier <= 0.3x the resume from the disk tier with its page
  cache dropped;
- replication runs at >= 0.8x the throughput of plain gloo sends;
- resuming a lost node from replicas takes <= 0.5x resuming it from disk.

``--no-replication`` leaves the four-rank rows out.

Usage::

    python benchmarks/memory_tier.py [--quick] [--size BYTES] [--steps N] [--reps N]
                                     [--compute N] [--dir DIR] [--memory-dir DIR]
                                     [--json PATH] [--allow-tmpfs] [--strict]
                                     [--no-replication]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import types
from collections.abc import Sequence
from functools import partial
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
    drop_cache,
    environment,
    finish,
    fmt_rate,
    fmt_ratio,
    fmt_seconds,
    median,
    ratio,
    remove_path,
    rotate,
    scratch_dir,
    settle,
    timed,
    verdict,
)

TENSORS = 8
COPY, BLOCKING = "copy: plain torch copy of the state", "blocking per save (memory tier)"
FRESH = "resume floor: fresh tensors filled by a copy"
PLAIN, MEMORY = "loop: no checkpoints", "loop: memory tier every step"
FROM_DISK, FROM_MEMORY = "resume: from disk", "resume: from memory"
GLOO, REPLICATE = "replication: plain gloo sends", "replication: memory tier"
INTO_FILES = "replication: plain gloo into new files in RAM"
LOST_DISK, LOST_REPLICAS = "lost node: resume from disk", "lost node: resume from replicas"
LOST_FLOOR = "lost node: floor (its files by plain gloo + fill)"


def import_fc() -> types.ModuleType:
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import functional_ckpt

    return functional_ckpt


def build_state(size: int) -> dict[str, torch.Tensor]:
    numel = max(1, size // 4 // TENSORS)
    gen = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(numel, generator=gen) for i in range(TENSORS)}


def compute(work: torch.Tensor, matmuls: int) -> None:
    """The forward and backward pass: reads the state (not here), changes none of it."""
    for _ in range(matmuls):
        work = work @ work
        work = work / (work.norm() + 1.0)


def update(state: dict[str, torch.Tensor]) -> None:
    """The optimizer step: every tensor of the state changed in place."""
    for t in state.values():
        t.add_(1e-3)


def plain_copy(state: dict[str, torch.Tensor], into: dict[str, torch.Tensor]) -> float:
    """Seconds to copy the state into buffers allocated beforehand."""
    start = time.perf_counter()
    with torch.no_grad():
        for k, t in state.items():
            into[k].copy_(t)
    return time.perf_counter() - start


def fresh_copy(state: dict[str, torch.Tensor]) -> float:
    """Seconds to allocate tensors like the state's and fill them by a plain copy: what
    any resume into new tensors pays before it reads a byte of a checkpoint."""
    start = time.perf_counter()
    with torch.no_grad():
        out = {k: torch.empty_like(t).copy_(t) for k, t in state.items()}
    seconds = time.perf_counter() - start
    del out
    return seconds


def calibrate(work: torch.Tensor, copy_s: float, factor: float = 30.0) -> int:
    """Matmuls making a step ``factor`` times a plain copy of the state (at least 20x
    with the machine's noise)."""
    compute(work, 2)
    one = median([timed(partial(compute, work, 1))[0] for _ in range(5)])
    return max(1, math.ceil(factor * copy_s / max(one, 1e-6)))


def plain_loop(
    state: dict[str, torch.Tensor], work: torch.Tensor, steps: int, matmuls: int
) -> None:
    for _ in range(steps):
        compute(work, matmuls)
        update(state)


def memory_loop(
    fc: Any,
    state: dict[str, torch.Tensor],
    work: torch.Tensor,
    steps: int,
    matmuls: int,
    root: Path,
    folder: Path | None,
    blocked: list[float] | None = None,
) -> None:
    """The same steps, a memory-tier save after each; ``blocked`` gets, per save, the
    seconds the loop spent in ``maybe_save`` and in the ``wait_staged`` after it."""
    tier = fc.manager.Memory(path=folder)
    clock = time.perf_counter
    with fc.CheckpointManager(root, save=fc.policy.never(), tiers=(tier,)) as mgr:
        held = 0.0
        for step in range(1, steps + 1):
            compute(work, matmuls)
            start = clock()
            mgr.wait_staged()
            held += clock() - start
            if step > 1 and blocked is not None:
                blocked.append(held)
            update(state)
            start = clock()
            mgr.maybe_save(state, step=step)
            held = clock() - start
        mgr.wait()


def resumes(
    fc: Any, state: dict[str, torch.Tensor], root: Path, folder: Path | None, disk_first: bool
) -> tuple[float, float, str]:
    """(seconds to resume from memory, from disk, how the page cache was dropped)."""
    like = {k: torch.empty_like(v) for k, v in state.items()}
    tier = fc.manager.Memory(path=folder, async_save=False)
    with fc.CheckpointManager(root, save=fc.policy.always(), tiers=(tier,)) as mgr:
        mgr.maybe_save(state, step=1)  # the same step in both tiers
        settle()

        def from_memory() -> float:
            seconds, got = timed(lambda: mgr.restore_latest(like=like))
            assert got is not None and mgr.restored_step == 1
            return seconds

        dropped = ""

        def from_disk() -> float:
            nonlocal dropped
            dropped = drop_cache(root)
            with fc.CheckpointManager(root, read_only=True) as ro:
                seconds, got = timed(lambda: ro.restore_latest(like=like))
                assert got is not None and ro.restored_step == 1
            return seconds

        if disk_first:
            t_disk = from_disk()
            t_memory = from_memory()
        else:
            t_memory = from_memory()
            t_disk = from_disk()
    return t_memory, t_disk, dropped


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="a 16 MiB state, 10 steps, 1 repetition")
    p.add_argument("--size", type=int, default=None, help="state bytes (default 256 MiB)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 30)")
    p.add_argument(
        "--compute",
        type=int,
        default=None,
        help="matmuls per step (256x256; default: a step of at least 20x a plain copy)",
    )
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3, quick 1)")
    p.add_argument(
        "--memory-dir", type=Path, default=None, help="the tier's folder (default: /dev/shm)"
    )
    p.add_argument(
        "--no-replication", action="store_true", help="leave out the four-rank replication rows"
    )
    add_run_args(p, "memory_tier")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    fc = import_fc()
    torch.set_num_threads(1)  # the loop's compute on one core, the saves beside it
    size = args.size or (16 * MiB if args.quick else 256 * MiB)
    steps = args.steps or (10 if args.quick else 12)
    reps = args.reps or (1 if args.quick else 3)
    fstype = check_not_tmpfs(args.dir, allow=args.allow_tmpfs)
    workdir = scratch_dir(args.dir)
    torch.manual_seed(0)
    work = torch.randn(256, 256)
    state = build_state(size)
    into = {k: torch.empty_like(v) for k, v in state.items()}
    for _ in range(2):  # the buffers' pages touched once, as a stager's are
        plain_copy(state, into)
    first_copy = median([plain_copy(state, into) for _ in range(5)])
    matmuls = args.compute if args.compute is not None else calibrate(work, first_copy)
    labels = (COPY, BLOCKING, PLAIN, MEMORY, FRESH, FROM_MEMORY, FROM_DISK)
    times: dict[str, list[float]] = {k: [] for k in labels}
    cpu_s: dict[str, list[float]] = {PLAIN: [], MEMORY: []}  # the process's, all threads
    dropped = ""
    try:
        warm = workdir / "warm-up"  # imports and first-touch costs stay out of the timings
        memory_loop(fc, state, work, 2, 1, warm, args.memory_dir and args.memory_dir / "warm-up")
        remove_path(warm)
        for k in range(reps):
            print(f"repetition {k + 1}/{reps}", file=sys.stderr, flush=True)
            folder = None if args.memory_dir is None else args.memory_dir / f"tier-{k}"
            root = workdir / f"loop-{k}"
            blocked: list[float] = []
            plain = partial(plain_loop, state, work, steps, matmuls)
            memory = partial(memory_loop, fc, state, work, steps, matmuls, root, folder, blocked)
            for label, fn in rotate([(PLAIN, plain), (MEMORY, memory)], k):  # A B, then B A
                cpu = time.process_time()
                times[label].append(timed(fn)[0])
                cpu_s[label].append(time.process_time() - cpu)
            times[BLOCKING].append(median(blocked))
            times[COPY] += [plain_copy(state, into) for _ in range(3)]
            remove_path(root)
            t_memory, t_disk, dropped = resumes(
                fc, state, workdir / f"resume-{k}", folder, k % 2 == 1
            )
            times[FRESH].append(fresh_copy(state))
            times[FROM_MEMORY].append(t_memory)
            times[FROM_DISK].append(t_disk)
            remove_path(workdir / f"resume-{k}")
        replicated = None
        if not args.no_replication:
            print("replication: four ranks", file=sys.stderr, flush=True)
            from _replication import launch

            ram = args.memory_dir if args.memory_dir is not None else Path("/dev/shm")
            shm = ram / f"fckpt-bench-{os.getpid()}"
            try:
                reports = launch(workdir / "replication", shm, size, max(reps, 3))
            finally:
                remove_path(shm)
            replicated = reports[0]  # every rank reports the slowest rank's times
            times[GLOO], times[REPLICATE] = replicated["plain"], replicated["replicate"]
            times[INTO_FILES] = replicated["into_files"]
            times[LOST_DISK], times[LOST_REPLICAS] = (
                replicated["from_disk"],
                replicated["from_replicas"],
            )
            times[LOST_FLOOR] = [
                a + b for a, b in zip(replicated["lost_plain"], replicated["fill"], strict=True)
            ]
    finally:
        remove_path(workdir)

    med = {label: median(v) for label, v in times.items()}
    base = {COPY: COPY, BLOCKING: COPY, PLAIN: PLAIN, MEMORY: PLAIN}
    base |= {FROM_DISK: FROM_DISK, FROM_MEMORY: FROM_DISK, FRESH: FROM_DISK}
    base |= {GLOO: GLOO, REPLICATE: GLOO, LOST_DISK: LOST_DISK, LOST_REPLICAS: LOST_DISK}
    base |= {LOST_FLOOR: LOST_DISK, INTO_FILES: GLOO}
    rows = [
        {
            "op": label,
            "times_s": times[label],
            "median_s": med[label],
            "ratio": ratio(med[label], med[base[label]]),
        }
        for label in times
    ]
    by = {r["op"]: r for r in rows}
    step_over_copy = ratio(med[PLAIN] / steps, med[COPY])
    targets = [
        (
            "where one training step takes at least 20x a plain memory copy of the state, "
            "the loop with an every-step async memory save is slowed by at most 5% against "
            "no checkpointing",
            by[MEMORY]["ratio"] if step_over_copy is not None and step_over_copy >= 20 else None,
            1.05,
        ),
        (
            "each save blocks the loop for at most 1.2x a plain memory copy of the state",
            by[BLOCKING]["ratio"],
            1.2,
        ),
        (
            "resume from the memory tier <= 0.3x the resume from the disk tier with its page "
            "cache dropped",
            by[FROM_MEMORY]["ratio"],
            0.3,
        ),
    ]
    if replicated is not None:
        throughput = ratio(med[GLOO], med[REPLICATE])  # the same bytes: times inverted
        by[REPLICATE]["throughput_ratio"] = throughput
        by[REPLICATE]["bytes"] = replicated["bytes"]
        by[LOST_REPLICAS]["fetched"] = reports[2]["fetched"]
        # >= 0.8x the throughput is <= 1.25x the time
        slower = None if throughput is None else 1.0 / throughput
        targets += [
            ("replication >= 0.8x the throughput of plain gloo (time <= 1.25x)", slower, 1.25),
            ("lost node: resume from replicas <= 0.5x from disk", by[LOST_REPLICAS]["ratio"], 0.5),
        ]
    checks = [
        {"target": name, "value": value, "limit": limit, "result": verdict(value, limit)}
        for name, value, limit in targets
    ]
    table = Table(["OP", "MEDIAN", "RATIO"])
    for r in rows:
        table.add(r["op"], fmt_seconds(r["median_s"]), fmt_ratio(r["ratio"]))
    if replicated is not None:
        table.add(
            "replication: throughput vs plain gloo",
            fmt_rate(replicated["bytes"], med[REPLICATE]),
            fmt_ratio(by[REPLICATE]["throughput_ratio"]),
        )
    print(
        f"state: {TENSORS} x {size // TENSORS / MiB:.1f} MiB float32 ({size / MiB:.0f} MiB); "
        f"{steps} steps of {matmuls} matmuls; {reps} repetitions; disk {args.dir} on {fstype}"
    )
    shown_step = "-" if step_over_copy is None else f"{step_over_copy:.1f}"
    print(
        f"one step (no checkpoints) = {shown_step}x a plain copy of the state "
        f"({fmt_seconds(med[PLAIN] / steps)} / {fmt_seconds(med[COPY])}); "
        f"disk page cache dropped by {dropped or '-'}"
    )
    save_cpu = (median(cpu_s[MEMORY]) - median(cpu_s[PLAIN])) / steps
    print(
        f"CPU time of one save (all threads): {fmt_seconds(save_cpu)} = "
        f"{save_cpu / med[COPY]:.1f}x a plain copy, {save_cpu / (med[PLAIN] / steps):.1%} "
        f"of a step; load {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
    )
    print(table.render())
    print()
    for c in checks:
        shown = "-" if c["value"] is None else f"{c['value']:.3f}"
        print(f"{c['result']:4}  {c['target']}  (measured {shown})")
    if args.quick:
        print("(--quick: the state is too small for the targets to mean anything)")
    payload = {
        "config": {
            "size": size,
            "tensors": TENSORS,
            "steps": steps,
            "compute": matmuls,
            "step_over_copy": step_over_copy,
            "page_cache": dropped,
            "save_cpu_s": save_cpu,
            "loadavg": os.getloadavg(),
            "reps": reps,
            "quick": args.quick,
            "fstype": fstype,
        },
        "environment": environment(),
        "rows": rows,
        "targets": checks,
    }
    return finish(args, payload)


if __name__ == "__main__":
    raise SystemExit(main())
