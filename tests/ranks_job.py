"""One rank of the tests of what the ranks of a save must agree on (tests/test_dist_ranks.py).

Modes (each rank writes what it raised as ``error.<rank>.json``, or "ok"):
  base-one-rank ROOT           both save ``a``; then only rank 1 passes ``base=a`` for ``b``
  two-paths ROOT save|async    rank 0 saves ``b``, rank 1 ``c``
  overwrite ROOT               only rank 1 passes ``overwrite=True``
  staging ROOT                 rank 0 ``save_async(staging="copy")``, rank 1 ``"write"``
  per-rank ROOT                rank 1 names one more per-rank subtree
  file-gone ROOT               rank 1's shard file vanishes after it reported it written
  gone-first ROOT save|async|restore   rank 1 leaves before the first round (after
                               ``fc.restore`` for ``restore``); rank 0 saves
  zstd ROOT                    both save ``a`` with ``compression="zstd"`` and restore it
  released ROOT                rounds of checkpoint collectives; writes how many
                               returned while gloo still held one of their tensors
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functional_ckpt as fc
from functional_ckpt._src.distributed import groups


def state(rank: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    return {
        "w": distribute_tensor(full, mesh, [Shard(0)]),
        "step": 3,
        "loader": {"pos": rank},
        "env": {"seed": rank},
    }


def record(root: Path, rank: int, what: Any) -> None:
    """``error.<rank>.json``: "ok", or the error's type, text and failing ranks."""
    if isinstance(what, BaseException):
        what = {
            "type": type(what).__name__,
            "str": str(what),
            "notes": getattr(what, "__notes__", []),
            "failures": {str(r): list(f) for r, f in getattr(what, "failures", {}).items()},
        }
    (root / f"error.{rank}.json").write_text(json.dumps(what))


def attempt(root: Path, rank: int, call: Any) -> None:
    try:
        call()
    except Exception as e:  # recorded whatever it is: the test checks its type
        record(root, rank, e)
    else:
        record(root, rank, "ok")


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    variant = sys.argv[3] if len(sys.argv) > 3 else ""
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    s = state(rank)
    if mode == "base-one-rank":
        fc.save(root / "a", s)
        attempt(root, rank, lambda: fc.save(root / "b", s, base=root / "a" if rank else None))
    elif mode == "two-paths":
        dest = root / ("c" if rank else "b")
        if variant == "async":
            attempt(root, rank, lambda: fc.save_async(dest, s).result())
        else:
            attempt(root, rank, lambda: fc.save(dest, s))
    elif mode == "overwrite":
        fc.save(root / "a", s)
        attempt(root, rank, lambda: fc.save(root / "a", s, overwrite=rank == 1))
    elif mode == "staging":
        mode_of = "write" if rank else "copy"
        attempt(root, rank, lambda: fc.save_async(root / "a", s, staging=mode_of).result())
    elif mode == "per-rank":
        names = ("rng", "loader", "env") if rank else ("rng", "loader")
        attempt(root, rank, lambda: fc.save(root / "a", s, per_rank=names))
    elif mode == "file-gone":
        from functional_ckpt._src.format.naming import shard_name
        from functional_ckpt._src.save import incremental

        real = incremental.write_rank

        def vanishing(tmp: Path, r: int, *args: Any, **kwargs: Any) -> Any:
            out = real(tmp, r, *args, **kwargs)
            (tmp / shard_name(r)).unlink()  # gone before the coordinator commits
            return out

        if rank == 1:
            incremental.write_rank = vanishing  # type: ignore[assignment]
        attempt(root, rank, lambda: fc.save(root / "a", s))
    elif mode == "released":
        released(root, rank)
    elif mode == "gone-first":
        groups.checkpoint_group()  # made together (a collective on the default group)
        if rank == 1:
            if variant == "restore":
                fc.restore(root / "solo", {"x": torch.zeros(3)})
            dist.barrier()  # rank 0 is about to save
            os._exit(0)  # leaves without taking part: its connections close
        dist.barrier()
        if variant == "async":
            attempt(root, rank, lambda: fc.save_async(root / "a", s).result())
        else:
            attempt(root, rank, lambda: fc.save(root / "a", s))
        os._exit(0)  # the default group's peer is gone: no orderly teardown
    elif mode == "zstd":

        def save_and_restore() -> None:  # each rank compresses its own file
            fc.save(root / "a", s, compression="zstd")
            got = fc.restore(root / "a", like=s)
            full = got["w"].full_tensor()
            if not torch.equal(full, s["w"].full_tensor()) or got["loader"]["pos"] != rank:
                raise AssertionError(f"rank {rank} restored other values")

        attempt(root, rank, save_and_restore)
    else:
        raise SystemExit(f"unknown mode {mode}")
    dist.barrier()  # both ranks have recorded what they saw
    dist.destroy_process_group()


def released(root: Path, rank: int) -> None:
    """Rounds of checkpoint collectives, each checked as it returns: gloo's worker
    thread holds none of its tensors any more (else, at exit, that thread could free
    the last one during interpreter shutdown and abort the process)."""
    real, late, rounds = groups._collective, [], []

    def checked(op: Any, /, *args: Any, **kwargs: Any) -> None:
        flat = [t for a in args for t in (a if isinstance(a, list) else [a])]
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        held = [t._use_count() for t in tensors]
        real(op, *args, **kwargs)
        rounds.append(op.__name__)
        late.extend(op.__name__ for t, n in zip(tensors, held, strict=True) if t._use_count() > n)

    groups._collective = checked
    group = groups.checkpoint_group(purpose="control")
    for i in range(150):
        groups.all_gather_bytes(b"x" * i, group)
        groups.gather_bytes(b"y" * i, group)
        groups.broadcast_bytes(b"z" * i, group)
        groups.agree(None, group, "a round")
    record(root, rank, {"rounds": len(rounds), "late": late})


if __name__ == "__main__":
    main()
