"""The GIL: how much does a checkpoint being written slow a Python-heavy training step?

A step is about 2 ms of pure Python (a dict-and-integer loop, calibrated at start)
plus an in-place update of the state's tensors' first elements, the kind of step
whose time is the interpreter's, not a kernel's. The loop runs in blocks of
``--seconds`` each, alternating *baseline* (no checkpoint) with each saver, in
rotation, ``--reps`` times. A saver starts a save as soon as the previous one is
durable, so a checkpoint is being written during the whole block:

* ``fc.save_async(staging="copy")``: a writer *thread* in this process (one reused
  ``fc.checkpoint.Stager``); the step waits for ``wait_staged()`` before its update;
* ``torch_checkpointing`` async (where installed): a writer *process*, durable
  through its hooks; the update runs under its ``lock()``;
* ``dcp.async_save`` in ``PROCESS`` mode: a writer *process*; the update waits for
  ``staging_completion``.

Reported per variant (medians over the blocks): the time of a step (Python work
plus update, the saver's calls excluded) and its slowdown against the baseline,
which is what the GIL (and the machine's other cores) cost; and the loop's time
per step with every saver call included. The question it answers: does writing
from a thread cost the loop more than 5% (then a writer process pays)?

Usage::

    python benchmarks/gil_step.py [--quick] [--reps N] [--seconds S] [--mib M]
                                  [--dir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _peers
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
    median,
    remove_path,
    rotate,
    scratch_dir,
)

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import functional_ckpt as fc

BASELINE = "no checkpoint"
FC_THREAD = 'fc.save_async(staging="copy") (thread)'
TC_PROCESS = "torch_checkpointing async (process)"
DCP_PROCESS = _peers.DCP_PROCESS


def python_work(n: int) -> int:
    """Pure interpreter work: dict updates and integer arithmetic, no C loop."""
    d: dict[int, int] = {}
    for i in range(n):
        d[i & 63] = d.get(i & 63, 0) + i
    return len(d)


def calibrate(target: float = 0.002) -> int:
    """The loop length whose median time here is ``target`` seconds."""
    n = 1000
    while True:
        times = []
        for _ in range(21):
            t0 = time.perf_counter()
            python_work(n)
            times.append(time.perf_counter() - t0)
        took = median(times)
        if took >= target / 2:
            return max(1, round(n * target / took))
        n *= 2


class Saver:
    """One way of saving in the background: start, wait until the state may change, done."""

    def __init__(self, label: str, workdir: Path, state: dict[str, torch.Tensor]) -> None:
        self.label, self.workdir, self.state = label, workdir, state
        self.stager = fc.checkpoint.Stager()
        self.pending: Any = None
        self.count = 0
        self.dests: list[Path] = []

    def start(self) -> None:
        self.count += 1
        dest = self.workdir / f"{self.label.split()[0].replace('.', '_')}-{self.count}"
        self.dests.append(dest)
        if self.label == FC_THREAD:
            self.pending = fc.save_async(dest, self.state, staging="copy", stager=self.stager)
        elif self.label == TC_PROCESS:
            m = _peers.manager(asynchronous=True, durable=True)
            self.pending = (m, m.save(str(dest), {_peers.ITEM: self.state}))
        else:
            self.pending = _peers.dcp_process_start(dest, self.state)

    def before_update(self) -> Callable[[], Any]:
        """What the step's update must run under (the capture is done by then)."""
        if self.label == FC_THREAD:
            self.pending.wait_staged()
        elif self.label == TC_PROCESS:
            return self.pending[0].lock  # type: ignore[no-any-return]
        else:
            self.pending.staging_completion.result()
        return _nothing

    def done(self) -> bool:
        if self.label == FC_THREAD:
            return bool(self.pending.done())
        if self.label == TC_PROCESS:
            return bool(self.pending[1].done())
        return bool(self.pending.upload_completion.done())

    def finish(self) -> None:
        if self.label == FC_THREAD:
            self.pending.result()
        elif self.label == TC_PROCESS:
            self.pending[1].result()
        else:
            self.pending.upload_completion.result()
        while len(self.dests) > 1:  # keep the newest: disk use stays bounded
            remove_path(self.dests.pop(0))


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _nothing() -> _Nothing:
    return _Nothing()


def block(
    saver: Saver | None, state: dict[str, torch.Tensor], n: int, seconds: float
) -> tuple[float, float]:
    """(median step time, loop time per step) over ``seconds`` of training."""
    steps: list[float] = []
    gc.collect()
    t_start = time.perf_counter()
    if saver is not None:
        saver.start()
    while not steps or time.perf_counter() - t_start < seconds:
        guard = _nothing
        if saver is not None:
            if saver.done():
                saver.finish()
                saver.start()
            guard = saver.before_update()
        t0 = time.perf_counter()
        python_work(n)
        with guard(), torch.no_grad():
            for t in state.values():
                t[0] += 1.0
        steps.append(time.perf_counter() - t0)
    if saver is not None:
        saver.finish()
    return median(steps), (time.perf_counter() - t_start) / len(steps)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="a small state, short blocks")
    p.add_argument("--reps", type=int, default=None, help="blocks per variant (default 3)")
    p.add_argument("--seconds", type=float, default=None, help="seconds per block (default 8)")
    p.add_argument("--mib", type=int, default=None, help="state size in MiB (default 256)")
    add_run_args(p, "gil_step", strict="the 5% slowdown of the thread writer")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    reps = args.reps or (1 if args.quick else 3)
    seconds = args.seconds or (0.5 if args.quick else 8.0)
    mib = args.mib or (8 if args.quick else 256)
    fstype = check_not_tmpfs(args.dir, allow=args.allow_tmpfs)
    workdir = scratch_dir(args.dir)
    gen = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(mib * MiB // 4 // 16, generator=gen) for i in range(16)}
    n = calibrate()
    labels = [FC_THREAD, *([TC_PROCESS] if _peers.available() else []), DCP_PROCESS]
    savers = {label: Saver(label, workdir, state) for label in labels}
    step: dict[str, list[float]] = {}
    loop: dict[str, list[float]] = {}
    try:
        for label in labels:  # warm: staging buffers, writer processes
            block(savers[label], state, n, 0.2)
        for rep in range(reps):
            print(f"repetition {rep + 1}/{reps}", file=sys.stderr, flush=True)
            for label in rotate([BASELINE, *labels], rep):
                s, per = block(savers.get(label), state, n, seconds)
                step.setdefault(label, []).append(s)
                loop.setdefault(label, []).append(per)
    finally:
        _peers.close()
        remove_path(workdir)
    base_step, base_loop = median(step[BASELINE]), median(loop[BASELINE])
    rows = [
        {
            "variant": label,
            "step_median_s": median(step[label]),
            "step_slowdown": median(step[label]) / base_step - 1.0,
            "loop_per_step_s": median(loop[label]),
            "loop_slowdown": median(loop[label]) / base_loop - 1.0,
        }
        for label in [BASELINE, *labels]
    ]
    table = Table(["variant", "step", "slowdown", "loop per step", "slowdown (loop)"])
    for r in rows:
        table.add(
            r["variant"],
            fmt_ms(r["step_median_s"]),
            fmt_pct(100 * r["step_slowdown"]),
            fmt_ms(r["loop_per_step_s"]),
            fmt_pct(100 * r["loop_slowdown"]),
        )
    print(
        f"\nGIL benchmark: {mib} MiB state (16 float32 tensors), a step of "
        f"{1e3 * base_step:.2f} ms (Python, calibrated {n} iterations, plus an in-place "
        f"update), {reps} x {seconds:g} s blocks per variant; scratch {args.dir} ({fstype}); "
        f"torch {torch.__version__}.\n"
    )
    print(table.render())
    thread = next(r for r in rows if r["variant"] == FC_THREAD)
    value = thread["step_slowdown"]
    targets = [
        {
            "target": "step slowdown while a thread writes (fc.save_async)",
            "value": value,
            "limit": 0.05,
            "result": "PASS" if value <= 0.05 else "FAIL",
        }
    ]
    payload = {
        "benchmark": "gil_step",
        "config": {"reps": reps, "seconds": seconds, "mib": mib, "iterations": n},
        "environment": environment(),
        "rows": rows,
        "targets": targets,
    }
    return finish(args, payload)


if __name__ == "__main__":
    sys.exit(main())
