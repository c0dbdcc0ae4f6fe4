"""One rank of tests/test_lineage_ranks.py.

Usage: lineage_ranks_job.py BASE URL OTHER. Every rank has a root of its own
(``BASE/root<R>``) in front of one remote ``URL``. Steps 1 and 2 are saved; then rank 1
copies the other run's step 3 (in ``OTHER``) into its root only, and every rank resumes,
tries to save steps 3 and 4, to roll back to step 3, then to step 1.
``BASE/out.<R>.json``: what each saw.
"""

from __future__ import annotations

import json
import shutil
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functional_ckpt as fc


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
    dist.barrier()
    with fc.CheckpointManager(root, tiers=(fc.manager.Remote(url),)) as mgr:
        mgr.restore_latest(like=state)
        for step in (3, 4):
            try:
                mgr.maybe_save({**state, "step": step}, step=step)
                seen[str(step)] = "saved"
            except fc.errors.CheckpointError as err:
                seen[str(step)] = f"{type(err).__name__}: {err}"
        try:
            mgr.rollback(3, like=state)
            seen["rollback"] = "rolled back"
        except fc.errors.CheckpointError as err:
            seen["rollback"] = f"{type(err).__name__}: {err}"
        try:  # rank 1's root holds its part of step 1, the remote the whole
            mgr.rollback(1, like=state)
            seen["back"] = f"rolled back to {mgr.restored_step}"
        except fc.errors.CheckpointError as err:
            seen["back"] = f"{type(err).__name__}: {err}"
        assert mgr.remote is not None
        mgr.remote.wait()
    (base / f"out.{rank}.json").write_text(json.dumps(seen))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
