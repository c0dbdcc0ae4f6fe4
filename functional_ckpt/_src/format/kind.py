"""What a path is, decided in one place, so every reader, lister and writer agrees. Only
directory entries are read: a ``COMMITTED`` entry is a claim the opening reader checks.
"""

from __future__ import annotations

import enum
import os
import stat
from pathlib import Path

from functional_ckpt._src.format import naming


class Kind(enum.Enum):
    """What :func:`classify` found at a path."""

    MISSING = "nothing"
    LINK = "a symbolic link"
    NOT_A_DIRECTORY = "a file, not a directory"
    TEMPORARY = "a save or deletion in progress (or one a crash interrupted)"
    QUARANTINED = "a checkpoint found damaged and moved aside"
    COMMITTED = "a checkpoint"
    UNCOMMITTED = "a checkpoint that was never committed"
    STOCK_DCP = "a stock torch.distributed.checkpoint directory"
    PART = "one rank's part of a checkpoint (shard files only)"
    EXPORT = "a safetensors export"
    RECORDING = "a recording"
    EMPTY = "an empty directory"
    OTHER = "a directory"

    @property
    def checkpoint(self) -> bool:
        """One checkpoint (of any kind, committed or not): nothing to nest others in."""
        return self.name in ("COMMITTED", "UNCOMMITTED", "STOCK_DCP", "PART", "EXPORT", "RECORDING")


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None


def _entries(path: Path) -> dict[str, bool]:
    """Each entry's name, and whether it is a regular file (links are not followed)."""
    try:
        with os.scandir(path) as it:
            return {e.name: e.is_file(follow_symlinks=False) for e in it}
    except OSError:
        return {}


def _directory_kind(path: Path, by_name: bool = True) -> Kind | None:
    """The kind of ``path`` decided before its entries are read, if that decides it."""
    st = _lstat(path)
    if st is None:
        return Kind.MISSING
    if stat.S_ISLNK(st.st_mode):
        return Kind.LINK
    if not stat.S_ISDIR(st.st_mode):
        return Kind.NOT_A_DIRECTORY
    if by_name and naming.QUARANTINE_INFIX in path.name:
        return Kind.QUARANTINED
    if by_name and naming.is_temporary_name(path.name):
        return Kind.TEMPORARY
    return None


def classify(path: Path, *, by_name: bool = True) -> Kind:
    """What ``path`` is; ``by_name=False`` looks past a temporary or quarantined name."""
    early = _directory_kind(path, by_name)
    if early is not None:
        return early
    names = _entries(path)
    if not names:
        return Kind.EMPTY
    if naming.COMMIT_MARKER in names:
        return Kind.COMMITTED
    if naming.MANIFEST in names:
        return Kind.UNCOMMITTED
    if naming.DCP_METADATA in names:
        return Kind.STOCK_DCP
    if naming.RECORDING_HEADER in names:
        return Kind.RECORDING
    if naming.EXPORT_WEIGHTS in names or naming.EXPORT_INDEX in names:
        return Kind.EXPORT
    if all(naming.is_shard_file(n) for n in names):
        return Kind.PART
    return Kind.OTHER


def is_committed(path: Path) -> bool:
    """``classify(path) is Kind.COMMITTED``, with one ``lstat`` more instead of a listing."""
    return _directory_kind(path) is None and _lstat(path / naming.COMMIT_MARKER) is not None


def _member(kind: Kind, name: str, regular: bool) -> bool:
    """Whether an entry belongs to a directory of ``kind`` (what replacing it may drop)."""
    if not regular:
        return False  # a link or a directory inside is never ours to drop
    dcp = name == naming.DCP_METADATA or naming.is_shard_file(name)
    if kind in (Kind.COMMITTED, Kind.UNCOMMITTED):
        own = name in (naming.COMMIT_MARKER, naming.MANIFEST) or naming.parse_part(name) is not None
        return dcp or own
    if kind in (Kind.STOCK_DCP, Kind.PART):
        return dcp
    return kind is Kind.EXPORT  # an export's side files (config, tokenizer) are plain files


def strays(path: Path, kind: Kind) -> list[str]:
    """The entries of ``path`` (of ``kind``) not its own files: what replacing it would lose."""
    return sorted(n for n, regular in _entries(path).items() if not _member(kind, n, regular))


def is_stock_dcp(path: Path) -> bool:
    """A directory written by stock DCP, counted only if it stayed at the path meanwhile."""
    real = Path(os.path.realpath(path))
    for _ in range(3):
        before = _identity(real)
        if classify(real) is not Kind.STOCK_DCP:
            return False
        if before is not None and _identity(real) == before:
            return True
    return False  # replaced on every look: the manifest reader reports the race


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino
