"""Calls of the C library that Python's ``os`` lacks (Linux's ``renameat2``, ``madvise``,
``sync_file_range``), loaded one way; where one does not exist its caller falls back."""

from __future__ import annotations

import ctypes
import sys
from typing import Any


def libc_function(name: str, argtypes: list[Any], restype: Any = ctypes.c_int) -> Any:
    """The C library's ``name`` with ``errno`` kept, or ``None`` where there is none."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn
