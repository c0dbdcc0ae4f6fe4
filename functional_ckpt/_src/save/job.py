"""A save after the plan stage: one value that every later stage reads, never changes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from functional_ckpt._src.distributed.topology import Topology
from functional_ckpt._src.format.manifest import Written
from functional_ckpt._src.save.incremental import Base
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.save.options import SaveOptions
from functional_ckpt._src.save.plan import Plan, Prepared
from functional_ckpt._src.save.trust import Ident


@dataclass(frozen=True)
class SaveJob:
    """Everything checked, nothing written yet. ``error``: a distributed rank's planning failure;
    ``idents``: the sources' identities and versions; ``staging``: None for a sync save."""

    dest: Path
    prepared: Prepared | None
    options: SaveOptions
    topology: Topology
    distributed: bool
    error: BaseException | None = None
    base: Base | None = None
    idents: tuple[Ident | None, ...] = ()
    snapshot: bool = False
    staging: str | None = None

    @property
    def plan(self) -> Plan:
        assert self.prepared is not None, "a failed rank's job has no plan"
        return self.prepared.plan

    def info(self, nbytes: int, created: float, t0: float) -> CheckpointInfo:
        """What this save reports once committed (``nbytes`` on disk), begun at ``t0``."""
        assert self.prepared is not None
        sources = self.prepared.plan.sources
        return CheckpointInfo(
            path=self.dest,
            nbytes=nbytes,
            tensor_bytes=sum(t.numel() * t.element_size() for t in sources),
            num_tensors=len(sources),
            num_values=self.prepared.plan.num_values,
            created=created,
            duration=time.perf_counter() - t0,
            metadata=self.prepared.metadata,
        )


@dataclass(frozen=True)
class Hooks:
    """Calls into a running write; ``live``: the caller's own tensors, read through the kernel."""

    after_each: Callable[[int], None] | None = None
    before_commit: Callable[[Written], None] | None = None
    after_read: Callable[[], None] | None = None
    live: bool = False
