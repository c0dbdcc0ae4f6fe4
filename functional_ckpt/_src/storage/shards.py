"""Shard files: tensor blobs written with checksums, read back checked at the manifest's offsets."""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from ctypes import string_at
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeAlias

from functional_ckpt._src.format.blobs import BlobTemplate, blob_template, byte_view
from functional_ckpt._src.format.checksum import crc32
from functional_ckpt._src.format.dcp_values import ByteEntry
from functional_ckpt._src.format.manifest import Chunk
from functional_ckpt._src.format.segments import Segment
from functional_ckpt._src.limits import LIMITS
from functional_ckpt._src.storage import durable, zstd
from functional_ckpt._src.storage.live import LiveReader
from functional_ckpt._src.threads import BackgroundThread, wait_quietly
from functional_ckpt.errors import CheckpointError

if TYPE_CHECKING:
    import torch

SMALL_TENSOR = 1 << 20  # smaller tensors are assembled in memory and written in batches
WRITE_BATCH = 8 << 20  # batched small writes are flushed once this many bytes are pending
CHUNK = 32 << 20  # large tensors are checksummed in chunks of this size, overlapping I/O

_pack_crc = struct.Struct("<I").pack_into  # a CRC32 into zip records, as BlobTemplate.patch
_CRC = BackgroundThread("fc-crc")


def crc_chunks(view: memoryview, start: int = 0) -> int:
    crc = start
    for off in range(0, len(view), CHUNK):
        crc = crc32(view[off : off + CHUNK], crc)
    return crc


def write_shard(
    path: Path,
    tensors: Iterable[torch.Tensor],
    offsets: Sequence[tuple[int, ...]] | None = None,
    *,
    after_each: Callable[[int], None] | None = None,
    background: list[Future[None]] | None = None,
    blobs: Sequence[ByteEntry] = (),
    sync: bool = True,
    live: bool = False,
    zstd_level: int = 0,
) -> Shard:
    """Write tensors (contiguous, on CPU) and then ``blobs`` as DCP blobs into a new file; return
    where each landed with its checksums. ``live``: tensors read only through the kernel."""
    name = path.name
    chunks: list[Chunk] = []
    located: list[ByteEntry] = []
    segments: list[Segment] = []
    fd = durable.open_new(path)
    fut: Future[int] | None = None
    readers = (LiveReader(), LiveReader()) if live else None  # this thread's, the pool's
    try:
        pending = bytearray()
        pos = 0  # where the next blob starts
        start = 0  # where ``pending`` starts; it holds small blobs from ``small`` on
        small = -1
        out = durable.Appender(fd, sync=sync)
        pool = _CRC.pool()
        # this file's templates by (dtype, shape), without a cache lookup per tensor
        templates: dict[tuple[torch.dtype, tuple[int, ...]], BlobTemplate] = {}
        new = tuple.__new__
        for i, t in enumerate(tensors):
            shape = tuple(t.shape)
            tpl = templates.get((t.dtype, shape))
            if tpl is None:
                tpl = templates[t.dtype, shape] = blob_template(t.dtype, shape)
            box = (0,) * len(shape) if offsets is None else offsets[i]
            if zstd_level:
                _flush(out, pending, start, small, segments)
                reader = readers[0] if readers else None
                chunks.append(zstd.write_blob(out, tpl, t, zstd_level, (box, name, pos), reader))
                pos = start = out.end
                small = -1
                if after_each is not None:
                    after_each(i)
                continue
            if tpl.nbytes < SMALL_TENSOR:
                if not (t.is_cpu and t.is_contiguous()):
                    raise CheckpointError(f"internal: tensor {i} is not contiguous host memory")
                data: bytes | memoryview = (  # a copy of a few bytes costs less than a view
                    readers[0].copy(byte_view(t))
                    if readers is not None
                    else string_at(t.data_ptr(), tpl.nbytes)
                    if tpl.nbytes < 4096
                    else byte_view(t)
                )
                crc = crc32(data)
                if small < 0:
                    small = len(pending)
                pending += tpl.head
                pending += data
                at = len(pending)
                pending += tpl.tail  # its CRC32 fields patched in place
                for p in tpl.crc_positions:
                    _pack_crc(pending, at + p, crc)
                tail: bytes | bytearray = pending[at:]
                if len(pending) >= WRITE_BATCH:
                    start, small = _flush(out, pending, start, small, segments), -1
            else:
                data = byte_view(t)
                if len(data) != tpl.nbytes:
                    raise CheckpointError(
                        f"internal: tensor {i} has {len(data)} bytes, expected {tpl.nbytes}"
                    )
                pending += tpl.head  # after the segment: it is the large blob's
                start, small = _flush(out, pending, start, small, segments, len(tpl.head)), -1
                crc_of = crc_chunks if readers is None else readers[1].crc
                fut = pool.submit(crc_of, data)
                for off in range(0, len(data), durable.COPY_BLOCK):  # the disk starts on
                    out.write(data[off : off + durable.COPY_BLOCK])  # each block at once
                crc, fut = fut.result(), None
                tail = tpl.patch(crc)
                pending += tail  # written with what follows
                start = out.end
            length = len(tpl.head) + tpl.nbytes + len(tail)
            hcrc = crc32(tail, tpl.head_crc)
            chunks.append(  # one per tensor: made without the named tuple's __new__
                new(
                    Chunk,
                    (box, shape, name, pos, length, pos + len(tpl.head), tpl.nbytes, crc, hcrc, 0),
                )
            )
            pos += length
            if after_each is not None:
                after_each(i)
        for b in blobs:
            located.append(b.located(name, pos))
            pending += b.data
            pos += len(b.data)
        if pending:
            _flush(out, pending, start, small, segments)
    except BaseException:
        os.close(fd)
        if fut is not None:  # the checksum thread reads the tensor: let it finish first
            wait_quietly(fut)
        raise
    finally:
        if readers is not None:  # the pool is done with its reader (waited for above)
            for r in readers:
                r.close()
    durable.close_new(fd, sync, background)
    return Shard(chunks, located, segments)


class Shard(NamedTuple):
    """What :func:`write_shard` wrote: tensors' chunks, values' entries, run checksums."""

    chunks: list[Chunk]
    located: list[ByteEntry]
    segments: list[Segment]


def _flush(
    out: durable.Appender,
    pending: bytearray,
    start: int,
    small: int,
    segments: list[Segment],
    after: int = 0,
) -> int:
    """Write and clear ``pending`` (file bytes from ``start``), returning the file's end; its small
    blobs from ``small`` on, but its last ``after`` bytes, make one segment."""
    end = len(pending) - after
    if 0 <= small < end and end - small <= LIMITS.segment_bytes:
        run = memoryview(pending)[small:end]
        segments.append(Segment(start + small, len(run), crc32(run)))
        run.release()
    out.write(pending)
    pending.clear()
    return out.end


def read_into(fd: int, offset: int, dest: memoryview) -> int:
    """Fill ``dest`` from ``fd`` at ``offset``; returns the bytes actually read."""
    done = 0
    while done < len(dest):
        n = os.preadv(fd, [dest[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


#: Where one blob's raw bytes land: a buffer, or a contiguous CPU tensor (its own bytes).
Landing: TypeAlias = "memoryview | torch.Tensor"
ReadJob = tuple[Chunk, Landing]  # a blob's chunk and where exactly its raw bytes land
Ready = Callable[[int, int], None]  # ready(address, end): once those bytes may be written

READ_WINDOW = 8 << 20  # at most this many bytes of small blobs read with one call
READ_BLOCK = 8 << 20  # a large blob read into memory being faulted in, a block at a time
READ_GAP = 64 << 10  # a run read with one call skips at most this many bytes


def _landing_view(dest: Landing) -> memoryview:
    """``dest`` as a writable buffer of exactly its bytes."""
    if isinstance(dest, memoryview):
        return dest
    n = _landing_size(dest)
    if not n:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * n).from_address(dest.data_ptr())).cast("B")


def _landing_size(dest: Landing) -> int:
    if isinstance(dest, memoryview):
        return dest.nbytes
    if not dest.is_contiguous():
        raise CheckpointError("internal: a tensor landing place must be contiguous")
    return dest.nbytes


def read_tensors(
    fd: int,
    jobs: Sequence[ReadJob],
    segments: Sequence[Segment] = (),
    *,
    ready: Ready | None = None,
) -> list[str | None]:
    """Read blobs from one opened file into place, checking every byte: per job None or fault."""
    results: list[str | None] = [None] * len(jobs)
    for chunk, dest in jobs:
        if (n := _landing_size(dest)) != chunk.nbytes:
            raise CheckpointError(f"internal: landing place of {n} bytes, blob {chunk.nbytes}")
    order = sorted(range(len(jobs)), key=[c.offset for c, _ in jobs].__getitem__)
    if any(c.zstd for c, _ in jobs):  # frames are decompressed one by one, in place
        for k in (k for k in order if jobs[k][0].zstd):
            results[k] = zstd.read_blob(fd, jobs[k][0], _landing_view(jobs[k][1]), ready)
        order = [k for k in order if not jobs[k][0].zstd]
    if segments:
        order = _read_segments(fd, jobs, order, segments, results)
    futures: list[tuple[int, Future[int]]] = []
    try:
        window = bytearray()
        i = 0
        while i < len(order):
            job = jobs[order[i]][0]
            if job.length >= SMALL_TENSOR:
                results[order[i]] = _read_large(fd, jobs[order[i]], futures, order[i], ready)
                i += 1
                continue
            j = i + 1
            end = job.offset + job.length
            while j < len(order):
                nxt = jobs[order[j]][0]
                if (
                    nxt.length >= SMALL_TENSOR
                    or nxt.offset + nxt.length - job.offset > READ_WINDOW
                    or nxt.offset - end > READ_GAP  # bytes nobody wants: a new run
                ):
                    break
                end = max(end, nxt.offset + nxt.length)
                j += 1
            window = _read_run(fd, jobs, order[i:j], job.offset, end, window, results)
            i = j
        for k, fut in futures:
            if fut.result() != jobs[k][0].crc32 and results[k] is None:
                results[k] = "checksum mismatch"
    except BaseException:  # the checksum thread reads the destinations: done first
        for _, fut in futures:
            wait_quietly(fut)
        raise
    return results


def _read_segments(
    fd: int,
    jobs: Sequence[ReadJob],
    order: list[int],
    segments: Sequence[Segment],
    results: list[str | None],
) -> list[int]:
    """Read the small blobs of each segment they fill half of; return the rest in order."""
    left: list[int] = []
    window = bytearray()
    i, n = 0, len(order)
    for seg in segments:
        while i < n and jobs[order[i]][0].offset < seg.offset:
            left.append(order[i])
            i += 1
        j, used, end = i, 0, seg.offset + seg.length
        while j < n:
            c = jobs[order[j]][0]
            if c.offset + c.length > end or c.length >= SMALL_TENSOR:
                break
            used += c.length
            j += 1
        if 2 * used < seg.length:  # sparse (or nothing wanted here): blob by blob
            left += order[i:j]
        else:
            window = _read_run(fd, jobs, order[i:j], seg.offset, end, window, results, seg.crc32)
        i = j
    left += order[i:]
    return left


def _read_run(
    fd: int,
    jobs: Sequence[ReadJob],
    run: list[int],
    start: int,
    end: int,
    window: bytearray,
    results: list[str | None],
    run_crc: int | None = None,
) -> bytearray:
    """Read the file's bytes ``start..end`` into ``window`` (returned, grown as needed) and copy
    the intact blobs ``run`` to their places; ``run_crc``: a segment's, else each blob's own."""
    if len(window) < end - start:
        window = bytearray(max(end - start, 1 << 16))
    view = memoryview(window)[: end - start]
    got = view[: read_into(fd, start, view)]
    addr = ctypes.addressof(ctypes.c_char.from_buffer(window))
    framing = run_crc is None or len(got) != end - start or crc32(got) != run_crc
    crc, memmove, size = crc32, ctypes.memmove, len(got)
    for k in run:
        chunk, dest = jobs[k]
        at = chunk.offset - start
        stop = at + chunk.length
        if stop > size:
            results[k] = f"only {max(0, size - at)} of {chunk.length} bytes"
            continue
        data_at = chunk.data_offset - start
        data_end = data_at + chunk.nbytes
        if framing and crc(got[data_end:stop], crc(got[at:data_at])) != chunk.hcrc32:
            results[k] = "blob headers fail their checksum"
        elif crc(got[data_at:data_end]) != chunk.crc32:
            results[k] = "checksum mismatch"
        elif type(dest) is memoryview:
            dest[:] = got[data_at:data_end]
        elif data_end > data_at:
            memmove(dest.data_ptr(), addr + data_at, data_end - data_at)
    got.release()
    view.release()
    return window


def _read_large(
    fd: int,
    job: ReadJob,
    futures: list[tuple[int, Future[int]]],
    k: int,
    ready: Ready | None,
) -> str | None:
    chunk, landing = job
    dest = _landing_view(landing)
    if ready is None:
        n = read_into(fd, chunk.data_offset, dest)
    else:
        base, n = ctypes.addressof(ctypes.c_char.from_buffer(dest)), 0
        for off in range(0, len(dest), READ_BLOCK):
            block = dest[off : off + READ_BLOCK]
            ready(base, off + len(block))
            got = read_into(fd, chunk.data_offset + off, block)
            block.release()
            n += got
            if got < READ_BLOCK:
                break
    if n != len(dest):
        return f"only {n} of {len(dest)} bytes"
    futures.append((k, _CRC.pool().submit(crc_chunks, dest)))
    head = os.pread(fd, chunk.data_offset - chunk.offset, chunk.offset)
    end = chunk.data_offset + len(dest)
    tail = os.pread(fd, chunk.offset + chunk.length - end, end)
    if crc32(tail, crc32(head)) != chunk.hcrc32:
        return "blob headers fail their checksum"
    return None
