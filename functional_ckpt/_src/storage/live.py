"""Reading memory its owner may free at any moment (``staging="none"``, FSDP's ``resize_(0)``):
a read of unmapped memory kills the process, so the kernel copies it into a ``memfd``.
"""

from __future__ import annotations

import errno
import mmap
import os

from functional_ckpt._src.format.checksum import crc32

BLOCK = 4 << 20  # bytes moved through the private file per call (its size, too)


class Freed(OSError):
    """Live memory could not be read: freed (or resized away) while a save read it."""


class LiveReader:
    """Checksums and copies of live memory, one per reading thread; :meth:`close` frees it."""

    def __init__(self) -> None:
        self._fd = os.memfd_create("fc-live", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, BLOCK)
        self._map = mmap.mmap(self._fd, BLOCK, prot=mmap.PROT_READ)
        self._view = memoryview(self._map)

    def _fill(self, view: memoryview) -> memoryview:
        """Up to :data:`BLOCK` bytes of ``view``, copied into the private file."""
        n = min(len(view), BLOCK)
        done = 0
        while done < n:
            try:
                done += os.pwrite(self._fd, view[done:n], done)
            except OSError as e:
                if e.errno == errno.EFAULT:
                    raise Freed(errno.EFAULT, "live memory was freed during the read") from None
                raise
        return self._view[:n]

    def crc(self, view: memoryview, start: int = 0) -> int:
        """CRC32 of ``view`` (live memory), continuing ``start``."""
        crc = start
        for off in range(0, len(view), BLOCK):
            crc = crc32(self._fill(view[off : off + BLOCK]), crc)
        return crc

    def copy(self, view: memoryview) -> bytes:
        """The bytes of ``view`` (live memory, at most :data:`BLOCK`)."""
        if len(view) > BLOCK:
            raise ValueError(f"internal: {len(view)} bytes copied at once, at most {BLOCK}")
        return bytes(self._fill(view))

    def close(self) -> None:
        self._view.release()
        self._map.close()
        os.close(self._fd)
