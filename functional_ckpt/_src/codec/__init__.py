"""Exact, pickle-free msgpack encoding of the non-tensor values of a training state.

A resumed run must be bit-identical, so every supported value comes back with the
same type at every level and the same bits (a tuple stays a tuple, an ``int`` key
an ``int``, a NaN its NaN), and anything else is refused, never converted. Types
msgpack stores exactly use its native forms, so the C packer does the bulk; the
rest are ext types whose codes are part of the format (docs/format.md): containers
as an array led by a marker ext, rebuilt inside the one C-level parse (no Python
recursion, tuple keys hashable in time), leaves with their payload in the ext.

Decoding treats its input as hostile: nothing imported or looked up by the data,
every length capped by the bytes present, nesting, containers per input byte and
keys per hash value bounded by :data:`functional_ckpt._src.limits.LIMITS`.
``encoding`` (which needs numpy and torch) is imported on first use: readers of
manifests only decode."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from functional_ckpt._src.codec.decoding import check_hashes, decode, find_unregistered
from functional_ckpt._src.codec.registration import register, unknown_tag_problem
from functional_ckpt._src.codec.tagged import Unregistered

if TYPE_CHECKING:
    from functional_ckpt._src.codec.encoding import _default as _default
    from functional_ckpt._src.codec.encoding import (
        check_encodable,
        encode,
        encode_checked,
        encode_counted,
    )

#: The names of ``encoding``, imported on first use.
_ENCODING = frozenset({"_default", "check_encodable", "encode", "encode_checked", "encode_counted"})

__all__ = ["Unregistered", "check_encodable", "check_hashes", "decode", "encode"]
__all__ += ["encode_checked", "encode_counted", "find_unregistered", "register"]
__all__ += ["unknown_tag_problem"]


def __getattr__(name: str) -> Any:
    """The encoder's names, imported on first use; the table's ext codes and depth limit."""
    if name in _ENCODING:
        module = "encoding"
    elif name.startswith("EXT_") or name == "MAX_ENCODE_DEPTH":
        module = "table"
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"functional_ckpt._src.codec.{module}"), name)
    globals()[name] = value  # looked up once; the next access finds it directly
    return value
