"""The manifest model: the entries a save writes and the manifest they make.

The manifest is the one place that knows the tree: every node, every non-tensor
value (exactly, through the codec), and for every tensor its spec, location and
checksums. These classes are what a save builds and what :mod:`.view` returns
after validating a manifest read back.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from functional_ckpt._src import codec
from functional_ckpt._src.format.coverage import numel
from functional_ckpt._src.format.dcp_values import ByteEntry
from functional_ckpt._src.format.keys import KeyPath
from functional_ckpt._src.format.limits import LIMITS
from functional_ckpt._src.format.naming import (
    FORMAT_NAME,
    FORMAT_VERSION,
)
from functional_ckpt.errors import CorruptCheckpoint


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: object, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpoint(f"{where}: unknown dtype {name!r}")
    return dtype


def element_size(dtype: torch.dtype) -> int:
    return dtype.itemsize


@dataclass(slots=True)
class Chunk:
    """One stored piece of a tensor: a box of the global tensor and where its bytes are.

    The one representation of a chunk from planning (the box alone) through
    writing (the shard writer fills in where the blob landed and its checksums)
    to reading (``parse`` builds it from the manifest, readers read it).
    """

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str = ""
    offset: int = 0  # blob start (what DCP's ``_StorageInfo`` points at)
    length: int = 0  # blob length
    data_offset: int = 0  # absolute offset of the raw bytes, C order of ``sizes``
    nbytes: int = 0
    crc32: int = 0  # CRC32 of the raw bytes
    hcrc32: int = 0  # CRC32 of the blob's other bytes

    @property
    def whole(self) -> bool:
        return not any(self.offsets)

    def to_plain(self) -> dict[str, Any]:
        return {
            "offsets": list(self.offsets),
            "sizes": list(self.sizes),
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "data_offset": self.data_offset,
            "nbytes": self.nbytes,
            "crc32": self.crc32,
            "hcrc32": self.hcrc32,
        }


@dataclass(slots=True)
class TensorEntry:
    """A tensor of the tree: its spec, DCP key and chunks (or the tensor it aliases).

    An alias shares its target's ``chunks`` list, so chunks filled in after
    planning are seen through both.
    """

    path: KeyPath
    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool
    chunks: list[Chunk] = field(default_factory=list)
    alias: KeyPath | None = None
    dcp_path: KeyPath | None = None  # DCP's object path of ``fqn``, when not ``path``
    kind: ClassVar[str] = "tensor"

    @property
    def spec(self) -> str:
        return f"{dtype_name(self.dtype)}{list(self.shape)}"

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * element_size(self.dtype)

    def to_plain(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "path": list(self.path),
            "kind": "tensor",
            "fqn": self.fqn,
            "dtype": dtype_name(self.dtype),
            "shape": list(self.shape),
            "requires_grad": self.requires_grad,
        }
        if self.dcp_path is not None:
            out["dcp_path"] = list(self.dcp_path)
        if self.alias is not None:
            out["alias"] = list(self.alias)
        else:
            out["chunks"] = [c.to_plain() for c in self.chunks]
        return out


@dataclass(slots=True)
class NodeEntry:
    """A sub-tree; ``info`` holds its batch size and dimension names when batched."""

    path: KeyPath
    info: dict[str, Any] | None = None
    kind: ClassVar[str] = "node"

    def to_plain(self) -> dict[str, Any]:
        return {"path": list(self.path), "kind": "node", **(self.info or {})}


@dataclass(slots=True)
class ValueEntry:
    """A non-tensor leaf, stored exactly through the codec."""

    path: KeyPath
    value: Any
    kind: ClassVar[str] = "value"

    def to_plain(self) -> dict[str, Any]:
        return {"path": list(self.path), "kind": "value", "value": self.value}


@dataclass(slots=True)
class PerRankEntry:
    """Where a per-rank subtree stands in the shared tree; each rank's lies in ``ranks``."""

    path: KeyPath
    kind: ClassVar[str] = "per_rank"

    def to_plain(self) -> dict[str, Any]:
        return {"path": list(self.path), "kind": "per_rank"}


Entry = TensorEntry | NodeEntry | ValueEntry | PerRankEntry


@dataclass
class Manifest:
    """A checkpoint's manifest as the writer builds it; :meth:`encode` gives its bytes.

    ``files`` maps each file name to its recorded size (and CRC32 for
    ``.metadata``); ``ranks`` holds each rank's per-rank entries.
    """

    created: float
    metadata: Any
    files: dict[str, dict[str, int]]
    entries: list[Entry]
    ranks: list[list[Entry]]
    root: dict[str, Any] | None = None  # the root TensorDict's batch size and names
    checked: bool = False  # values and metadata passed codec.check_encodable, no bytearrays
    dcp_bytes: list[ByteEntry] | None = None  # values as stock DCP byte entries

    def to_plain(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "created": self.created,
            "world_size": max(1, len(self.ranks)),
            "byteorder": sys.byteorder,
            "metadata": self.metadata,
            "files": self.files,
            "entries": [e.to_plain() for e in self.entries],
            "ranks": [{"entries": [e.to_plain() for e in r]} for r in self.ranks],
        }
        if self.root:
            out["root"] = self.root
        if self.dcp_bytes is not None:
            out["dcp_bytes"] = [b.to_plain() for b in self.dcp_bytes]
        return out

    def encode(self) -> bytes:
        """The manifest's bytes; what was checked at planning is not scanned again."""
        if self.checked:
            return codec.encode_checked(self.to_plain(), where="manifest")
        return codec.encode(self.to_plain(), where="manifest")


def tensor_groups(
    entries: Sequence[Entry], ranks: Sequence[Sequence[Entry]]
) -> list[list[TensorEntry]]:
    """The tensor entries of a manifest model: the shared ones, then each rank's."""
    return [[e for e in group if isinstance(e, TensorEntry)] for group in [entries, *ranks]]


def shape_problem(shape: Sequence[int], dtype: torch.dtype) -> str | None:
    """Why a tensor of this shape and dtype lies beyond the format's limits, or None."""
    if len(shape) > LIMITS.tensor_ndim:
        return f"{len(shape)} dimensions (the format allows at most {LIMITS.tensor_ndim})"
    extent = LIMITS.tensor_extent
    if any(d >= extent for d in shape):
        return f"a dimension of {max(shape)} (each must be below 2**{extent.bit_length() - 1})"
    if numel(shape) * element_size(dtype) >= extent:
        return (
            f"shape {list(shape)} of {dtype_name(dtype)} "
            f"(the element count times the element size must be below "
            f"2**{extent.bit_length() - 1})"
        )
    return None
