"""One rank of the replicated memory-tier tests (launched by tests/test_memory_replicas.py).

Four ranks as two nodes of two: ranks 0 and 1 are node ``a``, 2 and 3 node ``b``
(from ``LOCAL_RANK``, as torchrun on two machines sets it, or, under one
``torchrun --nproc_per_node=4``, from ``DOMAIN_SIZE`` through ``Memory(domain=...)``).
Each node has its memory folder ``BASE/mem-<node>``; the disk root ``BASE/root`` is
shared. The state is a weight sharded over the ranks, updated every step from a
per-rank generator whose state is saved too (``rng``), and a per-rank loader position.

    python tests/memory_job.py BASE STEPS [--die-at N]
                               [--die-in-round N | --full-in-round N] [--die-rank R] [--plain]
                               [--delete N | --rollback N]

``--die-at N``: every rank SIGKILLs itself once the memory step N is committed.
``--die-in-round N``: rank R SIGKILLs itself as the replication of its N-th memory
save starts (its part written, no replica sent). ``--full-in-round N``: rank R
finds no room for the replica it receives in its N-th round. Each rank prints ``RESUMED``
(the step, what its folder fetched, the warnings, and how many copies were checked
whole before the read) and ``FINAL`` (a digest of its final state). ``--delete N``:
every rank deletes step N at the end and prints ``HELD`` (the steps its folder and the
disk then hold). ``--rollback N``: every rank tries a rollback to N + 1, printing
``REFUSED`` and the error, then rolls back to step N (newer steps to the branch ``b``)
and prints ``ROLLED`` (its folder's steps, the disk's, the
branches).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functional_ckpt as fc

DISK_EVERY = 5
#: ``--plain``: a state of replicated tensors (written by one rank) and per-rank values.
PLAIN = False


def initial(mesh: Any, rank: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1000 + rank)
    full = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32) / 7
    if PLAIN:  # every tensor replicated: the same on every rank, written by one
        return {"w": full, "step": 0, "loader": {"pos": rank}}
    return {
        "w": distribute_tensor(full, mesh, [Shard(0)]),
        "frozen": distribute_tensor(full.flip(0) + 1, mesh, [Shard(0)]),  # never trained
        "step": 0,
        "rng": {"gen": gen.get_state()},
        "loader": {"pos": rank},
    }


def train(state: dict[str, Any], mesh: Any) -> dict[str, Any]:
    if PLAIN:
        w, pos = state["w"] * 0.999 + 1, int(state["loader"]["pos"]) + 4
        return {"w": w, "step": int(state["step"]) + 1, "loader": {"pos": pos}}
    gen = torch.Generator()
    gen.set_state(state["rng"]["gen"])
    local = state["w"].to_local() * 0.999 + torch.randn(state["w"].to_local().shape, generator=gen)
    return {
        "w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False),
        "frozen": state["frozen"],
        "step": int(state["step"]) + 1,
        "rng": {"gen": gen.get_state()},
        "loader": {"pos": int(state["loader"]["pos"]) + 4},
    }


def digest(state: dict[str, Any]) -> str:
    if PLAIN:
        crc = zlib.crc32(state["w"].contiguous().numpy().tobytes())
        return f"{crc:08x}-{state['step']}-{state['loader']['pos']}"
    local = state["w"].to_local().contiguous()
    crc = zlib.crc32(local.numpy().tobytes())
    crc = zlib.crc32(state["frozen"].to_local().contiguous().numpy().tobytes(), crc)
    crc = zlib.crc32(state["rng"]["gen"].numpy().tobytes(), crc)
    return f"{crc:08x}-{state['step']}-{state['loader']['pos']}"


def plain(state: Any) -> dict[str, Any]:
    if PLAIN:
        pos = int(state["loader"]["pos"])
        return {"w": state["w"], "step": int(state["step"]), "loader": {"pos": pos}}
    return {
        "w": state["w"],
        "frozen": state["frozen"],
        "step": int(state["step"]),
        "rng": {"gen": state["rng"]["gen"]},
        "loader": {"pos": int(state["loader"]["pos"])},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("steps", type=int)
    ap.add_argument("--die-at", type=int)
    ap.add_argument("--die-in-round", type=int)
    ap.add_argument("--die-rank", type=int, default=2)
    ap.add_argument("--full-in-round", type=int)
    ap.add_argument("--plain", action="store_true")
    ap.add_argument("--delete", type=int)
    ap.add_argument("--rollback", type=int)
    args = ap.parse_args()
    global PLAIN
    PLAIN = args.plain
    base = Path(args.base)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    size = int(os.environ.get("DOMAIN_SIZE", "0"))
    domain = (lambda r: r // size) if size else None
    node = "abcd"[rank // int(os.environ.get("LOCAL_WORLD_SIZE", "2"))]
    if args.die_in_round is not None and rank == args.die_rank:
        from functional_ckpt._src.manager import memory_replicas

        real, calls = memory_replicas.transfer, [0]

        def dying(*a: Any, **k: Any) -> int:
            calls[0] += 1
            if calls[0] == args.die_in_round:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **k)

        memory_replicas.transfer = dying  # type: ignore[assignment]
    if args.full_in_round is not None and rank == args.die_rank:
        from functional_ckpt._src.storage import durable

        real_open, opened = durable.open_new, [0]

        def full(path: Path, *, mapped: bool = False, **kw: Any) -> int:
            if mapped:  # a replica received (only the replication maps what it writes)
                opened[0] += 1
                if opened[0] == args.full_in_round:
                    raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return real_open(path, mapped=mapped, **kw)

        durable.open_new = full  # type: ignore[assignment]
    from functional_ckpt._src.manager import memory_replicas as replicas_module

    # how many memory-tier copies were checked byte for byte before a read
    real_verify, verified = replicas_module.verify, [0]

    def counted_verify(*a: Any, **k: Any) -> Any:
        verified[0] += 1
        return real_verify(*a, **k)

    replicas_module.verify = counted_verify  # type: ignore[assignment]
    from functional_ckpt._src.save import incremental

    # per memory-tier save of this rank: how many of its chunks were not written again
    unchanged, write_rank, reused = incremental.unchanged_chunks, incremental.write_rank, []
    memory_save = [False]

    def counting(*a: Any, **k: Any) -> Any:
        found = unchanged(*a, **k)
        if memory_save[0]:
            reused.append(sum(c is not None for c in found))
        return found

    def writing(tmp: Path, *a: Any, **k: Any) -> Any:
        memory_save[0] = tmp.is_relative_to(base / f"mem-{node}")
        return write_rank(tmp, *a, **k)

    incremental.unchanged_chunks = counting  # type: ignore[assignment]
    incremental.write_rank = writing  # type: ignore[assignment]
    tier = fc.manager.Memory(path=base / f"mem-{node}", promote_on=(), domain=domain)
    disk = fc.every_steps(DISK_EVERY) | fc.on_final()
    with (
        warnings.catch_warnings(record=True) as seen,
        fc.CheckpointManager(base / "root", save=disk, keep=fc.keep_last(2), tiers=(tier,)) as mgr,
    ):
        warnings.simplefilter("always")
        assert mgr.memory is not None and mgr.memory.replicas is not None
        state = initial(mesh, rank)
        # Onto another world size, each rank takes over the per-rank state of its number.
        keep_mine = None if world == 4 else (lambda saved, r, w: saved[r])
        restored = mgr.restore_latest(like=initial(mesh, rank), reshard=keep_mine)
        if restored is not None:
            state = plain(restored)
        report = mgr.memory.replicas.resumed
        told = [f"{w.category.__name__}: {w.message}" for w in seen]
        print("RESUMED", json.dumps([mgr.restored_step, report, told, verified[0]]), flush=True)
        while state["step"] < args.steps:
            mgr.wait_staged()
            state = train(state, mesh)
            step = state["step"]
            mgr.maybe_save(state, step=step, is_final=step == args.steps)
            if step == args.die_at:
                mgr.wait()
                os.kill(os.getpid(), signal.SIGKILL)
        mgr.wait()
        if args.delete is not None:
            mgr.delete(args.delete)
            print("HELD", json.dumps([mgr.memory.steps(), mgr.steps()]), flush=True)
            dist.barrier()  # before a keeper's close() removes its folder
        if args.rollback is not None:
            try:
                mgr.rollback(args.rollback + 1, like=initial(mesh, rank))
            except fc.errors.CheckpointError as err:
                print("REFUSED", json.dumps(str(err)), flush=True)
            mgr.rollback(args.rollback, like=initial(mesh, rank), branch="b")
            print("ROLLED", json.dumps([mgr.memory.steps(), mgr.steps(), mgr.branches()]))
        print("FINAL", digest(state), flush=True)
        print("REUSED", json.dumps(reused), flush=True)
        print("WARNINGS", json.dumps([str(w.message) for w in seen]), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
