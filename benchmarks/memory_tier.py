"""The memory tier: a checkpoint every step into RAM, against no checkpointing at all.

The state is ``--size`` bytes of float32 in ``TENSORS`` equal tensors, every one
updated in place each step (as an optimizer step would), after ``--compute``
matmuls standing in for the forward and backward pass. Measured, interleaved,
``--reps`` times:

loop
  *no checkpoints*: ``--steps`` training steps;
  *memory tier every step*: the same steps with ``CheckpointManager(save=never(),
  memory=Memory())``: a memory save every step, off the training thread
  (``wait_staged`` before each in-place update, ``wait`` at the end).
resume
  *from memory*: ``restore_latest(like)`` of a manager whose memory tier holds the
  newest step; *from disk*: ``restore_latest(like)`` of a read-only manager of the
  same root, whose disk tier holds the same step (its files dropped from the page
  cache first where the OS allows, as after a restart).

replication (four ranks as two nodes of two, ``benchmarks/_replication.py``)
  *memory tier*: phase 2 of a memory-tier save: each rank's shard file (a quarter
  of ``--size``) sent to its holder on the other node and committed in every
  folder; *plain gloo*: the same bytes between the same ranks, one ``dist.send``
  per file into buffers allocated beforehand (the floor);
  *resume from replicas*: node b's folder deleted (a lost node), ``restore_latest``
  (node b's shards fetched from node a, every byte checked); *resume from disk*:
  ``restore_latest`` of the same step from the disk tier.

Each pair runs back to back, in the order A B, then B A; the loop's compute runs on
one thread (``torch.set_num_threads(1)``), the saves beside it. Medians are
reported with their ratios (memory loop / plain loop, memory resume /
disk resume, plain gloo time / replication time as a throughput ratio, resume
from replicas / from disk). Targets: a memory save every step costs <= 1.5x the
loop without checkpoints; resuming from memory takes <= 1.0x resuming from disk;
replication runs at >= 0.8x the throughput of plain gloo sends; resuming a lost
node from replicas takes <= 0.5x resuming it from disk. ``--no-replication``
leaves the four-rank rows out.

Usage::

    python benchmarks/memory_tier.py [--quick] [--size BYTES] [--steps N] [--reps N]
                                     [--dir DIR] [--memory-dir DIR] [--json PATH]
                                     [--allow-tmpfs] [--strict] [--no-replication]
"""

from __future__ import annotations

import argparse
import os
import sys
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
PLAIN, MEMORY = "loop: no checkpoints", "loop: memory tier every step"
FROM_DISK, FROM_MEMORY = "resume: from disk", "resume: from memory"
GLOO, REPLICATE = "replication: plain gloo sends", "replication: memory tier"
LOST_DISK, LOST_REPLICAS = "lost node: resume from disk", "lost node: resume from replicas"


def import_fc() -> types.ModuleType:
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import functional_ckpt

    return functional_ckpt


def build_state(size: int) -> dict[str, torch.Tensor]:
    numel = max(1, size // 4 // TENSORS)
    gen = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(numel, generator=gen) for i in range(TENSORS)}


def train_step(state: dict[str, torch.Tensor], work: torch.Tensor, compute: int) -> None:
    for _ in range(compute):
        work = work @ work
        work = work / (work.norm() + 1.0)
    for t in state.values():
        t.add_(1e-3)


def plain_loop(
    state: dict[str, torch.Tensor], work: torch.Tensor, steps: int, compute: int
) -> None:
    for _ in range(steps):
        train_step(state, work, compute)


def memory_loop(
    fc: Any,
    state: dict[str, torch.Tensor],
    work: torch.Tensor,
    steps: int,
    compute: int,
    root: Path,
    folder: Path | None,
) -> None:
    tier = fc.manager.Memory(path=folder)
    with fc.CheckpointManager(root, save=fc.policy.never(), memory=tier) as mgr:
        for step in range(1, steps + 1):
            mgr.wait_staged()
            train_step(state, work, compute)
            mgr.maybe_save(state, step=step)
        mgr.wait()


def drop_cache(root: Path) -> None:
    """Ask the OS to drop the files under ``root`` from the page cache (best effort)."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            try:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except (OSError, AttributeError):
                pass
            finally:
                os.close(fd)


def resumes(
    fc: Any, state: dict[str, torch.Tensor], root: Path, folder: Path | None, disk_first: bool
) -> tuple[float, float]:
    """(seconds to resume from memory, from disk) of the same step."""
    like = {k: torch.empty_like(v) for k, v in state.items()}
    tier = fc.manager.Memory(path=folder, async_save=False)
    with fc.CheckpointManager(root, save=fc.policy.always(), memory=tier) as mgr:
        mgr.maybe_save(state, step=1)  # the same step in both tiers
        settle()

        def from_memory() -> float:
            seconds, got = timed(lambda: mgr.restore_latest(like=like))
            assert got is not None and mgr.restored_step == 1
            return seconds

        def from_disk() -> float:
            drop_cache(root)
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
    return t_memory, t_disk


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="a 16 MiB state, 10 steps, 1 repetition")
    p.add_argument("--size", type=int, default=None, help="state bytes (default 256 MiB)")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 30)")
    p.add_argument("--compute", type=int, default=4, help="matmuls per step (256x256)")
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
    steps = args.steps or (10 if args.quick else 30)
    reps = args.reps or (1 if args.quick else 3)
    fstype = check_not_tmpfs(args.dir, allow=args.allow_tmpfs)
    workdir = scratch_dir(args.dir)
    torch.manual_seed(0)
    work = torch.randn(256, 256)
    state = build_state(size)
    times: dict[str, list[float]] = {k: [] for k in (PLAIN, MEMORY, FROM_MEMORY, FROM_DISK)}
    try:
        warm = workdir / "warm-up"  # imports and first-touch costs stay out of the timings
        memory_loop(fc, state, work, 2, 1, warm, args.memory_dir and args.memory_dir / "warm-up")
        remove_path(warm)
        for k in range(reps):
            print(f"repetition {k + 1}/{reps}", file=sys.stderr, flush=True)
            folder = None if args.memory_dir is None else args.memory_dir / f"tier-{k}"
            root = workdir / f"loop-{k}"
            plain = partial(plain_loop, state, work, steps, args.compute)
            memory = partial(memory_loop, fc, state, work, steps, args.compute, root, folder)
            for label, fn in rotate([(PLAIN, plain), (MEMORY, memory)], k):  # A B, then B A
                times[label].append(timed(fn)[0])
            remove_path(root)
            t_memory, t_disk = resumes(fc, state, workdir / f"resume-{k}", folder, k % 2 == 1)
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
            times[LOST_DISK], times[LOST_REPLICAS] = (
                replicated["from_disk"],
                replicated["from_replicas"],
            )
    finally:
        remove_path(workdir)

    med = {label: median(v) for label, v in times.items()}
    base = {PLAIN: PLAIN, MEMORY: PLAIN, FROM_DISK: FROM_DISK, FROM_MEMORY: FROM_DISK}
    base |= {GLOO: GLOO, REPLICATE: GLOO, LOST_DISK: LOST_DISK, LOST_REPLICAS: LOST_DISK}
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
    targets = [
        ("memory tier every step <= 1.5x no checkpoints", by[MEMORY]["ratio"], 1.5),
        ("resume from memory <= 1.0x from disk", by[FROM_MEMORY]["ratio"], 1.0),
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
        f"{steps} steps of {args.compute} matmuls; {reps} repetitions; disk {args.dir} on {fstype}"
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
            "compute": args.compute,
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
