"""Text made from untrusted values: one line, bounded, never raising.

A checkpoint's values and names come from a file that may be hostile or merely
huge; whatever the package prints or puts in an error message about them goes
through here.
"""

from __future__ import annotations

from typing import Any

__all__ = ["clip", "short_repr"]


def clip(text: str, limit: int) -> str:
    """``text`` on one line (runs of whitespace made one space), at most ``limit`` long."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _big_int(n: int) -> str:
    """An int too long for ``repr`` (Python's 4300-digit limit), shown by size and hex head."""
    digits = int(n.bit_length() * 0.30103) + 1
    return f"<int of about {digits} digits, {hex(n)[:18]}...>"


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr`` on one line, at most ``limit`` characters; never raises.

    Checkpoints hold exact values of any size: an int past the interpreter's
    digit limit, or an object whose ``repr`` fails, is described instead.
    """
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        text = _describe(value)
    except Exception as err:
        text = f"<{type(value).__name__}: repr failed ({type(err).__name__})>"
    return clip(text, limit)


def _describe(value: Any) -> str:
    if isinstance(value, int):
        return _big_int(value)
    if isinstance(value, list | tuple | set | frozenset | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    return f"<{type(value).__name__}>"
