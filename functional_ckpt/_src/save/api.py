"""``fc.save`` and ``fc.save_async``: one pipeline, plan -> stage -> write -> commit."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from functional_ckpt._src.arguments import require
from functional_ckpt._src.distributed.topology import is_dtensor, topology
from functional_ckpt._src.format.naming import step_in_name
from functional_ckpt._src.log import done, logger, phase
from functional_ckpt._src.paths import PathLike
from functional_ckpt._src.save import incremental
from functional_ckpt._src.save import staging as stages
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.save.job import Hooks, SaveJob
from functional_ckpt._src.save.local import write_local
from functional_ckpt._src.save.options import DEFAULT_PER_RANK, SaveOptions, save_options
from functional_ckpt._src.save.plan import host_copy, prepare_save
from functional_ckpt._src.save.staging import PendingSave, Stager, Staging
from functional_ckpt._src.save.trust import idents
from functional_ckpt._src.state.tree import State, gc_paused
from functional_ckpt.errors import CheckpointError

_LOG = logger("save")


def plan_job(
    path: PathLike,
    state: State,
    options: SaveOptions,
    *,
    snapshot: bool,
    staging: str | None = None,
) -> SaveJob:
    """Check and plan a save once; a distributed rank keeps its failure in the job for all."""
    topo = topology()
    try:
        prepared = prepare_save(
            path,
            state,
            options.metadata,
            options.overwrite,
            per_rank=options.per_rank,
            rank=topo.rank,
            check_path=topo.coordinator,
        )
        base = incremental.open_base(options)
    except BaseException as e:
        if not topo.distributed:
            raise
        return SaveJob(Path(path), None, options, topo, True, e, staging=staging)
    plan = prepared.plan
    return SaveJob(
        prepared.dest,
        prepared,
        options,
        topo,
        topo.distributed or plan.has_dtensor,
        base=base,
        idents=idents(plan.sources),
        snapshot=snapshot,
        staging=staging,
    )


def write_job(job: SaveJob, tensors: Sequence[torch.Tensor], hooks: Hooks) -> CheckpointInfo:
    """Write and commit ``job``: this process alone, or every rank (with only ``after_read``)."""
    if job.distributed:
        from functional_ckpt._src.save.multi_rank import save_planned

        assert hooks.after_each is None and hooks.before_commit is None, "refused up front"
        info = save_planned(job, tensors, read=hooks.after_read)
        if not job.topology.coordinator:
            return info
    else:
        info = write_local(job, tensors, hooks)
    step = step_in_name(info.path.name)
    done(_LOG, "saved", info.path, seconds=info.duration, nbytes=info.nbytes, step=step)
    return info


def run_save(path: PathLike, state: State, options: SaveOptions) -> CheckpointInfo:
    """A synchronous save with the given options (``fc.save``, a manager's saves)."""
    with gc_paused():
        with phase(_LOG, "plan", path):
            job = plan_job(path, state, options, snapshot=False)
        with incremental.closing(job.base), phase(_LOG, "write and commit", path):
            sources = () if job.prepared is None else job.plan.sources
            tensors = list(sources) if job.distributed else [host_copy(t) for t in sources]
            info = write_job(job, tensors, Hooks())
        del job, sources, tensors  # freed unwalked by the collection re-enabling triggers
    return info


def save(
    path: PathLike,
    state: State,
    *,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    per_rank: Sequence[str] = DEFAULT_PER_RANK,
    base: PathLike | None = None,
    compression: str | None = None,
) -> CheckpointInfo:
    """Write ``state`` to the directory ``path``, atomically and durably: when this returns
    the checkpoint is complete and fsynced; before, ``path`` is absent or the previous one.
    Under a process group every rank calls it with its own state; ``per_rank`` names the
    top-level subtrees stored per rank. With ``base`` (a committed checkpoint), unchanged
    bytes are shared with it, the result still self-contained. ``compression="zstd"``
    (``"zstd:N"``: level N) stores tensors as zstd frames stock ``dcp.load`` reads too.
    """
    options = save_options("fc.save", metadata, overwrite, per_rank, base, compression)
    return run_save(path, state, options)


def start_save(
    path: PathLike,
    state: State,
    options: SaveOptions,
    staging: Staging,
    stager: Stager,
    *,
    before_write: Callable[[], None] | None = None,
) -> PendingSave:
    """An asynchronous save; ``before_write`` runs on its thread once staged (a memory tier's)."""
    staging = stages.check_staging(staging, "save_async")
    job = plan_job(path, state, options, snapshot=True, staging=staging)
    try:
        if job.distributed:
            if staging == "none":
                raise CheckpointError(
                    "save_async(staging='none') is not supported under torch.distributed; "
                    "use staging='copy' or 'write'"
                )
            from functional_ckpt._src.distributed.groups import checkpoint_group

            checkpoint_group(purpose=options.group)  # a collective: not on the save's thread
        return stages.run_in_background(job.dest, _work(job, staging, stager, before_write))
    except BaseException:  # else the save's thread closes the base
        if job.base is not None:
            job.base.close()
        raise


def save_async(
    path: PathLike,
    state: State,
    *,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    staging: Staging = "copy",
    stager: Stager | None = None,
    per_rank: Sequence[str] = DEFAULT_PER_RANK,
    base: PathLike | None = None,
    compression: str | None = None,
) -> PendingSave:
    """Start saving ``state`` to ``path`` in the background (docs/api.md); what can be
    checked raises here, and plain values are encoded now. ``staging="copy"``: tensors are
    copied into buffers first (a ``stager`` keeps them for the next save); ``"write"``: the
    live tensors are written into the files, staged once all are; ``"none"``: no copy, a
    tensor changed in place before ``result()`` returns is detected and the save refused.
    """
    options = save_options("fc.save_async", metadata, overwrite, per_rank, base, compression)
    fine = stager is None or isinstance(stager, Stager)
    require(fine, stager, "stager", "fc.save_async", "an fc.checkpoint.Stager")
    return start_save(path, state, options, staging, Stager() if stager is None else stager)


def _work(
    job: SaveJob, mode: Staging, stager: Stager, before_write: Callable[[], None] | None
) -> Callable[[PendingSave], CheckpointInfo]:
    """The background half of an async save: stage, then write; the base closed after."""
    ready: Callable[[], None] = before_write or (lambda: None)
    sources: Sequence[torch.Tensor] = () if job.prepared is None else job.plan.sources
    if mode == "none":  # only contiguous host tensors stay live
        tensors = [host_copy(t) for t in sources]
        guard = stages.version_guard(sources, job.plan.keys, tensors, job.plan.targets)
    elif mode == "copy":
        local = [t.to_local() if is_dtensor(t) else t for t in sources]  # type: ignore[attr-defined]

    def work(pending: PendingSave) -> CheckpointInfo:
        with incremental.closing(job.base):
            if mode == "none":
                pending._mark_staged()
                ready()
                after_each, check, moved = guard
                try:
                    return write_job(job, tensors, Hooks(after_each, check, live=True))
                except Exception as e:  # a read of memory freed meanwhile, say
                    try:
                        moved()
                    except CheckpointError as refused:
                        raise refused from e
                    raise
            if mode == "write":
                ready()
                live = list(sources) if job.distributed else [host_copy(t) for t in sources]
                return write_job(job, live, Hooks(after_read=pending._mark_staged))
            stager.acquire()
            try:
                copies = stager.stage(local)
                pending._mark_staged()
                ready()
                if job.distributed:
                    copies = [stages.rewrap(t, c) for t, c in zip(sources, copies, strict=True)]
                return write_job(job, copies, Hooks())
            finally:
                stager.release()

    return work
