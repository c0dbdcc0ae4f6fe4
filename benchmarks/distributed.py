"""Multi-rank save / restore: ``fc.save`` against stock ``torch.distributed.checkpoint``.

Two ranks on this machine (gloo, CPU) save a sharded state: ``--count`` float32
tensors of ``--mib`` MiB each (default 16 x 64 MiB = 1 GiB), every one a DTensor
with ``Shard(0)`` over a 2-rank CPU mesh, so each rank holds and writes half of
it (512 MiB). Compared, on the same disk, with every save durable:

save
  ``fc.save(path, state)`` (dispatches to the multi-rank save under the process
  group) against ``dcp.save(state, checkpoint_id=path, process_group=group)`` with
  its default ``FileSystemWriter`` (which fsyncs its files).
restore (for information; warm page cache: each tool reads what it just wrote)
  ``fc.restore(path, out=template)`` in place into DTensor templates against
  ``dcp.load(template, checkpoint_id=path, process_group=group)`` into the same
  preallocated DTensors.

Time of one operation = the maximum over ranks of ``barrier; t0; op; barrier; t1``.
Each tool runs ``--reps`` times, interleaved (repetition k starts at a rotated
position); the median is reported. Files are removed and flushed (``os.sync``)
between operations, outside the timed region. One untimed repetition
(a full save and restore per tool) comes first: it creates the checkpoint process
groups, imports the planners, starts helper threads and absorbs the first large
write of the run, which is several times slower whichever tool makes it.

Target: median ``fc.save`` / median ``dcp.save`` <= 0.8.

Without ``RANK`` in the environment the script is the launcher: it starts two
copies of itself with ``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE`` set,
collects their timings from per-rank JSON files, prints one table and writes
``--json``.

Usage::

    python benchmarks/distributed.py [--quick] [--reps N] [--dir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

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
    free_port,
    median,
    ratio,
    remove_path,
    rotate,
    scratch_dir,
    settle,
    verdict,
    write_json,
)

WORLD = 2
TARGET = 0.8  # fc.save / dcp.save

FC_SAVE = "fc.save"
DCP_SAVE = "dcp.save"
FC_RESTORE = "fc.restore(out=template)"
DCP_LOAD = "dcp.load(template)"
SAVE_TOOLS = (FC_SAVE, DCP_SAVE)
RESTORE_OF = {FC_SAVE: FC_RESTORE, DCP_SAVE: DCP_LOAD}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="small state and 2 repetitions")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 5, quick 2)")
    p.add_argument("--count", type=int, default=None, help="tensors (default 16, quick 4)")
    p.add_argument("--mib", type=int, default=None, help="MiB per tensor (default 64, quick 4)")
    add_run_args(p, "distributed", strict="the target")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    p.add_argument("--rank-dir", type=Path, help=argparse.SUPPRESS)  # set by the launcher
    args = p.parse_args(argv)
    args.reps = args.reps if args.reps is not None else (2 if args.quick else 5)
    args.count = args.count if args.count is not None else (4 if args.quick else 16)
    args.mib = args.mib if args.mib is not None else (4 if args.quick else 64)
    if args.reps < 1 or args.count < 1 or args.mib < 1:
        p.error("--reps, --count and --mib must be positive")
    return args


# --------------------------------------------------------------------------- one rank


def worker(args: argparse.Namespace) -> None:
    """One rank: build the sharded state, run every repetition, write its timings."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import functional_ckpt as fc

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    bench = dist.new_group(backend="gloo")  # timing barriers
    dcp_group = dist.new_group(backend="gloo")  # dcp's collectives, like fc's own group
    base: Path = args.dir

    def sharded(rows: int, cols: int, seed: int | None) -> DTensor:
        local_rows = rows // world
        if seed is None:
            local = torch.zeros(local_rows, cols)
        else:
            gen = torch.Generator().manual_seed(seed * 1000 + rank)
            local = torch.rand(local_rows, cols, generator=gen)
        return DTensor.from_local(
            local,
            mesh,
            [Shard(0)],
            run_check=False,
            shape=torch.Size((rows, cols)),
            stride=(cols, 1),
        )

    cols = 1024
    rows = args.mib * MiB // (4 * cols)
    rows -= rows % world
    state = {f"t{i:02d}": sharded(rows, cols, i) for i in range(args.count)}
    template = {k: sharded(rows, cols, None) for k in state}

    def barrier() -> None:
        dist.barrier(group=bench)

    def save(tool: str, path: Path, st: dict[str, Any]) -> None:
        if tool == FC_SAVE:
            fc.save(path, st)
        else:
            dcp_save(st, checkpoint_id=path, process_group=dcp_group)

    def restore(tool: str, path: Path, tpl: dict[str, Any]) -> None:
        if tool == FC_SAVE:
            fc.restore(path, out=tpl)  # in place, like dcp.load
        else:
            dcp_load(tpl, checkpoint_id=path, process_group=dcp_group)

    def timed(fn: Callable[[], None]) -> float:
        barrier()
        t0 = time.perf_counter()
        fn()
        barrier()
        return time.perf_counter() - t0

    def cleanup(path: Path) -> None:
        barrier()
        if rank == 0:
            remove_path(path)
            settle()
        barrier()

    for tool in SAVE_TOOLS:  # untimed warm-up repetition
        path = base / f"warmup-{tool}"
        save(tool, path, state)
        restore(tool, path, template)
        cleanup(path)

    times: dict[str, list[float]] = {t: [] for t in (*SAVE_TOOLS, *RESTORE_OF.values())}
    file_bytes: dict[str, int] = {}
    for k in range(args.reps):
        for tool in rotate(SAVE_TOOLS, k):
            path = base / f"rep{k}-{tool}"
            times[tool].append(timed(lambda: save(tool, path, state)))  # noqa: B023
            if rank == 0 and tool not in file_bytes:
                file_bytes[tool] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
            for t in template.values():
                t.to_local().zero_()
            times[RESTORE_OF[tool]].append(timed(lambda: restore(tool, path, template)))  # noqa: B023
            if k == 0:  # correctness, outside the timed region
                for key, t in state.items():
                    if not torch.equal(template[key].to_local(), t.to_local()):
                        raise SystemExit(f"rank {rank}: {tool} round trip differs at {key}")
            cleanup(path)

    out = {
        "rank": rank,
        "times_s": times,
        "file_bytes": file_bytes,
        "local_bytes": sum(t.to_local().numel() * 4 for t in state.values()),
        "global_bytes": sum(t.numel() * 4 for t in state.values()),
        "shape": [rows, cols],
    }
    write_json(args.rank_dir / f"rank{rank}.json", out)
    barrier()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- launcher


def launch(args: argparse.Namespace, argv: Sequence[str], rank_dir: Path) -> None:
    """Start WORLD copies of this script as ranks; wait for all; raise if one failed."""
    port = str(free_port())
    procs: list[subprocess.Popen[str]] = []
    logs = []
    for rank in range(WORLD):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(WORLD),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
            "PYTHONPATH": os.pathsep.join(
                p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p
            ),
        }
        log = open(rank_dir / f"rank{rank}.log", "w+", encoding="utf-8")  # noqa: SIM115
        logs.append(log)
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv]
        cmd += ["--dir", str(args.dir), "--rank-dir", str(rank_dir)]
        procs.append(
            subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        )
    deadline = time.monotonic() + args.timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                raise RuntimeError(f"ranks did not finish within {args.timeout:.0f} s")
            if any(p.returncode not in (None, 0) for p in procs):
                time.sleep(5)  # give the other rank a moment to fail on its own
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
    for log in logs:
        log.close()
    if failed:
        tails = []
        for r, rc in failed:
            text = (rank_dir / f"rank{r}.log").read_text(encoding="utf-8", errors="replace")
            tails.append(f"--- rank {r} (exit {rc}):\n{text[-3000:]}")
        raise RuntimeError("a rank failed:\n" + "\n".join(tails))


def summarize(args: argparse.Namespace, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    tools = list(ranks[0]["times_s"])
    rows = []
    for tool in tools:
        per_rank = [r["times_s"][tool] for r in ranks]
        worst = [max(vals) for vals in zip(*per_rank, strict=True)]
        rows.append(
            {
                "op": "save" if tool in SAVE_TOOLS else "restore",
                "tool": tool,
                "times_s": worst,
                "per_rank_times_s": per_rank,
                "median_s": median(worst),
            }
        )
    by_tool = {r["tool"]: r["median_s"] for r in rows}
    save_ratio = ratio(by_tool[FC_SAVE], by_tool[DCP_SAVE])
    return {
        "config": {
            "world_size": WORLD,
            "reps": args.reps,
            "count": args.count,
            "mib_per_tensor": args.mib,
            "shape": ranks[0]["shape"],
            "global_bytes": ranks[0]["global_bytes"],
            "bytes_per_rank": [r["local_bytes"] for r in ranks],
            "quick": args.quick,
            "dir": str(args.base),
            "filesystem": args.filesystem,
        },
        "environment": environment(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "rows": rows,
        "file_bytes": ranks[0]["file_bytes"],
        "ratios": {
            "fc.save/dcp.save": save_ratio,
            "fc.restore/dcp.load": ratio(by_tool[FC_RESTORE], by_tool[DCP_LOAD]),
        },
        "target": {
            "name": "fc.save / dcp.save (median)",
            "limit": TARGET,
            "value": save_ratio,
            "result": verdict(save_ratio, TARGET),
        },
    }


def render(result: dict[str, Any]) -> str:
    cfg = result["config"]
    total = cfg["global_bytes"]
    head = (
        f"distributed save/restore: {cfg['world_size']} ranks (gloo, CPU), "
        f"{cfg['count']} x {cfg['mib_per_tensor']} MiB float32 DTensors, Shard(0) "
        f"({total / MiB:.0f} MiB total, {cfg['bytes_per_rank'][0] / MiB:.0f} MiB per rank), "
        f"median of {cfg['reps']}, {cfg['filesystem']} at {cfg['dir']}"
    )
    table = Table(["op", "tool", "median", "min", "max", "throughput", "vs dcp"])
    dcp_of = {"save": DCP_SAVE, "restore": DCP_LOAD}
    medians = {r["tool"]: r["median_s"] for r in result["rows"]}
    for r in result["rows"]:
        table.add(
            r["op"],
            r["tool"],
            fmt_seconds(r["median_s"]),
            fmt_seconds(min(r["times_s"])),
            fmt_seconds(max(r["times_s"])),
            fmt_rate(total, r["median_s"]),
            fmt_ratio(ratio(r["median_s"], medians[dcp_of[r["op"]]])),
        )
    t = result["target"]
    value = "-" if t["value"] is None else f"{t['value']:.2f}x"
    line = f"target: {t['name']} <= {t['limit']}x: {value} {t['result']}"
    return "\n".join([head, "", table.render(), "", line])


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    if "RANK" in os.environ:
        worker(args)
        return 0
    args.dir.mkdir(parents=True, exist_ok=True)
    args.filesystem = check_not_tmpfs(args.dir, allow=args.allow_tmpfs)
    args.base = args.dir
    args.dir = scratch_dir(args.dir)
    rank_dir = args.dir / "ranks"
    rank_dir.mkdir()
    child_argv = _strip(raw, ("--dir", "--json", "--rank-dir"))
    try:
        launch(args, child_argv, rank_dir)
        ranks = [
            json.loads((rank_dir / f"rank{r}.json").read_text(encoding="utf-8"))
            for r in range(WORLD)
        ]
    finally:
        remove_path(args.dir)
    result = summarize(args, ranks)
    print(render(result))
    return finish(args, result, failed=result["target"]["result"] != "PASS")


def _strip(argv: Sequence[str], options: Sequence[str]) -> list[str]:
    """``argv`` without the given options and their values (both spellings)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in options:
            skip = True
            continue
        if any(a.startswith(o + "=") for o in options):
            continue
        out.append(a)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
