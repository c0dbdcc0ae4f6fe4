"""A save every rank takes part in: DCP's planner decides who writes what, each rank writes
its shard file, and the coordinator commits once every rank reported its data durable."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import SavePlan, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _compare_save_plans

from functional_ckpt._src import codec
from functional_ckpt._src.distributed import groups
from functional_ckpt._src.distributed.groups import as_checkpoint_error, checkpoint_group
from functional_ckpt._src.format.dcp_values import ByteEntry
from functional_ckpt._src.format.manifest import Chunk, Entry, TensorEntry, Tree, Written
from functional_ckpt._src.format.naming import parse_shard
from functional_ckpt._src.format.view import parse_planned
from functional_ckpt._src.save import dedup, exchange, incremental, splice, staging, trust
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.save.job import SaveJob
from functional_ckpt._src.save.local import finalize
from functional_ckpt._src.save.plan import byte_entries, host_copy
from functional_ckpt._src.state.tree import gc_paused
from functional_ckpt._src.storage import commit, durable
from functional_ckpt._src.storage.os_failure import os_failure
from functional_ckpt.errors import CheckpointError


@dataclass(frozen=True)
class _Commit:
    """What each rank writes with, and the coordinator commits with."""

    job: SaveJob
    tmp: Path
    created: float
    blobs: list[ByteEntry]  # the values for stock readers, planned (rank 0)
    idents: dict[str, trust.Ident | None]  # by DCP key
    read: Callable[[], None] | None = None  # once this rank read every tensor it writes

    def finish(
        self,
        ranks: tuple[tuple[Entry, ...], ...],
        sent: list[exchange.Sent],
        blobs: tuple[ByteEntry, ...],
        elsewhere: dict[str, int],
        cache: exchange.PlanCache,
    ) -> int:
        """Commit (the coordinator): the checkpoint's size; ``elsewhere``: files in ranks' parts."""
        plan = self.job.plan
        tree = Tree(plan.entries, ranks, plan.root)
        # every rank writes its file, unless an incremental save found nothing to write
        incremental_save = self.job.options.base is not None  # the same on every rank
        chunks, sizes, spliced = splice.merge(cache, sent, tree, blobs, incremental_save)
        written = Written(chunks, blobs, incremental.reused_info(self.tmp), spliced)
        try:
            # A shard file not in this directory is one a rank that does not share its
            # file system reported writing into a directory of its own (a part), or an error.
            missing = exchange.unreported(sizes, lambda n: (self.tmp / n).exists(), elsewhere)
            if missing:
                raise CheckpointError(
                    f"{self.job.dest}: shard file {', '.join(missing)} is missing at the commit "
                    "and no rank reported writing it elsewhere; nothing was committed"
                )
            return finalize(
                self.tmp, self.job, tree, written, created=self.created, elsewhere=elsewhere
            )
        except CheckpointError:  # e.g. CheckpointExists, itself an OSError
            raise
        except OSError as e:
            raise os_failure(e, self.job.dest, "saving") from e


def save_planned(
    job: SaveJob,
    tensors: Sequence[torch.Tensor],
    *,
    read: Callable[[], None] | None = None,
) -> CheckpointInfo:
    """The multi-rank write of a planned save: every rank calls it, every failure is agreed
    on so all fail together; ``read()`` once this rank no longer reads ``tensors``."""
    t0 = time.perf_counter()
    dest = job.dest
    group = checkpoint_group(purpose=job.options.group)
    rank = dist.get_rank()
    error: BaseException | None = job.error
    what = f"save {dest}"
    first = b""
    try:  # the directory's name and the arguments every rank must pass alike
        first = exchange.first_round(durable.tmp_sibling(dest).name, job) if rank == 0 else b""
    except BaseException as e:  # told with the agreement below, never left unsent
        error = error or e
    told = groups.answered(what, groups.broadcast_bytes, first, group)
    tmp_name, coordinator = "", None
    try:  # a rank that passed other arguments fails the save on every rank, in the next round
        tmp_name, coordinator = exchange.parse_first_round(told)
        if rank != 0 and coordinator is not None:
            error = error or exchange.disagreement(job, coordinator, rank, what)
    except CheckpointError as e:
        error = error or e
    tmp, made, own = dest.parent / tmp_name, False, False
    try:
        if rank == 0 and error is None:
            durable.make_dirs(dest.parent)
            tmp.mkdir()
            made = True
    except BaseException as e:
        error = os_failure(e, dest, "saving") if isinstance(e, OSError) else e
    _agree(error, group, what, tmp if made else None)
    try:
        own = rank != 0 and _own_part(tmp, job.options.parts)
    except BaseException as e:
        error = os_failure(e, dest, "saving") if isinstance(e, OSError) else e
    _agree(error, group, what, tmp if rank == 0 or own else None)
    plan = job.plan
    blobs: list[ByteEntry] = []
    state_dict: dict[str, Any] = {}
    idents: dict[str, trust.Ident | None] = {}
    try:  # a failure here travels with the first exchange, never left unsent
        idents = dict(zip((e.fqn for e in plan.targets), job.idents, strict=True))
        blobs = byte_entries(plan, snapshot=job.snapshot) if rank == 0 else []
        state_dict = {e.fqn: t for e, t in zip(plan.targets, tensors, strict=True)}
    except BaseException as e:
        error = e
    commit_job = _Commit(job, tmp, time.time(), blobs, idents, read)
    cache = staging.plans(group, exchange.PlanCache)
    try:
        with gc_paused():
            nbytes, seen = _rounds(commit_job, state_dict, cache, group, what, error)
    except VerdictLost as e:
        staging.forget(group)  # the next save plans afresh on every rank
        if own:
            _keep_part(tmp, dest)
            raise CheckpointError(
                f"{e}; this rank's part is kept at {dest}, no checkpoint on its own"
            ) from e
        raise
    except BaseException as e:
        staging.forget(group)
        if rank == 0 or own:
            commit.remove_tree(tmp)
        raise as_checkpoint_error(e, what, "; nothing was committed") from e
    if own:  # this rank's part of a checkpoint committed on the coordinator's file system
        _keep_part(tmp, dest)
    job.options.trust.remember(dest, seen, rank)
    return job.info(nbytes, commit_job.created, t0)


def coordinate(
    gathered: Sequence[bytes],
    mine: tuple[Entry, ...],
    cache: exchange.PlanCache,
    shared: Sequence[Entry] | None = None,
) -> tuple[dict[int, bytes], tuple[tuple[Entry, ...], ...], list[dedup.Drops | None]]:
    """The coordinator's step before the writes: (the failures, every rank's per-rank entries,
    each rank's drops); ``mine``/``shared``: the coordinator's own entries, not decoded again."""
    failures: dict[int, bytes] = {}
    entries: list[tuple[Entry, ...]] = []
    keys: list[tuple[dedup.ItemKey, ...] | None] = []
    for r, data in enumerate(gathered):
        told = codec.decode(data)
        if not isinstance(told, list) or len(told) != 3 or type(told[0]) is not bytes:
            raise CheckpointError(f"rank {r} sent an invalid save plan")
        report, local, k = told
        if report:
            failures[r] = report
            continue
        entries.append(mine if r == 0 else tuple(parse_planned(local, f"rank {r}'s entries")))
        keys.append(exchange.parse_keys(k, r))
    if failures:
        return failures, (), []
    drops = exchange.global_step(cache, keys)
    if shared is not None and cache.keys is not None and any(k is not None for k in keys):
        _check_held(cache.keys, shared, entries)
    return {}, tuple(entries), drops


def _check_held(
    keys: Sequence[tuple[dedup.ItemKey, ...]],
    shared: Sequence[Entry],
    ranks: Sequence[tuple[Entry, ...]],
) -> None:
    """Refuse a shared tensor the coordinator lacks: the manifest would not list another's copy."""
    known = {e.fqn for g in (shared, *ranks) for e in g if type(e) is TensorEntry}
    alone = sorted({(f, r) for r, items in enumerate(keys) for f, _, _ in items if f not in known})
    if alone:
        fqn = alone[0][0]
        rs = ", ".join(str(r) for f, r in alone if f == fqn)
        raise CheckpointError(
            f"the shared tensor {fqn!r} is held by rank {rs} but not by "
            "rank 0, whose shared keys the checkpoint lists; give every rank the same shared "
            "keys, or save it as per-rank state (under a subtree named in per_rank=)"
        )


def _rounds(
    job: _Commit,
    state_dict: dict[str, Any],
    cache: exchange.PlanCache,
    group: Any,
    what: str,
    error: BaseException | None = None,
) -> tuple[int, trust.Seen]:
    """Plan, write and commit in four exchanges to or from the coordinator, so a rank moves
    the same bytes whatever the world size: (the checkpoint's size, this commit's trust).
    """
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    rank = dist.get_rank(group)
    planner = DefaultSavePlanner()
    local: SavePlan | None = None
    same = False
    try:  # DCP's planner decides who writes what: sharded leaves by their owners
        if error is not None:
            raise error
        planner.set_up_planner(state_dict, None, rank == 0)
        local = planner.create_local_plan()
        same = (
            cache.local is not None
            and cache.final is not None
            and _compare_save_plans(local, cache.local)
        )
        payload = exchange.rank_payload(job.job.plan, None if same else dedup.item_keys(local))
    except BaseException as e:
        error, payload = e, exchange.rank_payload(job.job.plan, None, e)
    gathered = groups.answered(what, groups.gather_bytes, payload, group)  # 1
    replies: list[bytes] | None = None
    ranks: tuple[tuple[Entry, ...], ...] = ()
    failures: dict[int, bytes] = {}
    if gathered is not None:
        try:
            failures, ranks, drops = coordinate(
                gathered, job.job.plan.local, cache, job.job.plan.entries
            )
            if failures:
                replies = [exchange.reply(failures, None)] * len(gathered)
            else:
                replies = [exchange.reply({}, None if d is None else list(d)) for d in drops]
        except BaseException as e:
            replies = [exchange.reply({0: groups.report(e)}, None)] * len(gathered)
            error = error or e
    told: Any = None
    failures = {}
    data = groups.answered(what, groups.scatter_bytes, replies, group)
    try:  # a reply this rank cannot read is its failure, told in the next exchange
        failures, told = exchange.parse_reply(data)
    except CheckpointError as e:
        error = error or e
    groups.raise_failures(error if failures else None, what, failures)  # known to all
    written: list[tuple[str, Chunk]] = []
    located: list[ByteEntry] = []
    seen = trust.Seen((), ())
    try:
        if error is not None:
            raise error
        assert local is not None
        if told is None:
            if not same:
                raise CheckpointError("the coordinator reused a save plan this rank did not")
            assert cache.final is not None
            final = cache.final
        else:
            final = dedup.kept(local, exchange.parse_drops(told, len(local.items)))
        written, located, seen = _write(job, final, planner, rank)
        cache.local, cache.final = local, final
        # where ranks may not share the coordinator's file system, each says what it wrote
        mine = _own_files(job.tmp, rank) if job.job.options.parts else None
        payload = exchange.written_payload(written, part=mine, boxes=told is not None)
    except BaseException as e:
        error, payload = e, exchange.written_payload([], e)
    gathered = groups.answered(what, groups.gather_bytes, payload, group)  # 2
    result = b""
    nbytes = 0
    if gathered is not None:
        failures.clear()  # none, or this function raised above
        sent: list[exchange.Sent] = []
        elsewhere: dict[str, int] = {}
        try:
            for r, data in enumerate(gathered):
                report, chunks, part = exchange.parse_written(data, r)
                if report:
                    failures[r] = report
                if chunks is not None:
                    sent.append(chunks)
                if r:  # the coordinator's own files are in its directory
                    elsewhere.update(part)
            if error is not None:
                failures[0] = groups.report(error)
            if not failures:
                nbytes = job.finish(ranks, sent, tuple(located), elsewhere, cache)
        except BaseException as e:
            failures[0] = groups.report(e)
            error = error or e
        result = exchange.reply(failures, nbytes)
    try:
        verdict = groups.broadcast_bytes(result, group)
    except Exception as e:  # the coordinator died, or a rank that should hear it did
        committed = gathered is not None and not failures
        raise VerdictLost(what, e, committed=committed) from e
    failures, told = exchange.parse_reply(verdict)
    groups.raise_failures(error, what, failures)
    return int(told), seen


class VerdictLost(CheckpointError):
    """The last exchange of a save failed: only the coordinator knows whether it
    committed (it has, when ``committed``), so a rank keeps its part, which the
    checkpoint may need and which alone is never read as one."""

    def __init__(self, what: str, cause: BaseException, *, committed: bool) -> None:
        super().__init__(
            f"{what}: committed, but another rank did not take the verdict ({cause})"
            if committed
            else f"{what}: the coordinator did not confirm the commit ({cause}); it may have "
            "committed"
        )
        self.committed = committed


def _write(
    job: _Commit, plan: SavePlan, planner: Any, rank: int
) -> tuple[list[tuple[str, Chunk]], list[ByteEntry], trust.Seen]:
    """Write this rank's share of the final plan: (chunks by DCP key, located values, trust)."""
    items = [it for it in plan.items if it.type != WriteItemType.BYTE_IO]
    tensors = [host_copy(planner.resolve_data(it)) for it in items]
    keys: list[trust.Key] = []
    for item in items:
        assert item.tensor_data is not None
        keys.append((item.index.fqn, tuple(item.tensor_data.chunk.offsets)))
    chunk_idents = [job.idents.get(it.index.fqn) for it in items]
    try:  # each rank decides for its own chunks what its base already holds
        # Run checksums stay with the rank that wrote them: the file table records
        # none of a multi-rank save (its readers check every blob on its own).
        chunks, located, _ = incremental.write_rank(
            job.tmp,
            rank,
            job.job.base,
            keys,
            tensors,
            chunk_idents,
            blobs=job.blobs,
            zstd_level=job.job.options.zstd_level,
        )
    except OSError as e:
        raise os_failure(e, job.job.dest, "saving") from e
    if job.read is not None:
        job.read()
    written = [(it.index.fqn, c) for it, c in zip(items, chunks, strict=True)]
    return written, located, trust.Seen(keys, chunk_idents)


def _agree(error: BaseException | None, group: Any, what: str, made: Path | None) -> None:
    """:func:`groups.agree`, removing the directory ``made`` when any rank failed."""
    try:
        groups.agree(error, group, what)
    except BaseException:
        if made is not None:
            commit.remove_tree(made)
        raise


def _keep_part(tmp: Path, dest: Path) -> None:
    """Rename this rank's part to the checkpoint's name, or remove it when that fails."""
    try:
        commit.commit_checkpoint(tmp, dest, overwrite=True, replaces=commit.PARTS)
    except OSError as e:
        commit.remove_tree(tmp)
        raise os_failure(e, dest, "saving") from e


def _own_files(tmp: Path, rank: int) -> dict[str, int]:
    """This rank's shard files in ``tmp`` with their sizes: what it reports writing."""
    return {
        n: os.stat(tmp / n, follow_symlinks=False).st_size
        for n in sorted(os.listdir(tmp))
        if (parse_shard(n) or (-1,))[0] == rank
    }


def _own_part(tmp: Path, parts: bool) -> bool:
    """Create ``tmp`` here if this rank does not see the coordinator's: True if it did."""
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
