"""CRC32 (the zlib polynomial) at memory speed.

Every byte of a checkpoint is covered by CRC32, the checksum zip files (and thus
``torch.save`` blobs) already carry. ISA-L computes the identical value several
times faster than zlib, so checksums stay a small fraction of a save even when
the disk is fast; zlib is the fallback where ISA-L is not installed.
"""

from __future__ import annotations

from collections.abc import Callable

#: ``crc32(data, value=0) -> int`` over any buffer; the library function itself (a
#: wrapper would cost more than checksumming a small tensor's bytes).
crc32: Callable[..., int]

try:
    from isal.isal_zlib import crc32 as _isal_crc32

    crc32 = _isal_crc32

    BACKEND = "isal"
except ImportError:  # pragma: no cover - depends on the platform
    import zlib

    crc32 = zlib.crc32

    BACKEND = "zlib"

__all__ = ["BACKEND", "crc32"]
