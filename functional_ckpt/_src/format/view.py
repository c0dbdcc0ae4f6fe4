"""A decoded manifest validated once, and every rank's view of it.

A loader treats the manifest as untrusted input: every field is type- and
range-checked against the checkpoint's file table before a single byte is
allocated, and every rank's view (shared entries with its per-rank subtrees
spliced in) is derived from that one validation.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from functional_ckpt._src.format import parts as split_rule
from functional_ckpt._src.format.coverage import check_coverage, numel
from functional_ckpt._src.format.keys import KeyPath, format_path
from functional_ckpt._src.format.manifest import (
    Chunk,
    Entry,
    NodeEntry,
    TensorEntry,
    ValueEntry,
    checked_dtype_name,
    element_size,
    shape_problem,
)
from functional_ckpt._src.format.naming import (
    COMMIT_MARKER,
    DCP_METADATA,
    MANIFEST,
    part_name,
    safe_member,
)
from functional_ckpt._src.limits import LIMITS
from functional_ckpt.errors import CorruptCheckpoint, UnsafeCheckpoint


@dataclass
class ParsedManifest:
    """A manifest whose entries were checked against the checkpoint's files.

    ``order`` is the tree as seen by one rank: shared entries with that rank's
    per-rank subtrees spliced in where they stood.
    """

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
    planned: bool = False  # entries of a save in progress: no chunk is written yet
    inner: set[KeyPath] = field(default_factory=set)  # every proper prefix of an entry's path
    parts: int = 0  # per-rank parts of a split manifest (0: one manifest)
    split: dict[KeyPath, int] = field(default_factory=dict)  # evenly split tensors: their dim

    @property
    def metadata(self) -> Any:
        return self.raw.get("metadata")


def _int(v: object, where: str, what: str, lo: int = 0) -> int:
    if type(v) is not int or v < lo:
        raise CorruptCheckpoint(f"{where}: invalid {what} {v!r}")
    return v


def _files(manifest: dict[str, Any], root: Path, src: str) -> dict[str, int]:
    """The file table: safe names and recorded sizes.

    The files themselves were opened and checked against it (regular files of
    these sizes) when the checkpoint was opened (``storage/committed``). The marker
    and the manifest are never files of the table: a table naming them is forged.
    """
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CorruptCheckpoint(f"{src}: missing file table")
    sizes: dict[str, int] = {}
    for name, info in files.items():
        safe_member(root, name)
        if name in (COMMIT_MARKER, MANIFEST):
            raise CorruptCheckpoint(f"{src}: the file table lists {name!r}, which it may not")
        if not isinstance(info, dict):
            raise CorruptCheckpoint(f"{src}: bad entry for file {name!r}")
        sizes[name] = _int(info.get("size"), src, f"size of {name!r}")
    return sizes


def rank_entries(manifest: dict[str, Any], src: str) -> list[list[Any]]:
    ranks = manifest.get("ranks", [])
    if not isinstance(ranks, list) or not all(
        isinstance(r, dict) and isinstance(r.get("entries"), list) for r in ranks
    ):
        raise CorruptCheckpoint(f"{src}: invalid per-rank table")
    return [r["entries"] for r in ranks]


def parse_manifest(
    manifest: dict[str, Any],
    root: Path,
    *,
    rank: int | None = 0,
    parts: PartLoader | None = None,
) -> ParsedManifest:
    """Validate a decoded manifest against ``root`` and view it from ``rank``.

    ``rank`` selects whose per-rank subtrees are spliced in; None leaves them out.
    A caller that needs more than one rank's view parses once with
    :func:`parse_checkpoint` and asks it for each view.
    """
    return parse_checkpoint(manifest, root, parts=parts).view(rank)


#: Reads, authenticates and decodes part ``rank`` of a split manifest.
PartLoader = Callable[[int], Any]


@dataclass
class _Part:
    """One rank's part of a split manifest, validated: its per-rank entries, as
    decoded, and its chunk of every evenly split tensor."""

    entries: list[Any]
    chunks: dict[KeyPath, Chunk]


@dataclass
class ParsedCheckpoint:
    """A manifest validated once: the shared tree, and every rank's view derived from it.

    The shared entries are checked once; each rank's per-rank entries are checked
    the first time that rank's view is asked for. A split manifest's parts are read
    (``load_part``) and checked the first time a view needs them: a rank's own part
    for its per-rank entries, and the parts whose chunks it reads.
    """

    shared: ParsedManifest  # the view of ``rank=None``: per-rank subtrees left out
    ranks: list[list[Any]]  # each rank's per-rank entries, as decoded (one manifest)
    markers: list[tuple[int, KeyPath]]  # where in ``shared.order`` each per-rank subtree stands
    src: str
    views: dict[int, ParsedManifest] = field(default_factory=dict)
    load_part: PartLoader | None = None
    loaded: dict[int, _Part] = field(default_factory=dict)
    sparse: dict[int | None, ParsedManifest] = field(default_factory=dict)  # split chunks left out
    complete: bool = False  # every split tensor of ``shared`` holds its chunks

    @property
    def world_size(self) -> int:
        return self.shared.world_size

    def view(self, rank: int | None, parts: Iterable[int] | None = None) -> ParsedManifest:
        """The tree as ``rank`` sees it (None: without any per-rank subtree).

        With ``parts``, the evenly split tensors of a split manifest hold only the
        chunks of those parts (the ones a rank's shards meet), and no other part is
        read; without, they hold every chunk.
        """
        if parts is not None:
            return self.filled(self._sparse(rank), parts)
        self._complete()
        if rank is None:
            return self.shared
        got = self.views.get(rank)
        if got is None:
            got = self.views[rank] = self._view(rank)
        return got

    def filled(self, view: ParsedManifest, parts: Iterable[int]) -> ParsedManifest:
        """``view`` with its evenly split tensors holding the chunks of ``parts``."""
        split = self.shared.split
        if not split:
            return view
        loaded = [self.part(r).chunks for r in sorted(set(parts)) if 0 <= r < self.world_size]
        tensors = dict(view.tensors)
        for p in split:
            tensors[p] = tensors[p].with_chunks(tuple(got[p] for got in loaded))
        for p, e in view.tensors.items():
            if e.alias is not None and e.alias in split:
                tensors[p] = e.with_chunks(tensors[e.alias].chunks)
        return replace(view, tensors=tensors)

    def part(self, rank: int) -> _Part:
        """Part ``rank`` of a split manifest, read and validated once."""
        got = self.loaded.get(rank)
        if got is None:
            got = self.loaded[rank] = self._read_part(rank)
        return got

    def _sparse(self, rank: int | None) -> ParsedManifest:
        if rank is None or self.complete:
            return self.shared if rank is None else self.view(rank)
        got = self.sparse.get(rank)
        if got is None:
            got = self.sparse[rank] = self._view(rank)
        return got

    def _complete(self) -> None:
        """Give every split tensor of the shared tree all its chunks (every part read)."""
        if self.complete or not self.shared.split:
            self.complete = True
            return
        # every part's chunk is the rule's box: together they cover each tensor once
        whole = self.filled(self.shared, range(self.world_size))
        self.shared.tensors.update(whole.tensors)
        self.complete = True

    def _read_part(self, rank: int) -> _Part:
        name = part_name(rank)
        where = f"{Path(self.src).parent / name}"
        if self.load_part is None:
            raise CorruptCheckpoint(f"{where}: this reader was given no way to read it")
        if name not in self.shared.file_sizes:
            raise CorruptCheckpoint(f"{self.src}: the file table does not list {name}")
        return validated_part(self.load_part(rank), rank, self.shared, where)

    def _rank_entries(self, rank: int) -> list[Any] | None:
        """``rank``'s per-rank entries, as decoded (None: beyond the saving world)."""
        if self.shared.parts:
            return self.part(rank).entries if rank < self.shared.parts else None
        return self.ranks[rank] if rank < len(self.ranks) else None

    def all_views(self) -> list[ParsedManifest]:
        """Every saving rank's view, in rank order: ``world_size`` of them (one, the
        shared tree, for a manifest without per-rank tables)."""
        return [self.view(r) for r in range(self.world_size)]

    def groups(self) -> list[list[TensorEntry]]:
        """:func:`tensor_groups` of this manifest (shared, then each rank's own)."""
        return groups_of(self.shared, self.all_views())

    def _view(self, rank: int) -> ParsedManifest:
        base = self.shared
        out = replace(
            base,
            rank=rank,
            order=[],
            tensors=dict(base.tensors),
            values=dict(base.values),
            nodes=set(base.nodes),
            node_info=dict(base.node_info),
            inner=set(base.inner),
            split=dict(base.split),
        )
        mine = self._rank_entries(rank)
        if mine is None:
            out.order = list(base.order)
            return out
        src = (
            f"{Path(self.src).parent / part_name(rank)}"
            if base.parts
            else f"{self.src} rank {rank}"
        )
        prev = 0
        for pos, path in self.markers:
            out.order += base.order[prev:pos]
            prev = pos
            for j, sub in enumerate(mine):
                wsub = f"{src} entry {j}"
                p = _path(sub, wsub) if isinstance(sub, dict) else ()
                if p[: len(path)] == path:
                    _add(out, sub, wsub)
        out.order += base.order[prev:]
        if len(out.split) != len(base.split):
            raise CorruptCheckpoint(f"{src}: a per-rank tensor declares a split")
        return out


def parse_checkpoint(
    manifest: dict[str, Any], root: Path, *, parts: PartLoader | None = None
) -> ParsedCheckpoint:
    """Validate a decoded manifest against the directory ``root`` it came from, once.

    ``parts`` reads a split manifest's parts, when a view needs them.
    """
    src = str(root / "manifest.msgpack")
    out = ParsedManifest(manifest)
    out.parts = _parts_count(manifest, src)
    order = manifest.get("byteorder", "little")
    if order != sys.byteorder:
        raise CorruptCheckpoint(
            f"{src}: tensor bytes are {order}-endian; this machine is {sys.byteorder}-endian"
        )
    out.file_sizes = _files(manifest, root, src)
    root_record = manifest.get("root", {})
    if not isinstance(root_record, dict):
        raise CorruptCheckpoint(f"{src}: invalid root record")
    out.root = node_info(root_record, f"{src} root")
    entries = manifest.get("entries")
    if not isinstance(entries, list):
        raise CorruptCheckpoint(f"{src}: missing entries")
    ranks = [] if out.parts else rank_entries(manifest, src)
    out.world_size = out.parts or max(1, len(ranks))
    markers: list[tuple[int, KeyPath]] = []
    for i, e in enumerate(entries):
        where = f"{src} entry {i}"
        if isinstance(e, dict) and e.get("kind") == "per_rank":
            path = _path(e, where)
            out.per_rank_roots.append(path)
            markers.append((len(out.order), path))
            continue
        _add(out, e, where)
    return ParsedCheckpoint(out, ranks, markers, src, load_part=parts)


def _parts_count(manifest: dict[str, Any], src: str) -> int:
    """How many per-rank parts a split manifest has (0: one manifest)."""
    n = manifest.get("parts", 0)
    if n == 0:
        return 0
    if type(n) is not int or not 2 <= n <= LIMITS.chunks_per_tensor:
        raise CorruptCheckpoint(f"{src}: invalid number of manifest parts {n!r}")
    return n


def validated_part(raw: object, rank: int, shared: ParsedManifest, where: str) -> _Part:
    """Validate part ``rank`` of a split manifest (decoded) against its index's tree.

    It holds one row per evenly split tensor, in the index's order: that chunk's
    box follows from the rule, the rest is checked as any chunk is.
    """
    if not isinstance(raw, dict) or raw.get("part") != rank:
        raise CorruptCheckpoint(f"{where}: not part {rank} of this manifest")
    entries = raw.get("entries")
    rows = raw.get("chunks")
    split = shared.split
    if not isinstance(entries, list):
        raise CorruptCheckpoint(f"{where}: missing per-rank entries")
    if not isinstance(rows, list) or len(rows) != len(split):
        raise CorruptCheckpoint(
            f"{where}: {len(rows) if isinstance(rows, list) else 'no'} chunk rows for "
            f"{len(split)} split tensors"
        )
    chunks: dict[KeyPath, Chunk] = {}
    for i, (values, (p, dim)) in enumerate(zip(rows, split.items(), strict=True)):
        entry = shared.tensors[p]
        box = split_rule.split_box(entry.shape, dim, shared.parts, rank)
        plain = split_rule.row_plain(values, box)
        if plain is None:
            raise CorruptCheckpoint(f"{where}: invalid chunk row {i} ({format_path(p)})")
        chunks[p] = _chunk(plain, entry, element_size(entry.dtype_name), shared, f"{where} row {i}")
    return _Part(entries, chunks)


def parse_planned(plain: object, where: str) -> list[Entry]:
    """Entries of a save in progress from their plain form (``to_plain``), by the one parser.

    Ranks exchange their per-rank entries before any chunk is written, so the
    tensors carry no chunks yet; everything else is validated as on load.
    """
    if not isinstance(plain, list):
        raise CorruptCheckpoint(f"{where}: not a list of entries")
    out = ParsedManifest({}, planned=True)
    for i, e in enumerate(plain):
        _add(out, e, f"{where} entry {i}")
    entries: list[Entry] = []
    for path, kind in out.order:
        if kind == "node":
            entries.append(NodeEntry(path, out.node_info.get(path)))
        elif kind == "value":
            entries.append(ValueEntry(path, out.values[path]))
        else:
            entries.append(out.tensors[path])
    return entries


def parsed_groups(manifest: dict[str, Any], root: Path) -> list[list[TensorEntry]]:
    """:func:`tensor_groups` of a decoded manifest, each entry validated."""
    return parse_checkpoint(manifest, root).groups()


def groups_of(shared: ParsedManifest, ranks: Sequence[ParsedManifest]) -> list[list[TensorEntry]]:
    """:func:`tensor_groups` from ``parse`` results: ``rank=None``, then every rank's."""
    groups = [list(shared.tensors.values())]
    for one in ranks:
        groups.append([e for p, e in one.tensors.items() if p not in shared.tensors])
    return groups


def _path(e: dict[str, Any], where: str) -> KeyPath:
    p = e.get("path")
    if type(p) is list and 0 < len(p) <= LIMITS.key_depth:  # in line, the common case
        for k in p:
            if type(k) is not str:
                break
        else:
            return tuple(p)
    if (
        not isinstance(p, list)
        or not p
        or len(p) > LIMITS.key_depth
        or not all(isinstance(k, str) for k in p)
    ):
        raise CorruptCheckpoint(f"{where}: invalid key path {p!r}")
    return tuple(p)


def _add(out: ParsedManifest, e: object, where: str) -> None:
    if not isinstance(e, dict):
        raise CorruptCheckpoint(f"{where}: not a mapping")
    path = _path(e, where)
    if path in out.tensors or path in out.values or path in out.nodes:
        raise CorruptCheckpoint(f"{where}: duplicate key {format_path(path)}")
    kind = e.get("kind")
    # a leaf has nothing under it: a key under a tensor or a value would hide it
    parent = path[:-1]
    if parent and parent not in out.inner:  # first key seen below ``parent``
        for i in range(1, len(path)):
            if path[:i] in out.tensors or path[:i] in out.values:
                raise CorruptCheckpoint(
                    f"{where}: key {format_path(path)} lies under the leaf {format_path(path[:i])}"
                )
        out.inner.update(path[:i] for i in range(1, len(path)))
    if kind in ("tensor", "value") and path in out.inner:
        raise CorruptCheckpoint(f"{where}: the leaf {format_path(path)} has keys under it")
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
        out.tensors[path] = _tensor_entry(path, e, out, where)
    else:
        raise CorruptCheckpoint(f"{where}: unknown entry kind {kind!r}")
    out.order.append((path, kind))


def node_info(e: dict[str, Any], where: str) -> dict[str, Any] | None:
    """A node's batch size and dimension names; None for ``batch_size=[]`` (older manifests)."""
    size = e.get("batch_size", [])
    names = e.get("names")
    if not isinstance(size, list) or len(size) > 64:
        raise CorruptCheckpoint(f"{where}: invalid batch size {size!r}")
    dims = [_int(d, where, "batch dimension") for d in size]
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


def _tensor_entry(path: KeyPath, e: dict[str, Any], out: ParsedManifest, where: str) -> TensorEntry:
    dtype = checked_dtype_name(e.get("dtype"), where)
    shape_raw = e.get("shape")
    if not isinstance(shape_raw, list) or len(shape_raw) > LIMITS.tensor_ndim:
        raise CorruptCheckpoint(f"{where}: invalid shape {shape_raw!r}")
    n = size = element_size(dtype)
    extent = LIMITS.tensor_extent
    big = False
    for d in shape_raw:  # in line: a manifest holds tens of thousands of shapes
        if type(d) is not int or d < 0:
            _int(d, where, "dimension")
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
    entry = entry.with_chunks(tuple(_chunk(c, entry, size, out, where) for c in chunks))
    if sum(numel(c.sizes) for c in entry.chunks) != numel(shape) or (
        numel(shape) and not entry.chunks
    ):
        raise CorruptCheckpoint(f"{where}: chunks of {format_path(path)} do not cover the tensor")
    if len(entry.chunks) > 1:
        boxes = [(c.offsets, c.sizes) for c in entry.chunks]
        check_coverage(shape, boxes, f"{where}: chunks of {format_path(path)}")
    return entry


def _chunk(c: object, entry: TensorEntry, size: int, out: ParsedManifest, where: str) -> Chunk:
    """A chunk record checked; a record that passes every check in line is built at
    once, any other goes through :func:`_checked_chunk`, which names what is wrong."""
    got = _chunk_in_line(c, entry.shape, size, out.file_sizes)
    return _checked_chunk(c, entry, size, out, where) if got is None else got


def _chunk_in_line(
    c: object, shape: tuple[int, ...], size: int, file_sizes: dict[str, int]
) -> Chunk | None:
    """The chunk of a record that passes every check of :func:`_checked_chunk`, else None.

    Tens of thousands of chunks are checked in one loop here, without a call per
    field; a record this refuses is judged (and named) by :func:`_checked_chunk`.
    """
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
            offset, length, data_offset, nbytes, crc, hcrc = fields
            if (
                ok
                and nbytes == expected
                and offset <= data_offset
                and data_offset + nbytes <= offset + length <= file_sizes[file]
            ):
                return Chunk(
                    tuple(offsets),
                    tuple(sizes),
                    file,
                    offset,
                    length,
                    data_offset,
                    nbytes,
                    crc,
                    hcrc,
                )
    return None


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
    box_o = tuple(_int(v, where, "chunk offset") for v in offsets)
    box_s = tuple(_int(v, where, "chunk size") for v in sizes)
    if any(o + s > d for o, s, d in zip(box_o, box_s, entry.shape, strict=True)):
        raise UnsafeCheckpoint(f"{where}: a chunk of {format_path(entry.path)} lies outside it")
    file = c.get("file")
    if not isinstance(file, str) or file not in out.file_sizes or file == DCP_METADATA:
        raise CorruptCheckpoint(f"{where}: tensor stored in an unknown file {file!r}")
    chunk = Chunk(
        box_o,
        box_s,
        file,
        _int(c.get("offset"), where, "offset"),
        _int(c.get("length"), where, "length"),
        _int(c.get("data_offset"), where, "data offset"),
        _int(c.get("nbytes"), where, "byte count"),
        _int(c.get("crc32"), where, "checksum"),
        _int(c.get("hcrc32"), where, "checksum"),
    )
    expected = numel(box_s) * size
    if chunk.nbytes != expected:
        raise UnsafeCheckpoint(
            f"{where}: {format_path(entry.path)} declares {entry.spec} chunk {list(box_s)} "
            f"({expected} bytes) but records {chunk.nbytes} bytes"
        )
    fsize = out.file_sizes[file]
    if not (
        chunk.offset <= chunk.data_offset
        and chunk.data_offset + chunk.nbytes <= chunk.offset + chunk.length <= fsize
    ):
        raise UnsafeCheckpoint(
            f"{where}: {format_path(entry.path)} declares bytes beyond the end of {file} "
            f"({fsize} bytes)"
        )
    return chunk
