"""A committed checkpoint held open: its marker, manifest and every file it lists.

A reader accepts only a directory that carries a valid marker, authenticates the
manifest against it, and opens every listed file up front through one directory
descriptor (:mod:`.opener`), so it reads one consistent checkpoint even while a
writer replaces the path. :func:`open_vetted` adds the check of the derived
``.metadata`` against its recorded checksum.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from functional_ckpt._src import codec
from functional_ckpt._src.format import naming
from functional_ckpt._src.format.checksum import crc32
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
from functional_ckpt._src.storage.opener import exists_at, open_directory, open_member, read_exact
from functional_ckpt.errors import (
    CheckpointError,
    CheckpointNotFound,
    CorruptCheckpoint,
    IncompleteCheckpoint,
)

#: Upper bound on the manifest and marker sizes a reader accepts (hostile files).
MAX_MANIFEST_BYTES = LIMITS.manifest_bytes

MAX_MARKER_BYTES = LIMITS.marker_bytes

_MARKER_KEYS = {"format", "version", "manifest_size", "manifest_crc32"}


def _read_small(dir_fd: int, path: Path, name: str, limit: int, what: str) -> bytes:
    where = path / name
    try:
        fd = open_member(dir_fd, name, where, what=what)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{where}: the {what} is missing") from None
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CorruptCheckpoint(
                f"{where}: the {what} is {size} bytes, more than the {limit} recorded or allowed"
            )
        return read_exact(fd, size, where)
    finally:
        os.close(fd)


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
    raw = _read_small(dir_fd, path, COMMIT_MARKER, MAX_MARKER_BYTES, "commit marker")
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
    """Read and authenticate the manifest against its marker.

    A value whose class this process has not registered is a sound part of the
    checkpoint, so it is kept as an ``Unregistered`` placeholder (its tag added to
    ``unregistered``) for the restore to refuse if it selects it.
    """
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
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CorruptCheckpoint(
            f"{path / MANIFEST}: format version {version!r} is newer than this reader's "
            f"({FORMAT_VERSION}); upgrade functional_ckpt to read it"
        )
    if version != marker.get("version"):  # one save writes both with one version
        raise CorruptCheckpoint(
            f"{path / MANIFEST}: format version {version!r}, but {COMMIT_MARKER} says "
            f"{marker.get('version')!r}; the checkpoint is damaged"
        )
    return manifest


@dataclass
class Checkpoint:
    """A committed checkpoint held open: its manifest and every file it lists.

    All files were opened through one directory descriptor before any tensor byte
    is read, so a reader sees one consistent checkpoint even if the path is
    replaced (``overwrite=True``) or pruned meanwhile. Close it (or use ``with``).
    """

    path: Path
    dir_fd: int
    manifest: dict[str, Any]
    fds: dict[str, int] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)
    unregistered: frozenset[str] = frozenset()  # tags of placeholders among the values

    def fd(self, name: str) -> int:
        try:
            return self.fds[name]
        except KeyError:
            raise CorruptCheckpoint(
                f"{self.path}: {name!r} is not a file of this checkpoint"
            ) from None

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()
        if self.dir_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.dir_fd)
            self.dir_fd = -1

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_members(ck: Checkpoint, problems: list[tuple[str, CheckpointError]] | None = None) -> None:
    """Open every file the manifest lists, checked against its recorded size.

    With ``problems`` each file that fails is recorded there (and left out)
    instead of raising, so a verifier can report them all.
    """
    files = ck.manifest.get("files")
    if not isinstance(files, dict):
        raise CorruptCheckpoint(f"{ck.path / MANIFEST}: missing file table")
    for name, info in files.items():
        member = safe_member(ck.path, name)
        size = info.get("size") if isinstance(info, dict) else None
        if type(size) is not int or size < 0:
            raise CorruptCheckpoint(f"{ck.path / MANIFEST}: bad entry for file {name!r}")
        # A derived file's size is checked with its checksum, to tell hostile from damaged.
        derived = name == DCP_METADATA
        try:
            try:
                fd = open_member(ck.dir_fd, name, member, size=None if derived else size)
            except FileNotFoundError:
                raise CorruptCheckpoint(f"{member}: file is missing from the checkpoint") from None
        except CheckpointError as err:
            if problems is None:
                raise
            problems.append((name, err))
            continue
        ck.fds[name] = fd
        ck.sizes[name] = os.fstat(fd).st_size if derived else size


def _replaced(path: Path, dir_fd: int, had_marker: bool) -> bool:
    """Was the directory we hold renamed away, replaced or deleted since we opened it?"""
    try:
        now = os.stat(path)
    except OSError:
        return True
    held = os.fstat(dir_fd)
    if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
        return True
    return had_marker and not exists_at(dir_fd, COMMIT_MARKER)


def open_checkpoint(
    path: Path,
    *,
    members: bool = True,
    problems: list[tuple[str, CheckpointError]] | None = None,
) -> Checkpoint:
    """Open a committed checkpoint: marker, manifest and (``members``) every listed file.

    If the directory is replaced or deleted before all its files are open (a
    writer's ``overwrite=True`` or a prune), this starts once more from what is
    at ``path`` now; a second race is reported as ``CheckpointNotFound``, never as
    damage. With ``problems``, files that cannot be opened are listed there
    instead of raising (see :func:`open_members`).
    """
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
            if members:
                open_members(ck, None if problems is None else found)
            if found and _replaced(path, dir_fd, had_marker):
                raise found[0][1]
            if problems is not None:
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
                raise CheckpointNotFound(
                    f"{path}: the checkpoint was replaced or deleted while it was being read "
                    "(a writer overwrote or pruned it); read it again"
                ) from err
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
    with open_checkpoint(path, members=False) as ck:
        return ck.manifest


def iter_names(dir_fd: int) -> Iterator[str]:
    """The names in a held directory."""
    yield from sorted(os.listdir(dir_fd))


#: A damaged ``.metadata`` is scanned (to tell hostile from broken) only up to this size.
CLASSIFY_LIMIT = 64 << 20


def classify_metadata(ck: Checkpoint) -> CheckpointError:
    """A ``.metadata`` that fails its checksum: hostile, or merely damaged?

    Its opcodes are read statically (nothing is unpickled): naming anything but
    DCP's metadata classes makes it hostile.
    """
    from functional_ckpt._src.format import unpickler

    where = ck.path / naming.DCP_METADATA
    fd = ck.fds.get(naming.DCP_METADATA)
    size = ck.sizes.get(naming.DCP_METADATA, 0)
    if fd is not None and size <= CLASSIFY_LIMIT:
        try:
            hostile = unpickler.scan_pickle(opener.read_exact(fd, size, where), where)
        except CheckpointError:
            hostile = None
        if hostile is not None:
            return hostile
    return CorruptCheckpoint(f"{where}: does not match the checksum in the manifest")


def metadata_intact(ck: Checkpoint) -> bool:
    """Does ``.metadata`` have the size and CRC32 the manifest recorded (if it records one)?"""
    files = ck.manifest.get("files")
    info = files.get(naming.DCP_METADATA) if isinstance(files, dict) else None
    if not isinstance(info, dict):
        return True
    size = ck.sizes.get(naming.DCP_METADATA)
    if size is None or size != info.get("size"):
        return False
    return opener.crc32_fd(ck.fd(naming.DCP_METADATA), size) == info.get("crc32")


def read_part(ck: Checkpoint, rank: int) -> Any:
    """Part ``rank`` of a split manifest, authenticated and decoded.

    The index (which the marker authenticates) records each part's size and CRC32;
    the file was opened at that size with the others, and is read whole only here,
    within ``LIMITS.manifest_part_bytes``.
    """
    name = naming.part_name(rank)
    where = ck.path / name
    files = ck.manifest.get("files")
    info = files.get(name) if isinstance(files, dict) else None
    if not isinstance(info, dict):
        raise CorruptCheckpoint(f"{ck.path / MANIFEST}: the file table does not list {name}")
    size = ck.sizes.get(name, info.get("size"))
    limit = LIMITS.manifest_part_bytes
    if type(size) is not int or not 0 <= size <= limit:
        raise CorruptCheckpoint(
            f"{where}: the manifest part is {size!r} bytes, not a size up to the {limit} "
            "a reader accepts"
        )
    held = ck.fds.get(name)
    fd = open_member(ck.dir_fd, name, where, size=size) if held is None else held
    try:
        raw = opener.read_exact(fd, size, where)
    finally:
        if held is None:
            os.close(fd)
    if crc32(raw) != info.get("crc32"):
        raise CorruptCheckpoint(
            f"{where}: rank {rank}'s part of the manifest does not match its checksum in "
            f"{MANIFEST}; the checkpoint is damaged"
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


def open_vetted(path: Path) -> Checkpoint:
    """Open a committed checkpoint and vet it once: marker, manifest, every file, ``.metadata``.

    ``.metadata`` is derived from the manifest and never read by our readers; it
    is checked against the size and checksum the manifest recorded, so damage to
    it (which would mislead stock ``dcp.load``) is still reported. Close the
    result (or use ``with``); read every tensor through it.
    """
    ck = open_checkpoint(path)
    try:
        if not metadata_intact(ck):
            raise classify_metadata(ck)
    except BaseException:
        ck.close()
        raise
    return ck
