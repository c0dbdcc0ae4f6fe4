"""New host tensors whose fresh pages cost as little as the kernel allows.

A restore that returns new tensors writes every byte of them exactly once. With
4 KiB pages the kernel faults and zeroes that memory a page at a time while the
read copies into it, which costs several times the copy itself; memory advised
for transparent huge pages takes one fault per 2 MiB instead. The tensors stay
ordinary ones from torch's allocator (freed, resized and shared as usual): only
the 2 MiB-aligned interior of a large allocation is advised, before anything
touches it, and then the whole of it is faulted in with one call.

Huge pages are not always cheaper. Under a hypervisor that takes back free memory
(a virtio balloon reporting free pages, which Linux does in blocks of 2 MiB and
more), a huge page is served from memory the host has discarded and must fault in
again: measured five times slower than the small pages a busy guest reuses. So the
default asks for huge pages only where the kernel offers them (``enabled`` is
``always`` or ``madvise``) and no free-page reporting is active;
:data:`HUGE_PAGES_ENV` decides otherwise (``1`` always, ``0`` never, for instance
where memory is short and ``defrag`` would make the kernel compact memory to find
huge pages). Every fallback is silent: advice the kernel refuses leaves ordinary
memory.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import torch

from functional_ckpt._src.native import libc_function

#: Environment switch: ``0`` never asks for huge pages, ``1`` always, unset/``auto`` decides.
HUGE_PAGES_ENV = "FUNCTIONAL_CKPT_HUGE_PAGES"

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
    except OSError:
        return ""
    try:
        return os.read(fd, 4096).decode("ascii", "replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


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
        reporting = len(bits) > _BALLOON_F_REPORTING and bits[_BALLOON_F_REPORTING] == "1"
        if kind == _VIRTIO_BALLOON and reporting:
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


def advise_fresh(tensor: torch.Tensor, *, huge: bool) -> bool:
    """Advise a new CPU tensor's untouched memory; True if huge pages were accepted.

    ``huge`` asks for huge pages on the 2 MiB-aligned interior (the partial pages at
    either end stay small); then the whole page-aligned range is faulted in with
    one call. Either advice may be refused (old kernel, THP compiled out): the
    memory is then ordinary and faults in as it is written.
    """
    if _MADVISE is None:
        return False
    ptr = tensor.data_ptr()
    end = ptr + tensor.numel() * tensor.itemsize
    accepted = False
    if huge:
        lo = (ptr + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
        hi = end & ~(HUGE_PAGE - 1)
        accepted = hi > lo and _MADVISE(lo, hi - lo, MADV_HUGEPAGE) == 0
    lo = (ptr + _PAGE - 1) & ~(_PAGE - 1)
    hi = end & ~(_PAGE - 1)
    if hi > lo:
        _MADVISE(lo, hi - lo, MADV_POPULATE_WRITE)  # best effort: -1 is harmless
    return accepted


def host_empty(
    shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, *, huge: bool | None = None
) -> torch.Tensor:
    """A new CPU tensor about to be written once in full (by a read or a copy).

    Large ones get their pages advised and faulted in up front (see the module's
    docstring); ``huge`` overrides :func:`huge_pages_default`.
    """
    tensor = torch.empty(shape, dtype=dtype)
    if tensor.numel() * tensor.itemsize >= PREFAULT_BYTES:
        advise_fresh(tensor, huge=huge_pages_default() if huge is None else huge)
    return tensor
