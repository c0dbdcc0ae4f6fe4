"""Text made from untrusted values: one line, bounded, never raising.

A checkpoint's values and names come from a file that may be hostile or merely
huge; whatever the package prints or puts in an error message about them goes
through here. :func:`printable` is the one escape of text for a terminal: a key
name holding cursor movements, a line erase, a window title or a right-to-left
override must not rewrite what the user sees.
"""

from __future__ import annotations

from typing import Any

__all__ = ["clip", "joined_lines", "printable", "printable_lines", "short_repr"]


def clip(text: str, limit: int) -> str:
    """``text`` on one line (runs of whitespace made one space), at most ``limit`` long."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def joined_lines(text: str) -> str:
    """A multi-line message as one line: a line that introduces a list (ends with
    ``:``) runs on into it, other lines are set apart by ``;``.

    Errors list their findings one per line; on one line ``damaged tensor data:;
    ('model', 'w')...`` would read as an empty finding.
    """
    out = ""
    for line in (part.strip() for part in text.splitlines()):
        if not line:
            continue
        out += line if not out else (" " if out.endswith(":") else "; ") + line
    return out


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


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on escaped (``\\x1b``, ``\\u202e``).

    Control characters (C0, C1, DEL), line and paragraph separators, and format
    characters such as bidirectional overrides are written as Python escapes;
    a backslash is left alone, so the escape is for eyes, not for parsing back.
    """
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


def printable_lines(text: str) -> str:
    """:func:`printable` of each line: the line breaks of ``text`` are kept."""
    if text.isprintable():
        return text
    return "\n".join(printable(line) for line in text.split("\n"))
