"""Disk usage of checkpoints, from ``stat`` alone (incremental ones share hard links)."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any


def _regular(path: Path) -> Iterator[os.stat_result]:
    """The ``lstat`` of each regular file directly inside ``path`` (none if it vanished)."""
    with contextlib.suppress(OSError), os.scandir(path) as it:
        for entry in it:
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    yield st


def dir_size(path: Path) -> int:
    """Bytes in the regular files directly inside ``path`` (0 if it vanished)."""
    return sum(st.st_size for st in _regular(path))


def sharing(path: Path, files: Any) -> tuple[int, int]:
    """Bytes shared with other checkpoints now (several links) and added by its save."""
    shared = added = 0
    if not isinstance(files, dict):
        return 0, 0
    for name, info in files.items():
        if not isinstance(info, dict) or not isinstance(name, str) or "/" in name:
            continue
        size = info["size"] if isinstance(info.get("size"), int) else 0
        if not info.get("reused") or info.get("copied") is True:
            added += size
        with contextlib.suppress(OSError):
            st = os.stat(path / name, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
                shared += size
    return shared, added


def shared_bytes(path: Path) -> int:
    """Bytes of the files in ``path`` that are also linked elsewhere."""
    return sum(st.st_size for st in _regular(path) if st.st_nlink > 1)


def disk_bytes(paths: Sequence[Path]) -> int:
    """Bytes of the regular files directly inside ``paths``, each file counted once."""
    return sum({(st.st_dev, st.st_ino): st.st_size for p in paths for st in _regular(p)}.values())
