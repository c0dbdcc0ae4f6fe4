"""The manifest model: the entries a save writes and the manifest they make (the one
place that knows the tree); :mod:`.view` returns these classes once validated.
"""

from __future__ import annotations

import math
import operator
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import msgpack

from functional_ckpt._src import codec
from functional_ckpt._src.codec import table
from functional_ckpt._src.format import naming
from functional_ckpt._src.format import parts as split_rule
from functional_ckpt._src.format.checksum import crc32
from functional_ckpt._src.format.dcp_values import ByteEntry
from functional_ckpt._src.format.keys import KeyPath
from functional_ckpt._src.format.table_rows import table_plain, table_runs
from functional_ckpt._src.limits import LIMITS
from functional_ckpt.errors import CorruptCheckpoint

if TYPE_CHECKING:
    import torch

    from functional_ckpt._src.format.packed_rows import Spliced  # numpy: a writer's import


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """The ``torch.dtype`` of a checked name: made where a tensor is (torch is imported then)."""
    try:
        return table.TORCH_DTYPES[name]
    except KeyError:
        import torch

        raise CorruptCheckpoint(
            f"dtype {name!r} is not known to this torch ({torch.__version__})"
        ) from None


def shape_problem(shape: Sequence[int], dtype: str) -> str | None:
    """Why a tensor of this shape and dtype (its name) lies beyond the format's limits, or None."""
    if len(shape) > LIMITS.tensor_ndim:
        return f"{len(shape)} dimensions (the format allows at most {LIMITS.tensor_ndim})"
    extent = LIMITS.tensor_extent
    if any(d >= extent for d in shape):
        return f"a dimension of {max(shape)} (each must be below 2**{extent.bit_length() - 1})"
    if math.prod(shape) * table.DTYPE_SIZES[dtype] >= extent:
        return (
            f"shape {list(shape)} of {dtype} "
            f"(the element count times the element size must be below "
            f"2**{extent.bit_length() - 1})"
        )
    return None


class Chunk(NamedTuple):
    """One stored piece of a tensor: a box of the global tensor, where its bytes are, checksums."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str = ""
    offset: int = 0  # blob start (what DCP's ``_StorageInfo`` points at)
    length: int = 0  # blob length
    data_offset: int = 0  # absolute offset of the raw bytes, C order of ``sizes``
    nbytes: int = 0
    crc32: int = 0  # CRC32 of the raw bytes
    hcrc32: int = 0  # CRC32 of the blob's other bytes (of its stored frame, when ``zstd``)
    zstd: int = 0  # 1: stored as one zstd frame, DCP's ``stream.zstd/1`` (``storage/zstd``)

    @property
    def whole(self) -> bool:
        return not any(self.offsets)

    @property
    def transforms(self) -> list[str] | None:
        """DCP's ``_StorageInfo.transform_descriptors``: None (left out) for a plain blob."""
        return ["stream.zstd/1"] if self.zstd else None

    def to_plain(self) -> dict[str, Any]:
        out = self._asdict() | {"offsets": list(self.offsets), "sizes": list(self.sizes)}
        if not self.zstd:
            del out["zstd"]
        return out


class TensorEntry(NamedTuple):
    """A tensor of the tree: spec, DCP key and chunks (an alias holds its target's, for
    ``.metadata``); the dtype by name, so what reads a manifest needs no torch."""

    path: KeyPath
    fqn: str
    dtype_name: str
    shape: tuple[int, ...]
    requires_grad: bool
    chunks: tuple[Chunk, ...] = ()
    alias: KeyPath | None = None
    dcp_path: KeyPath | None = None  # DCP's object path of ``fqn``, when not ``path``

    @property
    def kind(self) -> str:
        return "tensor"

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype_name)

    @property
    def spec(self) -> str:
        return f"{self.dtype_name}{list(self.shape)}"

    def with_chunks(self, chunks: tuple[Chunk, ...]) -> TensorEntry:
        # a save and a restore make one per tensor: without the named tuple's __new__
        return tuple.__new__(TensorEntry, (*self[:5], chunks, *self[6:]))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * table.DTYPE_SIZES[self.dtype_name]

    def to_plain(self, split: int | None = None) -> dict[str, Any]:
        """The plain entry (``split``: an evenly split tensor's dimension, for its chunks)."""
        out: dict[str, Any] = {
            "path": list(self.path),
            "kind": "tensor",
            "fqn": self.fqn,
            "dtype": self.dtype_name,
            "shape": list(self.shape),
            "requires_grad": self.requires_grad,
        }
        if self.dcp_path is not None:
            out["dcp_path"] = list(self.dcp_path)
        if self.alias is not None:
            out["alias"] = list(self.alias)
        elif split is not None:
            out["split"] = split
        else:
            out["chunks"] = [c.to_plain() for c in self.chunks]
        return out


@dataclass(frozen=True, slots=True)
class NodeEntry:
    """A sub-tree; ``info`` holds its batch size and dimension names when batched."""

    path: KeyPath
    info: dict[str, Any] | None = None
    kind: ClassVar[str] = "node"

    def to_plain(self) -> dict[str, Any]:
        return {"path": list(self.path), "kind": "node", **(self.info or {})}


@dataclass(frozen=True, slots=True)
class ValueEntry:
    """A non-tensor leaf, encoded once when the save plans: an async save commits it as it was."""

    path: KeyPath
    value: Any
    encoded: bytes | None = field(default=None, compare=False, repr=False)
    kind: ClassVar[str] = "value"

    def to_plain(self) -> dict[str, Any]:
        return {"path": list(self.path), "kind": "value", "value": self.value}


@dataclass(frozen=True, slots=True)
class PerRankEntry:
    """Where a per-rank subtree stands in the shared tree; each rank's lies in ``ranks``."""

    path: KeyPath
    kind: ClassVar[str] = "per_rank"

    def to_plain(self) -> dict[str, Any]:
        return {"path": list(self.path), "kind": "per_rank"}


Entry = TensorEntry | NodeEntry | ValueEntry | PerRankEntry


@dataclass(frozen=True)
class Tree:
    """A state's tree as a save plans it: shared entries, every rank's, the root's info."""

    entries: tuple[Entry, ...]
    ranks: tuple[tuple[Entry, ...], ...]
    root: dict[str, Any] | None = None


@dataclass(frozen=True)
class Written:
    """What a save's write stage put on disk: chunks by DCP key, byte entries, file table extras."""

    chunks: Mapping[str, tuple[Chunk, ...]]
    blobs: tuple[ByteEntry, ...] = ()
    file_info: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    spliced: Spliced | None = None  # a multi-rank save's parts, packed by the coordinator


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's manifest as a save commits it (built by :func:`assemble`)."""

    created: float
    metadata: Any
    files: Mapping[str, Mapping[str, Any]]
    entries: tuple[Entry, ...]
    ranks: tuple[tuple[Entry, ...], ...]
    root: dict[str, Any] | None = None  # the root TensorDict's batch size and names
    dcp_bytes: tuple[ByteEntry, ...] = ()  # values as stock DCP byte entries
    metadata_bytes: bytes | None = field(default=None, repr=False)  # ``metadata``, encoded
    split: Mapping[KeyPath, int] = field(default_factory=dict)  # evenly split tensors: dim
    rows: Sequence[bytes] | None = field(default=None, repr=False)  # each part's rows, packed

    @property
    def parted(self) -> bool:
        """Written as an index and one part per rank (a multi-rank save)."""
        return len(self.ranks) > 1

    @cached_property
    def tables(self) -> list[tuple[int, int]]:
        """The runs of shared entries written as tensor tables (see :func:`table_runs`)."""
        return table_runs(self.entries, self.split)

    @property
    def version(self) -> int:
        if self.parted:
            return naming.PART_FILES_VERSION
        return naming.TABLES_VERSION if self.tables else naming.ONE_MANIFEST_VERSION

    @cached_property
    def listed(self) -> dict[int, dict[str, dict[str, Any]]]:
        """The file tables of the index (-1) and the parts (:func:`parts.file_tables`)."""
        named = {b.file for b in self.dcp_bytes}
        for e in self.entries:
            if type(e) is TensorEntry and e.alias is None and e.path not in self.split:
                named.update(c.file for c in e.chunks)
        return split_rule.file_tables(self.files, named, len(self.ranks) if self.parted else 0)

    def tensor_groups(self) -> list[list[TensorEntry]]:
        """The tensor entries: the shared ones, then each rank's (what ``.metadata`` lists)."""
        return [[e for e in g if type(e) is TensorEntry] for g in (self.entries, *self.ranks)]

    def encode(self) -> bytes:
        """The manifest's bytes: values and metadata as encoded when planned, spliced in."""
        head: dict[str, Any] = {
            "format": naming.FORMAT_NAME,
            "version": self.version,
            "created": self.created,
            "world_size": max(1, len(self.ranks)),
            "byteorder": sys.byteorder,
            "files": self.listed[-1],
        }
        if self.root:
            head["root"] = self.root
        head["dcp_bytes"] = [b.to_plain() for b in self.dcp_bytes]
        if self.parted:  # and the bytes of the files the parts list (for fc.inspect)
            head["parts"] = len(self.ranks)
            held = [f for r, table in self.listed.items() if r >= 0 for f in table.values()]
            reused = sum(f["size"] for f in held if f.get("reused") and not f.get("copied"))
            head["part_files"] = {"size": sum(f["size"] for f in held), "reused": reused}
        parts = [_map_header(len(head) + 2 + (not self.parted)), _elements(_flat(head))]
        parts += [_pack("metadata"), self.metadata_bytes or codec.encode(self.metadata)]
        parts += [_pack("entries"), _entries(self.entries, self.split, self.tables)]
        if not self.parted:  # in an index, each rank's entries lie in its part
            parts += [_pack("ranks"), _array_header(len(self.ranks))]
            for rank in self.ranks:
                parts += [_map_header(1), _pack("entries"), _entries(rank)]
        return b"".join(parts)

    @cached_property
    def part_rows(self) -> Sequence[bytes]:
        """Each part's rows packed (unless the coordinator packed them), in the index's order."""
        if self.rows is not None:
            return self.rows
        from functional_ckpt._src.format.packed_rows import chunk_rows  # numpy: writing only

        split = [e.chunks for e in self.entries if type(e) is TensorEntry and e.path in self.split]
        return chunk_rows(split, len(self.ranks))

    def encode_part(self, rank: int) -> bytes:
        """Part ``rank`` of a split manifest: that rank's per-rank entries, its chunk of every
        split tensor and its files, then their CRC32 (4 bytes, little-endian)."""
        head = {"format": naming.FORMAT_NAME, "version": self.version, "part": rank}
        head |= {"created": self.created, "files": self.listed.get(rank, {})}
        parts = [_map_header(len(head) + 2), _elements(_flat(head))]
        parts += [_pack("entries"), _entries(self.ranks[rank])]
        parts += [_pack("chunks"), self.part_rows[rank]]
        body = b"".join(parts)
        return body + crc32(body).to_bytes(4, "little")


def with_chunks(tree: Tree, written: Written) -> tuple[tuple[Entry, ...], ...]:
    """The tree's entry groups (shared, then each rank's) with the chunks written."""
    by_path: dict[KeyPath, tuple[Chunk, ...]] = {}
    groups: list[tuple[Entry, ...]] = []
    chunks_of = written.chunks.get
    for group in (tree.entries, *tree.ranks):
        out: list[Entry] = []
        add = out.append
        for e in group:
            if type(e) is TensorEntry:
                if e.alias is None:
                    found = tuple(chunks_of(e.fqn, ()))
                    if len(found) > 1:
                        found = tuple(sorted(found, key=operator.itemgetter(0)))  # by offsets
                    by_path[e.path] = found
                else:
                    found = by_path[e.alias]
                e = e.with_chunks(found)
            add(e)
        groups.append(tuple(out))
    return tuple(groups)


def assemble(
    tree: Tree,
    written: Written,
    files: Mapping[str, Mapping[str, Any]],
    *,
    created: float,
    metadata: Any,
    metadata_bytes: bytes | None = None,
) -> Manifest:
    """The one way a manifest is made: the planned tree, filled with what was written (an even
    split of one dimension across the ranks records that dimension instead of its boxes)."""
    shared, *ranks = with_chunks(tree, written)
    spliced = written.spliced
    split: dict[KeyPath, int] = {}
    for e in shared if spliced is None and len(ranks) > 1 else ():
        if type(e) is TensorEntry and e.alias is None:
            dim = split_rule.owned_split(e.shape, e.chunks, len(ranks))  # each in its rank's file
            if dim is not None:
                split[e.path] = dim
    return Manifest(
        created,
        metadata,
        files,
        shared,
        tuple(ranks),
        tree.root,
        dcp_bytes=written.blobs,
        metadata_bytes=metadata_bytes,
        split=split if spliced is None else spliced.split,
        rows=None if spliced is None else spliced.rows,
    )


_PACKER = msgpack.Packer(use_bin_type=True, use_single_float=False, autoreset=True)


def _pack(plain: Any) -> bytes:
    """Plain data this module built (strings, ints, lists, dicts), packed."""
    return codec.encode_checked(plain, where="manifest")


def _array_header(n: int) -> bytes:
    return bytes(_PACKER.pack_array_header(n))


def _map_header(n: int) -> bytes:
    return bytes(_PACKER.pack_map_header(n))


def _flat(mapping: Mapping[str, Any]) -> list[Any]:
    return [x for kv in mapping.items() for x in kv]


def _elements(items: list[Any]) -> bytes:
    packed = _pack(items)
    head = _array_header(len(items))
    assert packed.startswith(head)
    return packed[len(head) :]


def _pack_path(path: KeyPath) -> bytes:
    """A key path as :func:`_pack` packs it (a lone surrogate takes the checked way)."""
    try:
        return bytes(_PACKER.pack(list(path)))
    except UnicodeEncodeError:
        return _pack(list(path))


# Fixed strings packed by msgpack itself: the codec's tables (numpy, torch) are built
# on first use, and importing this module must not build them.
_VALUE_HEAD = _map_header(3) + bytes(_PACKER.pack("path"))
_VALUE_KIND = b"".join(bytes(_PACKER.pack(s)) for s in ("kind", "value", "value"))


def _entries(
    entries: Sequence[Entry],
    split: Mapping[KeyPath, int] | None = None,
    tables: Sequence[tuple[int, int]] = (),
) -> bytes:
    """An array of entries: runs of plain ones packed at once, values spliced in (``split``:
    the split rule instead of chunks; ``tables``: runs from :func:`table_runs` as tables)."""
    parts = [_array_header(len(entries) - sum(b - a for a, b in tables) + len(tables))]
    run: list[Any] = []
    starts = dict(tables)
    end = 0
    for i, e in enumerate(entries):
        if i < end:
            continue
        stop = starts.get(i)
        if stop is None and not isinstance(e, ValueEntry):
            if split and e.path in split:
                assert type(e) is TensorEntry
                run.append(e.to_plain(split[e.path]))
            else:
                run.append(e.to_plain())
            continue
        if run:
            parts.append(_elements(run))
            run = []
        if stop is not None:
            parts.append(_pack(table_plain(entries[i:stop])))
            end = stop
        elif isinstance(e, ValueEntry):  # the fixed keys packed once, the path by the
            # module's packer (a thousand values: a thousand packer calls, not checked encodes)
            parts += [_VALUE_HEAD, _pack_path(e.path), _VALUE_KIND]
            parts.append(e.encoded or codec.encode(e.value))
    if run:
        parts.append(_elements(run))
    return b"".join(parts)
