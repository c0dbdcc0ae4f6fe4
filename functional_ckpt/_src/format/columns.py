"""Fixed-width unsigned integer columns: many numbers as one little-endian byte string,
so a manifest of many tensors decodes as a few byte strings.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

from functional_ckpt.errors import CorruptCheckpoint

#: The array type code of each width a column may have.
_CODES = {array(c).itemsize: c for c in "QLIHB"}
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
