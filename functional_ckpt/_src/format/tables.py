"""A tensor table read back: many plain tensor entries, each field a column, checked in bulk.

Ten thousand small tensors then decode as a few byte strings, not a hundred thousand
containers; every row is held to the checks of a tensor entry of its own (:mod:`.entries`).
"""

from __future__ import annotations

from typing import Any

from functional_ckpt._src.format import columns
from functional_ckpt._src.format.entries import ParsedManifest, claim
from functional_ckpt._src.format.keys import format_path
from functional_ckpt._src.format.manifest import (
    Chunk,
    TensorEntry,
    checked_dtype_name,
    element_size,
    shape_problem,
)
from functional_ckpt._src.format.naming import DCP_METADATA
from functional_ckpt._src.format.table_rows import TABLE_KIND
from functional_ckpt._src.limits import LIMITS
from functional_ckpt.errors import CorruptCheckpoint, UnsafeCheckpoint

_FIELDS = frozenset({
    "kind", "file", "keys", "path_len", "is_node", "fqn", "dtypes", "dtype", "ndim", "shape",
    "requires_grad", "offset", "length", "data_offset", "crc32", "hcrc32",
})  # fmt: skip

_ZEROS = tuple((0,) * n for n in range(LIMITS.tensor_ndim + 1))


def is_table(e: object) -> bool:
    return type(e) is dict and e.get("kind") == TABLE_KIND


def _strings(raw: object, what: str, where: str) -> list[str]:
    if type(raw) is not list or not set(map(type, raw)) <= {str}:
        raise CorruptCheckpoint(f"{where}: invalid {what}")
    return raw


def add_table(out: ParsedManifest, t: dict[str, Any], where: str) -> None:
    """Add every row of table ``t`` to ``out`` (a node, or a tensor entry), in order."""
    if out.planned or set(t) != _FIELDS:
        raise CorruptCheckpoint(f"{where}: invalid tensor table (fields {sorted(map(str, t))})")
    file = t["file"]
    if type(file) is not str or file == DCP_METADATA or file not in out.file_sizes:
        raise CorruptCheckpoint(f"{where}: tensor table stored in an unknown file {file!r}")
    fsize = out.file_sizes[file]
    keys = _strings(t["keys"], "key paths", where)
    is_node = t["is_node"]
    if type(is_node) is not bytes or not is_node or max(is_node) > 1:
        raise CorruptCheckpoint(f"{where}: invalid is_node column")
    n = len(is_node)
    path_len = columns.unpack(t["path_len"], 2, n, f"{where} path_len")
    if sum(path_len) != len(keys) or not 0 < min(path_len) <= max(path_len) <= LIMITS.key_depth:
        raise CorruptCheckpoint(f"{where}: invalid key path lengths")
    fqns = _strings(t["fqn"], "DCP keys", where)
    m = len(fqns)
    if m != n - sum(is_node) or not m:
        raise CorruptCheckpoint(f"{where}: {m} DCP keys for {n - sum(is_node)} tensor rows")
    names = [checked_dtype_name(d, where) for d in _strings(t["dtypes"], "dtypes", where)]
    sizes = [element_size(d) for d in names]
    dtype = columns.unpack(t["dtype"], 1, m, f"{where} dtype")
    ndim = columns.unpack(t["ndim"], 1, m, f"{where} ndim")
    grad = columns.unpack(t["requires_grad"], 1, m, f"{where} requires_grad")
    if max(ndim) > LIMITS.tensor_ndim or max(dtype) >= len(names) or max(grad) > 1:
        raise CorruptCheckpoint(f"{where}: invalid dtype, rank or requires_grad column")
    dims = columns.unpack(t["shape"], 8, sum(ndim), f"{where} shape")
    tensor_rows = zip(
        ndim,
        dtype,
        grad,
        fqns,
        columns.unpack(t["offset"], 8, m, f"{where} offset"),
        columns.unpack(t["length"], 8, m, f"{where} length"),
        columns.unpack(t["data_offset"], 8, m, f"{where} data_offset"),
        columns.unpack(t["crc32"], 4, m, f"{where} crc32"),
        columns.unpack(t["hcrc32"], 4, m, f"{where} hcrc32"),
        strict=True,
    )
    extent = LIMITS.tensor_extent
    new = tuple.__new__  # a chunk and an entry per row: made without their __new__
    tensors, values, nodes, inner, order = out.tensors, out.values, out.nodes, out.inner, out.order
    k = j = 0
    for i, (p, node) in enumerate(zip(path_len, is_node, strict=True)):
        path = (keys[k],) if p == 1 else tuple(keys[k : k + p])
        k += p
        if (
            path in tensors
            or path in values
            or path in nodes
            or (not node and path in inner)
            or (p > 1 and path[:-1] not in inner)
        ):  # a key taken, or the first below its parent: the whole check
            claim(out, path, not node, f"{where} row {i}")
        if node:
            nodes.add(path)
            order.append((path, "node"))
            continue
        nd, d, g, fqn, off, ln, doff, c, h = next(tensor_rows)
        if nd == 1:  # most tensors of a table: biases, norms, optimizer moments
            x = dims[j]
            shape: tuple[int, ...] = (x,)
            nbytes = sizes[d] * x
            big = x >= extent
        else:
            shape = tuple(dims[j : j + nd])
            nbytes = sizes[d]
            big = False
            for x in shape:
                big = big or x >= extent
                nbytes *= x
        j += nd
        if (big or nbytes >= extent) and shape_problem(shape, names[d]) is not None:
            raise UnsafeCheckpoint(
                f"{where} row {i}: {format_path(path)} declares an impossible shape"
            )
        if not (off <= doff and doff + nbytes <= off + ln <= fsize):
            raise UnsafeCheckpoint(
                f"{where} row {i}: {format_path(path)} declares bytes beyond the end of "
                f"{file} ({fsize} bytes)"
            )
        chunk = new(Chunk, (_ZEROS[nd], shape, file, off, ln, doff, nbytes, c, h, 0))
        tensors[path] = new(TensorEntry, (path, fqn, names[d], shape, g == 1, (chunk,), None, None))
        order.append((path, "tensor"))
