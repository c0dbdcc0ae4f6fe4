"""A save every rank takes part in, through DCP's planners.

Every rank calls ``fc.save`` with its own state. DCP's planner decides who writes
what (sharded DTensor leaves by their owners, replicated tensors once, spread
across ranks); the storage writer here puts the chunks into each rank's shard file
with the same blob layout and CRC32s as a single-process save. The coordinator
commits only inside DCP's ``finish`` step, which runs after every rank reported
its data durable.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import _compare_save_plans
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from functional_ckpt._src import codec
from functional_ckpt._src.distributed import groups
from functional_ckpt._src.distributed.groups import _unwrap, checkpoint_group
from functional_ckpt._src.format.dcp_values import ByteEntry
from functional_ckpt._src.format.manifest import Chunk, Entry, Tree, Written
from functional_ckpt._src.format.naming import shard_name
from functional_ckpt._src.format.view import parse_planned
from functional_ckpt._src.save import dedup, incremental, trust
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.save.job import SaveJob
from functional_ckpt._src.save.local import finalize, remembered
from functional_ckpt._src.save.plan import Plan, byte_entries, host_copy
from functional_ckpt._src.state.gc_pause import gc_paused
from functional_ckpt._src.storage import commit, durable
from functional_ckpt._src.storage.os_failure import os_failure
from functional_ckpt.errors import CheckpointError


class _ChunkWriter(StorageWriter):
    """DCP storage writer that writes this project's blobs and commits on the coordinator.

    ``write_data`` returns, through DCP, the chunks each rank wrote; the coordinator's
    ``finish`` makes the manifest from the planned tree and those chunks.
    """

    def __init__(self, tmp: Path, job: SaveJob, commit_job: _Commit) -> None:
        super().__init__()
        self.tmp = tmp
        self.job = job
        self.commit_job = commit_job
        self.rank = 0
        self.seen = trust.Seen((), ())  # what this rank's commit remembers
        self.blobs: list[ByteEntry] = []  # the values for stock readers, located (rank 0)

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
        keys: list[trust.Key] = []
        for item in items:
            assert item.tensor_data is not None
            keys.append((item.index.fqn, tuple(item.tensor_data.chunk.offsets)))
        idents = self.commit_job.idents
        chunk_idents = [idents.get(it.index.fqn) for it in items]
        blobs = self.commit_job.blobs if self.rank == 0 else []
        try:  # each rank decides for its own chunks what its base already holds
            chunks, self.blobs = incremental.write_rank(
                self.tmp, self.rank, self.commit_job.base, keys, tensors, chunk_idents, blobs=blobs
            )
        except OSError as e:
            raise os_failure(e, self.job.dest, "saving") from e
        self.seen = remembered(keys, chunk_idents)
        results = [
            WriteResult(index=item.index, size_in_bytes=c.length, storage_data=c)
            for item, c in zip(items, chunks, strict=True)
        ]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        self.commit_job.nbytes = self.commit_job.finish(
            [wr for group in results for wr in group], tuple(self.blobs)
        )

    def storage_meta(self) -> Any:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


@dataclass
class _Commit:
    """What the coordinator needs to turn every rank's chunks into a committed checkpoint.

    Built once every rank's per-rank entries are known; ``nbytes`` is its one result.
    """

    job: SaveJob
    tmp: Path
    tree: Tree
    created: float
    world: int
    blobs: list[ByteEntry]  # the values for stock readers, planned (rank 0)
    base: incremental.Base | None
    idents: dict[str, trust.Ident | None]  # by DCP key
    nbytes: int = 0

    def finish(self, results: list[WriteResult], blobs: tuple[ByteEntry, ...]) -> int:
        # every rank writes its file, unless an incremental save found nothing to write
        incremental_save = self.job.options.base is not None  # the same on every rank
        chunks, sizes = merge_results(
            [(wr.index.fqn, wr.storage_data) for wr in results], blobs, self.world, incremental_save
        )
        written = Written(chunks, blobs, incremental.reused_info(self.tmp))
        prepared = self.job.prepared
        assert prepared is not None
        try:
            # Shard files not in this directory were written by ranks that do not share
            # its file system, each into a directory of its own (a part).
            elsewhere = {n: size for n, size in sizes.items() if not (self.tmp / n).exists()}
            nbytes, _ = finalize(
                self.tmp,
                self.job.dest,
                self.tree,
                written,
                created=self.created,
                metadata=prepared.metadata,
                metadata_bytes=prepared.metadata_bytes,
                overwrite=self.job.options.overwrite,
                elsewhere=elsewhere,
            )
        except CheckpointError:  # e.g. CheckpointExists, itself an OSError
            raise
        except OSError as e:
            raise os_failure(e, self.job.dest, "saving") from e
        return nbytes


class _Planner(DefaultSavePlanner):
    """DCP's save planner, deciding only who writes what, and once per layout.

    Of DCP's global step this writer needs the deduplication alone (which rank
    writes each replicated tensor). DCP's global ``Metadata`` (every rank's chunk of
    every tensor, validated chunk by chunk) is never read: the coordinator derives
    ``.metadata`` from the manifest, and the manifest's chunks are checked when it
    is read. So it is not built, and the empty one handed to DCP keeps a rank's
    share of DCP's closing broadcast the same size whatever the world size.

    A training loop saves one layout again and again, so DCP's plan caching is on:
    a rank whose local plan equals its last one (same keys, shapes, dtypes, boxes)
    sends an empty plan instead, and when every rank did, the coordinator reuses the
    last global plan without deduplicating again (:func:`global_plans`). ``key``
    names the cache: the checkpoint group's ranks, so that a plan is never reused
    by another world.
    """

    def __init__(self, key: str) -> None:
        super().__init__(enable_plan_caching=True)
        self._cached_plans_key = key

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        return dedup.dedup_save_plans(all_plans, self.dedup_save_to_lowest_rank)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        delta, plans = global_plans(self._cached_plans_key, all_plans, self._dedup_save_plans)
        self.global_plan = plans
        self.metadata = Metadata(state_dict_metadata={})
        return delta, self.metadata


def plan_key(ranks: Sequence[int]) -> str:
    """The plan cache's key for a checkpoint group of these global ranks."""
    return f"functional_ckpt/{len(ranks)}/{zlib.crc32(repr(tuple(ranks)).encode()):08x}"


def forget_plans(key: str) -> None:
    """Drop every plan cached under ``key`` on this rank (a save that failed: what
    the coordinator and this rank hold may no longer agree)."""
    for cache in (
        SavePlanner._cached_save_plan,
        SavePlanner._cached_final_save_plan,
        SavePlanner._cached_all_plans,
        SavePlanner._cached_global_plan,
        SavePlanner._cached_metadata,
    ):
        cache.pop(key, None)


def global_plans(
    key: str, all_plans: list[SavePlan], dedup: Callable[[list[SavePlan]], list[SavePlan]]
) -> tuple[list[SavePlan], list[SavePlan]]:
    """The global plans (what each rank is sent, and in full) for ranks' local plans.

    An empty, unusable local plan means "the same as my last": it is replaced by
    the plan cached for that rank. When no rank's plan changed, the last global
    plans are reused whole and every rank is sent an empty one (it reuses its own);
    otherwise the merged plans are deduplicated again and only the plans that
    changed are sent. A rank that claims a cached plan the coordinator does not hold
    (another world, a cache lost) is an error, never a stale plan; the failed save
    makes every rank forget its plans (:func:`forget_plans`), so the next one plans
    afresh.
    """
    cached = SavePlanner._cached_all_plans.get(key)
    unchanged = [not p.usable for p in all_plans]
    if any(unchanged) and (cached is None or len(cached) != len(all_plans)):
        raise CheckpointError(
            "a rank reused a save plan this coordinator does not hold; save again"
        )
    last = SavePlanner._cached_global_plan.get(key)
    if cached is not None and all(unchanged) and last is not None:
        return [SavePlan([], usable=False)] * len(all_plans), last
    merged = (
        all_plans
        if cached is None
        else [c if same else p for c, p, same in zip(cached, all_plans, unchanged, strict=True)]
    )
    plans = dedup(merged)
    if last is not None and len(last) == len(plans):
        delta = [
            SavePlan([], usable=False) if _compare_save_plans(old, new) else new
            for old, new in zip(last, plans, strict=True)
        ]
    else:
        delta = plans
    SavePlanner._cached_all_plans[key] = merged
    SavePlanner._cached_global_plan[key] = plans
    return delta, plans


def local_entries(plan: Plan) -> bytes:
    """A rank's per-rank entries as it sends them to the coordinator."""
    return codec.encode([e.to_plain() for e in plan.local])


def gathered_entries(gathered: Sequence[bytes]) -> tuple[tuple[Entry, ...], ...]:
    """Every rank's per-rank entries, as the coordinator receives them, validated."""
    return tuple(
        tuple(parse_planned(codec.decode(b), f"rank {r}'s entries")) for r, b in enumerate(gathered)
    )


def merge_results(
    results: Sequence[tuple[str, Chunk]],
    blobs: Sequence[ByteEntry],
    world: int,
    incremental_save: bool,
) -> tuple[dict[str, tuple[Chunk, ...]], dict[str, int]]:
    """Every rank's written chunks by DCP key, and each shard file's size.

    Pure, so the coordinator's share of a save can be measured for any world size
    without a process group (benchmarks/scale.py).
    """
    chunks: dict[str, list[Chunk]] = {}
    sizes = {} if incremental_save else {shard_name(r): 0 for r in range(world)}
    for fqn, c in results:
        chunks.setdefault(fqn, []).append(c)
        sizes[c.file] = max(sizes.get(c.file, 0), c.offset + c.length)  # blobs tile it
    for b in blobs:
        sizes[b.file] = max(sizes.get(b.file, 0), b.offset + b.length)
    return {k: tuple(v) for k, v in chunks.items()}, sizes


def save_planned(
    job: SaveJob, tensors: Sequence[torch.Tensor], *, timeout: float | None = None
) -> CheckpointInfo:
    """The multi-rank write of a planned save: every rank calls it; one checkpoint commits.

    A rank's planning failure (``job.error``) is agreed on with the coordinator's
    directory (one round: the coordinator makes it only when it planned, and removes
    it when another rank did not), so all of them fail together. ``tensors`` are what
    fills the plan's targets (the sources, DTensors included, or their staged copies).
    """
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    t0 = time.perf_counter()
    dest = job.dest
    group = checkpoint_group(timeout, purpose=job.options.group)
    rank = dist.get_rank()
    error: BaseException | None = job.error
    tmp_name = ""
    try:
        tmp_name = durable.tmp_sibling(dest).name if rank == 0 else ""
    except BaseException as e:  # told with the agreement below, never left unsent
        error = error or e
    tmp_name = groups.broadcast_bytes(tmp_name.encode(), group).decode()
    tmp = dest.parent / tmp_name
    made = False
    try:
        if rank == 0 and error is None:
            durable.make_dirs(dest.parent)
            tmp.mkdir()
            made = True
    except BaseException as e:
        error = os_failure(e, dest, "saving") if isinstance(e, OSError) else e
    try:
        groups.agree(error, group, f"save {dest}")
    except BaseException:
        if made:
            commit.remove_tree(tmp)
        raise
    plan = job.plan
    try:
        own = rank != 0 and _own_part(tmp, job.options.parts)
    except BaseException as e:
        error, own = os_failure(e, dest, "saving") if isinstance(e, OSError) else e, False
    try:
        groups.agree(error, group, f"save {dest}")
    except BaseException:
        if rank == 0 or own:
            commit.remove_tree(tmp)
        raise
    # only the coordinator builds the manifest: only it receives every rank's entries
    gathered = groups.gather_bytes(local_entries(plan), group)
    ranks: tuple[tuple[Entry, ...], ...] = ()
    if gathered is not None:
        ranks = gathered_entries(gathered)
        ranks = (*ranks[:rank], plan.local, *ranks[rank + 1 :])
    world = dist.get_world_size(group)
    idents = dict(zip((e.fqn for e in plan.targets), job.idents, strict=True))
    commit_job = _Commit(
        job,
        tmp,
        Tree(plan.entries, ranks, plan.root),
        time.time(),
        world,
        byte_entries(plan, snapshot=job.snapshot) if rank == 0 else [],
        None if own else job.base,  # a rank's own part has no base to share with
        idents,
    )
    writer = _ChunkWriter(tmp, job, commit_job)
    state_dict = {e.fqn: t for e, t in zip(plan.targets, tensors, strict=True)}
    key = plan_key(dist.get_process_group_ranks(group))
    try:
        with gc_paused():
            dcp_save(state_dict, storage_writer=writer, planner=_Planner(key), process_group=group)
    except BaseException as e:
        forget_plans(key)  # the next save plans afresh on every rank
        if rank == 0 or own:
            commit.remove_tree(tmp)
        raise _unwrap(e, f"save {dest}") from e
    if own:  # this rank's part of a checkpoint committed on the coordinator's file system
        try:
            commit.commit_checkpoint(tmp, dest, overwrite=True, replaces=commit.PARTS)
        except OSError as e:
            commit.remove_tree(tmp)
            raise os_failure(e, dest, "saving") from e
    nbytes = groups.broadcast_bytes(str(commit_job.nbytes).encode(), group)
    job.options.trust.remember(dest, writer.seen, writer.rank)
    assert job.prepared is not None
    return CheckpointInfo(
        path=dest,
        nbytes=int(nbytes.decode() or 0),
        tensor_bytes=sum(t.numel() * t.element_size() for t in plan.sources),
        num_tensors=len(plan.sources),
        num_values=plan.num_values,
        created=commit_job.created,
        duration=time.perf_counter() - t0,
        metadata=job.prepared.metadata,
    )


def _own_part(tmp: Path, parts: bool) -> bool:
    """Create ``tmp`` here if this rank does not see the coordinator's: True if it did.

    Ranks that share no file system with the coordinator (one local root per
    machine, under a remote tier: ``SaveOptions.parts``) each keep their shard files
    in a directory of their own, renamed to the checkpoint's name once the
    coordinator committed: a *part* of the checkpoint, without manifest or marker,
    which no reader takes for a checkpoint.
    """
    if tmp.is_dir():
        return False
    if not parts:
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
