"""functional_ckpt against Orbax on the same bytes: save, async save, restore.

Needs the ``bench`` extra (``pip install -e '.[bench]'``: ``jax[cpu]`` and
``orbax-checkpoint``). Two states, each built once as torch tensors (for fc) and as
jax CPU arrays holding the same bytes (for Orbax):

* *big*: 16 x 64 MiB float32 (1 GiB): bandwidth;
* *small*: 10,000 x 1 KiB float32 arrays plus 1,000 Python values (ints and
  floats): per-leaf overhead.

Tools, every one timed to a durable, committed checkpoint:

``orbax sync``
    ``ocp.Checkpointer(ocp.StandardCheckpointHandler())``: ``save`` returns once
    the checkpoint is finalized.
``orbax async``
    ``ocp.StandardCheckpointer()`` (an ``AsyncCheckpointer``). *Stall*: until
    ``save`` returns; *commit*: until ``wait_until_finished()`` returns.
``fc.save`` / ``fc.save_async``
    ``save_async(staging="copy")`` with a reused ``Stager`` (warmed up once).
    *Stall*: until ``wait_staged()``; *commit*: until ``result()``.
``fc.save_async(none)``
    ``staging="none"``: no copy, the caller leaves the tensors alone until
    ``result()``; the counterpart of Orbax on CPU, whose jax arrays are immutable
    and need no copy to be written in the background.

Restores: Orbax's ``restore(path, abstract_tree)`` (shapes and dtypes, new arrays)
against ``fc.restore(path, like=state)`` (new tensors) and ``fc.restore(path)`` (no
template). Every tool runs ``--reps`` times, interleaved; files are deleted and
flushed (``os.sync``) between runs outside the timings; medians and the ratio
fc / Orbax are reported (below 1: fc is faster).

Usage::

    python benchmarks/compare_orbax.py [--quick] [--reps N] [--dir DIR] [--json PATH]
                                       [--state big|small|both] [--allow-tmpfs]
"""

from __future__ import annotations

import gc
import logging
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
    fmt_ratio,
    fmt_seconds,
    median,
    ratio,
    remove_path,
    rotate,
    scratch_dir,
    settle,
    write_json,
)

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import functional_ckpt as fc

SAVE_PAIRS = [
    ("fc.save", "orbax sync"),
    ("fc.save_async", "orbax async"),
    ("fc.save_async(none)", "orbax async"),
]
RESTORE_PAIRS = [("fc.restore(like)", "orbax restore"), ("fc.restore()", "orbax restore")]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@dataclass
class Workload:
    name: str
    label: str
    torch_state: dict[str, Any]
    jax_state: dict[str, Any]
    nbytes: int


def make_workload(name: str, count: int, numel: int, values: int) -> Workload:
    import jax.numpy as jnp

    gen = torch.Generator().manual_seed(0)
    tensors = {f"a{i:05d}": torch.randn(numel, generator=gen) for i in range(count)}
    plain: dict[str, Any] = {}
    for i in range(values):
        plain[f"v{i:05d}"] = i if i % 2 else i * 0.5
    torch_state: dict[str, Any] = {**tensors, **plain}
    jax_state: dict[str, Any] = {k: jnp.asarray(t.numpy()) for k, t in tensors.items()}
    jax_state.update(plain)
    size = numel * 4
    each = (
        f"{size // MiB} MiB"
        if size >= MiB
        else f"{size // KiB} KiB"
        if size >= KiB
        else f"{size} B"
    )
    extra = f" + {values} values" if values else ""
    label = f"{count} x {each} float32{extra} ({count * size / MiB:.4g} MiB)"
    return Workload(name, label, torch_state, jax_state, count * size)


class Runner:
    """Every tool on one workload; each call writes (or reads) one checkpoint."""

    def __init__(self, w: Workload, workdir: Path) -> None:
        import jax
        import orbax.checkpoint as ocp

        self.w, self.workdir = w, workdir
        self.ocp = ocp
        self.orbax_sync = ocp.Checkpointer(ocp.StandardCheckpointHandler())
        self.orbax_async = ocp.StandardCheckpointer()
        self.abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, w.jax_state)
        self.stager = fc.checkpoint.Stager()
        self.fc_dir = workdir / "fc-read"
        self.orbax_dir = workdir / "orbax-read"
        fc.save(self.fc_dir, w.torch_state)
        self.orbax_sync.save(self.orbax_dir, w.jax_state)
        warm = workdir / "warm"
        fc.save_async(warm, w.torch_state, stager=self.stager).result()
        remove_path(warm)

    def out(self, tool: str) -> Path:
        return self.workdir / tool.replace(" ", "_").replace("(", "").replace(")", "")

    def save(self, tool: str) -> tuple[float, float]:
        """(stall, commit) seconds of one save."""
        path = self.out(tool)
        t0 = time.perf_counter()
        if tool == "fc.save":
            fc.save(path, self.w.torch_state)
            stall = time.perf_counter() - t0
            return stall, stall
        if tool in ("fc.save_async", "fc.save_async(none)"):
            staging: Any = "none" if tool.endswith("(none)") else "copy"
            pending = fc.save_async(path, self.w.torch_state, stager=self.stager, staging=staging)
            pending.wait_staged()
            stall = time.perf_counter() - t0
            pending.result()
            return stall, time.perf_counter() - t0
        if tool == "orbax sync":
            self.orbax_sync.save(path.absolute(), self.w.jax_state)
            stall = time.perf_counter() - t0
            return stall, stall
        if tool == "orbax async":
            self.orbax_async.save(path.absolute(), self.w.jax_state)
            stall = time.perf_counter() - t0
            self.orbax_async.wait_until_finished()
            return stall, time.perf_counter() - t0
        raise ValueError(tool)

    def restore(self, tool: str) -> float:
        t0 = time.perf_counter()
        if tool == "fc.restore(like)":
            result: Any = fc.restore(self.fc_dir, like=self.w.torch_state)
        elif tool == "fc.restore()":
            result = fc.restore(self.fc_dir)
        elif tool == "orbax restore":
            result = self.orbax_sync.restore(self.orbax_dir.absolute(), self.abstract)
            import jax

            jax.block_until_ready(result)
        else:
            raise ValueError(tool)
        elapsed = time.perf_counter() - t0
        del result
        return elapsed


def _collect(reps: int, tools: list[str], run: Callable[[str], Any]) -> dict[str, list[Any]]:
    samples: dict[str, list[Any]] = {t: [] for t in tools}
    for k in range(reps):
        for tool in rotate(tools, k):
            settle()
            gc.collect()
            samples[tool].append(run(tool))
    return samples


def bench(w: Workload, workdir: Path, reps: int) -> dict[str, Any]:
    runner = Runner(w, workdir)
    save_tools = ["fc.save", "fc.save_async", "fc.save_async(none)", "orbax sync", "orbax async"]

    def one_save(tool: str) -> tuple[float, float]:
        result = runner.save(tool)
        remove_path(runner.out(tool))
        return result

    saves = _collect(reps, save_tools, one_save)
    restores = _collect(reps, ["fc.restore(like)", "fc.restore()", "orbax restore"], runner.restore)
    result: dict[str, Any] = {"workload": w.label, "bytes": w.nbytes, "save": {}, "restore": {}}
    for tool, xs in saves.items():
        result["save"][tool] = {
            "stall_s": median([x[0] for x in xs]),
            "commit_s": median([x[1] for x in xs]),
            "samples": xs,
        }
    for tool, ts in restores.items():
        result["restore"][tool] = {"seconds": median(ts), "samples": ts}
    result["ratios"] = {
        **{
            f"{a} / {b} ({what})": ratio(
                result["save"][a][f"{what}_s"], result["save"][b][f"{what}_s"]
            )
            for a, b in SAVE_PAIRS
            for what in ("stall", "commit")
        },
        **{
            f"{a} / {b}": ratio(result["restore"][a]["seconds"], result["restore"][b]["seconds"])
            for a, b in RESTORE_PAIRS
        },
    }
    remove_path(runner.fc_dir)
    remove_path(runner.orbax_dir)
    return result


def render(results: dict[str, Any]) -> str:
    table = Table(["state", "operation", "fc", "orbax", "fc / orbax"])
    for name, r in results.items():
        s, rs = r["save"], r["restore"]
        rows = [
            ("save (sync), durable", s["fc.save"]["commit_s"], s["orbax sync"]["commit_s"]),
            ("async save: stall", s["fc.save_async"]["stall_s"], s["orbax async"]["stall_s"]),
            ("async save: commit", s["fc.save_async"]["commit_s"], s["orbax async"]["commit_s"]),
            (
                "async, no copy: stall",
                s["fc.save_async(none)"]["stall_s"],
                s["orbax async"]["stall_s"],
            ),
            (
                "restore (template)",
                rs["fc.restore(like)"]["seconds"],
                rs["orbax restore"]["seconds"],
            ),
            (
                "restore (no template)",
                rs["fc.restore()"]["seconds"],
                rs["orbax restore"]["seconds"],
            ),
        ]
        for op, a, b in rows:
            table.add(name, op, fmt_seconds(a), fmt_seconds(b), fmt_ratio(ratio(a, b)))
    return table.render()


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny states, 1 rep (smoke test)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--state", choices=("big", "small", "both"), default="both")
    add_run_args(parser, "compare_orbax", strict=None)
    args = parser.parse_args(argv)
    try:
        import jax
        import orbax.checkpoint as ocp
    except ImportError as exc:
        raise SystemExit(f"needs the bench extra (jax[cpu], orbax-checkpoint): {exc}") from None
    warnings.filterwarnings("ignore")
    logging.getLogger("absl").setLevel(logging.ERROR)
    jax.config.update("jax_platforms", "cpu")
    args.dir.mkdir(parents=True, exist_ok=True)
    fstype = check_not_tmpfs(args.dir, allow=args.allow_tmpfs)
    reps = 1 if args.quick else args.reps
    shapes = {
        "big": (16, 2 if args.quick else 16 * MiB, 0),
        "small": (100 if args.quick else 10_000, 256, 10 if args.quick else 1_000),
    }
    names = ["big", "small"] if args.state == "both" else [args.state]
    work = scratch_dir(args.dir)
    results: dict[str, Any] = {}
    try:
        for name in names:
            w = make_workload(name, *shapes[name])
            log(f"{name}: {w.label}, {reps} reps")
            results[name] = bench(w, work, reps)
            del w
            gc.collect()
    finally:
        remove_path(work)
    text = render(results)
    print(text)
    env = environment()
    env.update(jax=jax.__version__, orbax=getattr(ocp, "__version__", None), filesystem=fstype)
    write_json(
        args.json,
        {"benchmark": "compare_orbax", "reps": reps, "environment": env, "results": results},
    )
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
