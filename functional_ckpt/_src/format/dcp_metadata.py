"""DCP's ``.metadata`` of a checkpoint, derived from its manifest by one function.

The project's readers never read it; ``fc.verify`` compares it with the manifest.
"""

from __future__ import annotations

import functools
import pickle
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint import metadata as dcp

from functional_ckpt._src.format import dcp_pickle
from functional_ckpt._src.format.dcp_values import ByteEntry
from functional_ckpt._src.format.manifest import TensorEntry

#: The pickle protocol of the derived file (what ``pickle.dump`` writes by default).
PROTOCOL = 4
_VERSION: str | None = getattr(filesystem, "CURRENT_DCP_VERSION", None)


def metadata_for(
    groups: Sequence[Sequence[TensorEntry]], blobs: Sequence[ByteEntry] = ()
) -> dcp.Metadata:
    """The DCP ``Metadata`` of a manifest's tensor groups and byte entries, equal strings shared."""
    strings: dict[str, str] = {}
    props: dict[torch.dtype, dcp.TensorProperties] = {}
    sizes: dict[tuple[int, ...], torch.Size] = {}
    single: dict[tuple[torch.dtype, tuple[int, ...]], dcp.TensorStorageMetadata] = {}

    def s(text: str) -> str:
        return strings.setdefault(text, text)

    def size_of(dims: Sequence[int]) -> torch.Size:
        key = dims if type(dims) is tuple else tuple(int(d) for d in dims)
        got = sizes.get(key)
        if got is None:
            got = sizes[key] = torch.Size(key)
        return got

    state_md: dict[str, Any] = {}
    planner_data: dict[str, Any] = {}
    storage: dict[dcp.MetadataIndex, Any] = {}
    for entry in (e for group in groups for e in group):
        fqn, dtype, shape, chunks = s(entry.fqn), entry.dtype, entry.shape, entry.chunks
        prop = props.get(dtype) or props.setdefault(dtype, dcp.TensorProperties(dtype=dtype))
        # one chunk at the origin of a tensor's own shape (a view of some parts of a
        # split manifest holds one chunk at the origin that is not the whole tensor)
        whole = len(chunks) == 1 and chunks[0].whole and chunks[0].sizes == shape
        md = single.get((dtype, shape)) if whole else None
        if md is None:
            boxes = [dcp.ChunkStorageMetadata(size_of(c.offsets), size_of(c.sizes)) for c in chunks]
            md = dcp.TensorStorageMetadata(prop, size_of(shape), boxes)
            if whole:
                single[(dtype, shape)] = md
        state_md[fqn] = md
        key_path = entry.path if entry.dcp_path is None else entry.dcp_path
        planner_data[fqn] = tuple(s(k) for k in key_path)
        for i, c in enumerate(chunks):
            index = dcp.MetadataIndex(fqn, size_of(c.offsets), i)
            storage[index] = filesystem._StorageInfo(s(c.file), c.offset, c.length, c.transforms)
    value = dcp.BytesStorageMetadata()
    for b in blobs:
        fqn = s(b.fqn)
        state_md[fqn] = value
        planner_data[fqn] = tuple(s(k) if type(k) is str else k for k in b.path)
        storage[dcp.MetadataIndex(fqn)] = filesystem._StorageInfo(s(b.file), b.offset, b.length)
    return dcp.Metadata(state_md, planner_data, storage, None, _VERSION)


def derive(groups: Sequence[Sequence[TensorEntry]], blobs: Sequence[ByteEntry] = ()) -> bytes:
    """The exact bytes of ``.metadata`` for a manifest: a pickle stock ``dcp.load`` reads;
    the last layout's are kept, as a loop saves one layout again and again."""
    return _derived(_Layout(groups, blobs))


class _Layout:
    """A manifest's entries, equal and hashed by all that :func:`_derived` reads of them."""

    def __init__(self, groups: Sequence[Sequence[TensorEntry]], blobs: Sequence[ByteEntry]):
        self.groups, self.blobs = groups, blobs
        entries = [e for g in groups for e in g]  # ``.metadata`` lists them in one run
        values = tuple([(b.fqn, b.path, b.file, b.offset, b.length) for b in blobs])
        tensors = [(*e[:4], e.dcp_path, *[(*c[:5], c.zstd) for c in e.chunks]) for e in entries]
        self.key = values, tuple(tensors)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Layout) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


@functools.lru_cache(maxsize=1)
def _derived(layout: _Layout) -> bytes:
    groups, blobs = layout.groups, layout.blobs
    if dcp_pickle.supported() and not any(c.zstd for g in groups for e in g for c in e.chunks):
        return dcp_pickle.write(groups, blobs, _VERSION)
    # a torch that pickles its classes otherwise: its own pickle of its objects
    return pickle.dumps(metadata_for(groups, blobs), protocol=PROTOCOL)
