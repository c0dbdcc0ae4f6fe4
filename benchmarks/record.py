"""What does recording a simulation every step cost, and how fast does a record replay?

One run, on one disk. A vectorised toy environment (256 environments) carries a
1 MiB state: half of it static (a map and per-environment parameters, never
changed), half of it dynamic (positions, velocities, observations, actions:
every byte changes every step). Each step runs the environment (a little
compute, so the writer has the time a real loop leaves it), then calls
``fc.recording.Recorder.record``; the recording is committed periodically and at close.

Measured, medians over the steps:

* *stall*: the duration of ``record`` (the loop's only cost: one copy into a
  staging slot, plus the plain values' encoding and the hand-off);
* *bytes written*: every byte of the recording directory after ``close``, against
  the bytes that actually changed (the tensors that differ from the previous
  record, the plain values that differ);
* *replay*: ``replay[step]`` of random recorded steps, after ``fc.recording.Replay`` opened
  the recording once (reported separately).

Targets: stall <= 0.2 ms; bytes written <= 1.2x the changed bytes; replay of a
random step <= 10 ms.

Usage::

    python benchmarks/record.py [--quick] [--steps N] [--dir DIR] [--json PATH] [--strict]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import warnings
from collections.abc import Sequence
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
    finish,
    fmt_ms,
    median,
    remove_path,
    scratch_dir,
    verdict,
)
from tensordict import TensorDict

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import functional_ckpt as fc
from functional_ckpt._src import codec

STALL_LIMIT_S = 0.2e-3
BYTES_LIMIT = 1.2
REPLAY_LIMIT_S = 10e-3


def make_env(n_envs: int, total: int) -> TensorDict:
    """``total`` bytes of float32 state for ``n_envs`` environments, half of it static."""
    per_env = total // 2 // 4 // n_envs  # float32 elements per environment, per half
    dyn = per_env // 4
    return TensorDict(
        {
            "map": torch.randn(n_envs, per_env - 8),  # static
            "params": torch.rand(n_envs, 8),  # static
            "pos": torch.zeros(n_envs, dyn),
            "vel": torch.randn(n_envs, dyn),
            "obs": torch.zeros(n_envs, dyn),
            "action": torch.zeros(n_envs, dyn),
        },
        batch_size=[n_envs],
    )


def env_step(env: TensorDict, w: torch.Tensor) -> None:
    """One simulation step, in place: every dynamic byte changes."""
    env["action"].copy_(torch.tanh(env["obs"] @ w))
    env["vel"].mul_(0.99).add_(env["action"], alpha=0.01)
    env["pos"].add_(env["vel"], alpha=0.01)
    env["obs"].copy_(env["pos"] * env["params"][:, :1] + env["map"][:, : env["obs"].shape[1]])


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    env = make_env(args.envs, args.state_bytes)
    dyn = env["obs"].shape[1]
    w = torch.randn(dyn, dyn) / dyn**0.5
    path = workdir / "rec"
    stalls: list[float] = []
    sim: list[float] = []
    changed = 0
    prev: dict[str, torch.Tensor] = {}
    prev_step: bytes | None = None
    with fc.recording.Recorder(path, every=1) as recorder:
        for step in range(args.steps):
            t0 = time.perf_counter()
            env_step(env, w)
            t1 = time.perf_counter()
            recorder.record({"env": env, "step": step}, step=step)
            t2 = time.perf_counter()
            sim.append(t1 - t0)
            stalls.append(t2 - t1)
            for key, t in env.items():  # the bytes that actually changed (outside the timings)
                if key not in prev or not torch.equal(prev[key], t):
                    changed += t.numel() * t.element_size()
                    prev[key] = t.clone()
            encoded = codec.encode(step)
            if encoded != prev_step:
                changed += len(encoded)
                prev_step = encoded
        t_close = time.perf_counter()
    close_s = time.perf_counter() - t_close
    written = sum(p.stat().st_size for p in path.iterdir())
    t0 = time.perf_counter()
    replay = fc.recording.Replay(path)
    open_s = time.perf_counter() - t0
    rng = random.Random(1)
    picks = [rng.randrange(args.steps) for _ in range(args.replays)]
    replays: list[float] = []
    with replay:
        for step in picks:
            t0 = time.perf_counter()
            state = replay[step]
            replays.append(time.perf_counter() - t0)
            assert state["step"] == step
        last = replay[args.steps - 1]["env"]
    assert all(torch.equal(last[k], env[k]) for k in env.keys()), "the last record differs"
    state_bytes = sum(t.numel() * t.element_size() for t in env.values())
    return {
        "state_bytes": state_bytes,
        "static_bytes": env["map"].nbytes + env["params"].nbytes,
        "steps": args.steps,
        "stall_median_s": median(stalls),
        "stall_p90_s": sorted(stalls)[int(0.9 * len(stalls))],
        "sim_step_median_s": median(sim),
        "close_s": close_s,
        "changed_bytes": changed,
        "written_bytes": written,
        "bytes_ratio": written / changed,
        "replay_open_s": open_s,
        "replay_median_s": median(replays),
        "replays": len(replays),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="a 64 KiB state, 100 steps")
    p.add_argument("--steps", type=int, default=None, help="steps (default 2000, quick 100)")
    p.add_argument("--envs", type=int, default=256, help="environments (default 256)")
    p.add_argument("--replays", type=int, default=200, help="random steps replayed")
    add_run_args(p, "record")
    args = p.parse_args(argv)
    args.steps = args.steps or (100 if args.quick else 2000)
    args.state_bytes = 64 * KiB if args.quick else 1 * MiB
    if args.quick:
        args.envs, args.replays = 16, 20
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    fstype = check_not_tmpfs(args.dir, allow=args.allow_tmpfs)
    workdir = scratch_dir(args.dir)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        res = run(args, workdir)
    finally:
        remove_path(workdir)
    targets = [
        {
            "target": "stall per step (median) <= 0.2 ms",
            "value": res["stall_median_s"],
            "result": verdict(res["stall_median_s"], STALL_LIMIT_S),
        },
        {
            "target": "bytes written <= 1.2x the bytes that changed",
            "value": res["bytes_ratio"],
            "result": verdict(res["bytes_ratio"], BYTES_LIMIT),
        },
        {
            "target": "replay of a random step (median) <= 10 ms",
            "value": res["replay_median_s"],
            "result": verdict(res["replay_median_s"], REPLAY_LIMIT_S),
        },
    ]
    print(
        f"\nfunctional_ckpt record/replay benchmark ({started}): {res['steps']} steps of a "
        f"{res['state_bytes'] / MiB:.2f} MiB state ({res['static_bytes'] / MiB:.2f} MiB "
        f"static), {args.envs} environments; scratch {args.dir} ({fstype}); "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads."
    )
    table = Table(["measure", "value"])
    table.add("simulation step (median)", fmt_ms(res["sim_step_median_s"]))
    table.add("record() stall (median)", fmt_ms(res["stall_median_s"]))
    table.add("record() stall (p90)", fmt_ms(res["stall_p90_s"]))
    table.add("close (last commit)", fmt_ms(res["close_s"]))
    table.add("bytes that changed", f"{res['changed_bytes'] / MiB:.1f} MiB")
    table.add("bytes written", f"{res['written_bytes'] / MiB:.1f} MiB")
    table.add("written / changed", f"{res['bytes_ratio']:.3f}x")
    table.add("Replay(path) open", fmt_ms(res["replay_open_s"]))
    table.add(f"replay[random step] (median of {res['replays']})", fmt_ms(res["replay_median_s"]))
    print("\n" + table.render())
    checks = Table(["target", "result"])
    for t in targets:
        checks.add(t["target"], t["result"])
    print("\n" + checks.render())
    if args.quick:
        print("(--quick: the state is too small for the targets to mean anything)")
    payload = {
        "benchmark": "record",
        "started": started,
        "config": {
            "quick": args.quick,
            "steps": args.steps,
            "envs": args.envs,
            "dir": str(args.dir),
            "filesystem": fstype,
            "threads": torch.get_num_threads(),
        },
        "environment": environment(),
        "result": res,
        "targets": targets,
    }
    return finish(args, payload)


if __name__ == "__main__":
    sys.exit(main())
