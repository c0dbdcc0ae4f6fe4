"""Incremental saves: base files holding enough unchanged chunks are hard-linked (else copied)
in, so every checkpoint stays self-contained. A chunk is reused when key, box, dtype and
CRC32 match and its file is trusted (:mod:`.trust`) or compared byte for byte."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import stat
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from functional_ckpt._src.format import dcp_values as dcpbytes
from functional_ckpt._src.format import naming
from functional_ckpt._src.format.blobs import byte_view
from functional_ckpt._src.format.checksum import crc32
from functional_ckpt._src.format.dcp_values import ByteEntry
from functional_ckpt._src.format.manifest import Chunk
from functional_ckpt._src.format.naming import parse_shard, shard_name
from functional_ckpt._src.format.segments import Segment
from functional_ckpt._src.save.options import SaveOptions
from functional_ckpt._src.save.trust import Ident, Key, Seen
from functional_ckpt._src.storage import committed, durable, opener, shards, zstd
from functional_ckpt._src.storage.live import BLOCK, Freed, LiveReader
from functional_ckpt.errors import CheckpointError

#: A base data file is shared only while at least this fraction of its tensor bytes
#: is still used, so no checkpoint keeps more than about twice its live bytes alive.
MIN_LIVE = 0.5


#: errnos for which a hard link cannot work here, and a copy is made instead.
_NO_LINK = {errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EACCES}


@dataclass
class Base:
    """A committed base held open: its chunks, file sizes and tensor bytes per file."""

    ck: committed.Checkpoint
    chunks: dict[Key, tuple[torch.dtype, Chunk]]
    sizes: dict[str, int]
    tensor_bytes: dict[str, int]
    seen: Seen  # what this process saved there, if it wrote it
    trusted: set[str] = dataclasses.field(default_factory=set)  # files this process wrote
    fds: dict[str, int] = dataclasses.field(default_factory=dict)  # files opened to compare

    def open(self, name: str) -> int:
        """The base's data file ``name``, opened safely once and checked for its size."""
        fd = self.fds.get(name)
        if fd is None:
            where = naming.safe_member(self.ck.path, name)
            fd = self.fds[name] = opener.open_member(
                self.ck.dir_fd, name, where, size=self.sizes[name]
            )
        return fd

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()
        self.ck.close()


def open_base(options: SaveOptions) -> Base | None:
    """Open and vet a save's base: unreadable, an error if ``base_required``, else None."""
    path = options.base
    if path is None:
        return None
    ck = None
    try:
        ck = committed.open_checkpoint(path)
        parsed = committed.parsed(ck)
        chunks = {
            (e.fqn, c.offsets): (e.dtype, c)
            for group in parsed.groups()
            for e in group
            if e.alias is None
            for c in e.chunks
        }
        sizes = dict(parsed.shared.file_sizes)
        held = dict(sizes)
        for b in dcpbytes.parse_byte_entries(ck.manifest, held, path):
            held[b.file] -= b.length
        memory = options.trust.recall(ck.dir_fd, path)
        if memory is None:
            return Base(ck, chunks, sizes, held, Seen((), ()))
        return Base(ck, chunks, sizes, held, memory.seen, memory.trusted(ck.dir_fd))
    except BaseException as err:
        if ck is not None:
            ck.close()
        if not isinstance(err, CheckpointError):
            raise
        if not options.base_required:
            return None
        raise CheckpointError(
            f"base={path}: cannot be used as the base of an incremental save: {err}; "
            "pass a committed checkpoint of this format, or base=None for a full save"
        ) from err


def _unchanged(
    base: Base, key: Key, t: torch.Tensor, known: Ident | None, reader: LiveReader | None
) -> Chunk | None:
    """The base's chunk for ``key`` if ``t`` (contiguous, on the CPU) holds its bytes."""
    dtype, got = base.chunks.get(key, (None, None))
    if got is None or dtype != t.dtype or got.sizes != tuple(t.shape) or got.nbytes == 0:
        return None  # a new key, box or dtype: a layout change, written in full
    seen = base.seen.get(key)
    if seen is not None and known is not None and seen[0] == known[0] and seen[1] != known[1]:
        return None  # written in place since the base: changed, no checksum pass needed
    view = byte_view(t)
    if (reader.crc(view) if reader else shards.crc_chunks(view)) != got.crc32:
        return None
    if got.file not in base.trusted and not _stored_equals(base, got, t, reader):
        return None  # the base's file does not hold what its manifest says: not shared
    return got


def _stored_equals(base: Base, chunk: Chunk, t: torch.Tensor, reader: LiveReader | None) -> bool:
    """Whether the base's blob for ``chunk`` is intact and holds exactly ``t``'s bytes."""
    view = byte_view(t)
    try:
        fd = base.open(chunk.file)
        if chunk.zstd:  # decompressed (and checked) into a scratch copy, then compared
            scratch = memoryview(np.empty(len(view), dtype=np.uint8).data)
            if len(view) != chunk.nbytes or zstd.read_blob(fd, chunk, scratch) is not None:
                return False
            for off in range(0, len(view), BLOCK):
                mine = view[off : off + BLOCK]
                if scratch[off : off + BLOCK] != (mine if reader is None else reader.copy(mine)):
                    return False
            return True
        head = os.pread(fd, chunk.data_offset - chunk.offset, chunk.offset)
        end = chunk.data_offset + chunk.nbytes
        tail = os.pread(fd, chunk.offset + chunk.length - end, end)
        if len(view) != chunk.nbytes or crc32(tail, crc32(head)) != chunk.hcrc32:
            return False
        buf = np.empty(min(BLOCK if reader else shards.CHUNK, len(view)), dtype=np.uint8)
        for off in range(0, len(view), len(buf)):
            part = buf[: min(len(buf), len(view) - off)]
            got = shards.read_into(fd, chunk.data_offset + off, part.data)
            mine = view[off : off + len(part)]
            if reader is not None:
                mine = memoryview(reader.copy(mine))
            if got != len(part) or not np.array_equal(part, np.frombuffer(mine, np.uint8)):
                return False
    except Freed:
        raise  # the caller's memory, not the base: the save fails
    except (OSError, CheckpointError, KeyError, ValueError):
        return False
    return True


def unchanged_chunks(
    base: Base | None,
    keys: Sequence[Key],
    tensors: Sequence[torch.Tensor],
    idents: Sequence[Ident | None],
    live: bool = False,
) -> list[Chunk | None]:
    """Each chunk's base chunk of the same bytes, or None; ``live``: read through the kernel."""
    if base is None:
        return [None] * len(keys)
    reader = LiveReader() if live else None
    try:
        return [
            _unchanged(base, k, t, i, reader) for k, t, i in zip(keys, tensors, idents, strict=True)
        ]
    finally:
        if reader is not None:
            reader.close()


def place(
    base: Base | None,
    reused: list[Chunk | None],
    tmp: Path,
    rank: int,
    syncing: list[Future[None]],
    sync: bool = True,
) -> list[Chunk | None]:
    """Bring the base files the reused chunks lie in into ``tmp``; repoint the chunks (a
    file below :data:`MIN_LIVE`, or gone meanwhile, has its chunks written again)."""
    if base is None:
        return list(reused)
    used: dict[str, int] = {}
    for c in reused:
        if c is not None:
            used[c.file] = used.get(c.file, 0) + c.length
    names: dict[str, str] = {}
    for n, (name, live) in enumerate(sorted(used.items()), start=1):
        size = base.sizes.get(name, 0)
        if size and live >= MIN_LIVE * base.tensor_bytes.get(name, size):
            new = shard_name(rank, n)
            if _bring(base, name, size, tmp / new, syncing, sync):
                names[name] = new
    return [
        None if c is None or c.file not in names else c._replace(file=names[c.file]) for c in reused
    ]


def _bring(
    base: Base, name: str, size: int, dst: Path, syncing: list[Future[None]], sync: bool
) -> bool:
    """Hard-link (else copy) the base's file ``name`` to ``dst``; False if it is gone."""
    dir_fd = base.ck.dir_fd
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        return False
    compared = base.fds.get(name)
    if compared is not None and not os.path.samestat(os.fstat(compared), st):
        return False  # replaced since its bytes were compared
    try:
        os.link(name, dst, src_dir_fd=dir_fd, follow_symlinks=False)
    except OSError as e:
        if e.errno not in _NO_LINK:
            return False
        return _copy(base, name, size, dst, syncing, sync)
    if not os.path.samestat(os.stat(dst, follow_symlinks=False), st):  # swapped since the stat
        dst.unlink()
        return False
    return True


def _copy(
    base: Base, name: str, size: int, dst: Path, syncing: list[Future[None]], sync: bool
) -> bool:
    """Copy a base file whole (where links are impossible); its fsync joins ``syncing``."""
    try:
        where = base.ck.path / name
        src = opener.open_member(base.ck.dir_fd, name, where, size=size)
    except (OSError, CheckpointError):
        return False
    try:
        out = durable.open_new(dst)
        try:
            if durable.copy_range(src, out, size, writeback=sync) != size:
                raise CheckpointError(f"{where}: shorter than its recorded size")
        except BaseException:
            os.close(out)
            raise
        durable.close_new(out, sync, syncing)
    finally:
        os.close(src)
    return True


def reused_info(directory: Path) -> dict[str, dict[str, Any]]:
    """The ``files`` marks of data files reused from a base, and of copies (one link)."""
    out: dict[str, dict[str, Any]] = {}
    for n in os.listdir(directory):
        shard = parse_shard(n)
        if shard is not None and shard[1] >= 1:  # files a save reuses from a base: n >= 1
            out[n] = {"reused": True}
            if os.stat(directory / n, follow_symlinks=False).st_nlink == 1:
                out[n]["copied"] = True
    return out


def write_rank(
    tmp: Path,
    rank: int,
    base: Base | None,
    keys: Sequence[Key],
    tensors: Sequence[torch.Tensor],
    idents: Sequence[Ident | None],
    *,
    after_each: Callable[[int], None] | None = None,
    syncing: list[Future[None]] | None = None,
    blobs: Sequence[ByteEntry] = (),
    sync: bool = True,
    live: bool = False,
    zstd_level: int = 0,
) -> tuple[list[Chunk], list[ByteEntry], list[Segment]]:
    """Write one rank's chunks into ``tmp``, unchanged ones from the base, then ``blobs``."""
    background: list[Future[None]] = [] if syncing is None else syncing
    reused = place(
        base, unchanged_chunks(base, keys, tensors, idents, live), tmp, rank, background, sync
    )
    todo = [i for i, c in enumerate(reused) if c is None]
    if after_each is not None:
        for i, c in enumerate(reused):
            if c is not None:
                after_each(i)
    located: list[ByteEntry] = []
    segments: list[Segment] = []
    if todo or base is None or blobs:
        each = None if after_each is None else (lambda j: after_each(todo[j]))
        fresh, located, segments = shards.write_shard(
            tmp / shard_name(rank),
            [tensors[i] for i in todo],
            [keys[i][1] for i in todo],
            after_each=each,
            background=background if syncing is not None else None,
            blobs=blobs,
            sync=sync,
            live=live,
            zstd_level=zstd_level,
        )
        for i, c in zip(todo, fresh, strict=True):
            reused[i] = c
    if syncing is None:
        for fut in background:
            fut.result()
    return [c for c in reused if c is not None], located, segments


def closing(base: Base | None) -> contextlib.AbstractContextManager[Any]:
    """Close the base once the save is done with it."""
    return contextlib.closing(base) if base is not None else contextlib.nullcontext()
