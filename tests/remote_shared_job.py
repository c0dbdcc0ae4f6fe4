"""The part of the two-rank remote-tier job (tests/remote_job.py) with one local root
both ranks share (``BASE``, under the job's base):

1. in ``BASE/run``: save steps 1-2 and wait for their uploads;
2. a relaunch into the empty ``BASE/fresh`` (the same remote) resumes step 2: each
   rank downloads what it reads (the objects it fetches printed), the local copy is
   committed whole and ``fc.verify`` finds it intact;
3. into ``BASE/torn``, rank 1's download fails midway: every rank raises and no
   marker lies anywhere in the root (the download directory the test's next writer
   removes included);
4. into ``BASE/back``, whose remote keeps the newest step only: steps 1-2 saved, a
   rollback to 1 puts step 1 on the remote again before step 2 leaves it.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functional_ckpt as fc
from functional_ckpt._src.remote import fetch
from tests.remote_job import state


def run(base: Path, remote: str, options: dict[str, Any], rank: int, mesh: Any) -> None:
    def manager(name: str) -> fc.CheckpointManager:
        tier = fc.manager.Remote(remote, storage_options=options)
        return fc.CheckpointManager(base / name, tiers=(tier,))

    with manager("run") as mgr:
        assert mgr.remote is not None and mgr.remote.shared
        for step in (1, 2):
            mgr.maybe_save(state(mesh, rank, step), step=step)
        mgr.remote.wait()

    fetched: list[str] = []  # every object this rank downloads from the store
    real_get = fetch._get

    def counted(store: Any, step: int, tmp: Path, names: list[str]) -> None:
        fetched.extend(names)
        if os.environ.get("TEAR") == str(rank) and names:
            raise fc.CheckpointError(f"{names[0]}: torn off")
        real_get(store, step, tmp, names)

    fetch._get = counted  # type: ignore[assignment]
    with manager("fresh") as mgr:  # a relaunch on machines whose root is empty
        got = mgr.restore_latest(like=state(mesh, rank, 0))
        print("FETCHED", sorted(fetched), flush=True)
        assert got is not None and mgr.restored_step == 2, mgr.restored_step
        assert torch.equal(got["w"].to_local(), state(mesh, rank, 2)["w"].to_local())
        assert got["loader"]["pos"] == 100 * rank + 2 and got["step"] == 2
    dist.barrier()
    print("RESUMED", fc.verify(base / "fresh" / "step_000000002").ok, flush=True)

    os.environ["TEAR"] = "1"
    try:
        with manager("torn") as mgr:
            mgr.restore_latest(like=state(mesh, rank, 0))
        raise AssertionError("a torn download was resumed")
    except fc.CheckpointError as e:
        print("TORN", type(e).__name__, flush=True)
    dist.barrier()
    print("LEFT", fc.CheckpointManager(base / "torn", read_only=True).steps(), flush=True)
    markers = sorted(str(p.relative_to(base)) for p in (base / "torn").rglob("COMMITTED"))
    print("MARKERS", markers, flush=True)
    dist.barrier()
    back = fc.manager.Remote(f"{remote}/back", keep=fc.keep_last(1), storage_options=options)
    with fc.CheckpointManager(base / "back", tiers=(back,)) as mgr:
        for step in (1, 2):
            mgr.maybe_save(state(mesh, rank, step), step=step)
        assert mgr.remote is not None and mgr.remote.wait() and mgr.remote.steps() == [2]
        mgr.rollback(1, like=state(mesh, rank, 0), newer="delete")
        dist.barrier()  # the coordinator's remote part is done
        print("ROLLED BACK", mgr.remote.steps(), flush=True)
