"""What a root of checkpoints holds, read alike by the manager, the remote tier and
``fckpt``: listed by canonical ``step_N`` name, counted once committed, summarised from
its manifest alone."""

from __future__ import annotations

import math
import os
from collections.abc import Container, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from functional_ckpt._src.format import naming
from functional_ckpt._src.format.header import header_of
from functional_ckpt._src.format.kind import Kind, classify, is_committed
from functional_ckpt._src.format.naming import QUARANTINE_INFIX, parse_step, step_in_name
from functional_ckpt._src.policy.retention import CheckpointLike, RetentionPolicy
from functional_ckpt._src.storage import committed
from functional_ckpt._src.storage.usage import dir_size
from functional_ckpt._src.text import joined_lines
from functional_ckpt.errors import CheckpointError, CheckpointNotFound


@dataclass(frozen=True)
class StepInfo:
    """One managed checkpoint as retention and users see it: ``time``, when the save
    started (0.0 if unknown); ``size``, every file's."""

    step: int
    path: Path
    time: float
    metrics: Mapping[str, float] = field(default_factory=dict, hash=False)
    epoch: int | None = None
    is_final: bool = False
    size: int = 0
    metadata: Mapping[str, Any] = field(default_factory=dict, hash=False)


def read_info(path: Path, step: int) -> StepInfo:
    """The summary of the committed checkpoint of ``step``; raises if its manifest is
    unreadable or records another step (``committed.header_named``)."""
    head = committed.header_named(committed.read_manifest(path), step, path)
    record, when = head.record, 0.0 if head.created is None else head.created
    size = dir_size(path)
    return StepInfo(
        step, path, when, record.metrics, record.epoch, record.is_final, size, head.metadata
    )


def stamp(path: Path) -> tuple[int, int, int]:
    """Identity of a committed checkpoint's marker (``FileNotFoundError``: none)."""
    st = os.stat(path / naming.COMMIT_MARKER)
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def dir_identity(path: Path) -> tuple[int, tuple[int, int, int] | None] | None:
    """(directory inode, marker stamp), or None if gone: did a writer swap it under us?"""
    try:
        ino = os.stat(path).st_ino
    except FileNotFoundError:
        return None
    try:
        return ino, stamp(path)
    except FileNotFoundError:
        return ino, None


@dataclass
class RootEntry:
    """One checkpoint-related directory of a root: ``status`` is ``ok``, ``damaged``,
    ``uncommitted``, ``quarantined``, ``deleting`` or ``foreign`` (stock DCP)."""

    name: str
    path: Path
    step: int | None
    status: str
    canonical: bool = False
    time: float | None = None
    size: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    detail: str = ""

    @property
    def committed(self) -> bool:
        return self.status in ("ok", "damaged")


def entry_of(path: Path) -> RootEntry | None:
    """The entry for one directory of a root, or None if it is not checkpoint-related."""
    kind = classify(path)
    if kind not in _ENTRIES:
        return None
    name, (status, detail) = path.name, _ENTRIES[kind]
    entry = RootEntry(name, path, step_in_name(name), status, size=dir_size(path), detail=detail)
    entry.canonical = kind in (Kind.COMMITTED, Kind.UNCOMMITTED) and parse_step(name) is not None
    if kind is Kind.TEMPORARY:
        deleting = naming.TRASH_INFIX in name
        entry.status = "deleting" if deleting else "uncommitted"
        if leftover_manifest(path) is not None:
            entry.detail = "complete (committed): the next writer recovers it, never deletes it"
        elif deleting:
            entry.detail = "a deletion in progress (or interrupted)"
    elif kind is Kind.COMMITTED:
        try:
            head = committed.header_named(committed.read_manifest(path), parse_step(name), path)
        except (CheckpointError, OSError, ValueError, RecursionError, MemoryError) as err:
            entry.status, entry.detail = "damaged", joined_lines(str(err)) or type(err).__name__
            return entry
        entry.step = head.record.step if entry.step is None else entry.step
        entry.time, entry.metrics = head.created, dict(head.record.metrics)
        entry.metadata = dict(head.metadata)
    return entry


#: The status and detail of each kind of directory a root lists.
_ENTRIES = {
    Kind.QUARANTINED: ("quarantined", "found unreadable by a manager and moved aside"),
    Kind.TEMPORARY: ("uncommitted", "a save in progress, or one a crash interrupted"),
    Kind.COMMITTED: ("ok", ""),
    Kind.UNCOMMITTED: ("uncommitted", "never committed: the COMMITTED marker is missing"),
    Kind.STOCK_DCP: ("foreign", Kind.STOCK_DCP.value),
}


def root_entries(root: Path) -> list[RootEntry]:
    """Every checkpoint-related directory directly under ``root``, by step then name."""
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        raise CheckpointNotFound(f"{root}: no such directory") from None
    except NotADirectoryError:
        raise CheckpointNotFound(f"{root}: not a directory") from None
    entries = [e for n in names if (e := entry_of(root / n)) is not None]
    entries.sort(key=lambda e: (e.step if e.step is not None else -1, e.name))
    return entries


def step_dirs(root: Path) -> Iterator[tuple[int, Path, int]]:
    """(step, path, inode) of every canonical ``step_N`` directory, in no order."""
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return
    except NotADirectoryError:
        raise CheckpointError(f"{root}: the checkpoint root is a file, not a directory") from None
    for entry in entries:
        step = parse_step(entry.name)
        if step is not None and entry.is_dir(follow_symlinks=False):
            yield step, Path(entry.path), entry.inode()


def committed_steps(root: Path, exclude: Container[tuple[int, int]] = ()) -> dict[int, Path]:
    """Every committed checkpoint of ``root`` by step, ascending, less the ``(step,
    inode)`` pairs in ``exclude``: what "the checkpoints of a root" means to every reader."""
    found = {s: p for s, p, inode in step_dirs(root) if (s, inode) not in exclude}
    return {s: found[s] for s in sorted(found) if is_committed(found[s])}


def newest_summary(root: Path) -> StepInfo | None:
    """The newest committed checkpoint of ``root`` whose manifest reads; None if none does."""
    for step, path in reversed(committed_steps(root).items()):
        try:
            return read_info(path, step)
        except (CheckpointError, OSError):
            continue
    return None


def quarantined(root: Path) -> list[str]:
    """Names of the checkpoints of ``root`` that were moved aside as damaged."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(n for n in names if QUARANTINE_INFIX in n and n.startswith("step_"))


def kept_by(
    parts: Sequence[tuple[str, RetentionPolicy]], records: Sequence[CheckpointLike]
) -> dict[int, list[str]]:
    """For each step, the labels of the policy parts that keep it ("latest" keeps the newest)."""
    out: dict[int, list[str]] = {r.step: [] for r in records}
    for label, policy in parts:
        for step in sorted(policy.select(records)):
            out[step].append(label)
    if out:
        out[max(out)].append("latest")
    return out


def leftover_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of a leftover directory if its marker is whole and vouches for it."""
    try:
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        return committed.read_manifest_at(dir_fd, path, committed.read_marker(dir_fd, path))
    except (CheckpointError, OSError, ValueError, RecursionError, MemoryError):
        return None
    finally:
        os.close(dir_fd)


def _created(path: Path) -> float:
    manifest = leftover_manifest(path)
    t = None if manifest is None else header_of(manifest).created
    return -math.inf if t is None else t
