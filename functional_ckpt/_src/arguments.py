"""The checks of public arguments, one each for the kinds that recur. Python takes any value
for a flag (``partial="no"`` is true) and any iterable for names (``per_rank="rng"`` is 'r',
'n', 'g'): either does the opposite of what was written, so both are refused at the call."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any


def require(ok: bool, value: object, name: str, call: str, expected: str, shown: str = "") -> None:
    """Unless ``ok``, a TypeError naming ``value`` (``shown`` in its place where it may hold
    credentials) as argument ``name`` of ``call``."""
    if not ok:
        at = f"{name}={shown or repr(value)}"
        at = f"{call}({at})" if call else at
        raise TypeError(f"{at}: expected {expected}")


def flag(value: object, name: str, call: str = "") -> bool:
    require(isinstance(value, bool), value, name, call, "True or False")
    return value is True


def is_name(value: object) -> bool:
    return isinstance(value, str) and value != ""


def items(
    value: object, name: str, call: str, expected: str, ok: Callable[[Any], bool] = is_name
) -> tuple[Any, ...]:
    """The items of collection ``value``, each ``ok``; a str is one value, not its letters."""
    got = (
        None if isinstance(value, str | bytes) or not isinstance(value, Iterable) else tuple(value)
    )
    require(got is not None and all(map(ok, got)), value, name, call, expected)
    return got or ()


def mapping(
    value: object, name: str, call: str, expected: str, ok: Callable[..., bool] = lambda *_: True
) -> dict[Any, Any]:
    """``value`` (None: empty), a mapping whose every key and value are ``ok``, as a dict."""
    got = dict(value) if isinstance(value, Mapping) else {}
    fine = value is None or (isinstance(value, Mapping) and all(ok(k, v) for k, v in got.items()))
    require(fine, value, name, call, expected)
    return got
