"""One rank restoring a checkpoint of many files under a descriptor limit of 64
(launched by tests/test_open_files.py with RANK etc. set).

Usage: open_files_job.py PATH COUNT. The checkpoint holds COUNT tensors ``tNNN`` of
shape (6, 4), tensor ``i`` equal to ``expected(i)``, in more files than the limit
allows open at once. Each rank restores them as DTensors sharded on dim 0 over
every rank and checks its shards bit for bit; a single rank also restores without
a template, inspects and verifies. Prints ``ok`` when all of it held.

Or: open_files_job.py PATH count. PATH is tests/dist_job.py's ``shard-save`` of as
many ranks; each rank restores it onto the placements that saved it with
``os.open`` counted, and prints the names of the files it opened as JSON.

Or: open_files_job.py PATH save. The ranks save ``sharded(world)``, its tensor
sharded on dim 0 over every rank, and each rank's own ``loader``, at PATH.
"""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functional_ckpt as fc

LIMIT = 64


def expected(i: int) -> torch.Tensor:
    """Tensor ``i`` of the checkpoint (the last save changed each tensor once)."""
    return torch.arange(24, dtype=torch.float32).reshape(6, 4) + i * 100 + (0.5 if i else 0.0)


def opened_in_restore(path: Path) -> list[str]:
    """The files this rank opens restoring ``path`` onto the placements that saved it."""
    from tests.dist_job import shard_state

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    template = shard_state(mesh, dist.get_rank())
    names: list[str] = []
    real = os.open

    def counting(name: Any, *args: Any, **kwargs: Any) -> int:
        names.append(os.path.basename(os.fsdecode(name)))
        return real(name, *args, **kwargs)

    os.open = counting  # type: ignore[assignment]
    try:
        back = fc.restore(path, template)
    finally:
        os.open = real
    for key in ("w", "e", "r"):
        assert torch.equal(back[key].full_tensor(), template[key].full_tensor()), key
    return [n for n in names if n != path.name]


def sharded(world: int) -> torch.Tensor:
    return torch.arange(world * 8, dtype=torch.float32).reshape(world * 2, 4)


def main() -> None:
    path, count = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    if count == "save":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        w = distribute_tensor(sharded(dist.get_world_size()), mesh, [Shard(0)])
        fc.save(path, {"w": w, "loader": {"pos": dist.get_rank()}})
        dist.destroy_process_group()
    elif count == "count":
        print(json.dumps(opened_in_restore(path)))
        dist.destroy_process_group()
    else:
        limited(path, int(count))


def limited(path: Path, count: int) -> None:
    """Restore COUNT tensors of ``path`` under the descriptor limit, and check them."""
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    template = {
        f"t{i:03d}": distribute_tensor(torch.zeros(6, 4), mesh, [Shard(0)]) for i in range(count)
    }
    resource.setrlimit(resource.RLIMIT_NOFILE, (LIMIT, LIMIT))
    assert len(os.listdir(path)) > LIMIT  # more files than may be open at once
    back = fc.restore(path, template)
    rows = 6 // world
    for i in range(count):
        local = back[f"t{i:03d}"].to_local()
        want = expected(i)[rank * rows : (rank + 1) * rows]
        assert torch.equal(local, want), (rank, i)
    if world == 1:
        whole = fc.restore(path)
        assert all(torch.equal(whole[f"t{i:03d}"], expected(i)) for i in range(count))
        assert fc.inspect(path).num_tensors == count
        assert fc.verify(path).ok
    dist.barrier()
    dist.destroy_process_group()
    print("ok")


if __name__ == "__main__":
    main()
