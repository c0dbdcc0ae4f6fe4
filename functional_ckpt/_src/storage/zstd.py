"""Tensor blobs as zstd frames, as DCP's own ``ZStandard`` extension writes them. ``hcrc32``
covers the frame, ``crc32`` the tensor's bytes; nothing decompresses beyond its entry."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from functional_ckpt._src.format.blobs import BlobTemplate, byte_view
from functional_ckpt._src.format.checksum import crc32
from functional_ckpt._src.format.entries import ZSTD_HEAD
from functional_ckpt._src.format.manifest import Chunk
from functional_ckpt._src.storage.live import BLOCK  # bytes (de)compressed per step
from functional_ckpt.errors import CheckpointError

if TYPE_CHECKING:
    import torch

    from functional_ckpt._src.storage.durable import Appender
    from functional_ckpt._src.storage.live import LiveReader

#: The level ``compression="zstd"`` means (benchmarks/compression.py: on trained model
#: state level 1 compresses within 0.5% of level 3 at 1.6-2x its speed).
DEFAULT_LEVEL = 1


def _module() -> Any:
    try:
        import zstandard
    except ImportError as err:
        raise CheckpointError(
            "zstd compression needs the zstandard package (pip install zstandard)"
        ) from err
    return zstandard


def level_of(compression: object, what: str) -> int:
    """The zstd level of a ``compression=`` argument (None: 0, ``"zstd"``, ``"zstd:N"``)."""
    if compression is None:
        return 0
    if isinstance(compression, str) and compression.partition(":")[0] == "zstd":
        _, colon, level = compression.partition(":")
        ascii_digits = level.isascii() and level.isdigit()
        n = int(level) if ascii_digits else DEFAULT_LEVEL if not colon else -1
        if 1 <= n <= 19:
            _module()
            return n
    raise ValueError(
        f"{what}(compression={compression!r}): expected None, 'zstd' or 'zstd:N' (level 1-19)"
    )


def write_blob(
    out: Appender,
    tpl: BlobTemplate,
    t: torch.Tensor,
    level: int,
    at: tuple[tuple[int, ...], str, int],
    reader: LiveReader | None,
) -> Chunk:
    """Write ``t``'s blob as one zstd frame; ``at``: the chunk's box, file name and offset."""
    box, name, pos = at
    data = byte_view(t)
    if len(data) != tpl.nbytes:
        raise CheckpointError(f"internal: a tensor of {len(data)} bytes, expected {tpl.nbytes}")
    z = _module().ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
    comp = z.compressobj(size=len(tpl.head) + tpl.nbytes + len(tpl.tail))
    stored = [0, 0]  # crc, length

    def emit(b: bytes) -> None:
        if b:
            out.write(b)
            stored[0] = crc32(b, stored[0])
            stored[1] += len(b)

    emit(comp.compress(tpl.head))
    crc = 0
    for off in range(0, len(data), BLOCK):
        block: memoryview | bytes = data[off : off + BLOCK]
        if reader is not None:  # the caller's live memory: read through the kernel
            block = reader.copy(block)  # type: ignore[arg-type]
        crc = crc32(block, crc)
        emit(comp.compress(block))
    emit(comp.compress(tpl.patch(crc)))
    emit(comp.flush())
    return Chunk(box, tuple(t.shape), name, pos, stored[1], pos + len(tpl.head), tpl.nbytes, crc,
                 stored[0], 1)  # fmt: skip


class _Stored:
    """A frame's stored bytes, read from ``fd`` as the decompressor asks, their CRC32 kept."""

    def __init__(self, fd: int, chunk: Chunk) -> None:
        self.fd, self.pos, self.end, self.crc = fd, chunk.offset, chunk.offset + chunk.length, 0

    def read(self, n: int = -1) -> bytes:
        want = self.end - self.pos if n < 0 else min(n, self.end - self.pos)
        b = os.pread(self.fd, want, self.pos) if want > 0 else b""
        self.pos += len(b)
        self.crc = crc32(b, self.crc)
        return b

    def drain(self) -> None:
        while self.pos < self.end and self.read(BLOCK):
            pass


def read_blob(
    fd: int, chunk: Chunk, dest: memoryview, ready: Callable[[int, int], None] | None = None
) -> str | None:
    """Decompress ``chunk``'s frame into ``dest``: None if every byte checked out, else why not."""
    if ready is not None and len(dest):
        ready(ctypes.addressof(ctypes.c_char.from_buffer(dest)), len(dest))
    stored = _Stored(fd, chunk)
    problem = None
    try:
        with _module().ZstdDecompressor().stream_reader(stored, read_size=BLOCK) as r:
            head = chunk.data_offset - chunk.offset
            if len(_read_exact(r, memoryview(bytearray(head)))) != head:
                problem = "the zstd frame ends inside the blob's headers"
            elif (n := len(_read_exact(r, dest))) != len(dest):
                problem = f"the zstd frame holds only {n} of {len(dest)} bytes"
            elif len(r.read(ZSTD_HEAD + 1)) > ZSTD_HEAD or r.read(1):
                problem = "the zstd frame decodes to more bytes than its entry declares"
    except CheckpointError:
        raise
    except Exception as err:  # zstandard.ZstdError, or the bytes of a forged frame
        problem = f"the zstd frame does not decode ({err})"
    stored.drain()
    if stored.crc != chunk.hcrc32 or stored.pos != stored.end:
        return "stored (compressed) bytes fail their checksum"
    if problem is None and crc32(dest) != chunk.crc32:
        problem = "checksum mismatch"
    return problem


def _read_exact(r: Any, dest: memoryview) -> memoryview:
    done = 0
    while done < len(dest):
        n = r.readinto(dest[done : done + BLOCK])
        if not n:
            break
        done += n
    return dest[:done]
