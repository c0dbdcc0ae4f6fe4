"""The limits of the format, in one table that both save and load read: past them a
file is far more likely hostile or damaged than real, and a writer refuses what
its own loader would refuse, naming the key, before it writes a byte."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = ["LIMITS", "Limits"]


@dataclass(frozen=True)
class Limits:
    """Every bound of the on-disk format; each field says why it is where it is."""

    key_depth: int = 256
    """Longest key path of the tensor tree. Real states nest a few levels; the bound
    keeps every walk of a hostile tree short and every path printable."""

    tensor_ndim: int = 64
    """Most dimensions of a tensor or array: numpy's own limit (NPY_MAXDIMS); torch
    allocates per-dimension metadata before any data."""

    tensor_extent: int = 1 << 62
    """Exclusive bound of any dimension, of any tensor's element count times its
    element size, and of any byte offset or length: no real tensor reaches it, and
    offsets computed from it stay inside int64 arithmetic."""

    chunks_per_tensor: int = 1 << 16
    """Most stored chunks (shards) of one tensor: far more ranks than any job has."""

    coverage_cells: int = 1 << 22
    """Most cells of the grid one tensor's chunk boundaries cut it into, when a reader
    checks they cover every element once: real layouts make a few thousand."""

    manifest_bytes: int = 256 << 20
    """Largest manifest: about 150 bytes per tensor, so a million tensors and large
    values; read whole, so also what one hostile file can cost."""

    manifest_part_bytes: int = 64 << 20
    """Largest part of a split manifest (one rank's entries and chunks, about 50 bytes
    per tensor): read whole, so what one hostile part can cost."""

    segment_bytes: int = 16 << 20
    """Longest byte range one run checksum covers, read whole to check it (a writer's
    segments are its write batches, a few MiB)."""

    marker_bytes: int = 64 << 10
    """Largest commit marker (it holds a few fixed fields)."""

    state_file_bytes: int = 4 << 20
    """Largest JSON state file beside checkpoints (tiers' status, a job's progress): a
    few KiB. Its str keys' hashes are salted, so its size bounds its cost."""

    encode_depth: int = 500
    """Deepest nesting of a non-tensor value a save accepts: below msgpack's packer
    recursion limit (511) and below ``decode_depth``, so whatever encodes decodes."""

    decode_depth: int = 512
    """Deepest nesting a reader accepts; well inside msgpack's fixed parse stack
    (1024) and Python's recursion limit for whatever walks the value next."""

    decode_bytes_per_container: int = 8
    """At most one container per this many input bytes beyond ``decode_free_containers``:
    an empty map is one byte on disk and about 70 in memory, so this caps the
    amplification near 10x; real manifests hold about one per 30 bytes."""

    decode_free_containers: int = 1 << 16
    """Containers every decode may build whatever its size, so small values never
    meet the per-byte budget."""

    equal_hashes: int = 32
    """Most keys of one map or set sharing a hash value: more make building its table
    quadratic (a flood); real data meets a handful."""


#: The limits every reader and writer of this version uses.
LIMITS: Final = Limits()
