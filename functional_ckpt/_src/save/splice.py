"""The coordinator's merge of every rank's written chunks into the manifest's parts.

A training loop saves one layout again and again: each rank writes its last plan and
only its chunks' numbers change (the CRC32s; offsets where compressed). So the
coordinator keeps, from the last save, which part and row each rank's chunk fills and
which chunks the index holds; a save of that layout packs the parts' rows straight
from every rank's columns (:mod:`..format.packed_rows`) and keeps ``.metadata`` while
every file, offset and length is the same: no Python object per chunk
(docs/scale.md).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from functional_ckpt._src.format.dcp_values import ByteEntry
from functional_ckpt._src.format.keys import KeyPath
from functional_ckpt._src.format.manifest import Chunk, TensorEntry, Tree
from functional_ckpt._src.format.naming import shard_name
from functional_ckpt._src.format.packed_rows import Spliced, pack_rows
from functional_ckpt._src.format.parts import split_dim, split_size
from functional_ckpt._src.save.exchange import KeyBox, PlanCache, Recipe, Sent
from functional_ckpt.errors import CheckpointError

#: The columns ``.metadata`` reads of a row: its file, offset, length and zstd.
_LAYOUT = [0, 1, 2, 7]


def merge(
    held: PlanCache,
    sent: Sequence[Sent],
    tree: Tree,
    blobs: Sequence[ByteEntry],
    incremental_save: bool,
) -> tuple[dict[str, tuple[Chunk, ...]], dict[str, int], Spliced]:
    """Every rank's chunks by DCP key (only those the index and per-rank entries
    hold, for a layout saved last), each shard file's size, and the parts' rows."""
    world = len(sent)
    boxes = []
    for r, s in enumerate(sent):
        b = s.boxes
        if b is None:
            kept = held.boxes
            b = kept[r] if kept is not None and len(kept) == world else None
            if b is None or len(b) != len(s.table):
                raise CheckpointError(
                    f"rank {r} reported the chunks of a plan this coordinator does not "
                    "hold; save again"
                )
        boxes.append(b)
    held.boxes = boxes
    names: dict[str, int] = {}  # every file rows name, numbered across the ranks
    lut = np.array([names.setdefault(f, len(names)) for s in sent for f in s.files], np.uint64)
    table = np.concatenate([s.table for s in sent]) if sent else np.zeros((0, 8), np.uint64)
    base = np.cumsum([0] + [len(s.files) for s in sent[:-1]])
    at = np.repeat(base, [len(s.table) for s in sent]) + table[:, 0].astype(np.intp)
    table[:, 0] = lut[at] if len(table) else 0
    key = (
        incremental_save,
        tuple(
            (e.fqn, e.path, e.dcp_path, e.dtype_name, e.shape)
            for g in (tree.entries, *tree.ranks)
            for e in g
            if type(e) is TensorEntry
        ),
        tuple((b.fqn, b.file, b.offset, b.length) for b in blobs),
    )
    last = held.recipe
    if (
        last is not None
        and all(s.boxes is None for s in sent)
        and last.key == key
        and last.names == list(names)
        and np.array_equal(last.layout, table[:, _LAYOUT])
    ):
        rest: defaultdict[str, list[Chunk]] = defaultdict(list)
        rows = table[[g for g, _ in last.rest]].tolist() if last.rest else []
        for (_, (fqn, o, sz)), v in zip(last.rest, rows, strict=True):
            rest[fqn].append(Chunk(o, sz, last.names[v[0]], *v[1:]))
        parts = pack_rows(last.names, table[last.order], last.bounds)
        chunks = {k: tuple(v) for k, v in rest.items()}
        return chunks, dict(last.sizes), Spliced(last.spliced.split, parts, last.spliced.dcp)
    held.recipe = None
    return _first(held, boxes, list(names), table, tree, blobs, incremental_save, key)


def _first(
    held: PlanCache,
    boxes: list[list[KeyBox]],
    names: list[str],
    table: np.ndarray,
    tree: Tree,
    blobs: Sequence[ByteEntry],
    incremental_save: bool,
    key: Any,
) -> tuple[dict[str, tuple[Chunk, ...]], dict[str, int], Spliced]:
    """:func:`merge` of a layout not merged last: every chunk made, the recipe kept."""
    world = len(boxes)
    flat = (b for bs in boxes for b in bs)
    rows = table.tolist()
    results = [
        (k, Chunk(o, sz, names[v[0]], *v[1:])) for (k, o, sz), v in zip(flat, rows, strict=True)
    ]
    chunks, sizes = merge_results(results, blobs, world, incremental_save)
    split: dict[KeyPath, int] = {}
    row_of: dict[str, tuple[int, int, int]] = {}  # DCP key: (row, dim, split size)
    for e in tree.entries:
        if type(e) is TensorEntry and e.alias is None and world > 1:
            got = chunks.get(e.fqn, ())
            dim = None
            if len(got) == world:
                dim = split_dim(e.shape, sorted(got, key=lambda c: c.offsets), world)
            if dim is not None:
                split[e.path] = dim
                row_of[e.fqn] = (len(row_of), dim, split_size(e.shape[dim], world))
    n = len(row_of)
    where, rest = [], []
    for g, (fqn, o, sz) in enumerate(b for bs in boxes for b in bs):
        at = row_of.get(fqn)
        if at is None:
            rest.append((g, (fqn, o, sz)))
        else:
            where.append((o[at[1]] // at[2] * n + at[0], g))
    where.sort()
    order = np.array([g for _, g in where], np.intp)
    bounds = [n * r for r in range(world + 1)]
    spliced = Spliced(split, pack_rows(names, table[order], bounds))
    layout = table[:, _LAYOUT].copy()
    held.recipe = Recipe(key, names, layout, order, bounds, rest, dict(sizes), spliced)
    return chunks, sizes, spliced


def merge_results(
    results: Sequence[tuple[str, Chunk]],
    blobs: Sequence[ByteEntry],
    world: int,
    incremental_save: bool,
) -> tuple[dict[str, tuple[Chunk, ...]], dict[str, int]]:
    """Every rank's written chunks by DCP key, and each shard file's size."""
    chunks: defaultdict[str, list[Chunk]] = defaultdict(list)
    sizes = {} if incremental_save else {shard_name(r): 0 for r in range(world)}
    # each rank's chunks come in one run of its own file: its size kept in locals
    file, end = None, 0
    for fqn, c in results:
        chunks[fqn].append(c)
        if c[2] != file:
            if file is not None:
                sizes[file] = end
            file = c[2]
            end = sizes.get(file, 0)
        if c[3] + c[4] > end:  # offset + length: the blobs tile the file
            end = c[3] + c[4]
    if file is not None:
        sizes[file] = end
    for b in blobs:
        sizes[b.file] = max(sizes.get(b.file, 0), b.offset + b.length)
    return {k: tuple(v) for k, v in chunks.items()}, sizes
