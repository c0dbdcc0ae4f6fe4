"""One rank of tests/test_lineage_ranks.py.

Usage: lineage_ranks_job.py BASE URL OTHER. Every rank has a root of its own
(``BASE/root<R>``) in front of one remote ``URL``. Steps 1 and 2 are saved; then rank 1
copies the other run's step 3 (in ``OTHER``) into its root only (and the plan of a
rollback a crash cut short there), and every rank opens (finishing it) and resumes
(the remote keeping the last two), tries to save steps 3 and 4, to roll back to step 3,
then to step 1: with rank 1's upload of step 1 failing, to a branch name rank 1's root
alone holds, then as it is (each root's newer steps to the branch), and to save step 2
again. Then, in a root the ranks share with a memory folder, a crashed run's RAM steps
that a rollback made without the memory tier left are never resumed. ``BASE/out.<R>.json``:
what each saw.
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functional_ckpt as fc
from functional_ckpt._src.remote import protocol


def attempt(action: Callable[[], object], done: str) -> str:
    """``done``, or the error ``action`` raised."""
    try:
        action()
        return done
    except fc.errors.CheckpointError as err:
        return f"{type(err).__name__}: {err}"


def ram_after_rollback(base: Path) -> str:
    """Steps 1-5 in RAM (4 and 5 held), 2 and 4 on disk; a crash; a rollback to 2 without
    the memory tier; then what a relaunch with it resumes, and what RAM holds then."""
    root, tier = base / "shared", fc.manager.Memory(path=base / "mem", promote_on=())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # a state of every rank's part
    state = {"w": distribute_tensor(torch.arange(8.0), mesh, [Shard(0)]), "step": 0}
    try:
        with fc.CheckpointManager(root, save=fc.every_steps(2), tiers=(tier,)) as mgr:
            for step in range(1, 6):
                mgr.maybe_save({**state, "step": step}, step=step)
            raise RuntimeError("the run crashes")
    except RuntimeError:
        pass
    with fc.CheckpointManager(root, save=fc.every_steps(2)) as mgr:
        mgr.rollback(2, like=state, newer="delete")
    with fc.CheckpointManager(root, save=fc.every_steps(2), tiers=(tier,)) as mgr:
        assert mgr.memory is not None
        mgr.restore_latest(like=state)
        return f"{mgr.restored_step} {mgr.memory.steps()}"


def main() -> None:
    base, url, other = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    root = base / f"root{rank}"
    state = {"w": torch.full((8,), float(rank)), "step": 0}
    seen: dict[str, str] = {}
    warnings.simplefilter("ignore")
    with fc.CheckpointManager(root, tiers=(fc.manager.Remote(url),)) as mgr:
        for step in (1, 2):
            mgr.maybe_save({**state, "step": step}, step=step)
    if rank == 1:
        shutil.copytree(other / "step_000000003", root / "step_000000003")
        # a rollback on this root that a crash cut short once its plan was recorded
        (root / "step_000000009").mkdir()
        plan = {"to_step": 2, "names": ["step_000000009"], "newer": "delete", "branch": None}
        (root / ".rollback").write_text(json.dumps(plan))
    dist.barrier()
    remote = fc.manager.Remote(url, keep=fc.keep_last(2))
    with fc.CheckpointManager(root, tiers=(remote,)) as mgr:
        assert mgr.remote is not None
        left = [n for n in ("step_000000009", ".rollback") if (root / n).exists()]
        seen["finished"] = str(left)
        mgr.restore_latest(like=state)
        for step in (3, 4):
            save = {**state, "step": step}
            seen[str(step)] = attempt(lambda s=save: mgr.maybe_save(s, step=s["step"]), "saved")
        seen["rollback"] = attempt(lambda: mgr.rollback(3, like=state), "rolled back")
        real = protocol.put_part  # the remote keeps 2 and 4: a rollback to 1 uploads it

        def refused(store: Any, step: int, *a: Any, **k: Any) -> int:
            if step == 1 and rank == 1:
                raise OSError("the store refused step 1")
            return real(store, step, *a, **k)

        protocol.put_part = refused  # type: ignore[assignment]
        seen["upload"] = attempt(lambda: mgr.rollback(1, like=state), "rolled back")
        protocol.put_part = real  # type: ignore[assignment]
        seen["upload_left"] = f"{mgr.restored_step} {mgr.remote.steps()} {mgr.remote.failures}"
        if rank == 1:  # a branch name rank 1's root holds, the coordinator's not
            (root / "branches" / "x").mkdir(parents=True)
        seen["taken"] = attempt(lambda: mgr.rollback(1, like=state, branch="x"), "rolled back")
        branches = sorted(mgr.branches()), sorted(mgr.remote.store.branches())
        seen["taken_left"] = f"{mgr.restored_step} {mgr.remote.steps()} {branches}"
        # rank 1's root holds its part of step 1, the remote the whole
        seen["back"] = attempt(lambda: mgr.rollback(1, like=state), "rolled back")
        seen["back"] += f" to {mgr.restored_step}"
        seen["trunk"] = str(sorted(p.name for p in root.glob("step_*")))  # each rank's own
        held = {
            b: sorted(p.name for p in mgr.branch_root(b).glob("step_*")) for b in mgr.branches()
        }
        seen["branch"] = json.dumps(held)
        seen["again"] = attempt(lambda: mgr.maybe_save({**state, "step": 2}, step=2), "saved")
        mgr.remote.wait()
        if rank == 1:  # a save cut short in rank 1's root alone: no tier's step to branch
            (root / "step_000000007").mkdir()
        seen["cut"] = attempt(lambda: mgr.rollback(2, like=state, newer="branch"), "rolled back")
    with fc.CheckpointManager(root, tiers=(remote,)):  # reopened: no rollback left half done
        seen["reopened"] = str(sorted(p.name for p in root.glob("step_*")))
    if rank == 1:  # a rollback record damaged in rank 1's root: every rank fails at the open
        (root / ".rollback").write_text("{")
    opened = lambda: fc.CheckpointManager(root, tiers=(remote,)).close()  # noqa: E731
    seen["damaged"] = attempt(opened, "opened")
    seen["ram"] = ram_after_rollback(base)
    (base / f"out.{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
