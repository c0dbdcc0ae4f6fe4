"""Does a ``.metadata`` say what the manifest says? Compared field by field, without torch.

Not its bytes: an honest file from another torch differs. What ``dcp.load`` finds
things by (kinds, dtypes, shapes, chunks, offsets, key paths) is compared.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from functional_ckpt._src.format.dcp_standins import DType, TensorStorageMetadata
from functional_ckpt._src.format.dcp_values import ByteEntry
from functional_ckpt._src.format.manifest import Chunk, TensorEntry

#: A ``.metadata`` as ``dcp.load`` uses it: per key (dtype, shape, chunk boxes) or
#: ``"bytes"``; per stored piece (key, offsets) its (file, offset, length, transforms);
#: the key paths.
View = tuple[dict[str, Any], dict[tuple[str, Any], Any], Any]


#: DCP's name of the transform of a chunk stored as a zstd frame (``storage/zstd``).
ZSTD_DESCRIPTOR = "stream.zstd/1"


def transforms(c: Chunk) -> list[str] | None:
    """A chunk's ``_StorageInfo.transform_descriptors``: None (left out) for a plain blob."""
    return [ZSTD_DESCRIPTOR] if c.zstd else None


def manifest_view(groups: Sequence[Sequence[TensorEntry]], blobs: Sequence[ByteEntry] = ()) -> View:
    """What the ``.metadata`` derived from these entries says (later entries of a key win)."""
    chunks: dict[str, Any] = {}
    storage: dict[tuple[str, Any], Any] = {}
    planner: dict[str, Any] = {}
    for e in (e for group in groups for e in group):
        chunks[e.fqn] = (DType(e.dtype_name), tuple(e.shape), _boxes(e.chunks))
        planner[e.fqn] = tuple(e.path if e.dcp_path is None else e.dcp_path)
        for c in e.chunks:
            storage[(e.fqn, tuple(c.offsets))] = (c.file, c.offset, c.length, transforms(c))
    for b in blobs:
        chunks[b.fqn] = "bytes"
        planner[b.fqn] = tuple(b.path)
        storage[(b.fqn, None)] = (b.file, b.offset, b.length, None)
    return chunks, storage, planner


def file_view(md: Any) -> View:
    """What a parsed ``.metadata`` (``unpickler.load_standins``) says."""
    chunks: dict[str, Any] = {}
    for fqn, smd in md.state_dict_metadata.items():
        tensor = type(smd) is TensorStorageMetadata
        chunks[fqn] = (
            (smd.properties.dtype, tuple(smd.size), _boxes(smd.chunks)) if tensor else "bytes"
        )
    data = md.storage_data if isinstance(md.storage_data, dict) else {}
    storage: dict[tuple[str, Any], Any] = {}
    for k, v in data.items():
        key = (k.fqn, None if k.offset is None else tuple(k.offset))
        storage[key] = (v.relative_path, v.offset, v.length, v.transform_descriptors)
    return chunks, storage, md.planner_data


def _boxes(chunks: Any) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks)


def compare(found: View, expected: View, limit: int = 20) -> list[str]:
    """Every way ``found`` would make stock DCP read other than ``expected``, at most ``limit``."""
    problems: list[str] = []
    a, b = found[0], expected[0]
    for fqn in sorted(set(a) | set(b)):
        if fqn not in b:
            problems.append(f"tensor {fqn!r} is not in the manifest")
        elif fqn not in a:
            problems.append(f"tensor {fqn!r} of the manifest is missing")
        elif a[fqn] != b[fqn]:
            problems.append(f"tensor {fqn!r}: {a[fqn]} where the manifest says {b[fqn]}")
    sa, sb = found[1], expected[1]
    for key in sorted(set(sa) | set(sb), key=repr):
        if sa.get(key) != sb.get(key):
            problems.append(
                f"storage of {key[0]!r} at {key[1]}: {sa.get(key)} where the manifest says "
                f"{sb.get(key)}"
            )
    if found[2] != expected[2]:
        problems.append("planner data (key paths) differ from the manifest")
    return problems[:limit]
