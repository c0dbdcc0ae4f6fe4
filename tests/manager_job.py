"""Child process for the CheckpointManager crash tests: a tiny training run that resumes.

It trains :mod:`tests.training`'s model (dropout, AdamW, warm-up schedule, shuffling
loader, numpy and python randomness), saves every step under ``keep_last(2)`` so
saves and prunes happen constantly, and resumes with ``restore_latest``. Killed at
any moment and restarted, it must end in the state of an uninterrupted run.

``run()`` is the entry point used through a forkserver (importing torch once for
many runs); the script form serves the lock tests::

    python tests/manager_job.py ROOT --steps N [--kill-point P --kill-after K]
    python tests/manager_job.py ROOT --hold     # hold the writer lock until killed

``kill_point`` makes the job SIGKILL itself at the ``kill_after``-th pass through a
chosen point of the commit or prune protocol, for crashes that random timing
would rarely hit: ``marker`` (everything written but the commit marker),
``commit`` (renamed into place, parent not yet fsynced), ``prune`` (a trashed
checkpoint half removed).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import functional_ckpt as fc
from functional_ckpt._src.format import naming
from functional_ckpt._src.storage import commit
from tests.training import build, train_step

KILL_POINTS = ("marker", "commit", "prune")

#: What a forkserver imports once for all runs (the package imports them on first use).
PRELOAD = [
    "functional_ckpt._src.manager.manager",
    "functional_ckpt._src.save.api",
    "functional_ckpt._src.restore.api",
    "functional_ckpt._src.state.capture",
]


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install_kill_point(point: str, after: int) -> None:
    """Patch one step of the protocol so that its ``after``-th call kills the process."""
    calls = [0]

    def due() -> bool:
        calls[0] += 1
        return calls[0] >= after

    if point == "marker":
        original_marker = commit.write_commit_marker

        def marker(tmp: Path, manifest_bytes: bytes, **kwargs: Any) -> None:
            if due():
                _die()
            original_marker(tmp, manifest_bytes, **kwargs)

        commit.write_commit_marker = marker  # type: ignore[assignment]
    elif point == "commit":
        original_commit = commit.commit_checkpoint

        def dying_commit(tmp: Path, final: Path, **kwargs: Any) -> None:
            if due() and not final.exists():
                os.rename(tmp, final)
                _die()
            original_commit(tmp, final, **kwargs)

        commit.commit_checkpoint = dying_commit  # type: ignore[assignment]
    elif point == "prune":
        original_remove = commit.remove_tree

        def remove_tree(path: Path) -> None:
            if due():
                (path / naming.COMMIT_MARKER).unlink(missing_ok=True)
                (path / naming.MANIFEST).unlink(missing_ok=True)
                _die()
            original_remove(path)

        commit.remove_tree = remove_tree  # type: ignore[assignment]
    else:
        raise ValueError(f"kill_point={point!r}: expected one of {KILL_POINTS}")


def live_state(objs: tuple[Any, ...], step: int) -> Any:
    model, opt, sched, loader = objs
    return fc.capture(model=model, optimizer=opt, scheduler=sched, loader=loader, step=step)


def run(
    root: str,
    steps: int = 24,
    kill_point: str | None = None,
    kill_after: int = 1,
    keep: int = 2,
) -> None:
    """Train to ``steps``, resuming from whatever ``root`` holds."""
    torch.set_num_threads(1)
    if kill_point is not None:
        install_kill_point(kill_point, kill_after)
    objs = build()
    model, opt, sched, loader = objs
    with fc.CheckpointManager(root, save=fc.every_steps(1), keep=fc.keep_last(keep)) as mgr:
        restored = mgr.restore_latest(like=live_state(objs, 0))
        step = 0
        if restored is not None:
            fc.apply(restored, model=model, optimizer=opt, scheduler=sched, loader=loader)
            step = int(restored["step"])
        while step < steps:
            loss = train_step(model, opt, sched, loader)
            step += 1
            mgr.maybe_save(
                live_state(objs, step),
                step=step,
                metrics={"loss": loss},
                is_final=step == steps,
            )


def run_memory(
    root: str,
    memory: str,
    steps: int = 24,
    disk_every: int = 10,
    die_at: int | None = None,
    keep: int = 2,
    step_time: float = 0.0,
    remote: str | None = None,
) -> None:
    """Train to ``steps`` with a memory tier at ``memory`` (a save every step) above a disk
    tier saving every ``disk_every`` steps and at the end; resume from whatever the tiers
    hold. With ``die_at`` the job SIGKILLs itself once that step's memory save committed.
    ``step_time``: seconds more each step computes (a real step outlasts its save, so that
    a kill lands beside a save in flight rather than after the run's end). ``remote``: the
    URL of a remote tier behind the disk."""
    torch.set_num_threads(1)
    objs = build()
    model, opt, sched, loader = objs
    disk = fc.every_steps(disk_every) | fc.on_final()
    tiers: Any = (fc.manager.Memory(path=memory, keep=keep),)
    tiers += () if remote is None else (fc.manager.Remote(remote),)
    with fc.CheckpointManager(root, save=disk, keep=fc.keep_last(2), tiers=tiers) as mgr:
        restored = mgr.restore_latest(like=live_state(objs, 0))
        step = 0
        if restored is not None:
            fc.apply(restored, model=model, optimizer=opt, scheduler=sched, loader=loader)
            step = int(restored["step"])
            print(f"resumed {step}", flush=True)
        while step < steps:
            mgr.wait_staged()  # the memory save copies the state off the training thread
            loss = train_step(model, opt, sched, loader)
            time.sleep(step_time)
            step += 1
            mgr.maybe_save(
                live_state(objs, step),
                step=step,
                metrics={"loss": loss},
                is_final=step == steps,
            )
            if step == die_at:
                mgr.wait()
                _die()


def hold(root: str) -> None:
    """Hold the writer lock of ``root`` until killed (for the lock tests)."""
    with fc.CheckpointManager(root):
        print(f"locked {os.getpid()}", flush=True)
        while True:
            time.sleep(60)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--kill-point", choices=KILL_POINTS)
    ap.add_argument("--kill-after", type=int, default=1)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--hold", action="store_true")
    args = ap.parse_args(argv)
    if args.hold:
        hold(args.root)
    else:
        run(args.root, args.steps, args.kill_point, args.kill_after, args.keep)


if __name__ == "__main__":
    main()
