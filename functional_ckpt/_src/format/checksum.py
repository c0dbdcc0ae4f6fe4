"""CRC32 (the zlib polynomial) at memory speed.

Every byte of a checkpoint is covered by CRC32, the checksum zip files (and thus
``torch.save`` blobs) already carry. ISA-L computes the identical value several
times faster than zlib, so checksums stay a small fraction of a save even when
the disk is fast; zlib is the fallback where ISA-L is not installed.
"""

from __future__ import annotations

from typing import Any

try:
    from isal.isal_zlib import crc32 as _isal_crc32

    def crc32(data: Any, value: int = 0) -> int:
        return int(_isal_crc32(data, value))

    BACKEND = "isal"
except ImportError:  # pragma: no cover - depends on the platform
    import zlib

    def crc32(data: Any, value: int = 0) -> int:
        return zlib.crc32(data, value)

    BACKEND = "zlib"

__all__ = ["BACKEND", "crc32"]
