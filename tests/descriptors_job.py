"""One rank of tests/test_descriptors.py (launched with RANK etc. set).

Usage: descriptors_job.py ROOT OUT [URL]. Every rank opens a manager on the shared ROOT
(with a remote tier at URL if given), saves step 1 of a sharded state, restores it and
writes OUT.RANK.json: the descriptors it then holds that it did not before the manager
opened, as ``{"socket": n, ...}``; launched with ``TORCH_GLOO_LAZY_INIT=1``, as a user may
set it, its groups connect each pair at its first message. Its soft descriptor limit is first
lowered below what the coordinator's groups need (as 1,024 is at 500 ranks): they make room.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import resource
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functional_ckpt as fc


def held() -> dict[str, str]:
    """This process's open descriptors and what each is (``socket``, ``pipe``, a path)."""
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed since
            out[fd] = os.readlink(f"/proc/self/fd/{fd}").split(":[")[0]
    return out


def main() -> None:
    root, out = Path(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    state = {"w": distribute_tensor(torch.arange(48.0).reshape(12, 4), mesh, [Shard(0)])}
    tiers = (fc.manager.Disk(), fc.manager.Remote(sys.argv[3])) if len(sys.argv) > 3 else ()
    before = held()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    low = len(before) + 10  # below what two groups of 8 ranks need on the coordinator
    resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))
    with fc.CheckpointManager(root, tiers=tiers) as mgr:
        mgr.maybe_save(state, step=1, force=True)
        back = mgr.restore(1, like=state)
        assert torch.equal(back["w"].to_local(), state["w"].to_local())
        if mgr.remote is not None:  # at rest: an upload in flight reads the step's files
            mgr.remote.wait()
        added = [kind for fd, kind in held().items() if before.get(fd) != kind]
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] > low  # raised to make room
    kinds = collections.Counter(Path(k).name if k.startswith("/") else k for k in added)
    Path(f"{out}.{dist.get_rank()}.json").write_text(json.dumps(kinds))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
