"""A save every rank takes part in, through DCP's planners.

Every rank calls ``fc.save`` with its own state. DCP's planner decides who writes
what (sharded DTensor leaves by their owners, replicated tensors once, spread
across ranks); the storage writer here puts the chunks into each rank's shard file
with the same blob layout and CRC32s as a single-process save. The coordinator
commits only inside DCP's ``finish`` step, which runs after every rank reported
its data durable.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from functional_ckpt._src import codec
from functional_ckpt._src.distributed.groups import (
    _unwrap,
    agree,
    all_gather_bytes,
    checkpoint_group,
)
from functional_ckpt._src.format.dcp_values import ByteEntry
from functional_ckpt._src.format.manifest import Chunk, Entry, Manifest, tensor_groups
from functional_ckpt._src.format.naming import shard_name
from functional_ckpt._src.format.view import parse_planned
from functional_ckpt._src.save import incremental, trust
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.save.local import finalize, os_error
from functional_ckpt._src.save.plan import Plan, byte_entries, host_copy
from functional_ckpt._src.state.gc_pause import gc_paused
from functional_ckpt._src.storage import commit, durable, shards
from functional_ckpt.errors import CheckpointError


class _ChunkWriter(StorageWriter):
    """DCP storage writer that writes our blobs and commits on the coordinator."""

    def __init__(self, tmp: Path, job: _SaveJob) -> None:
        super().__init__()
        self.tmp = tmp
        self.job = job
        self.rank = 0
        self.seen: dict[trust.Key, trust.Ident] = {}  # for an incremental save

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = int(kwargs.get("rank", dist.get_rank()))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        items = [it for it in plan.items if it.type != WriteItemType.BYTE_IO]
        tensors = [host_copy(planner.resolve_data(it)) for it in items]  # type: ignore[arg-type]
        path = self.tmp / shard_name(self.rank)
        chunks = []
        for item in items:
            assert item.tensor_data is not None
            box = item.tensor_data.chunk
            chunks.append(Chunk(tuple(box.offsets), tuple(box.sizes)))
        blobs = self.job.blobs if self.rank == 0 else []
        try:
            if self.job.idents is None:
                shards.write_shard(path, tensors, chunks, blobs=blobs)
            else:  # each rank decides for its own chunks
                keys = [(it.index.fqn, c.offsets) for it, c in zip(items, chunks, strict=True)]
                idents = [self.job.idents.get(it.index.fqn) for it in items]
                self.seen = incremental.write_rank(
                    self.tmp, self.rank, self.job.base, keys, tensors, idents, chunks, blobs=blobs
                )
        except OSError as e:
            raise os_error(e, self.job.dest) from e
        results = [
            WriteResult(index=item.index, size_in_bytes=c.length, storage_data=c)
            for item, c in zip(items, chunks, strict=True)
        ]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.job.commit([wr for group in results for wr in group])

    def storage_meta(self) -> Any:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


@dataclass
class _SaveJob:
    """What the coordinator needs to turn written chunks into a committed checkpoint."""

    dest: Path
    tmp: Path
    entries: list[Entry]
    ranks: list[list[Entry]]
    metadata: Any
    overwrite: bool
    created: float
    nbytes: int = 0
    root: dict[str, Any] | None = None  # the root's batch size and names
    blobs: list[ByteEntry] = field(default_factory=list)  # values for stock readers (rank 0)
    base: incremental.Base | None = None  # an incremental save's base
    idents: dict[str, trust.Ident | None] | None = None  # by DCP key, when incremental
    world: int = 1

    def commit(self, results: list[WriteResult]) -> None:
        chunks: dict[str, list[Chunk]] = {}
        # every rank writes its file, unless an incremental save found nothing to write
        sizes = {} if self.idents is not None else {shard_name(r): 0 for r in range(self.world)}
        for wr in results:
            chunks.setdefault(wr.index.fqn, []).append(wr.storage_data)
            c = wr.storage_data
            sizes[c.file] = max(sizes.get(c.file, 0), c.offset + c.length)  # blobs tile it
        for group in tensor_groups(self.entries, self.ranks):
            for e in group:
                if e.alias is None:
                    e.chunks[:] = sorted(chunks.get(e.fqn, []), key=lambda c: c.offsets)
        manifest = Manifest(self.created, self.metadata, {}, self.entries, self.ranks, self.root)
        manifest.dcp_bytes = self.blobs
        try:
            # Shard files not in this directory were written by ranks that do not share
            # its file system, each into a directory of its own (a part).
            elsewhere = {n: size for n, size in sizes.items() if not (self.tmp / n).exists()}
            self.nbytes, _ = finalize(
                self.tmp,
                self.dest,
                manifest,
                overwrite=self.overwrite,
                file_info=incremental.reused_info(self.tmp),
                elsewhere=elsewhere,
            )
        except CheckpointError:  # e.g. CheckpointExists, itself an OSError
            raise
        except OSError as e:
            raise os_error(e, self.dest) from e


def save_planned(
    dest: Path,
    plan: Plan | None,
    metadata: Any,
    overwrite: bool,
    tensors: Sequence[torch.Tensor],
    error: BaseException | None,
    *,
    timeout: float | None = None,
    base: incremental.Base | None = None,
    idents: Sequence[trust.Ident | None] | None = None,
) -> CheckpointInfo:
    """The multi-rank write of a planned save: every rank calls it; one checkpoint commits.

    ``error`` is this rank's planning failure (then ``plan`` is None): the ranks
    agree on it first, so all of them fail together. ``tensors`` are what fills
    ``plan.targets`` (the sources, DTensors included, or their staged copies).
    """
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    t0 = time.perf_counter()
    group = checkpoint_group(timeout)
    rank = dist.get_rank()
    agree(error, group, f"save {dest}")
    assert plan is not None
    tmp_name = durable.tmp_sibling(dest).name if rank == 0 else ""
    tmp_name = all_gather_bytes(tmp_name.encode(), group)[0].decode()
    tmp = dest.parent / tmp_name
    error = None
    try:
        if rank == 0:
            durable.make_dirs(dest.parent)
            tmp.mkdir()
    except BaseException as e:
        error = os_error(e, dest) if isinstance(e, OSError) else e
    agree(error, group, f"save {dest}")
    try:
        own = rank != 0 and _own_part(tmp)
    except BaseException as e:
        error, own = os_error(e, dest) if isinstance(e, OSError) else e, False
    try:
        agree(error, group, f"save {dest}")
    except BaseException:
        if rank == 0 or own:
            commit.remove_tree(tmp)
        raise
    mine = codec.encode([e.to_plain() for e in plan.local])
    gathered = all_gather_bytes(mine, group)
    locals_ = [
        parse_planned(codec.decode(b), f"rank {r}'s entries") for r, b in enumerate(gathered)
    ]
    locals_[rank] = plan.local
    job = _SaveJob(dest, tmp, plan.entries, locals_, metadata, overwrite, time.time())
    job.root = plan.root
    if rank == 0:
        job.blobs = byte_entries(plan)
    if idents is not None and not own:  # a rank's own part has no base to share with
        job.base = base
        job.idents = {e.fqn: i for e, i in zip(plan.targets, idents, strict=True)}
    job.world = dist.get_world_size(group)
    writer = _ChunkWriter(tmp, job)
    state_dict = {e.fqn: t for e, t in zip(plan.targets, tensors, strict=True)}
    try:
        with gc_paused():
            dcp_save(
                state_dict,
                storage_writer=writer,
                planner=DefaultSavePlanner(),
                process_group=group,
            )
    except BaseException as e:
        if rank == 0 or own:
            commit.remove_tree(tmp)
        raise _unwrap(e, f"save {dest}") from e
    if own:  # this rank's part of a checkpoint committed on the coordinator's file system
        try:
            commit.commit_checkpoint(tmp, dest, overwrite=True, replaces=commit.PARTS)
        except OSError as e:
            commit.remove_tree(tmp)
            raise os_error(e, dest) from e
    sizes = all_gather_bytes(str(job.nbytes).encode(), group)
    if idents is not None:
        trust.remember(dest, writer.seen, writer.rank)
    return CheckpointInfo(
        path=dest,
        nbytes=int(sizes[0].decode() or 0),
        tensor_bytes=sum(t.numel() * t.element_size() for t in plan.sources),
        num_tensors=len(plan.sources),
        num_values=plan.num_values,
        created=job.created,
        duration=time.perf_counter() - t0,
        metadata=metadata,
    )


#: Roots whose checkpoints may be split across the ranks' own file systems (a remote
#: tier completes them): see :func:`allow_parts`.
_PART_ROOTS: set[Path] = set()


def allow_parts(root: Path, allowed: bool = True) -> None:
    """Let saves under ``root`` keep each rank's shard files on that rank's own disk.

    Only a remote tier, which uploads every rank's files and commits them as one
    checkpoint, makes such a split checkpoint whole; without one, a rank that does
    not see the coordinator's directory fails the save.
    """
    key = Path(os.path.abspath(root))
    if allowed:
        _PART_ROOTS.add(key)
    else:
        _PART_ROOTS.discard(key)


def _own_part(tmp: Path) -> bool:
    """Create ``tmp`` here if this rank does not see the coordinator's: True if it did.

    Ranks that share no file system with the coordinator (one local root per
    machine, under a remote tier) each keep their shard files in a directory of
    their own, renamed to the checkpoint's name once the coordinator committed: a
    *part* of the checkpoint, without manifest or marker, which no reader takes for
    a checkpoint.
    """
    if tmp.is_dir():
        return False
    if Path(os.path.abspath(tmp.parent)) not in _PART_ROOTS:
        raise CheckpointError(
            f"{tmp.parent}: rank {dist.get_rank()} does not see the directory rank 0 "
            "created there: a multi-rank save needs one directory shared by every rank, "
            "or a CheckpointManager with remote= (docs/tiered.md)"
        )
    durable.make_dirs(tmp.parent)
    try:
        tmp.mkdir()
    except FileExistsError:  # it showed up late: a shared file system after all
        return False
    return True
