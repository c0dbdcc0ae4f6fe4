"""One rank of the root-per-rank resume tests (tests/test_remote.py): every rank has a
local root of its own (``BASE/root<R>``), all share one remote (``URL``; an S3 endpoint
in ``ENDPOINT``).

Modes:
  save BASE URL SCALE STEPS     save steps 1..STEPS (w = arange * step * SCALE), wait
                                for the uploads
  resume BASE URL [kill]        restore_latest; writes ``BASE/resume.<R>.json`` with the
                                step, whether w matches that step and what it fetched;
                                ``kill``: rank 1 SIGKILLs itself mid-download
"""

from __future__ import annotations

import json
import os
import signal
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functional_ckpt as fc
from functional_ckpt._src.remote import fetch


def full(step: int, scale: int = 1) -> torch.Tensor:
    return torch.arange(48, dtype=torch.float32).reshape(12, 4) * step * scale + 0.5


def main() -> None:
    mode, base, url = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    endpoint = os.environ.get("ENDPOINT")
    options = {"client_kwargs": {"endpoint_url": endpoint}} if endpoint else None
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    def manager() -> fc.CheckpointManager:
        return fc.CheckpointManager(
            base / f"root{rank}",
            keep=fc.keep_last(1),
            tiers=(fc.manager.Remote(url, storage_options=options),),
        )

    if mode == "save":
        scale, steps = int(sys.argv[4]), int(sys.argv[5])
        with manager() as mgr:
            for step in range(1, steps + 1):
                state = {"w": distribute_tensor(full(step, scale), mesh, [Shard(0)]), "step": step}
                mgr.maybe_save(state, step=step)
            assert mgr.remote is not None
            mgr.remote.wait()
        dist.barrier()
        return
    fetched: list[str] = []
    real = fetch._get

    def counted(store: Any, step: int, tmp: Path, names: list[str]) -> None:
        fetched.extend(names)
        if rank == 1 and len(sys.argv) > 4 and sys.argv[4] == "kill":
            real(store, step, tmp, names[:1])
            os.kill(os.getpid(), signal.SIGKILL)
        real(store, step, tmp, names)

    fetch._get = counted  # type: ignore[assignment]
    told: dict[str, Any] = {"rank": rank}
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with manager() as mgr:
                like = {"w": distribute_tensor(torch.zeros(12, 4), mesh, [Shard(0)]), "step": 0}
                got = mgr.restore_latest(like=like)
                step = mgr.restored_step
                told["step"] = step
                if got is not None and step is not None:
                    want = distribute_tensor(full(step), mesh, [Shard(0)]).to_local()
                    told["match"] = bool(torch.equal(got["w"].to_local(), want))
                    told["step_value"] = int(got["step"])
        told["warnings"] = [f"{w.category.__name__}: {w.message}" for w in seen]
    except Exception as e:
        told["error"] = f"{type(e).__name__}: {e}"
        told["trace"] = traceback.format_exc()[-2000:]
    told["fetched"] = sorted(fetched)
    (base / f"resume.{rank}.json").write_text(json.dumps(told))
    os._exit(0)


if __name__ == "__main__":
    main()
