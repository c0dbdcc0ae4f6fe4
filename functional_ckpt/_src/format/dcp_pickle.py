"""The bytes of DCP's ``.metadata`` written as pickle opcodes, without DCP's objects.

At a thousand ranks, building and pickling DCP's objects per chunk was most of the
coordinator's work; here chunk records are written as numpy columns. ``pickle.load``
makes of them what :func:`.dcp_metadata.metadata_for` builds; :func:`supported`
checks that the installed torch reduces its classes as written here.
"""

from __future__ import annotations

import copyreg
import functools
import io
import operator
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from functional_ckpt._src.format.dcp_values import ByteEntry
from functional_ckpt._src.format.manifest import Chunk, TensorEntry

#: Each class's pickled state, as this writer emits it (keys in torch's order).
_STATE_KEYS: dict[str, tuple[tuple[str, ...], ...]] = {
    "Metadata": (
        ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"),
    ),
    "TensorStorageMetadata": (("properties", "size", "chunks"),),
    "ChunkStorageMetadata": (("offsets", "sizes"),),
    "MetadataIndex": (("fqn", "index", "offset"), ("fqn", "index")),
    "_StorageInfo": (("relative_path", "offset", "length"),),
}

_PACK_I = struct.Struct("<I").pack
_PACK_i = struct.Struct("<i").pack


def supported() -> bool:
    """Whether the installed torch pickles DCP's metadata as this writer emits it."""
    import torch
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint import metadata as md

    size = torch.Size([0])
    samples = [
        md.ChunkStorageMetadata(offsets=size, sizes=size),
        md.MetadataIndex("a", size, 0),
        md.MetadataIndex("a"),
        filesystem._StorageInfo("f", 0, 1),
        md.TensorStorageMetadata(md.TensorProperties(), size, []),
        md.Metadata(state_dict_metadata={}, planner_data={}, storage_data={}),
    ]

    def as_written(obj: Any) -> bool:  # copyreg.__newobj__(cls), then a dict of its fields
        got = obj.__reduce_ex__(4)
        return (
            len(got) >= 3
            and got[:2] == (copyreg.__newobj__, (type(obj),))  # type: ignore[attr-defined]
            and all(x is None for x in got[3:])
            and type(got[2]) is dict
            and tuple(got[2]) in _STATE_KEYS[type(obj).__name__]
        )

    return size.__reduce_ex__(4) == (torch.Size, ((0,),)) and all(map(as_written, samples))


def _embedded(obj: Any) -> bytes:
    """The opcodes making ``obj`` with nothing memoised (placed anywhere in a pickle)."""
    buf = io.BytesIO()
    pickler = pickle.Pickler(buf, protocol=4)
    pickler.fast = True  # no memo: the opcodes refer to nothing outside themselves
    pickler.dump(obj)
    data = buf.getvalue()
    body = data[2:-1]  # PROTO 4 ... STOP
    if body[:1] == pickle.FRAME:
        body = body[9:]
    return body


_box = operator.itemgetter(0, 1)  # a Chunk's (offsets, sizes)

_SMALL = [pickle.BININT1 + bytes((v,)) for v in range(0x100)]


def _int(v: int) -> bytes:
    if 0 <= v < 0x100:
        return _SMALL[v]
    if -0x80000000 <= v < 0x80000000:
        return pickle.BININT + _PACK_i(v)
    data = pickle.encode_long(v)
    return pickle.LONG1 + bytes((len(data),)) + data


def _get(i: int) -> bytes:
    return pickle.BINGET + bytes((i,)) if i < 0x100 else pickle.LONG_BINGET + _PACK_I(i)


class _Memo:
    """A pickle's memo as it is written: each method returns the opcodes pushing a value."""

    def __init__(self) -> None:
        self.count = 0
        self.known: dict[Any, int] = {}
        self.sizes: dict[tuple[int, ...], int] = {}  # apart: looked up once per chunk box

    def _new(self, key: Any, opcodes: bytes) -> bytes:
        self.known[key] = self.count
        self.count += 1
        return opcodes + pickle.MEMOIZE

    def string(self, text: str) -> bytes:
        got = self.known.get(text)
        if got is not None:
            return _get(got)
        data = text.encode("utf-8", "surrogatepass")
        n = len(data)
        head = (
            pickle.SHORT_BINUNICODE + bytes((n,)) if n < 0x100 else pickle.BINUNICODE + _PACK_I(n)
        )
        return self._new(text, head + data)

    def size(self, dims: Sequence[int]) -> bytes:
        """A ``torch.Size``: ``torch.Size((dims...))`` as its reduction pickles it."""
        key = dims if type(dims) is tuple else tuple(int(d) for d in dims)
        got = self.sizes.get(key)
        if got is not None:
            return _get(got)
        size = self.obj("Size", _dcp("Size")) + _tuple([_int(d) for d in key]) + pickle.TUPLE1
        self.sizes[key] = self.count
        self.count += 1
        return size + pickle.REDUCE + pickle.MEMOIZE

    def obj(self, key: Any, make: Callable[[], Any]) -> bytes:
        """A small object shared by many (a class, a dtype's properties, a version)."""
        got = self.known.get(("obj", key))
        if got is not None:
            return _get(got)
        return self._new(("obj", key), _embedded(make()))


def _dcp(name: str) -> Callable[[], Any]:
    """DCP's class ``name`` (``torch.Size`` for "Size"), imported when first pickled."""

    def cls() -> Any:
        import torch
        from torch.distributed.checkpoint import filesystem, metadata

        return getattr(
            filesystem if name == "_StorageInfo" else torch if name == "Size" else metadata, name
        )

    return cls


def write(
    groups: Sequence[Sequence[TensorEntry]], blobs: Sequence[ByteEntry], version: str | None
) -> bytes:
    """The pickle of what :func:`.dcp_metadata.metadata_for` builds, written directly."""
    m = _Memo()
    s, size, obj = m.string, m.size, m.obj
    out: list[bytes | bytearray] = [pickle.PROTO + b"\x04"]
    put = out.append
    # every class and field name memoised up front (pushed, then dropped), so that
    # the run of opcodes of each chunk's objects is the same few ``GET``s
    put(pickle.MARK)
    for name in _CLASSES:
        put(obj(name, _dcp(name)))
    bytes_md = functools.partial(_made, "BytesStorageMetadata")
    put(obj("BytesStorageMetadata", bytes_md) + obj("Size", _dcp("Size")))
    for name in _FIELDS:
        put(s(name))
    put(pickle.POP_MARK)
    md_cls, tensor_cls, chunk_cls, index_cls, info_cls = (obj(n, _dcp(n)) for n in _CLASSES)
    value = obj("BytesStorageMetadata", bytes_md)
    new = pickle.EMPTY_TUPLE + pickle.NEWOBJ
    state = pickle.EMPTY_DICT + pickle.MARK
    end = pickle.SETITEMS + pickle.BUILD
    chunk_pre, k_sizes = chunk_cls + new + state + s("offsets"), s("sizes")
    tensor_pre = tensor_cls + new
    k_props, k_size, k_chunks = s("properties"), s("size"), s("chunks")
    entries = [e for group in groups for e in group]

    put(md_cls + new + state + s("state_dict_metadata") + pickle.EMPTY_DICT + pickle.MARK)
    whole_md: dict[tuple[str, tuple[int, ...]], bytes] = {}
    # a layout of chunk boxes met before (a weight and its moments, equal layers):
    # its chunks' opcodes (GETs) and each chunk's offsets' memo index, made once
    layouts: dict[Any, tuple[bytes, np.ndarray]] = {}
    of_entry: list[np.ndarray] = []

    def boxes(chunks: Sequence[Chunk]) -> bytes:
        layout = tuple(map(_box, chunks))
        got = layouts.get(layout)
        if got is not None:
            of_entry.append(got[1])
            return got[0]
        # the first time memoises the sizes, the second is GETs only
        first, again = (
            b"".join([chunk_pre + size(o) + k_sizes + size(z) + end for o, z in layout])
            for _ in "12"
        )
        layouts[layout] = (again, np.array([m.sizes[o] for o, _ in layout], _MEMO))
        of_entry.append(layouts[layout][1])
        return first

    for e in entries:
        chunks, shape = e.chunks, e.shape
        put(s(e.fqn))
        # one chunk at the origin of a tensor's own shape is shared by equal tensors
        whole = len(chunks) == 1 and chunks[0].whole and chunks[0].sizes == shape
        if whole:
            got = whole_md.get((e.dtype_name, tuple(shape)))
            if got is not None:
                put(got)
                boxes(chunks)  # memoised with the first such tensor
                continue
            put(tensor_pre + pickle.MEMOIZE)
            whole_md[(e.dtype_name, tuple(shape))] = _get(m.count)
            m.count += 1
        else:
            put(tensor_pre)
        dtype = e.dtype
        props = functools.partial(_made, "TensorProperties", dtype=dtype)
        put(state + k_props + obj(("props", dtype), props))
        put(k_size + size(shape) + k_chunks + pickle.EMPTY_LIST)
        got = boxes(chunks)
        put(pickle.MARK + got + pickle.APPENDS + end if chunks else end)
    for b in blobs:
        put(s(b.fqn) + value)

    def key(k: Any) -> bytes:
        t = type(k)
        return s(k) if t is str else _int(k) if t is int else _embedded(k)

    put(pickle.SETITEMS + s("planner_data") + pickle.EMPTY_DICT + pickle.MARK)
    for e in entries:
        path = e.path if e.dcp_path is None else e.dcp_path
        put(s(e.fqn) + _tuple([key(k) for k in path]))
    for b in blobs:
        put(s(b.fqn) + _tuple([key(k) for k in b.path]))

    put(pickle.SETITEMS + s("storage_data") + pickle.EMPTY_DICT + pickle.MARK)
    k_fqn, k_index, k_offset, k_length = s("fqn"), s("index"), s("offset"), s("length")
    index_pre = index_cls + new + state + k_fqn
    info_pre = end + info_cls + new + state + s("relative_path")
    in_files: dict[tuple[str, ...], np.ndarray] = {}  # each chunk's file name, memoised
    for e, offsets in zip(entries, of_entry, strict=True):
        chunks = e.chunks
        if not chunks:
            continue
        names = tuple(map(_file, chunks))
        files = in_files.get(names)
        if files is None:  # names not met before memoised first (pushed, then dropped)
            put(pickle.MARK + b"".join([s(n) for n in dict.fromkeys(names)]) + pickle.POP_MARK)
            files = in_files[names] = np.array([m.known[n] for n in names], _MEMO)
        n = len(chunks)
        # each chunk one record of the same opcodes around five numbers, written for
        # all of them at once: the opcodes as a template, the numbers as columns
        put(
            _records(
                n,
                index_pre + s(e.fqn) + k_index,
                (pickle.BININT, _indices(n)),
                k_offset,
                (pickle.LONG_BINGET, offsets),
                info_pre,
                (pickle.LONG_BINGET, files),
                k_offset,
                _numbers(np.fromiter(map(_offset, chunks), np.int64, n)),
                k_length,
                _numbers(np.fromiter(map(_length, chunks), np.int64, n)),
                end,
            )
        )
    for b in blobs:
        put(index_pre + s(b.fqn) + k_index + pickle.NONE + info_pre + s(b.file) + k_offset)
        put(_int(b.offset) + k_length + _int(b.length) + end)
    put(pickle.SETITEMS + s("storage_meta") + pickle.NONE + s("version"))
    put(pickle.NONE if version is None else s(version))
    put(end + pickle.STOP)
    return b"".join(out)


_CLASSES = list(_STATE_KEYS)  # memoised in this order
_MEMO = np.dtype("<u4")  # a memo index, as LONG_BINGET takes it
_file, _offset, _length = (operator.itemgetter(i) for i in (2, 3, 4))


@functools.lru_cache(maxsize=8)
def _indices(n: int) -> np.ndarray:
    return np.arange(n, dtype="<i4")


def _numbers(values: np.ndarray) -> tuple[bytes, np.ndarray]:
    """A column of integers: 4-byte ``BININT`` where all fit, else 8-byte ``LONG1``."""
    if values.size and (values.max() > 0x7FFFFFFF or values.min() < -0x80000000):
        return pickle.LONG1 + b"\x08", values.astype("<i8")
    return pickle.BININT, values.astype("<i4")


def _records(n: int, *pieces: bytes | tuple[bytes, np.ndarray]) -> bytearray:
    """``n`` runs of ``pieces``: bytes as they are, (opcode, column) pairs as little-endian."""
    template: list[bytes] = []
    columns: list[np.ndarray] = []
    offsets: list[int] = []
    at = 0
    for piece in pieces:
        if isinstance(piece, bytes):
            template.append(piece)
            at += len(piece)
            continue
        opcode, column = piece
        template += [opcode, bytes(column.itemsize)]
        offsets.append(at + len(opcode))
        at += len(opcode) + column.itemsize
        columns.append(column)
    buf = bytearray(b"".join(template) * n)
    names = [f"c{i}" for i in range(len(columns))]
    formats = [c.dtype for c in columns]
    rows = np.frombuffer(
        buf, np.dtype({"names": names, "formats": formats, "offsets": offsets, "itemsize": at})
    )
    for name, column in zip(names, columns, strict=True):
        rows[name] = column
    return buf


#: The field names of DCP's classes, memoised before any object.
_FIELDS = sorted({k for keys in _STATE_KEYS.values() for kk in keys for k in kk})


def _tuple(items: list[bytes]) -> bytes:
    n = len(items)
    if n == 0:
        return pickle.EMPTY_TUPLE
    if n <= 3:
        return b"".join(items) + (pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3)[n - 1]
    return pickle.MARK + b"".join(items) + pickle.TUPLE


def _made(name: str, **fields: Any) -> Any:
    """An instance of DCP's class ``name`` (made when first pickled)."""
    return _dcp(name)()(**fields)
