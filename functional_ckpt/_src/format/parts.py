"""A split manifest: the sharding rule that places each rank's chunk, and a part's rows.

A tensor evenly split along one dimension (FSDP2's ``Shard(dim)``) records only that
dimension, so a restoring rank reads only the parts whose boxes meet its own shards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from functional_ckpt._src.format.naming import parse_shard

Box = tuple[tuple[int, ...], tuple[int, ...]]

#: The fields of a chunk a part row holds, in order (the box follows from the rule).
ROW_FIELDS = ("file", "offset", "length", "data_offset", "nbytes", "crc32", "hcrc32", "zstd")


def split_size(extent: int, parts: int) -> int:
    """The length of every chunk but the last along a split dimension (``torch.chunk``)."""
    return -(-extent // parts)


def is_even_split(shape: Sequence[int], dim: int, parts: int) -> bool:
    """Does the rule give ``parts`` non-empty chunks of ``shape`` along ``dim``?"""
    if not 0 <= dim < len(shape) or parts < 2:
        return False
    step = split_size(shape[dim], parts)
    return step * (parts - 1) < shape[dim]


def split_box(shape: Sequence[int], dim: int, parts: int, index: int) -> Box:
    """The box of chunk ``index`` when ``shape`` is split evenly along ``dim``."""
    step = split_size(shape[dim], parts)
    start = step * index
    offsets = [0] * len(shape)
    sizes = list(shape)
    offsets[dim] = start
    sizes[dim] = min(step, shape[dim] - start)
    return tuple(offsets), tuple(sizes)


def split_dim(shape: Sequence[int], boxes: Sequence[Any], parts: int) -> int | None:
    """The dimension along which ``boxes`` (sorted by offsets) are the even split of
    ``shape`` into ``parts`` chunks, each box chunk ``i`` of the rule; else None."""
    if len(boxes) != parts or parts < 2 or not shape:
        return None
    first = boxes[0][1]
    dim = next((d for d, (a, b) in enumerate(zip(first, shape, strict=True)) if a != b), None)
    if dim is None or not is_even_split(shape, dim, parts):
        return None
    # box i == split_box(shape, dim, parts, i) for every i, compared as lists (a
    # sharded tensor of a thousand-rank save has a thousand boxes)
    step = split_size(shape[dim], parts)
    whole = tuple(shape)
    before, after = whole[:dim], whole[dim + 1 :]
    middle, last = (*before, step, *after), (*before, shape[dim] - step * (parts - 1), *after)
    sizes = [b[1] for b in boxes]  # a box, or a chunk: its offsets and sizes come first
    if sizes[-1] != last or sizes.count(middle) != parts - 1 + (middle == last):
        return None
    zeros, tail = (0,) * dim, (0,) * len(after)
    if [b[0] for b in boxes] != [(*zeros, o, *tail) for o in range(0, step * parts, step)]:
        return None
    return dim


def owned_split(shape: Sequence[int], chunks: Sequence[Any], parts: int) -> int | None:
    """:func:`split_dim` of chunks (sorted) each in its part's rank's file, else None."""
    if [(parse_shard(c.file) or (-1,))[0] for c in chunks] != list(range(parts)):
        return None
    return split_dim(shape, chunks, parts)


def overlapping(extent: int, parts: int, start: int, length: int) -> range:
    """The chunks of an ``extent`` split in ``parts`` that meet ``[start, start + length)``."""
    if length <= 0:
        return range(0)
    step = split_size(extent, parts)
    return range(min(parts, start // step), min(parts, -(-(start + length) // step)))


def file_tables(
    files: Mapping[str, Mapping[str, Any]], in_index: set[str], parts: int
) -> dict[int, dict[str, dict[str, Any]]]:
    """The file table of the index (-1) and of each part that lists files: a restoring rank
    reads only the tables of the index and of the parts it reads."""
    out: dict[int, dict[str, dict[str, Any]]] = {-1: {}}
    for name, info in files.items():
        shard = parse_shard(name)
        owner = shard[0] if shard and shard[0] < parts and name not in in_index else -1
        out.setdefault(owner, {})[name] = dict(info)
    return out


def rows(chunks: Sequence[Any]) -> list[list[Any]]:
    """Each chunk as a part row: :data:`ROW_FIELDS` of it (``zstd`` only where set)."""
    return [list(c[2:] if c.zstd else c[2:9]) for c in chunks]


def row_plain(values: object, box: Box) -> dict[str, Any] | None:
    """A part row with its box, as a chunk's plain map; None if it is not a row."""
    if not isinstance(values, list) or not 7 <= len(values) <= len(ROW_FIELDS):
        return None
    return dict(zip(ROW_FIELDS, values, strict=False)) | {"offsets": [*box[0]], "sizes": [*box[1]]}
