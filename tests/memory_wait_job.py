"""One rank of tests/test_memory_replicas.py's wait test: two ranks share one memory
folder (rank 0 keeps it, its commits slowed), a memory save every step and a disk save
every second; after ``mgr.wait()`` each rank writes ``ROOT/held.<R>.json``: the steps
each tier lists and whether each memory step restores bit-exact on this rank."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functional_ckpt as fc
from functional_ckpt._src.storage import commit


def state(mesh: Any, step: int) -> dict[str, Any]:
    full = torch.arange(48, dtype=torch.float32).reshape(12, 4) + 1000 * step
    return {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": step}


def main() -> None:
    root, folder = Path(sys.argv[1]), Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    if rank == 0:  # the keeper commits late: a rank's wait() must still see its commit
        slow = commit.commit_checkpoint
        commit.commit_checkpoint = lambda *a, **k: (time.sleep(0.5), slow(*a, **k))[1]
    tier = fc.manager.Memory(path=folder, keep=2)
    with fc.CheckpointManager(root, save=fc.every_steps(2), tiers=(tier,)) as mgr:
        for step in range(1, 8):
            mgr.wait_staged()
            mgr.maybe_save(state(mesh, step), step=step)
        mgr.wait()
        assert mgr.memory is not None
        held = {"disk": mgr.steps(), "memory": mgr.memory.steps()}
        like = {"w": distribute_tensor(torch.zeros(12, 4), mesh, [Shard(0)]), "step": 0}
        seen: list[Any] = [None, None]
        dist.all_gather_object(seen, held)
        ok = []  # restored only where both ranks list the same steps (else one would hang)
        for step in held["memory"] if seen[0] == seen[1] else ():
            got = fc.restore(mgr.memory.folder / f"step_{step:09d}", like=like)
            ok.append(torch.equal(got["w"].to_local(), state(mesh, step)["w"].to_local()))
        (root / f"held.{rank}.json").write_text(json.dumps({**held, "restored": ok}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
