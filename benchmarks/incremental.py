"""Incremental checkpoints: what a save with ``base=`` costs against a full save.

The state is ``--size`` bytes of float32 in 20 equal tensors; ``--frozen`` of them
(default 90%: 18 of 20) never change, the others are updated in place between
saves, as an optimizer step would. One repetition runs, on the same disk and with
every save durable:

full save
  ``fc.save`` of the whole state (no base).
incremental, 90% frozen
  the trained tensors change; ``fc.save(base=previous)`` where ``previous`` was
  written by this process (the chain a manager's ``Disk(incremental=True)``
  builds): version counters tell which tensors moved, the frozen ones are
  confirmed by CRC32 and shared with the base by hard links.
incremental, 90% frozen, unknown base
  the same, with the version counters forgotten (a base written by another
  process): every tensor is checksummed before the write.
incremental, nothing frozen
  every tensor changes: the save writes everything, as a full one does.
restore
  ``fc.restore`` of the full checkpoint and of the 90%-frozen incremental one
  (two data files), warm page cache, ``RESTORE_ROUNDS`` times each, interleaved.

Each repetition runs every step (the full and the nothing-frozen saves twice,
in the order A B B A, which one is A alternating); medians are reported, with ratios to the full
save (time and bytes written, from ``fc.inspect(...).added_bytes``). Targets:
90% frozen writes <= 0.12x the bytes and takes <= 0.2x the time of a full save;
nothing frozen costs <= 1.05x a full save; restoring the incremental checkpoint
takes <= 1.05x restoring the full one.

Usage::

    python benchmarks/incremental.py [--quick] [--size BYTES] [--frozen F] [--reps N]
                                     [--dir DIR] [--json PATH] [--allow-tmpfs] [--strict]
"""

from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from _common import (
    REPO_ROOT,
    GiB,
    MiB,
    Table,
    add_run_args,
    bench_parser,
    check_not_tmpfs,
    environment,
    finish,
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

TENSORS = 20
#: Timed restores of each checkpoint per repetition (restores are quick and noisy).
RESTORE_ROUNDS = 3
FULL = "full save"
FROZEN = "incremental, 90% frozen"
FROZEN_COLD = "incremental, 90% frozen, unknown base"
NOTHING = "incremental, nothing frozen"
RESTORE_FULL = "restore full"
RESTORE_INC = "restore incremental"


def import_fc() -> types.ModuleType:
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import functional_ckpt

    return functional_ckpt


def build_state(size: int, frozen: float) -> tuple[dict[str, torch.Tensor], list[str]]:
    """``TENSORS`` float32 tensors of ``size`` bytes in all; the names that train."""
    numel = max(1, size // 4 // TENSORS)
    gen = torch.Generator().manual_seed(0)
    state = {f"w{i:02d}": torch.randn(numel, generator=gen) for i in range(TENSORS)}
    n_frozen = round(frozen * TENSORS)
    return state, [f"w{i:02d}" for i in range(n_frozen, TENSORS)]


def one_rep(
    fc: types.ModuleType,
    state: dict[str, torch.Tensor],
    trained: list[str],
    workdir: Path,
    k: int,
    times: dict[str, list[float]],
    written: dict[str, list[int]],
) -> None:
    from functional_ckpt._src.save import staging

    def step(names: Sequence[str]) -> None:
        for n in names:
            state[n].add_(1e-3)

    def save(label: str, name: str, base: Path | None) -> Path:
        settle()
        dest = workdir / f"{name}{k}"
        seconds, _ = timed(lambda: fc.save(dest, state, base=base))
        times[label].append(seconds)
        written[label].append(fc.inspect(dest).added_bytes)
        return dest

    settle()
    seed = workdir / f"seed{k}"
    fc.save(seed, state)
    chained = workdir / f"chained{k}"
    fc.save(chained, state, base=seed)  # untimed: this process now knows its counters
    step(trained)
    frozen = save(FROZEN, "frozen", chained)
    step(trained)
    staging.PROCESS_TRUST.clear()  # as if the base had been written by another process
    cold = save(FROZEN_COLD, "cold", frozen)
    step(list(state))
    # The same bytes, saved in full and on top of ``cold`` (whose counters are
    # known), twice each in the order A B B A, A alternating between repetitions:
    # the disk's drift, and whatever the first write after a sync pays, hit both alike.
    pair = rotate([(FULL, "full", None), (NOTHING, "nothing", cold)], k)
    paths: dict[str, Path] = {}
    for n, (label, name, base) in enumerate([*pair, *reversed(pair)]):
        paths.setdefault(label, save(label, f"{name}-{n}-", base))
    full = paths[FULL]
    restores: list[tuple[str, Callable[[], Any]]] = [
        (RESTORE_FULL, lambda: fc.restore(full)),
        (RESTORE_INC, lambda: fc.restore(frozen)),
    ]
    for r in range(RESTORE_ROUNDS + 1):  # interleaved; the first round warms the cache
        for label, fn in rotate(restores, k + r):
            seconds, back = timed(fn)
            del back
            if r:
                times[label].append(seconds)
    for p in list(workdir.iterdir()):
        remove_path(p)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="a 32 MiB state and 2 repetitions")
    p.add_argument("--size", type=int, default=None, help="state bytes (default 1 GiB)")
    p.add_argument("--frozen", type=float, default=0.9, help="fraction of tensors never changed")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 5, quick 2)")
    add_run_args(p, "incremental")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    fc = import_fc()
    size = args.size or (32 * MiB if args.quick else GiB)
    reps = args.reps or (2 if args.quick else 5)
    fstype = check_not_tmpfs(args.dir, allow=args.allow_tmpfs)
    workdir = scratch_dir(args.dir)
    state, trained = build_state(size, args.frozen)
    labels = [FULL, FROZEN, FROZEN_COLD, NOTHING, RESTORE_FULL, RESTORE_INC]
    times: dict[str, list[float]] = {label: [] for label in labels}
    written: dict[str, list[int]] = {label: [] for label in labels[:4]}
    try:
        fc.save(workdir / "warm-up", state)  # first-touch costs stay out of the timings
        remove_path(workdir / "warm-up")
        for k in range(reps):
            print(f"repetition {k + 1}/{reps}", file=sys.stderr, flush=True)
            one_rep(fc, state, trained, workdir, k, times, written)
    finally:
        remove_path(workdir)

    med = {label: median(v) for label, v in times.items()}
    bytes_med = {label: median([float(b) for b in v]) for label, v in written.items()}
    rows = []
    for label in labels:
        base = RESTORE_FULL if label.startswith("restore") else FULL
        row: dict[str, Any] = {
            "op": label,
            "times_s": times[label],
            "median_s": med[label],
            "time_ratio": ratio(med[label], med[base]),
        }
        if label in written:
            row["bytes_written"] = written[label]
            row["median_bytes"] = bytes_med[label]
            row["bytes_ratio"] = ratio(bytes_med[label], bytes_med[FULL])
        rows.append(row)
    by = {r["op"]: r for r in rows}
    targets = [
        ("90% frozen: bytes written <= 0.12x full", by[FROZEN]["bytes_ratio"], 0.12),
        ("90% frozen: time <= 0.2x full", by[FROZEN]["time_ratio"], 0.2),
        ("nothing frozen: time <= 1.05x full", by[NOTHING]["time_ratio"], 1.05),
        ("restore incremental <= 1.05x full", by[RESTORE_INC]["time_ratio"], 1.05),
    ]
    checks = [
        {"target": name, "value": value, "limit": limit, "result": verdict(value, limit)}
        for name, value, limit in targets
    ]

    table = Table(["OP", "MEDIAN", "TIME RATIO", "BYTES WRITTEN", "BYTES RATIO"])
    for r in rows:
        mb = r.get("median_bytes")
        table.add(
            r["op"],
            fmt_seconds(r["median_s"]),
            fmt_ratio(r["time_ratio"]),
            "-" if mb is None else f"{mb / MiB:.1f} MiB",
            fmt_ratio(r.get("bytes_ratio")),
        )
    print(
        f"state: {TENSORS} x {size // TENSORS / MiB:.1f} MiB float32 ({size / MiB:.0f} MiB), "
        f"{len(trained)} trained; {reps} repetitions; {args.dir} on {fstype}"
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
            "trained": len(trained),
            "frozen": args.frozen,
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
