"""Which entries a tensor table holds, and the table they make (:mod:`.tables` reads it).

Long runs of plain one-chunk tensors and the bare nodes between them are written as
tables, their rows told apart by ``kind``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from operator import attrgetter
from typing import Any

from functional_ckpt._src.format import columns
from functional_ckpt._src.format.keys import KeyPath

#: What a tensor table's ``kind`` says (:mod:`.tables` reads it back).
TABLE_KIND = "tensors"

#: The fewest entries in a row that a save writes as a table: below, a table saves
#: little, and the manifest keeps the version older readers know.
TABLE_MIN_ROWS = 32

#: The fields of a row's chunk a table holds, last, each a column of numbers this wide.
NUMBERS = (("offset", 8), ("length", 8), ("data_offset", 8), ("crc32", 4), ("hcrc32", 4))


def _row_file(e: Any, split: Mapping[KeyPath, int] | None) -> str | None:
    """The file of a tensor a table can hold (one whole chunk, no alias, no DCP path
    of its own, not split), "" for a node without batch size, else None."""
    if e.kind == "node":
        return "" if e.info is None else None
    if e.kind != "tensor" or e.alias is not None or e.dcp_path is not None or len(e.chunks) != 1:
        return None
    c = e.chunks[0]
    if c.sizes != e.shape or any(c.offsets) or c.zstd or (split and e.path in split):
        return None
    return str(c.file)


def table_runs(
    entries: Sequence[Any], split: Mapping[KeyPath, int] | None = None
) -> list[tuple[int, int]]:
    """``(start, end)`` of every run of at least :data:`TABLE_MIN_ROWS` entries a tensor table
    holds: plain tensors in one file, and the nodes between them."""
    runs: list[tuple[int, int]] = []
    start, file, tensors = 0, "", 0  # the run's first entry, its file, its tensors
    for i, e in enumerate((*entries, None)):
        got = None if e is None else _row_file(e, split)
        if got == "":  # a node joins any run
            continue
        if got is not None and (not file or got == file):
            file, tensors = got, tensors + 1
            continue
        if tensors and i - start >= TABLE_MIN_ROWS:  # the run ends before entry i
            runs.append((start, i))
        if got is None:
            start, file, tensors = i + 1, "", 0
        else:  # a tensor of another file starts a run of its own
            start, file, tensors = i, got, 1
    return runs


def table_plain(run: Sequence[Any]) -> dict[str, Any]:
    """Plain tensor and node entries as one table: each field of every row in one column."""
    tensors = [e for e in run if e.kind == "tensor"]
    chunks = [e.chunks[0] for e in tensors]
    names: dict[str, int] = {}  # each dtype's number, in order of first use
    dtype = [names.setdefault(e.dtype_name, len(names)) for e in tensors]
    return {
        "kind": TABLE_KIND,
        "file": chunks[0].file,
        "keys": [k for e in run for k in e.path],
        "path_len": columns.pack([len(e.path) for e in run], 2),
        "is_node": bytes(e.kind == "node" for e in run),
        "fqn": [e.fqn for e in tensors],
        "dtypes": list(names),
        "dtype": columns.pack(dtype, 1),
        "ndim": columns.pack([len(e.shape) for e in tensors], 1),
        "shape": columns.pack([d for e in tensors for d in e.shape], 8),
        "requires_grad": bytes(e.requires_grad for e in tensors),
    } | {k: columns.pack(map(attrgetter(k), chunks), width) for k, width in NUMBERS}
