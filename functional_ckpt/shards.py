"""Tensor shard files that are both ours and a real DCP checkpoint.

Stock ``torch.distributed.checkpoint`` stores every tensor as a ``torch.save`` zip
blob inside a shard file and finds it through ``.metadata``. Running ``torch.save``
once per tensor is what makes DCP slow on many small tensors, so we write the same
bytes ourselves: ``torch.save`` (with ``skip_data``) produces the zip around an
empty tensor of each distinct (dtype, shape) once, and every tensor of that shape
is emitted as that template with its raw bytes in the data record and the CRC32
fields patched. The CRC32 we compute for the zip is the checksum the manifest
records, so checksumming costs one pass that runs beside the disk write.

Readers of our own checkpoints never parse the zip: the manifest gives each
tensor's absolute data offset, so restore reads raw bytes straight into the
destination tensor.
"""

from __future__ import annotations

import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from functional_ckpt.checksum import crc32
from functional_ckpt.dcpbytes import ByteEntry
from functional_ckpt.errors import CheckpointError
from functional_ckpt.manifest import Chunk

#: Tensors below this size are assembled in memory and written in batches.
SMALL_TENSOR = 1 << 20
#: Batched small writes are flushed once this many bytes are pending.
WRITE_BATCH = 8 << 20
#: Large tensors are written and checksummed in chunks of this size, overlapped.
CHUNK = 32 << 20
#: Bytes read per step when checksumming a file range (the buffer stays in cache).
CRC_BLOCK = 4 << 20

_LOCAL_SIG = b"PK\x03\x04"
_CENTRAL_SIG = b"PK\x01\x02"
_DESCRIPTOR_SIG = b"PK\x07\x08"
_DATA_RECORD_SUFFIX = b"/data/0"


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (writable)."""
    if t.numel() == 0:
        return memoryview(b"")
    flat = t.detach()
    try:  # dtypes numpy knows: one call, no reshaping views
        array: Any = flat.numpy()
    except TypeError:  # bfloat16, float8, ...: reinterpret as bytes first
        array = flat.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")


class _SparseWriter:
    """A seekable sink that keeps what ``torch.save`` writes, skipping the data gap."""

    def __init__(self) -> None:
        self.parts: list[tuple[int, bytes]] = []
        self.pos = 0

    def write(self, b: Any) -> int:
        data = bytes(memoryview(b).cast("B"))
        self.parts.append((self.pos, data))
        self.pos += len(data)
        return len(data)

    def seek(self, off: int, whence: int = 0) -> int:
        self.pos = off if whence == 0 else self.pos + off if whence == 1 else self.pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


@dataclass(frozen=True)
class BlobTemplate:
    """The ``torch.save`` zip of one (dtype, shape), minus the tensor bytes."""

    head: bytes
    tail: bytes
    nbytes: int
    crc_positions: tuple[int, ...]  # offsets in ``tail`` of the data record's CRC32 fields
    head_crc: int  # CRC32 of ``head``: the start of every blob's header checksum

    def patch(self, crc: int) -> bytes:
        tail = bytearray(self.tail)
        packed = struct.pack("<I", crc)
        for pos in self.crc_positions:
            tail[pos : pos + 4] = packed
        return bytes(tail)


def _build_template(dtype: torch.dtype, shape: tuple[int, ...]) -> BlobTemplate:
    sink = _SparseWriter()
    with torch.serialization.skip_data():
        torch.save(torch.empty(shape, dtype=dtype), sink)  # type: ignore[arg-type]
    image = bytearray(sink.pos)
    for off, data in sink.parts:
        image[off : off + len(data)] = data
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    start = -1
    i = image.find(_LOCAL_SIG)
    while i >= 0:
        name_len, extra_len = struct.unpack_from("<HH", image, i + 26)
        name = bytes(image[i + 30 : i + 30 + name_len])
        if name.endswith(_DATA_RECORD_SUFFIX):
            flags = struct.unpack_from("<H", image, i + 6)[0]
            if not flags & 0x8 and nbytes:
                raise CheckpointError("unexpected torch.save zip layout (no data descriptor)")
            start = i + 30 + name_len + extra_len
            break
        i = image.find(_LOCAL_SIG, i + 4)
    if start < 0:
        raise CheckpointError("unexpected torch.save zip layout (no data record)")
    end = start + nbytes
    tail = bytes(image[end:])
    positions = []
    if tail.startswith(_DESCRIPTOR_SIG):
        positions.append(4)
    j = tail.find(_CENTRAL_SIG)
    while j >= 0:
        name_len = struct.unpack_from("<H", tail, j + 28)[0]
        if tail[j + 46 : j + 46 + name_len].endswith(_DATA_RECORD_SUFFIX):
            positions.append(j + 16)
        j = tail.find(_CENTRAL_SIG, j + 4)
    if nbytes == 0:
        positions = []  # CRC32 of no bytes is 0, already in the template
    elif len(positions) != 2:
        raise CheckpointError("unexpected torch.save zip layout (CRC fields not found)")
    head = bytes(image[:start])
    return BlobTemplate(head, tail, nbytes, tuple(positions), crc32(head))


_TEMPLATES: OrderedDict[tuple[torch.dtype, tuple[int, ...]], BlobTemplate] = OrderedDict()
_TEMPLATES_LOCK = threading.Lock()
_TEMPLATE_CACHE_SIZE = 8192


def blob_template(dtype: torch.dtype, shape: tuple[int, ...]) -> BlobTemplate:
    key = (dtype, shape)
    with _TEMPLATES_LOCK:
        tpl = _TEMPLATES.get(key)
        if tpl is not None:
            _TEMPLATES.move_to_end(key)
            return tpl
    tpl = _build_template(dtype, shape)
    with _TEMPLATES_LOCK:
        _TEMPLATES[key] = tpl
        while len(_TEMPLATES) > _TEMPLATE_CACHE_SIZE:
            _TEMPLATES.popitem(last=False)
    return tpl


def _write_all(fd: int, data: memoryview | bytes | bytearray) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def checksum_pool() -> ThreadPoolExecutor:
    """One background thread that checksums while the caller does I/O."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(1, thread_name_prefix="fc-crc")
        return _POOL


_SYNC_POOL: ThreadPoolExecutor | None = None


def sync_pool() -> ThreadPoolExecutor:
    """One background thread that fsyncs files while the caller computes (fsync drops the GIL)."""
    global _SYNC_POOL
    with _POOL_LOCK:
        if _SYNC_POOL is None:
            _SYNC_POOL = ThreadPoolExecutor(1, thread_name_prefix="fc-fsync")
        return _SYNC_POOL


def fsync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _crc_chunks(view: memoryview, start: int = 0) -> int:
    crc = start
    for off in range(0, len(view), CHUNK):
        crc = crc32(view[off : off + CHUNK], crc)
    return crc


def write_shard(
    path: Path,
    tensors: Iterable[torch.Tensor],
    chunks: Sequence[Chunk],
    *,
    after_each: Callable[[int], None] | None = None,
    background: list[Future[None]] | None = None,
    blobs: Sequence[ByteEntry] = (),
) -> None:
    """Write tensors (contiguous, on CPU) as DCP blobs into a new file, fsynced.

    Tensor ``i`` holds the bytes of ``chunks[i]``, whose location and checksums
    are filled in here. ``blobs`` (values as DCP byte entries) follow the
    tensors; their location and CRC32 are filled in too. ``after_each(i)`` runs
    once tensor ``i`` is fully written (version checks of unstaged saves hook in
    here). With ``background``, the fsync runs on :func:`sync_pool` and its
    future is appended there: the file is durable once that future is done.
    """
    name = path.name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        pending = bytearray()
        pos = 0
        pool = checksum_pool()
        for i, t in enumerate(tensors):
            tpl = blob_template(t.dtype, tuple(t.shape))
            data = byte_view(t)
            if len(data) != tpl.nbytes:
                raise CheckpointError(
                    f"internal: tensor {i} has {len(data)} bytes, expected {tpl.nbytes}"
                )
            if tpl.nbytes < SMALL_TENSOR:
                crc = crc32(data)
                tail = tpl.patch(crc)
                pending += tpl.head
                pending += data
                pending += tail
                if len(pending) >= WRITE_BATCH:
                    _write_all(fd, pending)
                    pending.clear()
            else:
                if pending:
                    _write_all(fd, pending)
                    pending.clear()
                fut: Future[int] = pool.submit(_crc_chunks, data)
                _write_all(fd, tpl.head)
                _write_all(fd, data)
                crc = fut.result()
                tail = tpl.patch(crc)
                _write_all(fd, tail)
            length = len(tpl.head) + tpl.nbytes + len(tail)
            c = chunks[i]
            c.file = name
            c.offset = pos
            c.length = length
            c.data_offset = pos + len(tpl.head)
            c.nbytes = tpl.nbytes
            c.crc32 = crc
            c.hcrc32 = crc32(tail, tpl.head_crc)
            pos += length
            if after_each is not None:
                after_each(i)
        for b in blobs:
            b.file, b.offset, b.length, b.crc32 = name, pos, len(b.data), crc32(b.data)
            pending += b.data
            pos += len(b.data)
        if pending:
            _write_all(fd, pending)
    except BaseException:
        os.close(fd)
        raise
    if background is None:
        fsync_and_close(fd)
    else:
        background.append(sync_pool().submit(fsync_and_close, fd))


# --------------------------------------------------------------------------- reading


def read_into(fd: int, offset: int, dest: memoryview) -> int:
    """Fill ``dest`` from ``fd`` at ``offset``; returns the bytes actually read."""
    done = 0
    total = len(dest)
    while done < total:
        n = os.preadv(fd, [dest[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


#: One blob to read: the chunk it holds and where its raw bytes land (exactly their size).
ReadJob = tuple[Chunk, memoryview]


#: Small blobs that lie together in the file are read with one call of this size.
READ_WINDOW = 8 << 20


def read_tensors(fd: int, jobs: Sequence[ReadJob]) -> list[str | None]:
    """Read blobs from one opened file into their destinations, checking every byte.

    Returns, per job, None when the blob arrived intact, else what is wrong.
    Small blobs are read in large windows; large ones straight into place while
    the previous one is checksummed in the background. ``fd`` stays open (it is
    the checkpoint's, opened safely; positional reads let threads share it).
    """
    results: list[str | None] = [None] * len(jobs)
    pool = checksum_pool()
    order = sorted(range(len(jobs)), key=lambda k: jobs[k][0].offset)
    futures: list[tuple[int, Future[int]]] = []
    i = 0
    while i < len(order):
        job = jobs[order[i]][0]
        if job.length >= SMALL_TENSOR:
            results[order[i]] = _read_large(fd, jobs[order[i]], pool, futures, order[i])
            i += 1
            continue
        j = i + 1
        end = job.offset + job.length
        while j < len(order):
            nxt = jobs[order[j]][0]
            if nxt.length >= SMALL_TENSOR or nxt.offset + nxt.length - job.offset > READ_WINDOW:
                break
            end = max(end, nxt.offset + nxt.length)
            j += 1
        window = os.pread(fd, end - job.offset, job.offset)
        for k in order[i:j]:
            results[k] = _check_small(jobs[k], memoryview(window), job.offset)
        i = j
    for k, fut in futures:
        if fut.result() != jobs[k][0].crc32 and results[k] is None:
            results[k] = "checksum mismatch"
    return results


def _check_small(job: ReadJob, window: memoryview, base: int) -> str | None:
    chunk, dest = job
    start = chunk.offset - base
    if start + chunk.length > len(window):
        return f"only {max(0, len(window) - start)} of {chunk.length} bytes"
    data_at = chunk.data_offset - base
    data = window[data_at : data_at + len(dest)]
    head = window[start:data_at]
    tail = window[data_at + len(dest) : start + chunk.length]
    if crc32(tail, crc32(head)) != chunk.hcrc32:
        return "blob headers fail their checksum"
    if crc32(data) != chunk.crc32:
        return "checksum mismatch"
    dest[:] = data
    return None


def _read_large(
    fd: int, job: ReadJob, pool: ThreadPoolExecutor, futures: list[tuple[int, Future[int]]], k: int
) -> str | None:
    chunk, dest = job
    n = read_into(fd, chunk.data_offset, dest)
    if n != len(dest):
        return f"only {n} of {len(dest)} bytes"
    futures.append((k, pool.submit(_crc_chunks, dest)))
    head = os.pread(fd, chunk.data_offset - chunk.offset, chunk.offset)
    end = chunk.data_offset + len(dest)
    tail = os.pread(fd, chunk.offset + chunk.length - end, end)
    if crc32(tail, crc32(head)) != chunk.hcrc32:
        return "blob headers fail their checksum"
    return None


def _reset_after_fork() -> None:
    global _POOL, _POOL_LOCK, _SYNC_POOL
    _POOL = _SYNC_POOL = None
    _POOL_LOCK = threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def crc_range(fd: int, offset: int, length: int, start: int = 0) -> tuple[int, int]:
    """CRC32 over a file range; returns (crc, bytes read).

    The range is read (by :func:`read_into`) into one reused buffer: a fresh
    buffer per read costs its page faults, several times the time of the read and
    the checksum together.
    """
    view = memoryview(bytearray(min(CRC_BLOCK, max(length, 0))))
    crc = start
    done = 0
    while done < length:
        n = read_into(fd, offset + done, view[: min(CRC_BLOCK, length - done)])
        if not n:
            break
        crc = crc32(view[:n], crc)
        done += n
    return crc, done
