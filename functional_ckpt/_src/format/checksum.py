"""CRC32 (the zlib polynomial): ISA-L's, several times faster, else zlib's."""

from __future__ import annotations

# ``crc32(data, value=0) -> int``: the library function itself (a wrapper would cost
# more than checksumming a small tensor's bytes).
try:
    from isal.isal_zlib import crc32

    BACKEND = "isal"
except ImportError:  # pragma: no cover - depends on the platform
    from zlib import crc32

    BACKEND = "zlib"

__all__ = ["BACKEND", "crc32"]
