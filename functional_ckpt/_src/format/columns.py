"""Fixed-width unsigned integer columns: many numbers as one little-endian byte string.

A manifest's tensor tables (:mod:`.tables`) hold a field of every row as one such
column, so that a manifest of many tensors decodes as a few byte strings rather
than one container per field, and reads back in bulk.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

from functional_ckpt.errors import CorruptCheckpoint

__all__ = ["pack", "unpack"]


def _code(width: int) -> str:
    for code in "BHILQ":
        if array(code).itemsize == width:
            return code
    raise RuntimeError(f"no array type code of {width} bytes")  # pragma: no cover


#: The array type code of each width a column may have.
_CODES = {w: _code(w) for w in (1, 2, 4, 8)}
_SWAP = sys.byteorder != "little"


def pack(values: Iterable[int], width: int) -> bytes:
    """``values`` (each in ``[0, 2**(8*width))``) as a column of ``width``-byte numbers."""
    a = array(_CODES[width], values)  # OverflowError: a value out of range
    if _SWAP:  # pragma: no cover - big-endian hosts
        a.byteswap()
    return a.tobytes()


def unpack(raw: object, width: int, n: int, where: str) -> list[int]:
    """The ``n`` numbers of a column read from a manifest; anything else is damage."""
    if type(raw) is not bytes or len(raw) != n * width:
        size = len(raw) if type(raw) is bytes else type(raw).__name__
        raise CorruptCheckpoint(f"{where}: {size} bytes for {n} numbers of {width} bytes")
    a = array(_CODES[width])
    a.frombytes(raw)
    if _SWAP:  # pragma: no cover - big-endian hosts
        a.byteswap()
    return a.tolist()
