"""The limits of the format, in one table that both save and load read.

A reader refuses what lies beyond these bounds, because past them a file is far
more likely hostile or damaged than real. A writer refuses the same things before
it writes a byte, naming the key at fault, so a save can never commit a checkpoint
that its own loader would then refuse (and a manager would then quarantine).
"""

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
    """Most dimensions of a tensor (or numpy array value). numpy's own limit
    (NPY_MAXDIMS) and far beyond any real layout; torch allocates per-dimension
    metadata before any data, so a reader bounds it first."""

    tensor_extent: int = 1 << 62
    """Exclusive bound of any dimension, of any tensor's element count times its
    element size, and of any byte offset or length: no real tensor reaches it, and
    offsets computed from it stay inside int64 arithmetic."""

    chunks_per_tensor: int = 1 << 16
    """Most stored chunks (shards) of one tensor: far more ranks than any job has."""

    coverage_cells: int = 1 << 22
    """Most cells of the grid that the distinct chunk boundaries of one tensor cut it
    into, when a reader checks that the chunks cover every element exactly once.
    Real layouts (row or column shards, 2-D meshes) make grids of a few thousand
    cells; the bound keeps that check near-linear on hostile boxes."""

    manifest_bytes: int = 256 << 20
    """Largest manifest. A manifest costs about 150 bytes per tensor plus the
    encoded non-tensor values, so 256 MiB is a million tensors and large values;
    anything bigger is a value that belongs in a tensor. Read whole into memory,
    so the bound is also what one read of a hostile file can cost."""

    manifest_part_bytes: int = 64 << 20
    """Largest part of a split manifest (one rank's per-rank entries and its chunk of
    every sharded tensor: about 50 bytes per tensor plus its values). Read whole by
    the ranks that need it, so the bound is what one hostile part can cost."""

    segment_bytes: int = 16 << 20
    """Longest byte range of a shard file that one run checksum covers: a reader
    reads a whole segment into memory to check it. A writer's segments are a few
    MiB (its write batches)."""

    marker_bytes: int = 64 << 10
    """Largest commit marker (it holds a few fixed fields)."""

    state_file_bytes: int = 4 << 20
    """Largest JSON state file kept beside checkpoints (the remote tier's status, the
    memory tier's status and mark, a job's progress): a few KiB of steps and
    messages. JSON cannot flood a hash table (its keys are strings, whose hashes
    are salted per process), so its size bound is its cost bound."""

    encode_depth: int = 500
    """Deepest nesting of a non-tensor value a save accepts: below msgpack's packer
    recursion limit (511) and below ``decode_depth``, so whatever encodes decodes."""

    decode_depth: int = 512
    """Deepest nesting a reader accepts; well inside msgpack's fixed parse stack
    (1024) and Python's recursion limit for whatever walks the value next."""

    decode_bytes_per_container: int = 8
    """Decode budget: at most one container (list, dict, tuple, set...) per this many
    input bytes, beyond ``decode_free_containers``. An empty map is one byte on disk
    and about 70 bytes in memory (a one-item list about 80); the budget caps that
    amplification near 10x, so a hostile 4 MiB manifest is refused within 64 MiB,
    while leaving room for any real manifest (about one container per 30 bytes)."""

    decode_free_containers: int = 1 << 16
    """Containers every decode may build whatever its size, so small values never
    meet the per-byte budget."""

    equal_hashes: int = 32
    """Most keys of one map, or members of one set, that may share a hash value.
    Equal hashes make building a hash table quadratic (a flood); real data meets
    a handful of accidental collisions at most."""


#: The limits every reader and writer of this version uses.
LIMITS: Final = Limits()
