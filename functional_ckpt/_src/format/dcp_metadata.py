"""DCP's ``.metadata`` of a checkpoint, derived from its manifest.

Stock ``torch.distributed.checkpoint`` finds tensors (and values stored as byte
entries, see :mod:`.dcp_values`) through ``.metadata``, a pickle of its
``Metadata``. For the project's own checkpoints it is a derived file: one
function (:func:`derive`) computes its exact bytes from the manifest's tensor and
byte entries (written as pickle opcodes by :mod:`.dcp_pickle`, which unpickle to
what :func:`metadata_for` builds), and the writer stores them. A restoring rank's
reader serves the objects themselves (:func:`metadata_for`). The project's readers never read it;
``fc.verify`` checks it without torch: parsed by the hardened unpickler into
plain stand-ins and compared field by field with the manifest
(:mod:`.dcp_compare`).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.serialization
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from functional_ckpt._src.format import dcp_pickle
from functional_ckpt._src.format import dcp_values as dcpbytes
from functional_ckpt._src.format.dcp_compare import transforms
from functional_ckpt._src.format.dcp_values import ByteEntry
from functional_ckpt._src.format.manifest import TensorEntry
from functional_ckpt._src.format.view import PartLoader, parse_checkpoint

#: The pickle protocol of the derived file (what ``pickle.dump`` writes by default).
PROTOCOL = 4


def _dcp_version() -> str | None:
    from torch.distributed.checkpoint import filesystem

    return getattr(filesystem, "CURRENT_DCP_VERSION", None)


def metadata_for(
    groups: Sequence[Sequence[TensorEntry]], blobs: Sequence[ByteEntry] = ()
) -> Metadata:
    """The DCP ``Metadata`` describing a manifest's tensors (shared, then per rank).

    ``groups`` comes from :func:`manifest.tensor_groups` (a manifest being
    written) or :meth:`view.ParsedCheckpoint.groups` (one being verified); ``blobs``
    are its values as DCP byte entries (:mod:`dcpbytes`), after the tensors.

    Equal strings, sizes and properties are one object each, so the pickle is
    compact and its bytes depend only on the manifest's content.
    """
    strings: dict[str, str] = {}
    props: dict[torch.dtype, TensorProperties] = {}
    sizes: dict[tuple[int, ...], torch.Size] = {}
    single: dict[tuple[torch.dtype, tuple[int, ...]], TensorStorageMetadata] = {}

    def s(text: str) -> str:
        return strings.setdefault(text, text)

    def size_of(dims: Sequence[int]) -> torch.Size:
        got = sizes.get(dims) if type(dims) is tuple else None  # chunks hold tuples of ints
        if got is None:
            key = tuple(int(d) for d in dims)
            got = sizes.get(key)
            if got is None:
                got = sizes[key] = torch.Size(key)
        return got

    state_md: dict[str, Any] = {}
    planner_data: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    for entry in (e for group in groups for e in group):
        fqn, dtype, shape, chunks = s(entry.fqn), entry.dtype, entry.shape, entry.chunks
        prop = props.get(dtype)
        if prop is None:
            prop = props[dtype] = TensorProperties(dtype=dtype)
        # one chunk at the origin of a tensor's own shape (a view of some parts of a
        # split manifest holds one chunk at the origin that is not the whole tensor)
        whole = len(chunks) == 1 and chunks[0].whole and chunks[0].sizes == shape
        md = single.get((dtype, shape)) if whole else None
        if md is None:
            md = TensorStorageMetadata(
                properties=prop,
                size=size_of(shape),
                chunks=[
                    ChunkStorageMetadata(offsets=size_of(c.offsets), sizes=size_of(c.sizes))
                    for c in chunks
                ],
            )
            if whole:
                single[(dtype, shape)] = md
        state_md[fqn] = md
        key_path = entry.path if entry.dcp_path is None else entry.dcp_path
        planner_data[fqn] = tuple(s(k) for k in key_path)
        for i, c in enumerate(chunks):
            index = MetadataIndex(fqn, size_of(c.offsets), i)
            storage[index] = _StorageInfo(s(c.file), c.offset, c.length, transforms(c))
    value = BytesStorageMetadata()
    for b in blobs:
        fqn = s(b.fqn)
        state_md[fqn] = value
        planner_data[fqn] = tuple(s(k) if type(k) is str else k for k in b.path)
        storage[MetadataIndex(fqn)] = _StorageInfo(s(b.file), b.offset, b.length)
    return Metadata(
        state_dict_metadata=state_md,
        planner_data=planner_data,
        storage_data=storage,
        storage_meta=None,
        version=_dcp_version(),
    )


def derive(groups: Sequence[Sequence[TensorEntry]], blobs: Sequence[ByteEntry] = ()) -> bytes:
    """The exact bytes of ``.metadata`` for a manifest: a pickle stock ``dcp.load`` reads.

    Written opcode by opcode (:mod:`.dcp_pickle`): it unpickles to what
    :func:`metadata_for` builds, field for field, without building it. A multi-rank
    save of the layout saved last keeps the last bytes (``save/splice``).
    """
    if dcp_pickle.supported() and not any(c.zstd for g in groups for e in g for c in e.chunks):
        return dcp_pickle.write(groups, blobs, _dcp_version())
    # a torch that pickles its classes otherwise: its own pickle of its objects
    return pickle.dumps(metadata_for(groups, blobs), protocol=PROTOCOL)


def derive_from_manifest(
    manifest: dict[str, Any], root: Path = Path("."), parts: PartLoader | None = None
) -> bytes:
    """:func:`derive` of a decoded manifest (validated here; ``root`` names it in errors;
    ``parts`` reads a split manifest's parts)."""
    once = parse_checkpoint(manifest, root, parts=parts)
    return derive(
        once.groups(), dcpbytes.parse_byte_entries(manifest, once.shared.file_sizes, root)
    )
