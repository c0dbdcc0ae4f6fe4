"""Child process for the ``fckpt run`` tests: a tiny job that resumes from its newest checkpoint.

::

    python tests/run_job.py ROOT --steps N [--save-every K] [--fail ATTEMPT:HOW:STEP ...]
                            [--ready FILE] [--step-time SECONDS] [--memory DIR]
                            [--die-after STEPS]

Each step adds 1 to every element of ``w``; the manager saves every ``K`` steps
and at the first event after a SIGTERM (``on_signal``), after which the job
exits 0. ``--fail`` makes attempt ``ATTEMPT`` (``FCKPT_RUN_ATTEMPT``; ``*``: every
attempt) die right after step ``STEP``: ``kill`` SIGKILLs itself, ``exit`` exits
with status 1. One line per attempt is appended to ``ROOT.log``; ``--ready``
names a file created once the first step is done. ``--memory`` adds a memory
tier in ``DIR`` saving every step; ``--die-after`` SIGKILLs every attempt that
many steps after the step it resumed from.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import functional_ckpt as fc


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--fail", action="append", default=[])
    parser.add_argument("--ready")
    parser.add_argument("--step-time", type=float, default=0.0)
    parser.add_argument("--memory")  # a memory tier's folder, saved every step
    parser.add_argument("--die-after", type=int)  # SIGKILL after this many steps of an attempt
    args = parser.parse_args()
    attempt = os.environ.get("FCKPT_RUN_ATTEMPT", "?")
    failures = {}
    for spec in args.fail:
        who, how, step = spec.split(":")
        if who in ("*", attempt):
            failures[int(step)] = how

    stop = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    policy = fc.every_steps(args.save_every) | fc.on_signal(signal.SIGTERM)
    state = {"w": torch.zeros(4), "step": 0}
    log = open(f"{args.root}.log", "a")  # noqa: SIM115 (kept open until the job dies)
    tiers = []
    if args.memory:
        tiers = [fc.manager.Memory(path=args.memory, async_save=False, promote_on=())]
    with fc.CheckpointManager(args.root, save=policy, tiers=tiers) as mgr:
        restored = mgr.restore_latest(like=state)
        if restored is not None:
            state = {"w": restored["w"], "step": int(restored["step"])}
        restored_step = state["step"]
        print(f"attempt {attempt}: from {state['step']}", file=log, end="", flush=True)
        for step in range(state["step"] + 1, args.steps + 1):
            state = {"w": state["w"] + 1, "step": step}
            saved = mgr.maybe_save(state, step=step)
            if args.ready and not os.path.exists(args.ready):
                Path(args.ready).touch()
            # A signal that lands after the vote is saved at the next event: stop once saved.
            if stop and saved:
                mgr.wait()
                print(f", stopped at {step}", file=log, flush=True)
                return 0
            how = failures.get(step)
            if args.die_after is not None and step - restored_step >= args.die_after:
                how = "kill"
            if how == "kill":
                print(f", killed at {step}", file=log, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            if how == "exit":
                print(f", failed at {step}", file=log, flush=True)
                return 1
            if args.step_time:
                time.sleep(args.step_time)
    print(", finished", file=log, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
