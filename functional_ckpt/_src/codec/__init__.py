"""Exact, pickle-free msgpack encoding of the non-tensor values of a training state: a
resumed run must be bit-identical, so every value comes back with the same type and bits
at every level, and anything else is refused, never converted. ``encoding`` (numpy and
torch) is imported on first use: readers only decode."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from functional_ckpt._src.codec.decoding import check_hashes, decode, find_unregistered
from functional_ckpt._src.codec.registration import register, unknown_tag_problem
from functional_ckpt._src.codec.tagged import Unregistered

if TYPE_CHECKING:
    from functional_ckpt._src.codec.encoding import (
        check_encodable,
        encode,
        encode_checked,
        encode_counted,
    )

__all__ = ["Unregistered", "check_encodable", "check_hashes", "decode", "encode"]
__all__ += ["encode_checked", "encode_counted", "find_unregistered", "register"]
__all__ += ["unknown_tag_problem"]


def __getattr__(name: str) -> Any:
    """The encoder's names, imported on first use."""
    if name not in ("check_encodable", "encode", "encode_checked", "encode_counted"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module("functional_ckpt._src.codec.encoding"), name)
    globals()[name] = value  # looked up once; the next access finds it directly
    return value
