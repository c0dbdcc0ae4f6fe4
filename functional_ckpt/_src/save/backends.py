"""Storage backends: where a planned, staged save is written and committed.

A backend receives the :class:`~.job.SaveJob` (the plan, built once) and the tensors
that fill its targets (the sources or their staged copies), writes every chunk, and
commits the manifest made from what it wrote. One process writes its files itself
(unchanged chunks taken from a base, :mod:`.incremental`); under
``torch.distributed`` every rank writes through DCP's planners (:mod:`.multi_rank`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from functional_ckpt._src.format.naming import parse_step
from functional_ckpt._src.log import done, logger
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.save.job import Hooks, SaveJob
from functional_ckpt._src.save.local import write_local


class Backend(Protocol):
    def write(
        self, job: SaveJob, tensors: Sequence[torch.Tensor], hooks: Hooks
    ) -> CheckpointInfo: ...


class LocalBackend:
    """One process writes its shard file (and links a base's) and commits."""

    def write(self, job: SaveJob, tensors: Sequence[torch.Tensor], hooks: Hooks) -> CheckpointInfo:
        return saved(write_local(job, tensors, hooks))


class DistributedBackend:
    """Every rank writes its shards through DCP's planners; the coordinator commits."""

    def __init__(self, timeout: float | None = None) -> None:
        self.timeout = timeout

    def write(self, job: SaveJob, tensors: Sequence[torch.Tensor], hooks: Hooks) -> CheckpointInfo:
        from functional_ckpt._src.save.multi_rank import save_planned

        info = save_planned(job, tensors, timeout=self.timeout, read=hooks.read)
        return saved(info) if job.topology.coordinator else info


def saved(info: CheckpointInfo) -> CheckpointInfo:
    """The INFO record of a finished save, on ``functional_ckpt.save``."""
    step = parse_step(info.path.name)
    done(_LOG, "saved", info.path, seconds=info.duration, nbytes=info.nbytes, step=step)
    return info


_LOG = logger("save")


def backend_for(job: SaveJob) -> Backend:
    return DistributedBackend() if job.distributed else LocalBackend()
