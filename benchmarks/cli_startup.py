"""How fast the ``fckpt`` command line answers, against starting Python itself.

What is compared, in one run (each command in a fresh process, as a shell runs it):

``python -c pass``
    the interpreter's own start: the baseline every ratio is taken against;
``fckpt --help``
    ``python -m functional_ckpt --help``: the parser, without any command's work;
``fckpt ls ROOT``
    ``python -m functional_ckpt ls ROOT`` of a root of ``--checkpoints`` committed
    checkpoints (a small model, AdamW and the RNG states, each from
    ``fc.capture``, saved by a ``CheckpointManager`` with metrics), which this script
    writes first into a scratch directory and removes at the end;
``fckpt inspect CKPT``
    ``python -m functional_ckpt inspect`` of the newest checkpoint of that root (its
    manifest read and validated; numpy loads to rebuild the RNG states' arrays);
``fckpt verify CKPT``
    ``python -m functional_ckpt verify`` of the same checkpoint: every byte re-read
    and checked, and its ``.metadata`` compared with the manifest.
``torch.save DICT``
    a new process that imports torch and ``torch.save``-s a plain dict of a few small
    tensors and values to a file (flushed and fsynced, as every save here is);
``fc.save DICT``
    a new process that imports functional_ckpt and ``fc.save``-s the same dict: the
    first save of a job, where the package's imports are felt (a plain dict needs no
    tensordict, whose import pulls in ``torch._dynamo``).
``torch.save+load DICT``
    a new process that ``torch.save``-s the dict (durably, as above) and ``torch.load``-s
    it back (``weights_only=True``);
``fc.save+restore DICT``
    a new process that ``fc.save``-s the dict and ``fc.restore``-s it into a template of
    the same plain containers: the first save and restore of a job resumed from dicts
    (plain containers come back, and tensordict is never imported).

Every command runs once untimed (so the page cache and the bytecode caches are
warm), then ``--reps`` times, interleaved; medians are reported. Targets, on the
medians:

* ``fckpt --help`` <= 3x ``python -c pass``;
* ``fckpt ls ROOT``, ``fckpt inspect CKPT`` and ``fckpt verify CKPT`` each <= 6x
  ``python -c pass`` (none loads torch; before, inspect and verify did);
* ``fc.save DICT`` <= 2x ``torch.save DICT``;
* ``fc.save+restore DICT`` <= 2x ``torch.save+load DICT``.

Usage::

    python benchmarks/cli_startup.py [--quick] [--reps N] [--checkpoints N] [--dir DIR]
                                     [--json PATH] [--strict]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from _common import (
    REPO_ROOT,
    Table,
    add_run_args,
    bench_parser,
    environment,
    finish,
    fmt_ratio,
    fmt_seconds,
    median,
    ratio,
    remove_path,
    render_targets,
    rotate,
    scratch_dir,
    verdict,
)

BASELINE = "python -c pass"
HELP = "fckpt --help"
LS = "fckpt ls ROOT"
INSPECT = "fckpt inspect CKPT"
VERIFY = "fckpt verify CKPT"
TORCH_SAVE = "torch.save DICT"
FC_SAVE = "fc.save DICT"
TORCH_ROUNDTRIP = "torch.save+load DICT"
FC_ROUNDTRIP = "fc.save+restore DICT"

#: The most each command may take, as a multiple of what it is measured against.
LIMITS = {
    HELP: (3.0, BASELINE),
    LS: (6.0, BASELINE),
    INSPECT: (6.0, BASELINE),
    VERIFY: (6.0, BASELINE),
    FC_SAVE: (2.0, TORCH_SAVE),
    FC_ROUNDTRIP: (2.0, TORCH_ROUNDTRIP),
}

#: The first save of a new process: the same dict, saved by each library durably.
_SAVE = """\
import os, sys, torch
state = {"w": torch.ones(64, 64), "b": torch.zeros(64), "step": 3, "lr": 0.1}
"""
_TORCH_SAVE = (
    _SAVE
    + """\
with open(sys.argv[1], "wb") as f:
    torch.save(state, f)
    f.flush()
    os.fsync(f.fileno())
"""
)
_FC_SAVE = _SAVE + "import functional_ckpt as fc\nfc.save(sys.argv[1], state, overwrite=True)\n"
_TORCH_ROUNDTRIP = _TORCH_SAVE + "back = torch.load(sys.argv[1], weights_only=True)\n"
_FC_ROUNDTRIP = (
    _FC_SAVE
    + """\
like = {"w": torch.empty(64, 64), "b": torch.empty(64), "step": 0, "lr": 0.0}
back = fc.restore(sys.argv[1], like)
assert "tensordict" not in sys.modules
"""
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="2 repetitions of a 5-checkpoint root")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default: 15)")
    p.add_argument(
        "--checkpoints", type=int, default=None, help="checkpoints in the root (default: 20)"
    )
    add_run_args(p, "cli_startup")
    args = p.parse_args(argv)
    if args.reps is None:
        args.reps = 2 if args.quick else 15
    if args.checkpoints is None:
        args.checkpoints = 5 if args.quick else 20
    return args


def make_root(root: Path, n: int) -> None:
    """``n`` checkpoints as a training loop leaves them (the manager records its policy)."""
    import torch

    import functional_ckpt as fc

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with fc.CheckpointManager(root, save=fc.every_steps(1), keep=fc.policy.keep_all()) as mgr:
        for step in range(1, n + 1):
            model(torch.randn(4, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
            state = fc.capture(model=model, optimizer=opt, step=step)
            mgr.maybe_save(state, step=step, metrics={"loss": 1.0 / step})


def commands(root: Path) -> dict[str, list[str]]:
    from functional_ckpt._src.format.naming import parse_step

    fckpt = [sys.executable, "-m", "functional_ckpt"]
    newest = max(p for p in root.iterdir() if parse_step(p.name) is not None)
    return {
        BASELINE: [sys.executable, "-c", "pass"],
        HELP: [*fckpt, "--help"],
        LS: [*fckpt, "ls", str(root)],
        INSPECT: [*fckpt, "inspect", str(newest)],
        VERIFY: [*fckpt, "verify", str(newest)],
        TORCH_SAVE: [sys.executable, "-c", _TORCH_SAVE, str(root.parent / "torch.pt")],
        FC_SAVE: [sys.executable, "-c", _FC_SAVE, str(root.parent / "fc_ckpt")],
        TORCH_ROUNDTRIP: [sys.executable, "-c", _TORCH_ROUNDTRIP, str(root.parent / "torch2.pt")],
        FC_ROUNDTRIP: [sys.executable, "-c", _FC_ROUNDTRIP, str(root.parent / "fc_ckpt2")],
    }


def run_once(argv: list[str], env: dict[str, str]) -> float:
    """Seconds from start to exit of one fresh process (its output discarded)."""
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr[-2000:]!r}")
    return seconds


def measure(root: Path, reps: int) -> dict[str, list[float]]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        "NO_COLOR": "1",
    }
    argvs = commands(root)
    for argv in argvs.values():  # warm the page cache and the bytecode caches
        run_once(argv, env)
    times: dict[str, list[float]] = {name: [] for name in argvs}
    for rep in range(reps):
        for name in rotate(list(argvs), rep):
            times[name].append(run_once(argvs[name], env))
    return times


def evaluate(medians: dict[str, float]) -> list[dict[str, Any]]:
    targets = []
    for name, (limit, against) in LIMITS.items():
        value = ratio(medians[name], medians[against])
        targets.append(
            {
                "target": f"{name} <= {limit:g}x {against}",
                "value": value,
                "limit": limit,
                "result": verdict(value, limit),
            }
        )
    return targets


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    workdir = scratch_dir(args.dir)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    root = workdir / "root"
    try:
        make_root(root, args.checkpoints)
        times = measure(root, args.reps)
    finally:
        remove_path(workdir)
    medians = {name: median(ts) for name, ts in times.items()}
    rows = [
        {
            "command": name,
            "times_s": ts,
            "median_s": medians[name],
            "ratio": ratio(medians[name], medians[BASELINE]),
        }
        for name, ts in times.items()
    ]
    targets = evaluate(medians)
    print(
        f"\nfckpt start-up benchmark ({started}): {args.reps} repetitions, medians; "
        f"a root of {args.checkpoints} checkpoints; python {sys.version.split()[0]}."
    )
    table = Table(["command", "median", f"vs {BASELINE}"])
    for r in rows:
        table.add(r["command"], fmt_seconds(r["median_s"]), fmt_ratio(r["ratio"]))
    print("\n" + table.render())
    print("\n" + render_targets(targets))
    payload = {
        "benchmark": "cli_startup",
        "started": started,
        "config": {
            "reps": args.reps,
            "quick": args.quick,
            "checkpoints": args.checkpoints,
            "dir": str(args.dir),
        },
        "environment": environment(),
        "rows": rows,
        "targets": targets,
    }
    return finish(args, payload)


if __name__ == "__main__":
    sys.exit(main())
