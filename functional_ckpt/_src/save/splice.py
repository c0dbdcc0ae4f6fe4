"""The coordinator's merge of every rank's written chunks into the manifest's parts. A loop
saves one layout again and again: where its rows went, and ``.metadata``, are kept while no
file, offset or length moved."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np

from functional_ckpt._src.format.dcp_values import ByteEntry
from functional_ckpt._src.format.keys import KeyPath
from functional_ckpt._src.format.manifest import Chunk, TensorEntry, Tree
from functional_ckpt._src.format.naming import shard_name
from functional_ckpt._src.format.packed_rows import COLUMNS, Spliced, pack_rows
from functional_ckpt._src.format.parts import owned_split, split_size
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
    """Every rank's chunks by DCP key, each shard file's size, and the parts' rows."""
    boxes = []
    for r, s in enumerate(sent):
        kept = held.boxes[r] if held.boxes and len(held.boxes) == len(sent) else None
        b = kept if s.boxes is None else s.boxes
        if b is None or len(b) != len(s.table):
            raise CheckpointError(
                f"rank {r} reported the chunks of a plan this coordinator does not hold; save again"
            )
        boxes.append(b)
    held.boxes = boxes
    names: dict[str, int] = {}  # every file rows name, numbered across the ranks
    lut = np.array([names.setdefault(f, len(names)) for s in sent for f in s.files], np.uint64)
    table = np.concatenate([s.table for s in sent]) if sent else np.zeros((0, COLUMNS), "u8")
    base = np.cumsum([0] + [len(s.files) for s in sent[:-1]])
    at = np.repeat(base, [len(s.table) for s in sent]) + table[:, 0].astype(np.intp)
    table[:, 0] = lut[at] if len(table) else 0
    sizes = file_sizes(list(names), table, blobs, 0 if incremental_save else len(sent))
    key = (  # what .metadata depends on besides the rows' layout
        incremental_save,
        [(e.fqn, e.path, e.dcp_path, e.dtype_name, e.shape) for g in (tree.entries, *tree.ranks)
         for e in g if type(e) is TensorEntry],
        [(b.fqn, b.path, b.file, b.offset, b.length) for b in blobs],
    )  # fmt: skip
    last = held.recipe
    again = (
        last is not None
        and all(s.boxes is None for s in sent)
        and (last.key, last.names) == (key, list(names))
        and np.array_equal(last.layout, table[:, _LAYOUT])
    )
    if again and last is not None:  # only the rows the index and per-rank entries hold
        boxed = [b for _, b in last.rest]
        rows = table[[g for g, _ in last.rest]].tolist()
    else:
        boxed, rows = [b for bs in boxes for b in bs], table.tolist()
    chunks: defaultdict[str, list[Chunk]] = defaultdict(list)
    files = list(names)
    for (fqn, o, sz), v in zip(boxed, rows, strict=True):
        chunks[fqn].append(Chunk(o, sz, files[v[0]], *v[1:]))
    if not again or last is None:
        last = _recipe(boxed, chunks, files, table, tree, len(sent), key)
    spliced = Spliced(last.spliced.split, pack_rows(files, table[last.order], last.bounds))
    if again:
        spliced.dcp = last.spliced.dcp
    held.recipe = dataclasses.replace(last, spliced=spliced)
    return {k: tuple(v) for k, v in chunks.items()}, sizes, spliced


def _recipe(
    flat: list[KeyBox],
    chunks: dict[str, list[Chunk]],
    names: list[str],
    table: np.ndarray,
    tree: Tree,
    world: int,
    key: Any,
) -> Recipe:
    """Where rows go: part ``p`` holds chunk ``p`` of each split tensor, the index the rest."""
    split: dict[KeyPath, int] = {}
    row_of: dict[str, tuple[int, int, int]] = {}  # DCP key: (row, dim, split size)
    for e in tree.entries:
        if type(e) is not TensorEntry or e.alias is not None:
            continue
        got = chunks.get(e.fqn, [])
        dim = owned_split(e.shape, sorted(got), world) if len(got) == world > 1 else None
        if dim is not None:
            split[e.path] = dim
            row_of[e.fqn] = (len(row_of), dim, split_size(e.shape[dim], world))
    n = len(row_of)
    where, rest = [], []
    for g, (fqn, o, _) in enumerate(flat):
        at = row_of.get(fqn)
        if at is None:
            rest.append((g, flat[g]))
        else:
            where.append((o[at[1]] // at[2] * n + at[0], g))
    order = np.array([g for _, g in sorted(where)], np.intp)
    bounds = [n * r for r in range(world + 1)]
    layout = table[:, _LAYOUT].copy()
    return Recipe(key, names, layout, order, bounds, rest, Spliced(split, ()))


def file_sizes(
    names: list[str], table: np.ndarray, blobs: Sequence[ByteEntry], world: int
) -> dict[str, int]:
    """Each file's size: the end of its last blob; the ``world`` ranks' files even when empty."""
    ends = np.zeros(len(names), np.uint64)
    np.maximum.at(ends, table[:, 0].astype(np.intp), table[:, 1] + table[:, 2])
    sizes = {shard_name(r): 0 for r in range(world)}
    sizes.update(zip(names, ends.tolist(), strict=True))
    for b in blobs:
        sizes[b.file] = max(sizes.get(b.file, 0), b.offset + b.length)
    return sizes
