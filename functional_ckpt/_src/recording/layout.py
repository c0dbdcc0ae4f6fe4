"""A recording on disk (docs/simulation.md): its files, its commit marker, reading them.

The header is written once; data segments and the index (one frame per commit) are
append-only; the marker ``RECORDED``, replaced atomically at each commit, holds the
committed sizes and checksums. A reader trusts nothing beyond the marker: bytes past
the committed sizes are a crash's leftovers, and every byte within them is checked."""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from functional_ckpt._src import codec
from functional_ckpt._src.format.checksum import crc32
from functional_ckpt._src.format.entries import node_info
from functional_ckpt._src.format.kind import Kind, classify
from functional_ckpt._src.format.manifest import Entry, TensorEntry, ValueEntry
from functional_ckpt._src.format.naming import RECORDING_HEADER
from functional_ckpt._src.format.view import parse_planned
from functional_ckpt._src.limits import LIMITS
from functional_ckpt._src.storage import opener
from functional_ckpt.errors import CheckpointError, CorruptCheckpoint, NotARecording

__all__ = ["FORMAT", "HEADER", "INDEX", "LOC", "RECORDING_MARKER", "MAX_STEP", "VERSION"]
__all__ += ["Committed", "NotARecording", "open_at_least", "read_committed"]
__all__ += ["segment_name"]

FORMAT = "functional_ckpt.recording"
VERSION = 1
HEADER = RECORDING_HEADER
INDEX = "index.bin"
RECORDING_MARKER = "RECORDED"
#: A leaf's location in the data: segment number, CRC32, byte offset, byte count.
LOC = np.dtype([("seg", "<u4"), ("crc", "<u4"), ("off", "<u8"), ("n", "<u8")])
FRAME = struct.Struct("<I")
#: The largest step a record may have (the index holds steps as int64).
MAX_STEP = (1 << 63) - 1
_MARKER_KEYS = {"format", "version", "records", "index_size", "index_crc32", "header_size"}
_MARKER_KEYS |= {"header_crc32", "segments"}


def segment_name(i: int) -> str:
    return f"data-{i:06d}.bin"


@dataclass
class Committed:
    """What a reader may use of a recording: its committed records, vetted."""

    path: Path
    header: dict[str, Any]
    entries: list[Entry]
    leaves: list[TensorEntry | ValueEntry]
    steps: np.ndarray  # int64, strictly increasing
    locs: np.ndarray  # LOC, shape (records, leaves)
    segments: list[int]  # committed size of each segment
    file_bytes: int  # bytes of every file, uncommitted tails included
    tail_bytes: int  # bytes past the committed sizes (a crash's leftovers)

    def new_bytes(self) -> tuple[np.ndarray, np.ndarray]:
        """Per record: (bytes it appended, leaves it appended); the others it shares."""
        locs, fresh = self.locs, np.ones(self.locs.shape, dtype=bool)
        fresh[1:] = (locs[1:]["seg"] != locs[:-1]["seg"]) | (locs[1:]["off"] != locs[:-1]["off"])
        sizes = np.where(fresh, locs["n"], 0).sum(axis=1)
        return sizes.astype(np.int64), fresh.sum(axis=1)


def _int(value: object, where: Path, what: str) -> int:
    if type(value) is not int or not 0 <= value < 1 << 63:
        raise CorruptCheckpoint(f"{where}: invalid {what} {value!r}")
    return value


def open_at_least(dir_fd: int, path: Path, name: str, size: int, what: str) -> int:
    """Open a member safely, checked to hold at least its ``size`` committed bytes."""
    where = path / name
    try:
        fd = opener.open_member(dir_fd, name, where, what=what)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{where}: the {what} is missing") from None
    actual = os.fstat(fd).st_size
    if actual < size:
        os.close(fd)
        raise CorruptCheckpoint(f"{where}: {actual} bytes, the marker committed {size}")
    return fd


def _read(dir_fd: int, path: Path, name: str, size: int, what: str) -> tuple[bytes, int]:
    """The first ``size`` bytes of a member (the rest is uncommitted) and its full size."""
    fd = open_at_least(dir_fd, path, name, size, what)
    try:
        return opener.read_exact(fd, size, path / name), os.fstat(fd).st_size
    finally:
        os.close(fd)


def open_recording(path: Path, what: str) -> int:
    """A descriptor of the recording directory ``path``; :class:`NotARecording` otherwise."""
    try:
        dir_fd = opener.open_directory(path)
    except CheckpointError as exc:
        raise NotARecording(f"{what}: {exc}") from None
    found = classify(path)
    if found is not Kind.RECORDING:
        os.close(dir_fd)
        kind = (
            "a checkpoint (use fc.restore)"
            if found is Kind.COMMITTED
            else f"not a recording (it has no {HEADER}: {found.value})"
        )
        raise NotARecording(f"{what}: {path} is {kind}")
    return dir_fd


def read_recording_marker(dir_fd: int, path: Path) -> dict[str, Any] | None:
    """The decoded marker, or None before the first commit."""
    where = path / RECORDING_MARKER
    try:
        raw = opener.read_small(dir_fd, RECORDING_MARKER, where, LIMITS.marker_bytes, "marker")
    except FileNotFoundError:
        return None
    marker = codec.decode(raw, source=str(where))
    if not isinstance(marker, dict) or set(marker) != _MARKER_KEYS:
        raise CorruptCheckpoint(f"{where}: not a recording's commit marker")
    if marker["format"] != FORMAT or marker["version"] != VERSION:
        raise CorruptCheckpoint(
            f"{where}: format {marker['format']!r} version {marker['version']!r}; this "
            f"version of functional_ckpt reads {FORMAT!r} version {VERSION}"
        )
    segments = marker["segments"]
    if not isinstance(segments, list):
        raise CorruptCheckpoint(f"{where}: invalid segment list")
    for key in _MARKER_KEYS - {"format", "version", "segments"}:
        _int(marker[key], where, key)
    for size in segments:
        _int(size, where, "segment size")
    return marker


def parse_header(raw: bytes, where: Path) -> tuple[dict[str, Any], list[Entry]]:
    header = codec.decode(raw, source=str(where))
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CorruptCheckpoint(f"{where}: not a recording's header")
    entries = parse_planned(header.get("layout"), str(where))
    root = header.get("root")
    if root is not None and not isinstance(root, dict):
        raise CorruptCheckpoint(f"{where}: invalid root record {root!r}")
    header["root"] = node_info(root, str(where)) if root else None
    every = header.get("every")
    if type(every) is not int or every < 1:
        raise CorruptCheckpoint(f"{where}: invalid 'every' {every!r}")
    return header, entries


def parse_index(
    raw: bytes, where: Path, leaves: list[TensorEntry | ValueEntry], segments: list[int]
) -> tuple[np.ndarray, np.ndarray]:
    """(steps, locations) of every committed frame, each location checked to be in bounds."""
    steps: list[int] = []
    parts: list[np.ndarray] = []
    pos, width = 0, len(leaves) * LOC.itemsize
    while pos < len(raw):
        if pos + FRAME.size > len(raw):
            raise CorruptCheckpoint(f"{where}: a frame is cut at byte {pos}")
        (size,) = FRAME.unpack_from(raw, pos)
        frame = codec.decode(raw[pos + FRAME.size : pos + FRAME.size + size], source=str(where))
        pos += FRAME.size + size
        got = frame.get("steps") if isinstance(frame, dict) else None
        locs = frame.get("locs") if isinstance(frame, dict) else None
        if not (isinstance(got, list) and isinstance(locs, bytes)) or len(locs) != len(got) * width:
            raise CorruptCheckpoint(f"{where}: invalid frame ending at byte {pos}")
        steps += [_int(s, where, "step") for s in got]
        parts.append(np.frombuffer(locs, LOC).reshape(len(got), len(leaves)))
    step_array = np.array(steps, dtype=np.int64)
    if len(step_array) > 1 and not (np.diff(step_array) > 0).all():
        raise CorruptCheckpoint(f"{where}: steps are not strictly increasing")
    locs = np.concatenate(parts) if parts else np.empty((0, len(leaves)), LOC)
    sizes = np.array([*segments, 0], dtype=np.uint64)
    seg = np.minimum(locs["seg"], len(segments)).astype(np.int64)
    room = sizes[seg]  # off + n could wrap around 2**64: compared without adding
    beyond = (locs["off"] > room) | (locs["n"] > room - np.minimum(locs["off"], room))
    if (locs["seg"] >= len(segments)).any() or beyond.any():
        raise CorruptCheckpoint(f"{where}: a record points beyond the committed data")
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, TensorEntry) and len(locs) and (locs["n"][:, i] != leaf.nbytes).any():
            raise CorruptCheckpoint(f"{where}: a record of {leaf.path} has the wrong size")
    return step_array, locs


def read_committed(path: Path, what: str) -> tuple[int, Committed]:
    """Open and vet a recording once: (its directory descriptor, what is committed)."""
    dir_fd = open_recording(path, what)
    try:
        marker = read_recording_marker(dir_fd, path)
        if marker is None:
            raise NotARecording(f"{what}: {path} is a recording with nothing committed yet")
        raw, header_bytes = _read(dir_fd, path, HEADER, marker["header_size"], "header")
        if crc32(raw) != marker["header_crc32"] or header_bytes != len(raw):
            raise CorruptCheckpoint(f"{path / HEADER}: does not match its commit marker")
        header, entries = parse_header(raw, path / HEADER)
        leaves = [e for e in entries if isinstance(e, TensorEntry | ValueEntry)]  # stored
        index, index_bytes = _read(dir_fd, path, INDEX, marker["index_size"], "index")
        if crc32(index) != marker["index_crc32"]:
            raise CorruptCheckpoint(f"{path / INDEX}: does not match its commit marker")
        steps, locs = parse_index(index, path / INDEX, leaves, marker["segments"])
        if len(steps) != marker["records"]:
            raise CorruptCheckpoint(f"{path / INDEX}: {len(steps)} records, marker says more")
        total = header_bytes + index_bytes
        for i, size in enumerate(marker["segments"]):
            fd = open_at_least(dir_fd, path, segment_name(i), size, "data segment")
            total += os.fstat(fd).st_size
            os.close(fd)
        committed = sum(marker["segments"]) + marker["index_size"] + header_bytes
    except BaseException:
        os.close(dir_fd)
        raise
    done = Committed(
        path, header, entries, leaves, steps, locs, marker["segments"], total, total - committed
    )
    return dir_fd, done
