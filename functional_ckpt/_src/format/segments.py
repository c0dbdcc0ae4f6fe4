"""Run checksums: one CRC32 over a run of adjacent small blobs of a shard file.

Checking three checksums per small tensor costs more than reading it, so a reader of
a whole *segment* checks one CRC32, and checks its blobs one by one only if it fails
(naming the damaged ones). A file's record holds ``segments``: three columns
(:mod:`.columns`), ``offset`` and ``length`` of 8 bytes and ``crc32`` of 4, in file order.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from functional_ckpt._src.format import columns
from functional_ckpt._src.limits import LIMITS
from functional_ckpt.errors import CorruptCheckpoint

#: The field of a file's record in the manifest's file table.
FIELD = "segments"

_COLUMNS = frozenset({"offset", "length", "crc32"})

#: A writer starts a new segment only after a full write batch or a large tensor
#: (1 MiB and more): a file holds at most one segment per this many bytes, plus one.
MIN_SPACING = 256 << 10


class Segment(NamedTuple):
    """A byte range of a shard file and the CRC32 of its bytes."""

    offset: int
    length: int
    crc32: int

    @property
    def end(self) -> int:
        return self.offset + self.length


def pack_segments(segments: list[Segment]) -> dict[str, bytes]:
    """The file table's record of ``segments`` (in file order)."""
    return {
        "offset": columns.pack((s.offset for s in segments), 8),
        "length": columns.pack((s.length for s in segments), 8),
        "crc32": columns.pack((s.crc32 for s in segments), 4),
    }


def parse_segments(raw: Any, size: int, where: str) -> tuple[Segment, ...]:
    """The segments a file's record declares: anything but sorted, disjoint, non-empty
    ranges inside ``size``, each at most ``LIMITS.segment_bytes``, is damage."""
    if type(raw) is not dict or set(raw) != _COLUMNS or type(raw["crc32"]) is not bytes:
        raise CorruptCheckpoint(f"{where}: invalid run checksums (segments)")
    n = len(raw["crc32"]) // 4
    if n > 1 + size // MIN_SPACING:
        raise CorruptCheckpoint(f"{where}: {n} segments in a file of {size} bytes")
    offsets = columns.unpack(raw["offset"], 8, n, f"{where} segment offsets")
    lengths = columns.unpack(raw["length"], 8, n, f"{where} segment lengths")
    crcs = columns.unpack(raw["crc32"], 4, n, f"{where} segment checksums")
    out: list[Segment] = []
    pos = 0
    for i, (off, length, crc) in enumerate(zip(offsets, lengths, crcs, strict=True)):
        if not (pos <= off and 0 < length <= LIMITS.segment_bytes and off + length <= size):
            raise CorruptCheckpoint(
                f"{where}: segment {i} ({length} bytes at {off}) overlaps another, is empty, "
                f"longer than {LIMITS.segment_bytes} bytes or beyond the file's {size} bytes"
            )
        out.append(Segment(off, length, crc))
        pos = off + length
    return tuple(out)
