"""The manifest's entries: building them at save, validating them at load.

The manifest is the one place that knows the tree: every node, every non-tensor
value (exactly, through the codec), and for every tensor its spec, location and
checksums. A loader treats it as untrusted input: every field is type- and
range-checked against the files on disk before a single byte is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from functional_ckpt.errors import CorruptCheckpoint, UnsafeCheckpoint
from functional_ckpt.format import DCP_METADATA, safe_member
from functional_ckpt.tree import KeyPath, format_path

#: Nested deeper than this, a tree is rejected as hostile.
MAX_TREE_DEPTH = 256


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: object, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpoint(f"{where}: unknown dtype {name!r}")
    return dtype


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass
class TensorEntry:
    """A validated tensor entry of a manifest."""

    index: int
    path: KeyPath
    fqn: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool
    file: str = ""
    offset: int = 0
    length: int = 0
    data_offset: int = 0
    nbytes: int = 0
    crc32: int = 0
    hcrc32: int = 0
    alias: int | None = None

    @property
    def spec(self) -> str:
        return f"{dtype_name(self.dtype)}{list(self.shape)}"


@dataclass
class ParsedManifest:
    """A manifest whose entries were checked against the checkpoint's files."""

    raw: dict[str, Any]
    order: list[tuple[KeyPath, str]] = field(default_factory=list)  # (path, kind)
    tensors: dict[KeyPath, TensorEntry] = field(default_factory=dict)
    values: dict[KeyPath, Any] = field(default_factory=dict)
    nodes: set[KeyPath] = field(default_factory=set)
    file_sizes: dict[str, int] = field(default_factory=dict)

    @property
    def metadata(self) -> Any:
        return self.raw.get("metadata")


def _int(v: object, where: str, what: str, lo: int = 0) -> int:
    if type(v) is not int or v < lo:
        raise CorruptCheckpoint(f"{where}: invalid {what} {v!r}")
    return v


def parse(manifest: dict[str, Any], root: Path) -> ParsedManifest:
    """Validate a decoded manifest against the directory ``root`` it came from."""
    src = str(root / "manifest.msgpack")
    out = ParsedManifest(manifest)
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CorruptCheckpoint(f"{src}: missing file table")
    for name, info in files.items():
        member = safe_member(root, name)
        if not isinstance(info, dict):
            raise CorruptCheckpoint(f"{src}: bad entry for file {name!r}")
        size = _int(info.get("size"), src, f"size of {name!r}")
        try:
            actual = member.stat().st_size
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{member}: file is missing from the checkpoint") from None
        if not member.is_file():
            raise UnsafeCheckpoint(f"{member}: not a regular file")
        if actual != size:
            raise CorruptCheckpoint(
                f"{member}: file is {actual} bytes, the manifest recorded {size} "
                "(truncated or replaced)"
            )
        out.file_sizes[name] = size
    entries = manifest.get("entries")
    if not isinstance(entries, list):
        raise CorruptCheckpoint(f"{src}: missing entries")
    for i, e in enumerate(entries):
        where = f"{src} entry {i}"
        if not isinstance(e, dict):
            raise CorruptCheckpoint(f"{where}: not a mapping")
        p = e.get("path")
        if (
            not isinstance(p, list)
            or not p
            or len(p) > MAX_TREE_DEPTH
            or not all(isinstance(k, str) for k in p)
        ):
            raise CorruptCheckpoint(f"{where}: invalid key path {p!r}")
        path: KeyPath = tuple(p)
        if path in out.tensors or path in out.values or path in out.nodes:
            raise CorruptCheckpoint(f"{where}: duplicate key {format_path(path)}")
        kind = e.get("kind")
        out.order.append((path, str(kind)))
        if kind == "node":
            out.nodes.add(path)
        elif kind == "value":
            if "value" not in e:
                raise CorruptCheckpoint(f"{where}: value entry without a value")
            out.values[path] = e["value"]
        elif kind == "tensor":
            out.tensors[path] = _tensor_entry(i, path, e, out, where)
        else:
            raise CorruptCheckpoint(f"{where}: unknown entry kind {kind!r}")
    return out


def _tensor_entry(
    i: int, path: KeyPath, e: dict[str, Any], out: ParsedManifest, where: str
) -> TensorEntry:
    dtype = dtype_from_name(e.get("dtype"), where)
    shape_raw = e.get("shape")
    if not isinstance(shape_raw, list) or len(shape_raw) > 64:
        raise CorruptCheckpoint(f"{where}: invalid shape {shape_raw!r}")
    shape = tuple(_int(d, where, "dimension") for d in shape_raw)
    fqn = e.get("fqn")
    if not isinstance(fqn, str):
        raise CorruptCheckpoint(f"{where}: invalid DCP key {fqn!r}")
    entry = TensorEntry(i, path, fqn, dtype, shape, bool(e.get("requires_grad", False)))
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * element_size(dtype)
    if "alias" in e:
        target = e["alias"]
        by_index = {t.index: t for t in out.tensors.values()}
        if type(target) is not int or target not in by_index:
            raise CorruptCheckpoint(f"{where}: alias of an unknown entry {target!r}")
        src = by_index[target]
        if src.dtype != dtype or src.shape != shape:
            raise CorruptCheckpoint(f"{where}: alias spec differs from its target")
        entry.alias = target
        entry.file, entry.data_offset, entry.nbytes = src.file, src.data_offset, src.nbytes
        return entry
    file = e.get("file")
    if not isinstance(file, str) or file not in out.file_sizes or file == DCP_METADATA:
        raise CorruptCheckpoint(f"{where}: tensor stored in an unknown file {file!r}")
    entry.file = file
    entry.offset = _int(e.get("offset"), where, "offset")
    entry.length = _int(e.get("length"), where, "length")
    entry.data_offset = _int(e.get("data_offset"), where, "data offset")
    entry.nbytes = _int(e.get("nbytes"), where, "byte count")
    entry.crc32 = _int(e.get("crc32"), where, "checksum")
    entry.hcrc32 = _int(e.get("hcrc32"), where, "checksum")
    if entry.nbytes != nbytes:
        raise UnsafeCheckpoint(
            f"{where}: {format_path(path)} declares {entry.spec} ({nbytes} bytes) "
            f"but records {entry.nbytes} bytes"
        )
    size = out.file_sizes[file]
    if not (
        entry.offset <= entry.data_offset
        and entry.data_offset + entry.nbytes <= entry.offset + entry.length <= size
    ):
        raise UnsafeCheckpoint(
            f"{where}: {format_path(path)} declares bytes beyond the end of {file} ({size} bytes)"
        )
    return entry
