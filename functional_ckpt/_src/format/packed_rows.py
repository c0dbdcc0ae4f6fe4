"""A split manifest's part rows packed from number columns, byte for byte as msgpack packs
:func:`.parts.rows`: a few numpy passes instead of a Python object per chunk.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import msgpack
import numpy as np

from functional_ckpt._src.format.keys import KeyPath

#: The columns of a row table: the file (an index into the names), then the chunk's
#: numbers after it (:data:`.parts.ROW_FIELDS`), ``zstd`` last (packed only where set).
COLUMNS = 8


@dataclass
class Spliced:
    """What the coordinator of a multi-rank save packed from every rank's columns: the evenly
    split tensors, each part's rows, and ``.metadata`` (the last save's, else derived)."""

    split: Mapping[KeyPath, int]
    rows: Sequence[bytes]
    dcp: bytes | None = None


#: msgpack's unsigned integer forms past a fixint: (marker, bytes that follow).
_UINTS = ((0xCC, 1), (0xCD, 2), (0xCE, 4), (0xCF, 8))


def _widths(v: np.ndarray) -> np.ndarray:
    """Bytes msgpack packs each value in: 1 (fixint), 2, 3, 5 or 9."""
    w: np.ndarray = 1 + (v > 0x7F) + (v > 0xFF) + 2 * (v > 0xFFFF) + 4 * (v > 0xFFFFFFFF)
    return w


def _put(buf: np.ndarray, at: np.ndarray, v: np.ndarray, w: np.ndarray) -> None:
    small = w == 1
    buf[at[small]] = v[small]
    for marker, n in _UINTS:
        m = w == n + 1
        if m.any():
            p = at[m]
            buf[p] = marker
            be = v[m].astype(f">u{n}").view(np.uint8).reshape(-1, n)
            buf[p[:, None] + np.arange(1, n + 1)] = be


def pack_rows(names: Sequence[str], table: np.ndarray, bounds: Sequence[int]) -> list[bytes]:
    """Each part's rows as one msgpack array: part ``i`` holds ``table[bounds[i]:bounds[i+1]]``."""
    packed = [bytes(msgpack.packb(n, use_bin_type=True)) for n in names]
    lens = np.array([len(p) for p in packed] or [0], np.int64)
    file, ints, zstd = table[:, 0], table[:, 1:7], table[:, 7]
    widths = _widths(ints)
    zw = np.where(zstd != 0, _widths(zstd), 0)
    size = 1 + lens[file] + widths.sum(axis=1) + zw
    ends = np.cumsum(size)
    starts = ends - size
    buf = np.zeros(int(ends[-1]) if len(ends) else 0, np.uint8)
    buf[starts] = np.where(zstd != 0, 0x98, 0x97)  # a fixarray of 8 or 7 fields
    at = starts + 1
    if len(table):
        names_buf = np.zeros((len(packed), int(lens.max())), np.uint8)
        for i, p in enumerate(packed):
            names_buf[i, : len(p)] = np.frombuffer(p, np.uint8)
        for n in np.unique(lens[file]):
            m = lens[file] == n
            buf[at[m][:, None] + np.arange(n)] = names_buf[file[m], :n]
    at = at + lens[file]
    for j in range(ints.shape[1]):
        _put(buf, at, ints[:, j], widths[:, j])
        at = at + widths[:, j]
    z = zstd != 0
    _put(buf, at[z], zstd[z], zw[z])
    out = []
    for a, b in pairwise(bounds):
        lo, hi = (int(starts[a]), int(ends[b - 1])) if a < b else (0, 0)
        out.append(bytes(msgpack.Packer().pack_array_header(b - a)) + buf[lo:hi].tobytes())
    return out


def chunk_rows(by_tensor: Sequence[Sequence[Any]], parts: int) -> list[bytes]:
    """:func:`pack_rows` of chunks: part ``r`` holds chunk ``r`` of every tensor."""
    names: dict[str, int] = {}
    by_part = zip(*by_tensor, strict=True)
    rows = [(names.setdefault(c.file, len(names)), *c[3:]) for cs in by_part for c in cs]
    bounds = [len(by_tensor) * r for r in range(parts + 1)]
    return pack_rows(list(names), np.array(rows, np.uint64).reshape(-1, COLUMNS), bounds)
