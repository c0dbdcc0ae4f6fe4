"""Run checksums: one CRC32 over a run of adjacent small blobs of a shard file.

Three checksums per small tensor cost more than reading it, so a reader checks one
CRC32 per segment and the blobs one by one only if it fails (naming the damaged ones).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from functional_ckpt._src.format import columns
from functional_ckpt._src.limits import LIMITS
from functional_ckpt.errors import CorruptCheckpoint

#: The field of a file's record in the manifest's file table.
FIELD = "segments"

_WIDTHS = {"offset": 8, "length": 8, "crc32": 4}  # a segment's fields, each a column

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
    return {k: columns.pack([getattr(s, k) for s in segments], w) for k, w in _WIDTHS.items()}


def parse_segments(raw: Any, size: int, where: str) -> tuple[Segment, ...]:
    """The segments a file's record declares: anything but sorted, disjoint, non-empty
    ranges inside ``size``, each at most ``LIMITS.segment_bytes``, is damage."""
    if type(raw) is not dict or set(raw) != set(_WIDTHS) or type(raw["crc32"]) is not bytes:
        raise CorruptCheckpoint(f"{where}: invalid run checksums (segments)")
    n = len(raw["crc32"]) // 4
    if n > 1 + size // MIN_SPACING:
        raise CorruptCheckpoint(f"{where}: {n} segments in a file of {size} bytes")
    found = (columns.unpack(raw[k], w, n, f"{where} segment {k}") for k, w in _WIDTHS.items())
    out: list[Segment] = []
    pos = 0
    for i, (off, length, crc) in enumerate(zip(*found, strict=True)):
        if not (pos <= off and 0 < length <= LIMITS.segment_bytes and off + length <= size):
            raise CorruptCheckpoint(
                f"{where}: segment {i} ({length} bytes at {off}) overlaps another, is empty, "
                f"longer than {LIMITS.segment_bytes} bytes or beyond the file's {size} bytes"
            )
        out.append(Segment(off, length, crc))
        pos = off + length
    return tuple(out)
