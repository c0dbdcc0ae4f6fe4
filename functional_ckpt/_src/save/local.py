"""One process writes a planned state and commits it.

Tensor bytes are written as chunks (a whole tensor, or one shard of a sharded
tensor); :func:`finalize` turns chunk records into the manifest and DCP's
``.metadata`` and commits the directory. Single-process saves and the coordinator
of a multi-rank save share it.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from functional_ckpt._src.distributed.topology import is_dtensor as is_dtensor
from functional_ckpt._src.format import dcp_metadata, naming
from functional_ckpt._src.format import dcp_values as dcpbytes
from functional_ckpt._src.format.checksum import crc32
from functional_ckpt._src.format.manifest import (
    Chunk,
    Manifest,
    tensor_groups,
)
from functional_ckpt._src.format.naming import shard_name
from functional_ckpt._src.paths import PathLike as PathLike
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.save.plan import Plan, byte_entries
from functional_ckpt._src.storage import commit, durable, shards
from functional_ckpt.errors import CheckpointError


def os_error(e: OSError, where: Path) -> CheckpointError:
    if e.errno == errno.ENOSPC:
        return CheckpointError(f"{where}: no space left on the device while saving ({e})")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return CheckpointError(f"{where}: permission denied while saving ({e})")
    return CheckpointError(f"{where}: saving failed: {e}")


def finalize(
    tmp: Path,
    dest: Path,
    manifest: Manifest,
    *,
    overwrite: bool,
    before_commit: Callable[[], None] | None = None,
    syncing: list[Future[None]] | None = None,
    file_info: Mapping[str, Mapping[str, Any]] | None = None,
    elsewhere: Mapping[str, int] | None = None,
) -> tuple[int, int]:
    """Write ``.metadata``, the manifest and the marker into ``tmp``; commit as ``dest``.

    Every shard file in ``tmp`` must already be written and every chunk of the
    manifest filled in; ``syncing`` holds the fsyncs of shard files still
    running (they overlap with deriving and encoding here). ``.metadata``
    (derived from the manifest by :func:`dcp_metadata.derive`), the manifest (its file
    table filled in here) and the marker are each written and fsynced at their
    final size, and every fsync has finished, before the marker is written and the
    directory is fsynced and renamed. ``file_info`` adds fields to files' entries
    (data files reused from a base). ``elsewhere`` names the shard files (with
    their sizes) that other ranks wrote into directories of their own, when the
    ranks share no file system. Returns (bytes on disk, manifest bytes).
    """
    syncing = [] if syncing is None else syncing
    try:
        groups = tensor_groups(manifest.entries, manifest.ranks)
        md_bytes = dcp_metadata.derive(groups, manifest.dcp_bytes or ())
        _write_file(tmp / naming.DCP_METADATA, md_bytes, syncing)
        files = manifest.files
        files.clear()
        for name in sorted(os.listdir(tmp)):
            if name == naming.DCP_METADATA:
                files[name] = {"size": len(md_bytes), "crc32": crc32(md_bytes)}
            else:
                files[name] = {"size": (tmp / name).stat().st_size}
            files[name].update((file_info or {}).get(name, {}))
        for name, size in sorted((elsewhere or {}).items()):
            files.setdefault(name, {"size": size})
        manifest_bytes = manifest.encode()
        durable.write_new(tmp / naming.MANIFEST, manifest_bytes)
    finally:
        for fut in syncing:  # every file durable (or its error raised) before going on
            fut.result()
    if before_commit is not None:
        before_commit()
    commit.write_commit_marker(tmp, manifest_bytes)
    commit.commit_checkpoint(tmp, dest, overwrite=overwrite)
    total = sum(f["size"] for f in files.values()) + len(manifest_bytes)
    return total, len(manifest_bytes)


def _write_file(path: Path, data: bytes, syncing: list[Future[None]]) -> None:
    """Write a new file whole; its fsync runs in the background (appended to ``syncing``)."""
    fd = durable.open_new(path)
    try:
        durable.write_all(fd, data)
    except BaseException:
        os.close(fd)
        raise
    syncing.append(shards.sync_pool().submit(shards.fsync_and_close, fd))


#: Writes tensor ``i`` as ``chunks[i]`` into the temporary directory (filling in the
#: chunks, calling ``after_each(i)``, appending background fsyncs to ``syncing``);
#: returns fields to add to the files' entries in the manifest.
DataWriter = Callable[
    [
        Path,
        Sequence[torch.Tensor],
        list[Chunk],
        Sequence[dcpbytes.ByteEntry],
        Callable[[int], None] | None,
        list[Future[None]],
    ],
    Mapping[str, Mapping[str, Any]],
]


def _write_chunks(
    tmp: Path,
    tensors: Sequence[torch.Tensor],
    chunks: list[Chunk],
    blobs: Sequence[dcpbytes.ByteEntry],
    after_each: Callable[[int], None] | None,
    syncing: list[Future[None]],
) -> Mapping[str, Mapping[str, Any]]:
    shards.write_shard(
        tmp / shard_name(0),
        tensors,
        chunks,
        after_each=after_each,
        background=syncing,
        blobs=blobs,
    )
    return {}


def write_local(
    dest: Path,
    plan: Plan,
    tensors: Sequence[torch.Tensor],
    *,
    metadata: Any,
    overwrite: bool,
    after_each: Callable[[int], None] | None = None,
    before_commit: Callable[[], None] | None = None,
    write_data: DataWriter | None = None,
) -> CheckpointInfo:
    """Write a planned state from one process with the full commit protocol.

    ``tensors`` are the bytes to write for ``plan.sources`` (the sources themselves,
    or staged copies), each contiguous and on the CPU. ``after_each(i)`` runs once
    tensor ``i`` is written; ``before_commit()`` may raise to refuse the commit.
    ``write_data`` replaces how the tensor chunks reach the directory (an
    incremental save takes unchanged ones from its base).
    """
    t0 = time.perf_counter()
    created = time.time()
    tmp = durable.tmp_sibling(dest)
    try:
        durable.make_dirs(dest.parent)
        tmp.mkdir()
        chunks = []
        for entry in plan.targets:
            entry.chunks[:] = [Chunk((0,) * len(entry.shape), entry.shape)]
            chunks.append(entry.chunks[0])
        syncing: list[Future[None]] = []
        blobs = byte_entries(plan)
        info = (write_data or _write_chunks)(tmp, tensors, chunks, blobs, after_each, syncing)
        manifest = Manifest(
            created,
            metadata,
            {},
            plan.entries,
            [plan.local],
            plan.root,
            checked=plan.checked,
            dcp_bytes=blobs,
        )
        nbytes, _ = finalize(
            tmp,
            dest,
            manifest,
            overwrite=overwrite,
            before_commit=before_commit,
            syncing=syncing,
            file_info=info,
        )
    except CheckpointError:  # e.g. CheckpointExists, itself an OSError
        commit.remove_tree(tmp)
        raise
    except OSError as e:
        commit.remove_tree(tmp)
        raise os_error(e, dest) from e
    except BaseException:
        commit.remove_tree(tmp)
        raise
    return CheckpointInfo(
        path=dest,
        nbytes=nbytes,
        tensor_bytes=sum(c.nbytes for c in chunks),
        num_tensors=len(chunks),
        num_values=plan.num_values,
        created=created,
        duration=time.perf_counter() - t0,
        metadata=metadata,
    )
