"""Storage backends: where a flattened, staged save is written and committed.

A backend receives a :class:`SaveJob` (the plan, built once) and the tensors
that fill its targets (the sources or their staged copies), writes every chunk,
fills in the chunks of the plan's entries, and commits the manifest built from
them. Local files, incremental local files (reusing a base's files, see
:mod:`incremental`) and the distributed DCP writer are the backends; a remote
tier is one more class with the same method.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from functional_ckpt._src.distributed.topology import Topology
from functional_ckpt._src.save import incremental, trust
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.save.local import write_local
from functional_ckpt._src.save.plan import Plan


@dataclass
class SaveJob:
    """A save after the flatten stage: everything checked, nothing written yet.

    ``error`` is a distributed rank's planning failure, kept for the backend to
    agree on with the other ranks (then ``plan`` is None); a single process
    raises it at once instead.
    """

    dest: Path
    plan: Plan | None
    metadata: Any
    overwrite: bool
    topology: Topology
    distributed: bool
    error: BaseException | None = None
    base: incremental.Base | None = None  # an incremental save's base, held open
    idents: list[trust.Ident | None] | None = None  # the sources', when incremental


@dataclass
class Hooks:
    """Calls into a running write: ``after_each(i)`` once tensor ``i`` is written,
    ``before_commit()`` (which may raise to refuse the commit) right before it."""

    after_each: Callable[[int], None] | None = None
    before_commit: Callable[[], None] | None = None


class Backend(Protocol):
    def write(
        self, job: SaveJob, tensors: Sequence[torch.Tensor], hooks: Hooks
    ) -> CheckpointInfo: ...


class LocalBackend:
    """One process writes one shard file and commits (the protocol of ``writer``)."""

    def write(self, job: SaveJob, tensors: Sequence[torch.Tensor], hooks: Hooks) -> CheckpointInfo:
        assert job.plan is not None
        return write_local(
            job.dest,
            job.plan,
            tensors,
            metadata=job.metadata,
            overwrite=job.overwrite,
            after_each=hooks.after_each,
            before_commit=hooks.before_commit,
        )


class IncrementalBackend:
    """One process writes what changed since the base; unchanged chunks are the base's."""

    def write(self, job: SaveJob, tensors: Sequence[torch.Tensor], hooks: Hooks) -> CheckpointInfo:
        assert job.plan is not None and job.idents is not None
        return incremental.write_local(
            job.dest,
            job.plan,
            tensors,
            job.base,
            job.idents,
            metadata=job.metadata,
            overwrite=job.overwrite,
            after_each=hooks.after_each,
            before_commit=hooks.before_commit,
        )


class DistributedBackend:
    """Every rank writes its shards through DCP's planners; the coordinator commits."""

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = timeout

    def write(self, job: SaveJob, tensors: Sequence[torch.Tensor], hooks: Hooks) -> CheckpointInfo:
        from functional_ckpt._src.save.multi_rank import save_planned

        return save_planned(
            job.dest,
            job.plan,
            job.metadata,
            job.overwrite,
            tensors,
            job.error,
            timeout=self.timeout,
            base=job.base,
            idents=job.idents,
        )


def backend_for(job: SaveJob) -> Backend:
    if job.distributed:
        return DistributedBackend()
    return LocalBackend() if job.idents is None else IncrementalBackend()
