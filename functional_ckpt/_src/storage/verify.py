"""``fc.verify``: every byte re-read and checked, and ``.metadata`` against the manifest."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from functional_ckpt._src.format import dcp_values as dcpbytes
from functional_ckpt._src.format import naming, unpickler
from functional_ckpt._src.format.checksum import crc32
from functional_ckpt._src.format.dcp_values import ByteEntry
from functional_ckpt._src.format.keys import format_path
from functional_ckpt._src.format.manifest import Chunk, TensorEntry
from functional_ckpt._src.paths import PathLike
from functional_ckpt._src.storage import committed, opener, shards
from functional_ckpt._src.storage.committed import classify_metadata
from functional_ckpt.errors import CheckpointError, CorruptCheckpoint, UnsafeCheckpoint


@dataclass(frozen=True)
class Problem:
    where: str  # a file name or a key path
    detail: str
    file: str | None = None  # the file at fault, where one is (a replica's holder refetches it)

    def __str__(self) -> str:
        return f"{self.where}: {self.detail}"


@dataclass
class VerifyReport:
    """The outcome of re-reading every byte of a checkpoint."""

    path: Path
    ok: bool
    problems: list[Problem]
    files_checked: int = 0
    bytes_checked: int = 0

    def __str__(self) -> str:
        state = "OK" if self.ok else "DAMAGED"
        head = f"{self.path}: {state} ({self.files_checked} files, {self.bytes_checked} bytes)"
        return "\n".join([head, *(f"  {p}" for p in self.problems)])


def verify(path: PathLike) -> VerifyReport:
    """Recompute every checksum over every byte; raise only if ``path`` is no checkpoint."""
    src = Path(path)
    report = VerifyReport(src, True, [])
    failed: list[tuple[str, CheckpointError]] = []
    name = naming.COMMIT_MARKER  # the file at fault: the marker, else what it authenticates
    try:  # CheckpointNotFound / IncompleteCheckpoint propagate
        committed.check_committed(src)
        name = naming.MANIFEST
        ck = committed.open_checkpoint(src, problems=failed)
    except (CorruptCheckpoint, UnsafeCheckpoint) as err:
        report.ok = False
        report.problems.append(Problem(name, str(err), name))
        return report
    with ck:
        try:  # its name is what every reader of a root takes it for
            committed.header_named(ck.manifest, naming.parse_step(src.name), src.name)
        except CorruptCheckpoint as err:
            report.problems.append(Problem(naming.MANIFEST, str(err)))
        _verify_open(ck, failed, report)
    report.ok = not report.problems
    return report


def _verify_open(
    ck: committed.Checkpoint, failed: list[tuple[str, CheckpointError]], report: VerifyReport
) -> None:
    src, manifest = ck.path, ck.manifest
    report.problems += [Problem(name, str(err), name) for name, err in failed]
    unread = {name for name, _ in failed}  # missing, wrong size or not a regular file
    try:
        once = committed.parsed(ck)
        parts = [naming.part_name(r) for r in range(once.shared.parts)]
        bad = []
        for rank, name in enumerate(parts):  # a part at fault is named
            try:
                once.part(rank)
            except (CorruptCheckpoint, UnsafeCheckpoint) as err:
                bad.append(Problem(name, str(err), name))
        if bad:
            report.problems += bad
            return
        shared, parsed = once.shared, once.all_views()
        blobs = dcpbytes.parse_byte_entries(manifest, shared.file_sizes, src)
    except (CorruptCheckpoint, UnsafeCheckpoint) as err:
        report.problems.append(Problem(naming.MANIFEST, str(err), naming.MANIFEST))
        return
    files = manifest["files"]  # the index's table and every part's
    more: list[tuple[str, CheckpointError]] = []
    committed.check_members(ck, more)  # the files the parts list, opened at their sizes
    report.problems += [Problem(name, str(err), name) for name, err in more if name not in unread]
    unread |= {name for name, _ in more}
    listed = set(files) | set(parts) | {naming.MANIFEST, naming.COMMIT_MARKER}
    for child in sorted(os.listdir(ck.dir_fd)):
        if child not in listed:
            report.problems.append(Problem(child, "unexpected file in the checkpoint", child))
    if naming.DCP_METADATA not in unread:
        _verify_metadata(ck, once.groups(), blobs, report)
    by_file: dict[str, dict[int, tuple[str, Chunk | ByteEntry]]] = {}
    for one in parsed:
        for e in one.tensors.values():
            if e.alias is None:
                for c in e.chunks:
                    by_file.setdefault(c.file, {})[c.offset] = (format_path(e.path), c)
    for b in blobs:
        by_file.setdefault(b.file, {})[b.offset] = (f"DCP byte entry {b.fqn!r}", b)
    for name in files:
        if name != naming.DCP_METADATA and naming.parse_part(name) is None and name not in unread:
            try:  # a file at a time, closed once checked
                _verify_file(ck, name, sorted(by_file.get(name, {}).items()), parsed[0], report)
            finally:
                ck.release(name)


def _verify_metadata(
    ck: committed.Checkpoint,
    groups: list[list[TensorEntry]],
    blobs: list[ByteEntry],
    report: VerifyReport,
) -> None:
    """``.metadata`` is intact and says exactly what the manifest says."""
    name = naming.DCP_METADATA
    info = ck.manifest["files"].get(name)
    if not isinstance(info, dict):
        report.problems.append(Problem(name, "not recorded in the manifest"))
        return
    where = ck.path / name
    if ck.sizes[name] != info.get("size"):
        report.problems.append(Problem(name, str(classify_metadata(ck)), name))
        return
    try:
        raw = opener.read_exact(ck.fd(name), ck.sizes[name], where)
    finally:
        ck.release(name)
    report.files_checked += 1
    report.bytes_checked += len(raw)
    try:
        if crc32(raw) != info.get("crc32"):
            raise classify_metadata(ck)
        found = unpickler.load_standins(raw, where)
    except (CorruptCheckpoint, UnsafeCheckpoint) as err:
        report.problems.append(Problem(name, str(err), name))
        return
    for diff in unpickler.compare(found, groups, blobs):
        why = f"disagrees with the manifest (stock dcp.load would misread): {diff}"
        report.problems.append(Problem(name, why, name))


def _verify_file(
    ck: committed.Checkpoint,
    name: str,
    chunks: list[tuple[int, tuple[str, Chunk | ByteEntry]]],
    parsed: Any,
    report: VerifyReport,
) -> None:
    """Every byte of a shard file belongs to one blob whose checksums hold, as do the run
    checksums (a damaged blob reported once, by its key). A base's file may have gaps."""
    report.files_checked += 1
    pos = 0
    damaged: list[tuple[int, int]] = []  # the byte ranges of blobs found damaged
    fd = ck.fd(name)
    info = parsed.raw.get("files", {}).get(name)
    gaps = isinstance(info, dict) and info.get("reused") is True
    size = parsed.file_sizes[name]

    def bad(where: str, detail: str) -> None:
        report.problems.append(Problem(where, detail, name))

    for _, (key, c) in chunks:
        if c.offset != pos and not (gaps and c.offset > pos):
            bad(name, f"bytes {pos}..{c.offset} are not accounted for")
        start = len(report.problems)
        if isinstance(c, ByteEntry) or c.zstd:  # one checksum over the stored bytes
            crc, n = crc_range(fd, c.offset, c.length)
            report.bytes_checked += n
            if isinstance(c, ByteEntry) and crc != c.crc32:
                bad(key, f"bytes in {name} fail their checksum")
            elif not isinstance(c, ByteEntry) and crc != c.hcrc32:
                bad(key, f"stored (compressed) tensor bytes in {name} fail their checksum")
        else:
            hcrc, n1 = crc_range(fd, c.offset, c.data_offset - c.offset)
            crc, n2 = crc_range(fd, c.data_offset, c.nbytes)
            end = c.data_offset + c.nbytes
            hcrc, n3 = crc_range(fd, end, c.offset + c.length - end, hcrc)
            report.bytes_checked += n1 + n2 + n3
            if crc != c.crc32:
                bad(key, f"tensor data in {name} fails its checksum")
            if hcrc != c.hcrc32:
                bad(key, f"blob headers in {name} fail their checksum")
        if len(report.problems) > start:
            damaged.append((c.offset, c.offset + c.length))
        pos = c.offset + c.length
    if pos != size and not (gaps and pos < size):
        bad(name, f"bytes {pos}..{size} are not accounted for")
    for seg in parsed.segments.get(name, ()):
        crc, _ = crc_range(fd, seg.offset, seg.length)  # bytes counted above
        if crc != seg.crc32 and not any(a < seg.end and seg.offset < b for a, b in damaged):
            bad(name, f"bytes {seg.offset}..{seg.end} fail their run checksum")


CRC_BLOCK = 4 << 20  # bytes read per step: the buffer stays in cache


def crc_range(fd: int, offset: int, length: int, start: int = 0) -> tuple[int, int]:
    """CRC32 over a file range, and the bytes read, into one reused buffer (fresh ones fault)."""
    view = memoryview(bytearray(min(CRC_BLOCK, max(length, 0))))
    crc = start
    done = 0
    while done < length:
        n = shards.read_into(fd, offset + done, view[: min(CRC_BLOCK, length - done)])
        if not n:
            break
        crc = crc32(view[:n], crc)
        done += n
    return crc, done
