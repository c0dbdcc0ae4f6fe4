"""How long does an asynchronous save stall the training loop?

What is compared, in one run, on the same disk, with every save made durable:

``fc.save_async(staging="copy")``
    with one reused :class:`fc.checkpoint.Stager` per state (a warm-up save allocates its
    buffers first). *Stall*: from the call until ``wait_staged()`` returns.
``fc.save_async(staging="none")``
    no copy; the stall is the up-front checks and the hand-off to the writer thread.
``plain copy``
    ``dst.copy_(src)`` over the same tensors into preallocated buffers: the floor for
    any save that must let the caller mutate the state afterwards.
``fc.save``
    synchronous: the stall is the whole durable save.
``dcp.async_save``
    stock ``torch.distributed.checkpoint.async_save(..., no_dist=True)`` with one
    reused ``DefaultStager(StagingOptions(use_async_staging=True))`` per state
    (pinned memory, shared memory and non-blocking copies need an accelerator and
    are off). *Stall*: from the call until ``staging_completion`` is done.

peers (``benchmarks/_peers.py``)
    ``torch_checkpointing``'s ``CheckpointManager`` with its async saver (a writer
    process, shared-memory staging), durable through its hooks and as shipped; *stall*:
    from the call until its ``lock()`` is free (the capture is done). Stock
    ``dcp.async_save`` in ``PROCESS`` mode on a one-rank gloo group.

For the async variants the run also reports *commit*: from the call until the
checkpoint is durable (``result()``; DCP's ``upload_completion``).

Two states: *big* (16 x 64 MiB float32, 1 GiB: bandwidth-bound) and *small* (2,000
x 256 KiB float32, 500 MiB: per-tensor overhead shows). Every tool runs ``--reps``
times, interleaved (repetition k starts at a rotated position), files are deleted
and flushed (``os.sync``) between runs outside the timings, and medians are
reported, with targets checked as ratios within the run:

* stall(copy) <= 1.3x the plain copy;
* stall(copy) <= 0.15x sync ``fc.save``;
* stall(none) <= 5 ms on the 1 GiB state;
* stall(copy) <= stock ``dcp.async_save``'s stall (thread and process mode) and
  ``torch_checkpointing``'s.

Usage::

    python benchmarks/async_stall.py [--quick] [--reps N] [--dir DIR] [--json PATH]
                                     [--state big|small|both] [--strict]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _peers
import torch
from _common import (
    REPO_ROOT,
    KiB,
    MiB,
    Table,
    add_run_args,
    bench_parser,
    check_not_tmpfs,
    environment,
    finish,
    fmt_ms,
    fmt_ratio,
    fmt_seconds,
    median,
    ratio,
    remove_path,
    render_targets,
    rotate,
    scratch_dir,
    settle,
    verdict,
)

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import functional_ckpt as fc
from functional_ckpt._src.save.staging import Staging

# Tool labels: row keys in the table, the JSON and the targets.
FC_COPY = 'fc.save_async(staging="copy")'
FC_NONE = 'fc.save_async(staging="none")'
COPY = "plain copy (dst.copy_(src))"
FC_SYNC = "fc.save (sync)"
DCP_ASYNC = "dcp.async_save(DefaultStager)"
TC_ASYNC, TC_ASYNC_PLAIN, DCP_PROCESS = _peers.TC_ASYNC, _peers.TC_ASYNC_PLAIN, _peers.DCP_PROCESS

NOTES = {
    FC_COPY: "reused fc.checkpoint.Stager; stall = call -> wait_staged()",
    FC_NONE: "no copy; stall = call -> wait_staged()",
    COPY: "preallocated buffers; no disk",
    FC_SYNC: "stall = the whole durable save",
    DCP_ASYNC: "reused DefaultStager; stall = call -> staging_completion",
    TC_ASYNC: "reused CheckpointManager (writer process); stall = call -> lock() free",
    TC_ASYNC_PLAIN: "as above, without the fsync hooks: not durable",
    DCP_PROCESS: "writer process, reused DefaultStager; stall = call -> staging_completion",
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- states


@dataclass
class Workload:
    name: str  # "big" | "small"
    label: str
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def make_workload(name: str, count: int, numel: int) -> Workload:
    gen = torch.Generator().manual_seed(0 if name == "big" else 1)
    tensors = {f"w{i}": torch.randn(numel, generator=gen) for i in range(count)}
    size = numel * 4
    each = f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"
    total = count * size
    return Workload(name, f"{count} x {each} float32 ({total / MiB:.0f} MiB)", tensors)


# --------------------------------------------------------------------------- tools


@dataclass
class Timing:
    stall: float
    commit: float | None  # None: the tool has no background part


class Runner:
    """Every tool for one state, with the reusable buffers each of them keeps."""

    def __init__(self, w: Workload, workdir: Path) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.w = w
        self.workdir = workdir
        self.stager = fc.checkpoint.Stager()
        self.copy_buffers = [torch.empty_like(t) for t in w.tensors.values()]
        self.dcp_stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=False,
            )
        )

    def tools(self) -> dict[str, Callable[[Path], Timing]]:
        return {
            FC_COPY: self.fc_copy,
            FC_NONE: self.fc_none,
            COPY: self.plain_copy,
            FC_SYNC: self.fc_sync,
            DCP_ASYNC: self.dcp_async,
            **self.peers(),
        }

    def peers(self) -> dict[str, Callable[[Path], Timing]]:
        """torch_checkpointing's async saves (where installed) and DCP's process mode."""
        tools: dict[str, Callable[[Path], Timing]] = {DCP_PROCESS: self.dcp_process}
        if _peers.available():
            tools[TC_ASYNC] = lambda dest: Timing(*_peers.tc_async(dest, self.w.tensors))
            tools[TC_ASYNC_PLAIN] = lambda dest: Timing(
                *_peers.tc_async(dest, self.w.tensors, durable=False)
            )
        return tools

    def dcp_process(self, dest: Path) -> Timing:
        return Timing(*_peers.dcp_process(dest, dict(self.w.tensors)))

    def close(self) -> None:
        self.dcp_stager.close()
        _peers.close()

    def _fc_async(self, dest: Path, staging: Staging) -> Timing:
        t0 = time.perf_counter()
        pending = fc.save_async(dest, self.w.tensors, staging=staging, stager=self.stager)
        pending.wait_staged()
        t1 = time.perf_counter()
        pending.result()
        return Timing(t1 - t0, time.perf_counter() - t0)

    def fc_copy(self, dest: Path) -> Timing:
        return self._fc_async(dest, "copy")

    def fc_none(self, dest: Path) -> Timing:
        return self._fc_async(dest, "none")

    def plain_copy(self, dest: Path) -> Timing:
        t0 = time.perf_counter()
        with torch.no_grad():
            for dst, src in zip(self.copy_buffers, self.w.tensors.values(), strict=True):
                dst.copy_(src)
        return Timing(time.perf_counter() - t0, None)

    def fc_sync(self, dest: Path) -> Timing:
        t0 = time.perf_counter()
        fc.save(dest, self.w.tensors)
        return Timing(time.perf_counter() - t0, None)

    def dcp_async(self, dest: Path) -> Timing:
        from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse, async_save

        t0 = time.perf_counter()
        response = async_save(
            dict(self.w.tensors),
            checkpoint_id=dest,
            async_stager=self.dcp_stager,
            no_dist=True,
        )
        if isinstance(response, AsyncSaveResponse):
            response.staging_completion.result()
            t1 = time.perf_counter()
            response.upload_completion.result()
        else:  # staging ran inside the call
            t1 = time.perf_counter()
            response.result()
        return Timing(t1 - t0, time.perf_counter() - t0)

    def run(self, label: str, fn: Callable[[Path], Timing]) -> Timing:
        """One timed run; deletion and the flush of dirty pages stay outside the timing."""
        dest = self.workdir / f"{self.w.name}-{label.split('(')[0].replace('.', '_')}"
        remove_path(dest)
        settle()
        gc.collect()
        timing = fn(dest)
        remove_path(dest)
        settle()
        return timing


# --------------------------------------------------------------------------- results


@dataclass
class Results:
    stall: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    commit: dict[tuple[str, str], list[float]] = field(default_factory=dict)

    def add(self, state: str, label: str, t: Timing) -> None:
        self.stall.setdefault((state, label), []).append(t.stall)
        if t.commit is not None:
            self.commit.setdefault((state, label), []).append(t.commit)

    def med_stall(self, state: str, label: str) -> float | None:
        xs = self.stall.get((state, label))
        return median(xs) if xs else None

    def med_commit(self, state: str, label: str) -> float | None:
        xs = self.commit.get((state, label))
        return median(xs) if xs else None


def run_workload(w: Workload, workdir: Path, reps: int, res: Results) -> None:
    runner = Runner(w, workdir)
    try:
        tools = runner.tools()
        log(f"{w.name}: {w.label}: warm-up (allocates the staging buffers)")
        for label in (FC_COPY, FC_NONE, COPY, DCP_ASYNC, *runner.peers()):
            runner.run(label, tools[label])  # the peers' writer processes start here
        allocations = runner.stager.allocations
        for rep in range(reps):
            log(f"  {w.name}: repetition {rep + 1}/{reps}")
            for label in rotate(list(tools), rep):
                res.add(w.name, label, runner.run(label, tools[label]))
        if runner.stager.allocations != allocations:
            log(f"warning: the fc.checkpoint.Stager reallocated its buffers during {w.name}")
    finally:
        runner.close()


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    name: str
    state: str
    num: str  # the label whose stall is checked
    den: str | None  # None: the stall itself, in seconds
    limit: float


TARGETS = [
    *(
        t
        for state in ("big", "small")
        for t in (
            Target("stall(copy) / plain copy", state, FC_COPY, COPY, 1.3),
            Target("stall(copy) / sync fc.save", state, FC_COPY, FC_SYNC, 0.15),
            Target("stall(copy) / dcp.async_save stall", state, FC_COPY, DCP_ASYNC, 1.0),
            Target("stall(copy) / dcp.async_save(PROCESS) stall", state, FC_COPY, DCP_PROCESS, 1.0),
            Target(f"stall(copy) / {TC_ASYNC} stall", state, FC_COPY, TC_ASYNC, 1.0),
        )
    ),
    Target('stall(staging="none") at 1 GiB', "big", FC_NONE, None, 0.005),
]


def evaluate(res: Results) -> list[dict[str, Any]]:
    rows = []
    for t in TARGETS:
        num = res.med_stall(t.state, t.num)
        value = num if t.den is None else ratio(num, res.med_stall(t.state, t.den))
        rows.append(
            {
                "state": t.state,
                "target": t.name,
                "value": value,
                "limit": t.limit,
                "unit": "s" if t.den is None else "x",
                "result": verdict(value, t.limit),
            }
        )
    return rows


def result_rows(res: Results, workloads: dict[str, Workload]) -> list[dict[str, Any]]:
    rows = []
    for w in workloads.values():
        copy = res.med_stall(w.name, COPY)
        sync = res.med_stall(w.name, FC_SYNC)
        for label in (
            FC_COPY,
            FC_NONE,
            COPY,
            FC_SYNC,
            DCP_ASYNC,
            DCP_PROCESS,
            TC_ASYNC,
            TC_ASYNC_PLAIN,
        ):
            stall = res.med_stall(w.name, label)
            if stall is None:
                continue
            rows.append(
                {
                    "state": w.name,
                    "tool": label,
                    "stall_median_s": stall,
                    "commit_median_s": res.med_commit(w.name, label),
                    "stall_times_s": res.stall[(w.name, label)],
                    "commit_times_s": res.commit.get((w.name, label), []),
                    "stall_vs_plain_copy": ratio(stall, copy),
                    "stall_vs_sync_fc_save": ratio(stall, sync),
                    "bytes": w.nbytes,
                    "note": NOTES[label],
                }
            )
    return rows


def render_results(rows: list[dict[str, Any]]) -> str:
    table = Table(["state", "tool", "stall", "commit", "stall/copy", "stall/fc.save", "note"])
    for r in rows:
        table.add(
            r["state"],
            r["tool"],
            fmt_ms(r["stall_median_s"]),
            fmt_seconds(r["commit_median_s"]),
            fmt_ratio(r["stall_vs_plain_copy"]),
            fmt_ratio(r["stall_vs_sync_fc_save"]),
            r["note"],
        )
    return table.render()


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="small states and 2 repetitions")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 5, quick 2)")
    p.add_argument("--state", choices=["big", "small", "both"], default="both")
    add_run_args(p, "async_stall")
    return p.parse_args(argv)


def build_workloads(args: argparse.Namespace) -> dict[str, Workload]:
    out: dict[str, Workload] = {}
    if args.state in ("big", "both"):
        big = (8, 256 * KiB) if args.quick else (16, 16 * MiB)  # 8 x 1 MiB / 16 x 64 MiB
        out["big"] = make_workload("big", *big)
    if args.state in ("small", "both"):
        small = (200, 4 * KiB) if args.quick else (2_000, 64 * KiB)  # x 16 KiB / x 256 KiB
        out["small"] = make_workload("small", *small)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed")
    fstype = check_not_tmpfs(args.dir, allow=args.allow_tmpfs)
    workdir = scratch_dir(args.dir)
    reps = args.reps or (2 if args.quick else 5)
    workloads = build_workloads(args)
    res = Results()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        for name in list(workloads):
            run_workload(workloads[name], workdir, reps, res)
    finally:
        remove_path(workdir)
    rows = result_rows(res, workloads)
    targets = evaluate(res)

    print(
        f"\nfunctional_ckpt async-save stall benchmark ({started}): {reps} repetitions, "
        f"medians; scratch {args.dir} ({fstype}); every save fsynced; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads."
    )
    for w in workloads.values():
        print(f"  {w.name}: {w.label}")
    print("  stall: from the call until the caller may mutate the state again;")
    print("  commit: from the call until the checkpoint is durable.")
    print("\n" + render_results(rows))
    print("\n" + render_targets(targets, ("state", "target")))
    if args.quick:
        print("(--quick: the states are too small for the targets to mean anything)")

    payload = {
        "benchmark": "async_stall",
        "started": started,
        "config": {
            "reps": reps,
            "quick": args.quick,
            "dir": str(args.dir),
            "filesystem": fstype,
            "state": args.state,
            "threads": torch.get_num_threads(),
        },
        "states": {
            k: {"label": w.label, "bytes": w.nbytes, "tensors": len(w.tensors)}
            for k, w in workloads.items()
        },
        "environment": environment(),
        "rows": rows,
        "targets": targets,
    }
    return finish(args, payload)


if __name__ == "__main__":
    sys.exit(main())
