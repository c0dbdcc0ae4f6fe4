"""The two-rank remote-tier job (launched once by tests/test_remote.py): ``BASE``, and
``URL`` the prefix of an S3 bucket on the test's moto server at ``ENDPOINT``. Its
parts in turn, each printing into ``BASE/<part>.<R>.out``:

- ``shared``: one local root both ranks share (tests/remote_shared_job.py);
- ``ranks``: a root per rank, checkpoints damaged remotely (tests/remote_ranks_job.py);
- ``lineage``: two runs, a root per rank each, save the same steps to one remote
  (tests/remote_ranks_job.py);
- ``own``, last (a rank dies in it), below.

In ``own``, every rank has local roots of its own (``BASE/own/<name><R>``: no shared
file system) and all share one remote. In order:

0. ``fc.save`` into ``plain<R>``, without a remote tier, fails on every rank;
1. in ``run<R>``: save steps 1-3 and wait for their uploads;
2. restart in the same roots: every rank resumes from step 3 (rank 0's local copy
   lacks rank 1's files, rank 1 has only its part: each downloads what it reads,
   the objects it fetches printed), in DTensors, bit-identically;
3. save step 4, during whose upload rank 1 dies: rank 0 reports the failed
   upload (no remote commit) within the collective timeout and exits.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functional_ckpt as fc
from functional_ckpt._src.remote import fetch, protocol


def state(mesh: Any, rank: int, step: int) -> dict[str, Any]:
    full = torch.arange(40, dtype=torch.float32).reshape(8, 5) * step
    return {
        "w": distribute_tensor(full, mesh, [Shard(0)]),  # each rank writes its half
        "step": step,
        "loader": {"pos": 100 * rank + step},
    }


def own(base: Path, remote: str, options: dict[str, Any], rank: int, mesh: Any) -> None:
    def manager(name: str) -> fc.CheckpointManager:
        return fc.CheckpointManager(
            base / f"{name}{rank}",
            keep=fc.keep_last(1),
            tiers=(fc.manager.Remote(remote, storage_options=options),),
        )

    try:  # without a remote tier, a save needs one directory every rank sees
        fc.save(base / f"plain{rank}" / "step_1", state(mesh, rank, 1))
        raise AssertionError("a split save without a remote tier was committed")
    except fc.CheckpointError as e:
        assert "rank 1 does not see the directory rank 0 created" in str(e), e
    print("REFUSED", flush=True)

    with manager("run") as mgr:
        assert mgr.remote is not None and not mgr.remote.shared
        for step in (1, 2, 3):
            mgr.maybe_save(state(mesh, rank, step), step=step)
        mgr.remote.wait()
        print("UPLOADED", mgr.remote.steps() if rank == 0 else "", flush=True)
    # Rank 1's root holds parts (its own shard files), never a checkpoint of its own.
    print("LOCAL", fc.CheckpointManager(base / f"run{rank}", read_only=True).steps(), flush=True)

    fetched: list[str] = []  # every object this rank downloads from the store
    real_get = fetch._get

    def counted(store: Any, step: int, tmp: Path, names: list[str]) -> None:
        fetched.extend(names)
        real_get(store, step, tmp, names)

    fetch._get = counted  # type: ignore[assignment]
    mgr = manager("run")  # the job restarts on the same machines
    got = mgr.restore_latest(like=state(mesh, rank, 0))
    print("FETCHED", sorted(fetched), flush=True)
    assert got is not None and mgr.restored_step == 3, mgr.restored_step
    assert torch.equal(got["w"].to_local(), state(mesh, rank, 3)["w"].to_local())
    assert got["loader"]["pos"] == 100 * rank + 3 and got["step"] == 3
    print("RESUMED", mgr.restored_step, flush=True)

    assert mgr.remote is not None
    if rank == 1:
        real = protocol.put_part

        def dying(store: Any, step: int, *a: Any, **k: Any) -> int:
            if step == 4:
                os._exit(9)  # a rank dies mid-upload
            return real(store, step, *a, **k)

        protocol.put_part = dying
    mgr.maybe_save(state(mesh, rank, 4), step=4)  # committed locally: training goes on
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mgr.remote.wait()
    print("FAILED", sorted(mgr.remote.failures), [str(w.message) for w in seen], flush=True)


def main() -> None:
    from tests import remote_ranks_job, remote_shared_job

    base, url = Path(sys.argv[1]), sys.argv[2]
    options = {"client_kwargs": {"endpoint_url": os.environ["ENDPOINT"]}}
    dist.init_process_group("gloo")
    rank, mesh = dist.get_rank(), init_device_mesh("cpu", (dist.get_world_size(),))
    real = fetch._get
    parts = {
        "shared": remote_shared_job.run,
        "ranks": remote_ranks_job.damaged,
        "lineage": remote_ranks_job.two_runs,
        "own": own,
    }
    for name, part in parts.items():
        (base / name).mkdir(parents=True, exist_ok=True)
        with open(base / f"{name}.{rank}.out", "w") as out, contextlib.redirect_stdout(out):
            part(base / name, f"{url}/{name}", options, rank, mesh)
        fetch._get = real  # type: ignore[assignment]
        os.environ.pop("TEAR", None)
    os._exit(0)  # the job is broken (rank 1 is gone): no orderly shutdown


if __name__ == "__main__":
    main()
