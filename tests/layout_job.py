"""One rank of tests/test_dist_layout.py: saves whose layout differs between ranks.

Modes (each rank writes ``told.<rank>.json``: per save, "ok" or the error's text):
  held-alone ROOT   (2 ranks) rank 1 alone holds a shared tensor ``z``: as the first
                    save of the process, then after a save of the layout without it
                    (its plan cached); each followed by a save without ``z``
  permuted ROOT     (3 ranks) DTensors made from local shards on the mesh of the ranks
                    reversed, saved twice (the second reuses the first's plan); each
                    restored bit-exact
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functional_ckpt as fc


def fulls(k: int) -> dict[str, torch.Tensor]:
    """The full tensors of save ``k`` (a bfloat16 one too: its bits are compared)."""
    g = torch.Generator().manual_seed(k)
    return {"w": torch.randn(12, 6, generator=g), "e": torch.randn(12, 4, generator=g).bfloat16()}


def attempt(told: list[Any], path: Path, state: dict[str, Any]) -> None:
    try:
        saved_exactly(path, state)
    except Exception as e:  # recorded whatever it is: the test checks its text
        told.append(f"{type(e).__name__}: {e} {' '.join(getattr(e, '__notes__', []))}")
    else:
        told.append("ok")


def saved_exactly(path: Path, state: dict[str, Any]) -> None:
    """Save ``state`` to ``path`` and restore it bit for bit on this rank."""
    fc.save(path, state)
    like = {
        k: DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements)
        if isinstance(v, DTensor)
        else torch.zeros_like(v)
        for k, v in state.items()
    }
    got = fc.restore(path, like=like)
    for k, v in state.items():
        a, b = (got[k].to_local(), v.to_local()) if isinstance(v, DTensor) else (got[k], v)
        if a.dtype != b.dtype or not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            raise AssertionError(f"{k} restored other bits")


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    told: list[Any] = []
    if mode == "held-alone":
        plain = {"b": torch.arange(5.0)}
        alone = {**plain, **({"z": torch.ones(3)} if rank == 1 else {})}
        for name, state in (("a", alone), ("b", plain), ("c", alone), ("d", plain)):
            attempt(told, root / name, state)
    elif mode == "permuted":
        mesh = DeviceMesh("cpu", list(reversed(range(world))))
        at = mesh.get_coordinate()
        assert at is not None
        rows = slice(at[0] * 12 // world, (at[0] + 1) * 12 // world)
        for k in (1, 2):
            state = {
                n: DTensor.from_local(t[rows].clone(), mesh, [Shard(0)], run_check=False)
                for n, t in fulls(k).items()
            }
            attempt(told, root / f"s{k}", state)
    else:
        raise SystemExit(f"unknown mode {mode}")
    (root / f"told.{rank}.json").write_text(json.dumps(told))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
