"""Manifest entries validated: key paths, nodes, values, tensors, chunks and tensor tables.

A well-formed record passes checks done in line (a manifest holds tens of thousands);
any other goes through the checks that name what is wrong with it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from functional_ckpt._src.codec.table import DTYPE_ALIASES, DTYPE_SIZES
from functional_ckpt._src.format import columns
from functional_ckpt._src.format import parts as split_rule
from functional_ckpt._src.format.keys import KeyPath, format_path
from functional_ckpt._src.format.manifest import Chunk, TensorEntry, shape_problem
from functional_ckpt._src.format.naming import DCP_METADATA
from functional_ckpt._src.format.segments import Segment
from functional_ckpt._src.format.table_rows import NUMBERS, TABLE_KIND
from functional_ckpt._src.limits import LIMITS
from functional_ckpt.errors import CorruptCheckpoint, UnsafeCheckpoint

#: The most bytes a zstd frame's blob may hold before its tensor's bytes (zip records).
ZSTD_HEAD = 1 << 16


@dataclass
class ParsedManifest:
    """A manifest checked against the checkpoint's files; ``order``: the tree one rank sees."""

    raw: dict[str, Any]
    rank: int = 0
    world_size: int = 1
    order: list[tuple[KeyPath, str]] = field(default_factory=list)  # (path, kind)
    tensors: dict[KeyPath, TensorEntry] = field(default_factory=dict)
    values: dict[KeyPath, Any] = field(default_factory=dict)
    nodes: set[KeyPath] = field(default_factory=set)
    node_info: dict[KeyPath, dict[str, Any]] = field(default_factory=dict)  # batch size, names
    root: dict[str, Any] | None = None  # the root's batch size and names, if batched
    per_rank_roots: list[KeyPath] = field(default_factory=list)
    file_sizes: dict[str, int] = field(default_factory=dict)
    segments: dict[str, tuple[Segment, ...]] = field(default_factory=dict)  # run checksums
    planned: bool = False  # entries of a save in progress: no chunk is written yet
    inner: set[KeyPath] = field(default_factory=set)  # every proper prefix of an entry's path
    parts: int = 0  # per-rank parts of a split manifest (0: one manifest)
    split: dict[KeyPath, int] = field(default_factory=dict)  # evenly split tensors: their dim


def check_coverage(
    shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]], what: str
) -> None:
    """Every element of a tensor of ``shape`` lies in exactly one box (a reader that trusted
    the boxes could return a hole, or pick one of two overlapping writes): no cell of the
    grid the box boundaries cut is filled twice, and the element counts leave none empty."""
    boxes = [(o, s) for o, s in boxes if math.prod(s)]  # empty boxes cover nothing
    if len(boxes) <= 1:
        return
    cuts = []
    for i, dim in enumerate(shape):
        starts = {o[i] for o, _ in boxes}
        cuts.append(sorted({0, dim, *starts, *(o[i] + s[i] for o, s in boxes)}))
    counts = [len(b) - 1 for b in cuts]
    cells = math.prod(counts)
    if cells > LIMITS.coverage_cells:
        raise UnsafeCheckpoint(
            f"{what} ({len(boxes)}) cut the tensor into {cells} pieces (at most "
            f"{LIMITS.coverage_cells} can be checked); not a layout any writer produces"
        )
    index = [{v: j for j, v in enumerate(b)} for b in cuts]
    strides = [math.prod(counts[i + 1 :]) for i in range(len(counts))]
    grid = bytearray(cells)  # one byte per cell, C order: filled or not
    filled = b"\x01"
    for offsets, sizes in boxes:
        spans = [
            range(index[i][o], index[i][o + s])
            for i, (o, s) in enumerate(zip(offsets, sizes, strict=True))
        ]
        lead, last = (spans[:-1], spans[-1]) if spans else ([], range(1))
        for cell in itertools.product(*lead):  # each row of the box along the last dimension
            start = sum(j * k for j, k in zip(cell, strides, strict=False)) + last.start
            end = start + len(last)
            if grid.find(filled, start, end) != -1:
                raise CorruptCheckpoint(
                    f"{what} overlap at offsets {list(offsets)}; the checkpoint is damaged"
                )
            grid[start:end] = filled * (end - start)


def checked_dtype_name(name: object, where: str) -> str:
    """The name a manifest gives a dtype, if the format knows it (aliases such as ``float`` too)."""
    if isinstance(name, str):
        name = DTYPE_ALIASES.get(name, name)
        if name in DTYPE_SIZES:
            return name
    raise CorruptCheckpoint(f"{where}: unknown dtype {name!r}")


def checked_int(v: object, where: str, what: str) -> int:
    if type(v) is not int or v < 0:
        raise CorruptCheckpoint(f"{where}: invalid {what} {v!r}")
    return v


def entry_path(e: dict[str, Any], where: str) -> KeyPath:
    p = e.get("path")
    if type(p) is list and 0 < len(p) <= LIMITS.key_depth:  # in line, the common case
        for k in p:
            if type(k) is not str:
                break
        else:
            return tuple(p)
    raise CorruptCheckpoint(f"{where}: invalid key path {p!r}")


def claim(out: ParsedManifest, path: KeyPath, leaf: bool, where: str) -> None:
    """Take ``path`` for a new entry (a ``leaf``: a tensor or a value): no other entry
    has it, and no leaf hides keys under it."""
    if path in out.tensors or path in out.values or path in out.nodes:
        raise CorruptCheckpoint(f"{where}: duplicate key {format_path(path)}")
    parent = path[:-1]
    if parent and parent not in out.inner:  # first key seen below ``parent``
        for i in range(1, len(path)):
            if path[:i] in out.tensors or path[:i] in out.values:
                raise CorruptCheckpoint(
                    f"{where}: key {format_path(path)} lies under the leaf {format_path(path[:i])}"
                )
        out.inner.update(path[:i] for i in range(1, len(path)))
    if leaf and path in out.inner:
        raise CorruptCheckpoint(f"{where}: the leaf {format_path(path)} has keys under it")


def add_entry(out: ParsedManifest, e: object, where: str) -> None:
    if not isinstance(e, dict):
        raise CorruptCheckpoint(f"{where}: not a mapping")
    path = entry_path(e, where)
    kind = e.get("kind")
    claim(out, path, kind in ("tensor", "value"), where)
    if kind == "node":
        out.nodes.add(path)
        info = node_info(e, where)
        if info is not None:
            out.node_info[path] = info
    elif kind == "value":
        if "value" not in e:
            raise CorruptCheckpoint(f"{where}: value entry without a value")
        out.values[path] = e["value"]
    elif kind == "tensor":
        out.tensors[path] = tensor_entry(path, e, out, where)
    else:
        raise CorruptCheckpoint(f"{where}: unknown entry kind {kind!r}")
    out.order.append((path, kind))


def node_info(e: dict[str, Any], where: str) -> dict[str, Any] | None:
    """A node's batch size and dimension names; None for ``batch_size=[]`` (older manifests)."""
    size = e.get("batch_size", [])
    names = e.get("names")
    if not isinstance(size, list) or len(size) > 64:
        raise CorruptCheckpoint(f"{where}: invalid batch size {size!r}")
    dims = [checked_int(d, where, "batch dimension") for d in size]
    if len(dims) > LIMITS.tensor_ndim or any(d >= LIMITS.tensor_extent for d in dims):
        raise UnsafeCheckpoint(f"{where}: impossible batch size {dims}")
    if names is not None and (
        not isinstance(names, list)
        or len(names) != len(dims)
        or not all(n is None or isinstance(n, str) for n in names)
    ):
        raise CorruptCheckpoint(f"{where}: invalid dimension names {names!r}")
    return None if not dims else {"batch_size": dims} | ({} if names is None else {"names": names})


def tensor_entry(path: KeyPath, e: dict[str, Any], out: ParsedManifest, where: str) -> TensorEntry:
    dtype = checked_dtype_name(e.get("dtype"), where)
    shape_raw = e.get("shape")
    if not isinstance(shape_raw, list) or len(shape_raw) > LIMITS.tensor_ndim:
        raise CorruptCheckpoint(f"{where}: invalid shape {shape_raw!r}")
    n = DTYPE_SIZES[dtype]
    extent = LIMITS.tensor_extent
    big = False
    for d in shape_raw:  # in line: a manifest holds tens of thousands of shapes
        if type(d) is not int or d < 0:
            checked_int(d, where, "dimension")
        big = big or d >= extent
        n *= d
    shape = tuple(shape_raw)
    if (big or n >= extent) and shape_problem(shape, dtype) is not None:
        raise UnsafeCheckpoint(f"{where}: {format_path(path)} declares an impossible shape")
    fqn = e.get("fqn")
    if not isinstance(fqn, str):
        raise CorruptCheckpoint(f"{where}: invalid DCP key {fqn!r}")
    dcp_path = e.get("dcp_path")
    if "dcp_path" in e:
        if (
            not isinstance(dcp_path, list)
            or not 0 < len(dcp_path) <= LIMITS.key_depth + 1
            or not all(isinstance(k, str) for k in dcp_path)
            or ".".join(dcp_path) != fqn
        ):
            raise CorruptCheckpoint(f"{where}: invalid DCP key path {dcp_path!r}")
        dcp_path = tuple(dcp_path)
    grad = bool(e.get("requires_grad", False))
    entry = TensorEntry(path, fqn, dtype, shape, grad, (), None, dcp_path)
    if "alias" in e:
        target = e["alias"]
        is_path = isinstance(target, list) and all(isinstance(k, str) for k in target)
        src = out.tensors.get(tuple(target)) if is_path else None
        if src is None or src.alias is not None:
            raise CorruptCheckpoint(f"{where}: alias of an unknown tensor {target!r}")
        if src.dtype_name != dtype or src.shape != shape:
            raise CorruptCheckpoint(f"{where}: alias spec differs from its target")
        return entry._replace(chunks=src.chunks, alias=src.path)
    if "split" in e and not out.planned:
        dim = e["split"]
        if type(dim) is not int or not split_rule.is_even_split(shape, dim, out.parts):
            raise CorruptCheckpoint(f"{where}: invalid split {dim!r} of {format_path(path)}")
        out.split[path] = dim
        return entry
    chunks = e.get("chunks")
    if not isinstance(chunks, list) or len(chunks) > LIMITS.chunks_per_tensor:
        raise CorruptCheckpoint(f"{where}: invalid chunk list")
    if out.planned:
        if chunks:
            raise CorruptCheckpoint(f"{where}: a planned tensor carries chunks")
        return entry
    if len(chunks) == 1 and (one := checked_chunk(chunks[0], entry, out, where)).nbytes == n:
        return entry.with_chunks((one,))  # the common case: one chunk, covering the tensor
    found = tuple([checked_chunk(c, entry, out, where) for c in chunks])
    if sum([c.nbytes for c in found]) != n:  # the boxes' bytes: the tensor's, or a hole
        raise CorruptCheckpoint(f"{where}: chunks of {format_path(path)} do not cover the tensor")
    if len(found) > 1:
        boxes = [(c.offsets, c.sizes) for c in found]
        check_coverage(shape, boxes, f"{where}: chunks of {format_path(path)}")
    return entry.with_chunks(found)


#: A chunk record's numbers, in :class:`Chunk`'s order, and their names in messages.
_FIELDS = (
    ("offset", "offset"), ("length", "length"), ("data_offset", "data offset"),
    ("nbytes", "byte count"), ("crc32", "checksum"), ("hcrc32", "checksum"), ("zstd", "transform"),
)  # fmt: skip
_NUMBERS = tuple(k for k, _ in _FIELDS[:6])  # ``zstd`` may be left out: 0


def checked_chunk(c: object, entry: TensorEntry, out: ParsedManifest, where: str) -> Chunk:
    """A chunk record checked in line, every fault named."""
    if type(c) is not dict:
        raise CorruptCheckpoint(f"{where}: invalid chunk")
    offsets, sizes, shape = c.get("offsets"), c.get("sizes"), entry.shape
    if (
        type(offsets) is not list
        or type(sizes) is not list
        or not len(offsets) == len(shape) == len(sizes)
    ):
        raise CorruptCheckpoint(f"{where}: chunk box does not match the tensor's rank")
    expected = DTYPE_SIZES[entry.dtype_name]
    for o, s, d in zip(offsets, sizes, shape, strict=True):
        if type(o) is not int or type(s) is not int or o < 0 or s < 0 or o + s > d:
            for v in offsets:
                checked_int(v, where, "chunk offset")
            for v in sizes:
                checked_int(v, where, "chunk size")
            raise UnsafeCheckpoint(f"{where}: a chunk of {format_path(entry.path)} lies outside it")
        expected *= s
    file = c.get("file")
    if type(file) is not str or file not in out.file_sizes or file == DCP_METADATA:
        raise CorruptCheckpoint(f"{where}: tensor stored in an unknown file {file!r}")
    fields = (*map(c.get, _NUMBERS), c.get("zstd", 0))
    offset, length, data_offset, nbytes, _, _, zstd = fields
    for v in fields:
        if type(v) is not int or v < 0:  # named: the first field at fault
            for x, (_, what) in zip(fields, _FIELDS, strict=True):
                checked_int(x, where, what)
    if nbytes != expected:
        raise UnsafeCheckpoint(
            f"{where}: {format_path(entry.path)} declares {entry.spec} chunk {sizes} "
            f"({expected} bytes) but records {nbytes} bytes"
        )
    if zstd > 1 or (zstd and data_offset - offset > ZSTD_HEAD):
        raise CorruptCheckpoint(f"{where}: invalid zstd frame record of {format_path(entry.path)}")
    fsize = out.file_sizes[file]
    raw_end = offset if zstd else data_offset + nbytes
    if not (offset <= data_offset and raw_end <= offset + length <= fsize):
        raise UnsafeCheckpoint(
            f"{where}: {format_path(entry.path)} declares bytes beyond the end of {file} "
            f"({fsize} bytes)"
        )
    return tuple.__new__(Chunk, (tuple(offsets), tuple(sizes), file, *fields))


#: A tensor table's fields (``table_rows.table_plain``): many plain tensors and nodes,
#: each field of every row a column, decoded as a few byte strings and checked in bulk.
_TABLE_FIELDS = frozenset({
    "kind", "file", "keys", "path_len", "is_node", "fqn", "dtypes", "dtype", "ndim", "shape",
    "requires_grad", *(k for k, _ in NUMBERS),
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
    if out.planned or set(t) != _TABLE_FIELDS:
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
    sizes = [DTYPE_SIZES[d] for d in names]
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
        *(columns.unpack(t[k], width, m, f"{where} {k}") for k, width in NUMBERS),
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
        shape = (dims[j],) if nd == 1 else tuple(dims[j : j + nd])
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
