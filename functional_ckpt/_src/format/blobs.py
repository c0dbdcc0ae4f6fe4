"""The bytes of one tensor as stock DCP stores it: a ``torch.save`` zip blob.

``torch.save`` per tensor makes DCP slow on many small tensors, so the zip of each
(dtype, shape) is built once and filled per tensor (:class:`BlobTemplate`).
"""

from __future__ import annotations

import ctypes
import functools
import io
import struct
import sys
import zipfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from functional_ckpt._src.format.checksum import crc32
from functional_ckpt.errors import CheckpointError

if TYPE_CHECKING:
    import torch

_LOCAL_SIG = b"PK\x03\x04"
_CENTRAL_SIG = b"PK\x01\x02"
_DESCRIPTOR_SIG = b"PK\x07\x08"
_END_SIG = b"PK\x05\x06"
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_DESCRIPTOR = struct.Struct("<4sIII")
_END = struct.Struct("<4sHHHHIIH")
_DATA_RECORD_SUFFIX = b"/data/0"
_PREFIX = "archive/"  # the record prefix of fc's blobs, the one ``torch.save`` gives a stream
_COMPACT_LIMIT = 1 << 31  # below this, no size or offset of the blob needs zip64
_DATE = (1 << 5) | 1  # 1980-01-01, the zip epoch, in MS-DOS date format


def bytes_are_values(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory holds exactly its values, in order: only then are its bytes used."""
    return t.is_cpu and t.is_contiguous() and not (t.is_conj() or t.is_neg())


def lands_raw(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a stored blob of ``dtype`` may be read straight into ``t``."""
    return t.dtype == dtype and bytes_are_values(t)


def byte_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (writable). Not ``t.numpy()``:
    numpy marks the storage never resizable again (a save must leave the state as it was)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    array = (ctypes.c_char * n).from_address(t.data_ptr())
    array._tensor = t  # type: ignore[attr-defined]  # the view holds the tensor
    return memoryview(array).cast("B")


class _Sparse(io.RawIOBase):
    """A seekable file keeping only what is written, read back with zeros in the gaps."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[tuple[int, bytes]] = []
        self.pos = self.size = 0

    def write(self, b: Any) -> int:
        data = bytes(memoryview(b).cast("B"))
        self.parts.append((self.pos, data))
        self.pos += len(data)
        self.size = max(self.size, self.pos)
        return len(data)

    def seek(self, off: int, whence: int = 0) -> int:
        base = 0 if whence == 0 else self.pos if whence == 1 else self.size
        self.pos = max(0, base + off)
        return self.pos

    def readinto(self, b: Any) -> int:
        out = memoryview(b).cast("B")
        n = max(0, min(len(out), self.size - self.pos))
        out[:n] = bytes(n)
        start, end = self.pos, self.pos + n
        for off, data in self.parts:  # in write order: a later write wins
            lo, hi = max(off, start), min(off + len(data), end)
            if lo < hi:
                out[lo - start : hi - start] = data[lo - off : hi - off]
        self.pos = end
        return n


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


def _saved_empty(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[_Sparse, int]:
    """What ``torch.save`` writes for this spec (the data left out), and its byte size."""
    import torch

    sink = _Sparse()
    with torch.serialization.skip_data():
        torch.save(torch.empty(shape, dtype=dtype), sink)  # type: ignore[arg-type]
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return sink, nbytes


def _compact_template(sink: _Sparse, nbytes: int) -> BlobTemplate:
    """The records ``torch.load`` reads, taken from ``torch.save``'s zip and framed anew."""
    with zipfile.ZipFile(sink) as z:
        names = z.namelist()
        pickles = [n for n in names if n.endswith("/data.pkl")]
        prefix = pickles[0][: -len("data.pkl")] if len(pickles) == 1 else ""
        versions = [v for v in ("version", ".data/version") if prefix + v in names]
        if not prefix or not versions:
            raise CheckpointError(f"unexpected torch.save zip layout (records {names})")
        records = [(_PREFIX + "data.pkl", z.read(pickles[0]))]
        records.append((_PREFIX + versions[0], z.read(prefix + versions[0])))
    if sys.byteorder != "little":
        records.append((_PREFIX + "byteorder", sys.byteorder.encode()))
    head = bytearray()
    central = bytearray()

    def entry(name: bytes, flags: int, crc: int, size: int) -> None:
        fields = (20, 20, flags, 0, 0, _DATE, crc, size, size, len(name), 0, 0, 0, 0, 0)
        central.extend(_CENTRAL.pack(_CENTRAL_SIG, *fields, len(head)) + name)

    for name, data in records:
        crc = crc32(data)
        entry(name.encode(), 0, crc, len(data))
        head += _LOCAL.pack(_LOCAL_SIG, 20, 0, 0, 0, _DATE, crc, len(data), len(data), len(name), 0)
        head += name.encode() + data
    data_name = (_PREFIX + "data/0").encode()
    data_crc_at = len(central) + 16
    entry(data_name, 0x8, 0, nbytes)
    head += _LOCAL.pack(_LOCAL_SIG, 20, 0x8, 0, 0, _DATE, 0, 0, 0, len(data_name), 0)
    head += data_name
    tail = bytearray(_DESCRIPTOR.pack(_DESCRIPTOR_SIG, 0, nbytes, nbytes))
    data_crc_at += len(tail)
    cd_offset = len(head) + nbytes + len(tail)
    n = len(records) + 1
    tail += central
    tail += _END.pack(_END_SIG, 0, 0, n, n, len(central), cd_offset, 0)
    positions = (4, data_crc_at) if nbytes else ()  # CRC32 of no bytes is 0, as written
    return BlobTemplate(bytes(head), bytes(tail), nbytes, positions, crc32(bytes(head)))


def _torch_save_template(sink: _Sparse, nbytes: int) -> BlobTemplate:
    """``torch.save``'s own zip (zip64 where the size needs it), bytes left out."""
    sink.seek(0)
    image = bytearray(sink.readall())
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


@functools.lru_cache(maxsize=8192)
def blob_template(dtype: torch.dtype, shape: tuple[int, ...]) -> BlobTemplate:
    """The template of every tensor of this dtype and shape (built once: a pure function)."""
    sink, nbytes = _saved_empty(dtype, shape)
    if nbytes < _COMPACT_LIMIT:
        return _compact_template(sink, nbytes)
    return _torch_save_template(sink, nbytes)
