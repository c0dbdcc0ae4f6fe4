"""A committed checkpoint held open by one directory descriptor, even while a writer replaces it."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from functional_ckpt._src import codec
from functional_ckpt._src.format import naming
from functional_ckpt._src.format.checksum import crc32
from functional_ckpt._src.format.header import Header, header_of
from functional_ckpt._src.format.naming import (
    COMMIT_MARKER,
    DCP_METADATA,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST,
    safe_member,
)
from functional_ckpt._src.format.view import ParsedCheckpoint, parse_checkpoint
from functional_ckpt._src.limits import LIMITS
from functional_ckpt._src.storage import opener
from functional_ckpt._src.storage.opener import exists_at, open_directory, open_member
from functional_ckpt._src.storage.os_failure import os_failure, ran_out
from functional_ckpt.errors import (
    CheckpointError,
    CheckpointNotFound,
    CorruptCheckpoint,
    IncompleteCheckpoint,
)

#: Upper bound on the manifest and marker sizes a reader accepts (hostile files).
MAX_MANIFEST_BYTES = LIMITS.manifest_bytes

_MARKER_KEYS = {"format", "version", "manifest_size", "manifest_crc32"}


def _read_small(dir_fd: int, path: Path, name: str, limit: int, what: str) -> bytes:
    try:
        return opener.read_small(dir_fd, name, path / name, limit, what)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path / name}: the {what} is missing") from None


def read_marker(dir_fd: int, path: Path) -> dict[str, Any]:
    """The commit marker of the directory held by ``dir_fd``, or why there is none."""
    if not exists_at(dir_fd, COMMIT_MARKER):
        if exists_at(dir_fd, DCP_METADATA) and not exists_at(dir_fd, MANIFEST):
            raise CheckpointNotFound(
                f"{path}: a stock torch.distributed.checkpoint directory, not a functional_ckpt "
                "checkpoint: it has no checksums to verify (fc.restore reads it with a template)"
            )
        if exists_at(dir_fd, MANIFEST):
            raise IncompleteCheckpoint(
                f"{path}: the checkpoint was never committed ({COMMIT_MARKER} is missing); "
                "it was interrupted or is still being written"
            )
        raise CheckpointNotFound(f"{path}: not a checkpoint (no {COMMIT_MARKER} or {MANIFEST})")
    raw = _read_small(dir_fd, path, COMMIT_MARKER, LIMITS.marker_bytes, "commit marker")
    marker = codec.decode(raw, source=str(path / COMMIT_MARKER))
    if (
        not isinstance(marker, dict)
        or set(marker) != _MARKER_KEYS
        or marker.get("format") != FORMAT_NAME
    ):
        raise CorruptCheckpoint(f"{path / COMMIT_MARKER}: not a functional_ckpt commit marker")
    version = marker.get("version")
    if type(version) is not int or version < 1:
        raise CorruptCheckpoint(f"{path / COMMIT_MARKER}: invalid format version {version!r}")
    if version > FORMAT_VERSION:
        raise CorruptCheckpoint(
            f"{path}: written by a newer format (version {version!r}; this reader knows "
            f"{FORMAT_VERSION}); upgrade functional_ckpt to read it"
        )
    return marker


def read_manifest_at(
    dir_fd: int, path: Path, marker: dict[str, Any], unregistered: set[str] | None = None
) -> dict[str, Any]:
    """Read the manifest its marker authenticates (an unregistered class's value: a placeholder)."""
    expected = marker.get("manifest_size")
    limit = expected if type(expected) is int and 0 <= expected <= MAX_MANIFEST_BYTES else 0
    raw = _read_small(dir_fd, path, MANIFEST, limit, "manifest")
    if len(raw) != marker.get("manifest_size") or crc32(raw) != marker.get("manifest_crc32"):
        raise CorruptCheckpoint(
            f"{path / MANIFEST}: the manifest does not match its checksum in {COMMIT_MARKER} "
            f"({len(raw)} bytes); the checkpoint is damaged"
        )
    tags = set() if unregistered is None else unregistered
    manifest = codec.decode(raw, source=str(path / MANIFEST), unregistered=tags)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CorruptCheckpoint(f"{path / MANIFEST}: not a functional_ckpt manifest")
    version = manifest.get("version")
    if version != marker.get("version"):  # one save writes both (read_marker bounds it)
        raise CorruptCheckpoint(
            f"{path / MANIFEST}: format version {version!r}, but {COMMIT_MARKER} says "
            f"{marker.get('version')!r}; the checkpoint is damaged"
        )
    return manifest


#: Descriptors of its files a held checkpoint keeps open at once (a restore reads file
#: after file: a handful serves any world size, whatever ``ulimit -n``).
MAX_OPEN = 8


@dataclass
class Checkpoint:
    """A committed checkpoint held open: its directory, authenticated manifest and files. A file
    deleted meanwhile (a prune) is ``CheckpointNotFound``, never damage."""

    path: Path
    dir_fd: int
    manifest: dict[str, Any]
    fds: dict[str, int] = field(default_factory=dict)  # open now, least recently used first
    sizes: dict[str, int] = field(default_factory=dict)  # of every file opened so far
    unregistered: frozenset[str] = frozenset()  # tags of placeholders among the values

    def fd(self, name: str) -> int:
        """A descriptor of file ``name`` of this checkpoint, opened if it is not."""
        fd = self.fds.pop(name, None)
        if fd is None:
            fd = self.open_file(name)
            while len(self.fds) >= MAX_OPEN:
                self.release(next(iter(self.fds)))
        self.fds[name] = fd
        return fd

    def release(self, name: str) -> None:
        """Close file ``name``, its reads done (it is opened again if read again)."""
        fd = self.fds.pop(name, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def release_all(self) -> None:
        """Close every file held open (the directory stays held)."""
        for name in list(self.fds):
            self.release(name)

    def open_file(self, name: str, *, listed: bool = True) -> int:
        """Open file ``name`` at its recorded size; ``listed=False``: a file no table lists."""
        files = self.manifest.get("files")
        info = files.get(name) if isinstance(files, dict) and listed else {"size": 0}
        if not isinstance(info, dict):
            raise CorruptCheckpoint(f"{self.path}: {name!r} is not a file of this checkpoint")
        member = safe_member(self.path, name)
        size = info.get("size")
        if type(size) is not int or size < 0:
            raise CorruptCheckpoint(f"{self.path / MANIFEST}: bad entry for file {name!r}")
        # A derived file's size is checked with its checksum, to tell hostile from damaged.
        derived = name == DCP_METADATA or not listed
        try:
            fd = open_member(self.dir_fd, name, member, size=None if derived else size)
        except FileNotFoundError:
            if _replaced(self.path, self.dir_fd, True):
                raise _gone(self.path) from None
            raise CorruptCheckpoint(f"{member}: file is missing from the checkpoint") from None
        except OSError as e:
            if ran_out(e):
                raise os_failure(e, member, "reading") from e
            raise CheckpointError(f"{member}: cannot read the checkpoint file: {e}") from e
        self.sizes[name] = os.fstat(fd).st_size if derived else size
        return fd

    def close(self) -> None:
        self.release_all()
        if self.dir_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.dir_fd)
            self.dir_fd = -1

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _gone(path: Path) -> CheckpointNotFound:
    return CheckpointNotFound(
        f"{path}: the checkpoint was replaced or deleted while it was being read "
        "(a writer overwrote or pruned it); read it again"
    )


def check_members(ck: Checkpoint, problems: list[tuple[str, CheckpointError]]) -> None:
    """Check that every listed file opens at its recorded size (failures into ``problems``)."""
    files = ck.manifest.get("files")
    if not isinstance(files, dict):
        raise CorruptCheckpoint(f"{ck.path / MANIFEST}: missing file table")
    for name in files:
        try:
            os.close(ck.open_file(name))
        except CheckpointError as err:
            if isinstance(err, CheckpointNotFound):
                raise
            problems.append((name, err))


def _replaced(path: Path, dir_fd: int, had_marker: bool) -> bool:
    """Was the directory we hold renamed away, replaced or deleted since we opened it?"""
    try:
        now = os.stat(path)
    except OSError:
        return True
    if not os.path.samestat(now, os.fstat(dir_fd)):
        return True
    return had_marker and not exists_at(dir_fd, COMMIT_MARKER)


def open_checkpoint(
    path: Path, *, problems: list[tuple[str, CheckpointError]] | None = None
) -> Checkpoint:
    """Open a committed checkpoint, its marker and manifest authenticated (``problems``: also
    :func:`check_members`); a directory replaced twice meanwhile is ``CheckpointNotFound``."""
    for attempt in (0, 1):
        dir_fd = open_directory(path)
        had_marker = False
        ck = Checkpoint(path, dir_fd, {})
        found: list[tuple[str, CheckpointError]] = []
        try:
            marker = read_marker(dir_fd, path)
            had_marker = True
            tags: set[str] = set()
            ck.manifest = read_manifest_at(dir_fd, path, marker, tags)
            ck.unregistered = frozenset(tags)
            if problems is not None:
                check_members(ck, found)
                if found and _replaced(path, dir_fd, had_marker):
                    raise found[0][1]
                problems += found
            return ck
        except (CheckpointError, OSError) as err:
            replaced = _replaced(path, dir_fd, had_marker)
            ck.close()
            if not replaced:
                if isinstance(err, CheckpointError):
                    raise
                raise CheckpointError(f"{path}: cannot read the checkpoint: {err}") from err
            if attempt:
                raise _gone(path) from err
    raise AssertionError("unreachable")


def check_committed(path: Path) -> dict[str, Any]:
    """Return the commit marker of a checkpoint directory, or say why there is none."""
    dir_fd = open_directory(path)
    try:
        return read_marker(dir_fd, path)
    finally:
        os.close(dir_fd)


def read_manifest(path: Path) -> dict[str, Any]:
    """Read and authenticate the manifest of a committed checkpoint."""
    with open_checkpoint(path) as ck:
        return ck.manifest


def header_named(manifest: dict[str, Any], step: int | None, where: object) -> Header:
    """The header of a checkpoint whose name says ``step`` (None: a name of no step), as
    every reader of a root's or a remote's checkpoints takes it. One recording another
    step (renamed or copied in by hand) is damage: taken as ``step``, a run would number
    on from a state it lacks, and listing, retention and uploads would count it as the
    newest."""
    head = header_of(manifest)
    recorded = head.record.step
    if step is not None and recorded is not None and recorded != step:
        raise CorruptCheckpoint(
            f"{where}: named for step {step}, but the checkpoint records step {recorded}; "
            f"damaged as step {step} (its own name is {naming.step_name(recorded)})"
        )
    return head


CLASSIFY_LIMIT = 64 << 20  # a damaged .metadata is scanned for hostility up to this size


def classify_metadata(ck: Checkpoint) -> CheckpointError:
    """A ``.metadata`` failing its checksum: hostile (read statically) or merely damaged?"""
    from functional_ckpt._src.format import unpickler

    where = ck.path / naming.DCP_METADATA
    size = ck.sizes.get(naming.DCP_METADATA, 0)
    if naming.DCP_METADATA in ck.sizes and size <= CLASSIFY_LIMIT:
        try:
            raw = opener.read_exact(ck.fd(naming.DCP_METADATA), size, where)
            hostile = unpickler.scan_pickle(raw, where)
        except CheckpointError:
            hostile = None
        finally:
            ck.release(naming.DCP_METADATA)
        if hostile is not None:
            return hostile
    return CorruptCheckpoint(f"{where}: does not match the checksum in the manifest")


def read_part(ck: Checkpoint, rank: int) -> Any:
    """Part ``rank`` of a split manifest, authenticated (own CRC32; the index's before v4)."""
    name = naming.part_name(rank)
    where = ck.path / name
    files = ck.manifest.get("files")
    info = files.get(name) if isinstance(files, dict) else None
    own = ck.manifest.get("version", 0) >= naming.PART_FILES_VERSION
    if not own and not isinstance(info, dict):
        raise CorruptCheckpoint(f"{ck.path / MANIFEST}: the file table does not list {name}")

    def bounded(size: object) -> int:
        limit = LIMITS.manifest_part_bytes
        if type(size) is not int or not 0 <= size <= limit:
            raise CorruptCheckpoint(
                f"{where}: the manifest part is {size!r} bytes, not a size up to the {limit} "
                "a reader accepts"
            )
        return size

    size = 0 if own else bounded(info.get("size"))  # type: ignore[union-attr]
    fd = ck.open_file(name, listed=not own)
    try:
        raw = opener.read_exact(fd, bounded(os.fstat(fd).st_size) if own else size, where)
    finally:
        os.close(fd)
    if own:
        raw, expected = raw[:-4], int.from_bytes(raw[-4:], "little")
    else:
        expected = info.get("crc32")  # type: ignore[union-attr]
    if crc32(raw) != expected:
        raise CorruptCheckpoint(
            f"{where}: rank {rank}'s part of the manifest does not match its checksum"
            f"{'' if own else f' in {MANIFEST}'}; the checkpoint is damaged"
        )
    tags: set[str] = set()
    part = codec.decode(raw, source=str(where), unregistered=tags)
    if not isinstance(part, dict) or part.get("format") != FORMAT_NAME:
        raise CorruptCheckpoint(f"{where}: not a part of a functional_ckpt manifest")
    if tags:
        ck.unregistered = ck.unregistered | frozenset(tags)
    return part


def parsed(ck: Checkpoint) -> ParsedCheckpoint:
    """The manifest of an opened checkpoint, validated once; its parts read as views need them."""
    return parse_checkpoint(ck.manifest, ck.path, parts=lambda rank: read_part(ck, rank))


def every_file(path: Path) -> dict[str, Any]:
    """Every file but the marker and the manifest, as the file tables record it (a copy's)."""
    with open_checkpoint(path) as ck:
        once = parsed(ck)
        for rank in range(once.shared.parts):
            once.part(rank)  # its files join the file table
        files = dict(ck.manifest["files"])
        for name in map(naming.part_name, range(once.shared.parts)):
            files.setdefault(name, {"size": ck.sizes[name]})  # a part that checks itself
        return files
