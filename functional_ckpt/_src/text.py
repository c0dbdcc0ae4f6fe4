"""Text made from untrusted values: one line, bounded, never raising. :func:`printable`
is the one escape of text for a terminal: a key holding cursor movements or a
right-to-left override must not rewrite what the user sees."""

from __future__ import annotations

from typing import Any

__all__ = ["clip", "joined_lines", "printable", "printable_lines", "short_repr"]


def clip(text: str, limit: int) -> str:
    """``text`` on one line (runs of whitespace made one space), at most ``limit`` long."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def joined_lines(text: str) -> str:
    """A multi-line message as one line: a line ending with ``:`` runs on into the list it
    introduces (``damaged:; ...`` would read as an empty finding), others join by ``;``."""
    out = ""
    for line in (part.strip() for part in text.splitlines()):
        if not line:
            continue
        out += line if not out else (" " if out.endswith(":") else "; ") + line
    return out


def short_repr(value: Any, limit: int = 80) -> str:
    """``repr`` on one line, at most ``limit`` characters; never raises (a huge int, or
    an object whose ``repr`` fails, is described instead)."""
    try:
        text = repr(value)
    except (ValueError, RecursionError):
        text = _describe(value)
    except Exception as err:
        text = f"<{type(value).__name__}: repr failed ({type(err).__name__})>"
    return clip(text, limit)


def _describe(value: Any) -> str:
    if isinstance(value, int):  # past Python's 4300-digit repr limit
        digits = int(value.bit_length() * 0.30103) + 1
        return f"<int of about {digits} digits, {hex(value)[:18]}...>"
    if isinstance(value, list | tuple | set | frozenset | dict):
        return f"<{type(value).__name__} of {len(value)} items>"
    return f"<{type(value).__name__}>"


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on (controls, separators,
    bidirectional overrides) as a Python escape, for eyes, not for parsing back."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else _escape(ch) for ch in text)


def printable_lines(text: str) -> str:
    """:func:`printable` of each line: the line breaks of ``text`` are kept."""
    if text.isprintable():
        return text
    return "\n".join(printable(line) for line in text.split("\n"))
