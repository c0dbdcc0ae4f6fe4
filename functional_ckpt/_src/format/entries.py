"""One manifest entry validated: a key path, a node, a value, a tensor and its chunks.

The common, well-formed record passes checks done in line (a manifest holds tens of
thousands); any other goes through the checks that name what is wrong with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from functional_ckpt._src.format import parts as split_rule
from functional_ckpt._src.format.coverage import check_coverage, numel
from functional_ckpt._src.format.keys import KeyPath, format_path
from functional_ckpt._src.format.manifest import (
    Chunk,
    TensorEntry,
    checked_dtype_name,
    element_size,
    shape_problem,
)
from functional_ckpt._src.format.naming import DCP_METADATA
from functional_ckpt._src.format.segments import Segment
from functional_ckpt._src.limits import LIMITS
from functional_ckpt.errors import CorruptCheckpoint, UnsafeCheckpoint

#: The most bytes a zstd frame's blob may hold before its tensor's bytes (zip records).
ZSTD_HEAD = 1 << 16


@dataclass
class ParsedManifest:
    """A manifest whose entries were checked against the checkpoint's files; ``order``:
    the tree as one rank sees it."""

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

    @property
    def metadata(self) -> Any:
        return self.raw.get("metadata")


def checked_int(v: object, where: str, what: str, lo: int = 0) -> int:
    if type(v) is not int or v < lo:
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
    if not dims:
        return None
    return {"batch_size": dims} if names is None else {"batch_size": dims, "names": names}


def tensor_entry(path: KeyPath, e: dict[str, Any], out: ParsedManifest, where: str) -> TensorEntry:
    dtype = checked_dtype_name(e.get("dtype"), where)
    shape_raw = e.get("shape")
    if not isinstance(shape_raw, list) or len(shape_raw) > LIMITS.tensor_ndim:
        raise CorruptCheckpoint(f"{where}: invalid shape {shape_raw!r}")
    n = size = element_size(dtype)
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
    grad = bool(e.get("requires_grad", False))
    dcp_path = None
    if "dcp_path" in e:
        dp = e["dcp_path"]
        if (
            not isinstance(dp, list)
            or not 0 < len(dp) <= LIMITS.key_depth + 1
            or not all(isinstance(k, str) for k in dp)
            or ".".join(dp) != fqn
        ):
            raise CorruptCheckpoint(f"{where}: invalid DCP key path {dp!r}")
        dcp_path = tuple(dp)
    if "alias" in e:
        target = e["alias"]
        is_path = isinstance(target, list) and all(isinstance(k, str) for k in target)
        src = out.tensors.get(tuple(target)) if is_path else None
        if src is None or src.alias is not None:
            raise CorruptCheckpoint(f"{where}: alias of an unknown tensor {target!r}")
        if src.dtype_name != dtype or src.shape != shape:
            raise CorruptCheckpoint(f"{where}: alias spec differs from its target")
        return TensorEntry(path, fqn, dtype, shape, grad, src.chunks, src.path, dcp_path)
    if "split" in e and not out.planned:
        dim = e["split"]
        if (
            type(dim) is not int
            or not out.parts
            or not split_rule.is_even_split(shape, dim, out.parts)
        ):
            raise CorruptCheckpoint(f"{where}: invalid split {dim!r} of {format_path(path)}")
        out.split[path] = dim
        return TensorEntry(path, fqn, dtype, shape, grad, (), None, dcp_path)
    chunks = e.get("chunks")
    if not isinstance(chunks, list) or len(chunks) > LIMITS.chunks_per_tensor:
        raise CorruptCheckpoint(f"{where}: invalid chunk list")
    if out.planned:
        if chunks:
            raise CorruptCheckpoint(f"{where}: a planned tensor carries chunks")
        return TensorEntry(path, fqn, dtype, shape, grad, (), None, dcp_path)
    if len(chunks) == 1:  # the common case: one chunk, which then covers the tensor
        one = _chunk_in_line(chunks[0], shape, size, out.file_sizes)
        if one is not None:  # its bytes are its box's: as many as the tensor's, or a hole
            if one.nbytes != n:
                raise CorruptCheckpoint(
                    f"{where}: chunks of {format_path(path)} do not cover the tensor"
                )
            return TensorEntry(path, fqn, dtype, shape, grad, (one,), None, dcp_path)
    entry = TensorEntry(path, fqn, dtype, shape, grad, (), None, dcp_path)
    entry = entry.with_chunks(tuple(checked_chunk(c, entry, size, out, where) for c in chunks))
    if sum(numel(c.sizes) for c in entry.chunks) != numel(shape) or (
        numel(shape) and not entry.chunks
    ):
        raise CorruptCheckpoint(f"{where}: chunks of {format_path(path)} do not cover the tensor")
    if len(entry.chunks) > 1:
        boxes = [(c.offsets, c.sizes) for c in entry.chunks]
        check_coverage(shape, boxes, f"{where}: chunks of {format_path(path)}")
    return entry


def checked_chunk(
    c: object, entry: TensorEntry, size: int, out: ParsedManifest, where: str
) -> Chunk:
    """A chunk record checked: in line, else by :func:`_checked_chunk` (naming the fault)."""
    got = _chunk_in_line(c, entry.shape, size, out.file_sizes)
    return _checked_chunk(c, entry, size, out, where) if got is None else got


def _chunk_in_line(
    c: object, shape: tuple[int, ...], size: int, file_sizes: dict[str, int]
) -> Chunk | None:
    """The chunk of a record that passes every check of :func:`_checked_chunk` (in one
    loop, without a call per field: a manifest holds tens of thousands), else None."""
    if type(c) is dict:
        offsets = c.get("offsets")
        sizes = c.get("sizes")
        file = c.get("file")
        fields = (
            c.get("offset", -1),
            c.get("length", -1),
            c.get("data_offset", -1),
            c.get("nbytes", -1),
            c.get("crc32", -1),
            c.get("hcrc32", -1),
        )
        if (
            type(offsets) is list
            and type(sizes) is list
            and len(offsets) == len(shape) == len(sizes)
            and type(file) is str
            and file != DCP_METADATA
            and file in file_sizes
        ):
            ok = True
            expected = size
            for o, s, d in zip(offsets, sizes, shape, strict=True):
                if type(o) is not int or type(s) is not int or o < 0 or s < 0 or o + s > d:
                    ok = False
                    break
                expected *= s
            for v in fields:
                if type(v) is not int or v < 0:
                    ok = False
            offset, length, data_offset, nbytes = fields[:4]
            zstd = c.get("zstd", 0)
            if (
                ok
                and nbytes == expected
                and offset <= data_offset
                and offset + length <= file_sizes[file]
                and (
                    data_offset + nbytes <= offset + length
                    if zstd == 0
                    else zstd == 1 and data_offset - offset <= ZSTD_HEAD
                )
            ):
                return Chunk(tuple(offsets), tuple(sizes), file, *fields, zstd)
    return None


#: A chunk record's numbers, in :class:`Chunk`'s order, and their names in messages.
_FIELDS = (
    ("offset", "offset"), ("length", "length"), ("data_offset", "data offset"),
    ("nbytes", "byte count"), ("crc32", "checksum"), ("hcrc32", "checksum"), ("zstd", "transform"),
)  # fmt: skip


def _checked_chunk(
    c: object, entry: TensorEntry, size: int, out: ParsedManifest, where: str
) -> Chunk:
    if not isinstance(c, dict):
        raise CorruptCheckpoint(f"{where}: invalid chunk")
    offsets = c.get("offsets")
    sizes = c.get("sizes")
    if (
        not isinstance(offsets, list)
        or not isinstance(sizes, list)
        or len(offsets) != len(entry.shape)
        or len(sizes) != len(entry.shape)
    ):
        raise CorruptCheckpoint(f"{where}: chunk box does not match the tensor's rank")
    box_o = tuple(checked_int(v, where, "chunk offset") for v in offsets)
    box_s = tuple(checked_int(v, where, "chunk size") for v in sizes)
    if any(o + s > d for o, s, d in zip(box_o, box_s, entry.shape, strict=True)):
        raise UnsafeCheckpoint(f"{where}: a chunk of {format_path(entry.path)} lies outside it")
    file = c.get("file")
    if not isinstance(file, str) or file not in out.file_sizes or file == DCP_METADATA:
        raise CorruptCheckpoint(f"{where}: tensor stored in an unknown file {file!r}")
    fields = [checked_int(c.get(k, 0 if k == "zstd" else None), where, w) for k, w in _FIELDS]
    chunk = Chunk(box_o, box_s, file, *fields)
    expected = numel(box_s) * size
    if chunk.nbytes != expected:
        raise UnsafeCheckpoint(
            f"{where}: {format_path(entry.path)} declares {entry.spec} chunk {list(box_s)} "
            f"({expected} bytes) but records {chunk.nbytes} bytes"
        )
    if chunk.zstd > 1 or (chunk.zstd and chunk.data_offset - chunk.offset > ZSTD_HEAD):
        raise CorruptCheckpoint(f"{where}: invalid zstd frame record of {format_path(entry.path)}")
    fsize = out.file_sizes[file]
    raw_end = chunk.offset if chunk.zstd else chunk.data_offset + chunk.nbytes
    if not (chunk.offset <= chunk.data_offset and raw_end <= chunk.offset + chunk.length <= fsize):
        raise UnsafeCheckpoint(
            f"{where}: {format_path(entry.path)} declares bytes beyond the end of {file} "
            f"({fsize} bytes)"
        )
    return chunk
