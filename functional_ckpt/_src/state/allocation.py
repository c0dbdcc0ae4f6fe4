"""New host tensors whose fresh pages cost as little as the kernel allows.

Faulting 4 KiB pages during a read costs several times the copy, so memory is advised
for huge pages and :class:`Prefaulter` faults it ahead of the reads. Under a balloon
that reports free pages, huge pages are five times slower: they are asked for only
where no such reporting is active (:data:`HUGE_PAGES_ENV` decides otherwise).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from functional_ckpt._src.native import libc_function
from functional_ckpt._src.threads import BackgroundThread, wait_quietly

#: Environment switch: ``0`` never asks for huge pages, ``1`` always, unset/``auto`` decides.
HUGE_PAGES_ENV = "FCKPT_HUGE_PAGES"
#: Host tensors from this size on get their pages advised and faulted in up front.
PREFAULT_BYTES = 4 << 20
#: The transparent huge page size of x86-64 and most arm64 kernels.
HUGE_PAGE = 2 << 20
#: ``madvise`` advice: back with transparent huge pages.
MADV_HUGEPAGE = 14
#: ``madvise`` advice that faults a whole range in with one call (Linux 5.14+).
MADV_POPULATE_WRITE = 23
#: The kernel's transparent huge page switch.
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
#: Where virtio devices list their negotiated feature bits.
VIRTIO_DEVICES = Path("/sys/bus/virtio/devices")
_VIRTIO_BALLOON = 5  # virtio device id
_BALLOON_F_REPORTING = 5  # feature bit: the guest reports free pages to the host
_PAGE = mmap.PAGESIZE
_MADVISE = libc_function("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])


def _small_text(path: Path) -> str:
    """A kernel attribute file's text; empty where it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        try:
            return os.read(fd, 4096).decode("ascii", "replace")
        finally:
            os.close(fd)
    except OSError:
        return ""


def thp_offered(enabled: Path = THP_ENABLED) -> bool:
    """Whether the kernel grants huge pages to memory that asks (``[always]``/``[madvise]``)."""
    text = _small_text(enabled)
    return "[always]" in text or "[madvise]" in text


def free_pages_reported(devices: Path = VIRTIO_DEVICES) -> bool:
    """Whether a virtio balloon hands free 2 MiB blocks back to the host."""
    try:
        names = sorted(os.listdir(devices))
    except OSError:
        return False
    for name in names:
        dev = devices / name
        try:
            kind = int(_small_text(dev / "device").strip() or "-1", 16)
        except ValueError:
            continue
        bits = _small_text(dev / "features").strip()
        if kind == _VIRTIO_BALLOON and bits[_BALLOON_F_REPORTING:][:1] == "1":
            return True
    return False


def huge_pages_default(
    env: str | None = None, *, enabled: Path = THP_ENABLED, devices: Path = VIRTIO_DEVICES
) -> bool:
    """Whether new large tensors ask for huge pages: the switch, else where they are cheaper."""
    value = (os.environ.get(HUGE_PAGES_ENV, "") if env is None else env).strip().lower()
    if value in ("0", "false", "no", "off", "never"):
        return False
    if value in ("1", "true", "yes", "on", "always"):
        return True
    return _MADVISE is not None and thp_offered(enabled) and not free_pages_reported(devices)


def advise_fresh(tensor: torch.Tensor, *, huge: bool, fault: bool = True) -> bool:
    """Advise a new CPU tensor's untouched memory (``huge``: its 2 MiB-aligned interior;
    ``fault``: faulted in with one call); True if huge pages were accepted."""
    if _MADVISE is None:
        return False
    ptr = tensor.data_ptr()
    end = ptr + tensor.numel() * tensor.itemsize
    accepted = False
    if huge:
        lo = (ptr + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
        hi = end & ~(HUGE_PAGE - 1)
        accepted = hi > lo and _MADVISE(lo, hi - lo, MADV_HUGEPAGE) == 0
    if fault:
        populate(ptr, end - ptr)
    return accepted


def populate(ptr: int, length: int) -> None:
    """Fault in the whole pages of ``length`` bytes from ``ptr`` with one call (best effort)."""
    if _MADVISE is None:
        return
    lo = (ptr + _PAGE - 1) & ~(_PAGE - 1)
    hi = (ptr + length) & ~(_PAGE - 1)
    if hi > lo:
        _MADVISE(lo, hi - lo, MADV_POPULATE_WRITE)


def host_empty(
    shape: tuple[int, ...] | torch.Size,
    dtype: torch.dtype,
    *,
    huge: bool | None = None,
    fault: bool = True,
) -> torch.Tensor:
    """A new CPU tensor about to be written once in full; a large one faulted in up front."""
    tensor = torch.empty(shape, dtype=dtype)
    if tensor.numel() * tensor.itemsize >= PREFAULT_BYTES:
        advise_fresh(tensor, huge=huge_pages_default() if huge is None else huge, fault=fault)
    return tensor


#: Bytes a :class:`Prefaulter` faults in per call, and a reader waits for at a time.
FAULT_BLOCK = 8 << 20

_FAULTS = BackgroundThread("fc-fault")


class Prefaulter:
    """New tensors' pages faulted in by a background thread in the order they are read."""

    def __init__(self, tensors: Sequence[torch.Tensor], block: int = FAULT_BLOCK) -> None:
        self._ranges = [(t.data_ptr(), t.numel() * t.itemsize) for t in tensors]
        self._index = {ptr: i for i, (ptr, _) in enumerate(self._ranges)}
        self._block = block
        self._progress = (0, 0)  # (tensor, bytes of it faulted in); past the last: done
        self._cond = threading.Condition()
        self._stop = False
        self._future: Future[None] | None = (
            _FAULTS.pool().submit(self._run) if self._ranges else None
        )

    def _run(self) -> None:
        try:
            for i, (ptr, n) in enumerate(self._ranges):
                for off in range(0, n, self._block):
                    if self._stop:
                        return
                    step = min(self._block, n - off)
                    populate(ptr + off, step)
                    with self._cond:
                        self._progress = (i, off + step)
                        self._cond.notify_all()
        finally:
            with self._cond:
                self._progress = (len(self._ranges), 0)
                self._cond.notify_all()

    def ready(self, tensor_ptr: int, end: int) -> None:
        """Return once the first ``end`` bytes of the tensor at ``tensor_ptr`` are in."""
        i = self._index.get(tensor_ptr)
        if i is None:
            return
        with self._cond:
            self._cond.wait_for(lambda: self._progress >= (i, end) or self._progress[0] > i)

    def close(self) -> None:
        """Stop faulting in and wait for the thread (it never touches freed memory)."""
        self._stop = True
        if self._future is not None:
            wait_quietly(self._future)  # even when interrupted: it reads the tensors
