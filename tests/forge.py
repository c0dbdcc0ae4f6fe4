"""Rewrite a real checkpoint's manifest and re-sign it, as an attacker or a bug could.

The commit marker records the manifest's size and CRC32; re-signing recomputes
them, so the edited manifest is read as authentic and only its content is tested.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from functional_ckpt._src import codec
from functional_ckpt._src.format import naming
from functional_ckpt._src.storage import commit, committed


def restore_in(mode: str, ck: Path, like: Any) -> Any:
    """Restore ``ck`` in one of the three modes: ``like`` (new tensors like ``like``'s),
    ``none`` (the tree from the manifest), ``out`` (into new tensors like ``like``'s)."""
    import torch

    import functional_ckpt as fc

    if mode == "like":
        return fc.restore(ck, like)
    if mode == "none":
        return fc.restore(ck)
    assert mode == "out", mode
    into = {
        k: torch.empty_like(v, device="cpu") if isinstance(v, torch.Tensor) else v
        for k, v in like.items()
    }
    return fc.restore(ck, out=into)


def resign(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``edit`` to the decoded manifest of ``path``, write it back, re-sign the marker."""
    manifest = committed.read_manifest(path)
    edit(manifest)
    raw = codec.encode(manifest)
    (path / naming.MANIFEST).write_bytes(raw)
    os.unlink(path / naming.COMMIT_MARKER)
    commit.write_commit_marker(path, raw, version=manifest["version"])


def flip(ck: Path, key: str, *, header: bool = False, file: str | None = None) -> None:
    """Damage one byte of top-level tensor ``key``'s blob (its first chunk, or its chunk
    in ``file``): in its data, or its framing."""
    from functional_ckpt._src.restore.read import vetted_view

    chunks = vetted_view(ck).tensors[(key,)].chunks
    chunk = next(c for c in chunks if file in (None, c.file))
    at = chunk.offset if header else chunk.data_offset + chunk.nbytes // 2
    fd = os.open(ck / chunk.file, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, at)
        os.pwrite(fd, bytes([byte[0] ^ 0x5A]), at)
    finally:
        os.close(fd)


def sign(path: Path, raw: bytes) -> None:
    """Write a commit marker for ``raw`` (already the manifest of ``path``), with the
    version the manifest says (1 for bytes that decode to no manifest)."""
    try:
        version = codec.decode(raw).get("version", 1)  # type: ignore[union-attr]
    except Exception:
        version = 1
    commit.write_commit_marker(path, raw, version=version if type(version) is int else 1)


def write_part(path: Path, rank: int, part: dict[str, Any]) -> None:
    """Write ``part`` as part ``rank`` of the split manifest of ``path``, checksummed as
    its version says: by the CRC32 after it (version 4), or in the re-signed index."""
    from functional_ckpt._src.format.checksum import crc32

    raw = codec.encode(part)
    name = naming.part_name(rank)
    if committed.read_manifest(path)["version"] >= naming.PART_FILES_VERSION:
        (path / name).write_bytes(raw + crc32(raw).to_bytes(4, "little"))
        return
    (path / name).write_bytes(raw)
    resign(path, lambda m: m["files"].update({name: {"size": len(raw), "crc32": crc32(raw)}}))


def read_part(path: Path, rank: int) -> dict[str, Any]:
    """Part ``rank`` of the split manifest of ``path``, decoded (its checksum left out)."""
    raw = (path / naming.part_name(rank)).read_bytes()
    if committed.read_manifest(path)["version"] >= naming.PART_FILES_VERSION:
        raw = raw[:-4]
    part = codec.decode(raw)
    assert isinstance(part, dict)
    return part


def old_layout(path: Path) -> None:
    """Rewrite a split manifest as the format's versions 2 and 3 laid it out: every
    file in the index's table, with each part's size and CRC32; parts without files
    and without a checksum of their own."""
    from functional_ckpt._src.format.checksum import crc32
    from functional_ckpt._src.format.entries import is_table

    index = committed.read_manifest(path)
    version = naming.TABLES_VERSION if any(map(is_table, index["entries"])) else 2
    for rank in range(index["parts"]):
        part = read_part(path, rank)
        index["files"].update(part.pop("files"))
        del part["created"]
        part["version"] = version
        (path / naming.part_name(rank)).write_bytes(codec.encode(part))
    index["version"] = version
    for rank in range(index["parts"]):
        raw = (path / naming.part_name(rank)).read_bytes()
        index["files"][naming.part_name(rank)] = {"size": len(raw), "crc32": crc32(raw)}
    raw = codec.encode(index)
    (path / naming.MANIFEST).write_bytes(raw)
    os.unlink(path / naming.COMMIT_MARKER)
    commit.write_commit_marker(path, raw, version=version)
