"""A save after the plan stage: one value that every later stage reads, never changes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from functional_ckpt._src.distributed.topology import Topology
from functional_ckpt._src.format.manifest import Written
from functional_ckpt._src.save.incremental import Base
from functional_ckpt._src.save.options import SaveOptions
from functional_ckpt._src.save.plan import Plan, Prepared
from functional_ckpt._src.save.trust import Ident


@dataclass(frozen=True)
class SaveJob:
    """Everything checked, nothing written yet.

    ``error`` is a distributed rank's planning failure, kept for the write to agree
    on with the other ranks (then ``prepared`` is None); a single process raises it at
    once instead. ``base`` is an incremental save's base, held open; ``idents`` the
    sources' identities and version counters when planned; ``snapshot``: the values
    for stock readers come from the plan's encodings (an asynchronous save, whose
    caller may change the live values before the write). ``staging``: an
    asynchronous save's staging mode (None: a synchronous one).
    """

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


@dataclass(frozen=True)
class Hooks:
    """Calls into a running write: ``after_each(i)`` once tensor ``i`` is written,
    ``after_read()`` once no tensor is read any more (the caller may change them), and
    ``before_commit(written)`` (which may raise to refuse the commit) right before it.
    ``live``: the tensors are the caller's own, read while it goes on (``staging="none"``),
    so only ever through the kernel (:mod:`..storage.live`)."""

    after_each: Callable[[int], None] | None = None
    before_commit: Callable[[Written], None] | None = None
    after_read: Callable[[], None] | None = None
    live: bool = False
