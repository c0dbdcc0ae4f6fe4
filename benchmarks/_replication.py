"""The memory tier's replication across nodes, for ``benchmarks/memory_tier.py``.

Four ranks as two nodes of two (``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` as torchrun on
two machines sets them), each node with its memory folder, on one shared disk root.
The state is ``size`` bytes of float32 sharded over the ranks (a DTensor), so each
rank's shard file is a quarter of it. Measured, ``reps`` times:

replication
  *memory tier*: phase 2 of a memory-tier save (every rank's shard file sent to its
  holder on the other node, the coordinator's manifest to every folder, agreed on,
  committed in each folder), the part already written;
  *plain gloo*: the same bytes sent between the same ranks with one ``dist.send`` per
  file, in the same order, into buffers allocated beforehand (the floor); *into new
  files*: the same sends, each received straight into a new file of the receiver's
  folder in RAM, as a replica must land.
resume after a lost node
  *from replicas*: node b's folder deleted, ``restore_latest`` of a new manager (node
  b's shards fetched from node a, every byte checked, then read);
  *from disk*: ``restore_latest`` of a read-only manager of the root, the same step
  (its files dropped from the page cache first where the OS allows).
  *floor*: what any resume of the lost node pays on this machine, the sum of two
  parts measured on their own: the files node b lacks sent by plain gloo from node
  a's ranks, the same moves in the same order, into buffers allocated beforehand;
  and every rank's new tensors like its shard filled by a plain copy.

Each rank reports its times; a row's time is the slowest rank's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

WORLD = 4


def launch(base: Path, memory: Path, size: int, reps: int) -> list[dict[str, Any]]:
    """Run the four ranks; each rank's JSON report."""
    from _common import free_port

    port = str(free_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(base), str(memory), str(size), str(reps)],
            env={
                **env,
                "RANK": str(r),
                "WORLD_SIZE": str(WORLD),
                "LOCAL_RANK": str(r % 2),
                "LOCAL_WORLD_SIZE": "2",
            },
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(WORLD)
    ]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        if p.returncode != 0:
            raise RuntimeError(f"a replication rank failed ({p.returncode}): {out[-2000:]}")
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def _slowest(seconds: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _plain_sends(moves: Any, rank: int, src: Any, receive: Any, group: Any) -> float:
    """The slowest rank's time for ``moves`` by plain sends of ``src``, each received by
    ``receive(move, tag)``."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for tag, m in enumerate(moves):
        if m.src == rank:
            dist.send(src[: m.size], dst=m.dst, group=group, tag=tag)
        elif m.dst == rank:
            receive(m, tag)
    return _slowest(time.perf_counter() - t0)


def _recv_into_new_file(path: Path, size: int, src: int, group: Any, tag: int) -> None:
    """Receive ``size`` bytes straight into the pages of a new file (a shared map of it)."""
    import mmap

    import torch
    import torch.distributed as dist

    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
        view = mmap.mmap(fd, size)
        piece = torch.frombuffer(view, dtype=torch.uint8)
        dist.recv(piece, src=src, group=group, tag=tag)
        del piece
        view.close()
    finally:
        os.close(fd)


def worker(base: Path, memory: Path, size: int, reps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import functional_ckpt as fc
    from functional_ckpt._src.distributed.groups import checkpoint_group
    from functional_ckpt._src.distributed.replication import Move
    from functional_ckpt._src.format.naming import shard_name, step_name

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    full = torch.randn(WORLD * 64, max(1, size // 4 // (WORLD * 64)))
    state = {"w": distribute_tensor(full, mesh, [Shard(0)]), "step": 0}
    node = "ab"[rank // 2]
    folder = memory / f"mem-{node}"
    root = base / "root"
    out: dict[str, Any] = {
        "replicate": [],
        "plain": [],
        "from_replicas": [],
        "from_disk": [],
        "into_files": [],
        "lost_plain": [],
        "fill": [],
    }
    tier = fc.manager.Memory(path=folder, async_save=False, promote_on=(), keep=1)
    mgr = fc.CheckpointManager(root, save=fc.policy.always(), keep=fc.keep_last(1), tiers=(tier,))
    mem = mgr.memory
    assert mem is not None and mem.replicas is not None
    rep = mem.replicas
    plain_group = checkpoint_group(purpose="bench-plain")
    like = {"w": distribute_tensor(torch.zeros_like(full), mesh, [Shard(0)]), "step": 0}
    for k in range(reps):
        step = k + 1
        # Phase 1 (the part written), then phase 2 timed alone.
        if mem.keeper:
            mem.delete(mem.steps())  # keep=1: room for this step
            rep.clear_staging()
        dist.barrier()
        mem.writes.save(rep.staging(step), state, {"run": {"id": mem.run.id}})
        dist.barrier()  # every part renamed into place (a part's rank renames it)
        t0 = time.perf_counter()
        rep.replicate(step, None)
        out["replicate"].append(_slowest(time.perf_counter() - t0))
        if mem.keeper:
            mem._prune()
        # The floor: the same bytes between the same ranks, one send per file.
        sizes = [os.stat(folder / step_name(step) / shard_name(r)).st_size for r in range(WORLD)]
        holders = rep.layout.holders
        moves = [Move(r, h, shard_name(r), n) for r, n in enumerate(sizes) for h in holders[r]]
        nbytes = os.stat(folder / step_name(step) / shard_name(rank)).st_size
        bufs = {m.src: torch.empty(m.size, dtype=torch.uint8) for m in moves if m.dst == rank}
        src = torch.ones(nbytes, dtype=torch.uint8)

        def into_buffer(m: Any, tag: int, bufs: dict[int, Any] = bufs) -> None:
            dist.recv(bufs[m.src], src=m.src, group=plain_group, tag=tag)

        out["plain"].append(_plain_sends(moves, rank, src, into_buffer, plain_group))
        del into_buffer
        out["bytes"] = sum(m.size for m in moves)
        del bufs
        # The same sends, each landing in a new file of the receiver's folder in RAM
        # (where a replica must be): the file's pages are new, as a replica's are.
        into = folder / f".bench-into-{rank}"
        into.mkdir(exist_ok=True)

        def into_file(m: Any, tag: int, into: Path = into) -> None:
            _recv_into_new_file(into / shard_name(m.src), m.size, m.src, plain_group, tag)

        out["into_files"].append(_plain_sends(moves, rank, src, into_file, plain_group))
        shutil.rmtree(into)
    # The disk tier holds the newest step too: the manager saves it there every time.
    mgr.maybe_save(state, step=reps + 1)
    for k in range(reps):
        if mem._lock is not None:  # as a crash leaves it: no close, the lock let go
            mem._lock.release()
            mem._lock = None
        if mgr._lock is not None:
            mgr._lock.release()
            mgr._lock = None
        dist.barrier()
        if rank == 2:  # node b is lost, and its RAM with it
            shutil.rmtree(folder)
        dist.barrier()
        mgr = fc.CheckpointManager(
            root, save=fc.policy.always(), keep=fc.keep_last(1), tiers=(tier,)
        )
        mem = mgr.memory
        assert mem is not None and mem.replicas is not None
        dist.barrier()
        t0 = time.perf_counter()
        got = mgr.restore_latest(like=like)
        out["from_replicas"].append(_slowest(time.perf_counter() - t0))
        assert got is not None and mgr.restored_step == reps + 1, mgr.restored_step
        out["fetched"] = mem.replicas.resumed.get("fetched", {})
        from _common import drop_cache

        drop_cache(root)  # as the disk tier's resume after a restart would find it
        dist.barrier()
        with fc.CheckpointManager(root, read_only=True) as ro:
            t0 = time.perf_counter()
            got = ro.restore_latest(like=like)
            out["from_disk"].append(_slowest(time.perf_counter() - t0))
            assert got is not None and ro.restored_step == reps + 1
        _ = k
    # The floor of a lost node's resume: node b's files by plain gloo, then a plain fill
    # of new tensors like each rank's shard (each part on its own, slowest rank each).
    sizes = [os.stat(root / step_name(reps + 1) / shard_name(r)).st_size for r in range(WORLD)]
    # node a's ranks to node b's
    lost = [Move(r % 2, 2 + r % 2, shard_name(r), n) for r, n in enumerate(sizes)]
    shard = state["w"].to_local()
    src = torch.ones(max(sizes), dtype=torch.uint8)
    for _ in range(reps):
        into = {t: torch.empty(m.size, dtype=torch.uint8) for t, m in enumerate(lost)
                if m.dst == rank}  # fmt: skip

        def into_buffer(m: Any, tag: int, into: dict[int, Any] = into) -> None:
            dist.recv(into[tag], src=m.src, group=plain_group, tag=tag)

        out["lost_plain"].append(_plain_sends(lost, rank, src, into_buffer, plain_group))
        del into, into_buffer
        dist.barrier()
        t0 = time.perf_counter()
        fresh = torch.empty_like(shard)
        fresh.copy_(shard)
        out["fill"].append(_slowest(time.perf_counter() - t0))
        del fresh
    mgr.close()
    dist.barrier()
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    report = worker(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    print(json.dumps(report), flush=True)
