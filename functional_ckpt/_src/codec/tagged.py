"""Tagged plain data: the table of tagged types, and the standard library's types in it.

Hyper-parameters routinely hold paths, datetimes, enums, namespaces, dataclasses
and named tuples, and a resume must give them back with their class. They are
stored as a (tag, fields) pair whose fields are ordinary codec values, and rebuilt
only through this table: the standard library's types below (paths, datetimes
with their time zones, ``argparse.Namespace``), plus the classes a user registers
(:mod:`.registration`). A tag read from a checkpoint is a key into the table,
never a module or class name to import, so a hostile checkpoint can at most build
a class the program already chose to trust, from fields that are checked against
that class. A tag nobody registered is kept as a placeholder by a reader that only
looks (:mod:`.placeholder`).

The table is the codec's one piece of module state that changes on purpose: only
the functions here fill it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import pathlib
import zoneinfo
from collections.abc import Callable
from typing import Any, NamedTuple

from functional_ckpt.errors import UnsupportedValue

__all__ = [
    "TAGGED",
    "_BadFields",
    "TaggedType",
    "add",
    "add_class",
    "add_name",
    "by_tag",
]


class TaggedType(NamedTuple):
    """How one class is taken apart into fields and rebuilt from them."""

    tag: str
    cls: type
    fields: Callable[[Any], object]
    build: Callable[[Any], object]


class _BadFields(Exception):
    """Internal: fields that do not fit the tagged class (the decoder reports corruption)."""


TAGGED: dict[type, TaggedType] = {}
"""Every class stored as tagged data, by exact type (what ``encode`` looks up)."""

_BY_TAG: dict[str, TaggedType] = {}


def by_tag(tag: str) -> TaggedType | None:
    return _BY_TAG.get(tag)


def _add(entry: TaggedType) -> None:
    TAGGED[entry.cls] = entry
    _BY_TAG[entry.tag] = entry


def add(entry: TaggedType) -> None:
    """Store ``entry``'s class under its tag, and read that tag as it."""
    _add(entry)


def add_class(entry: TaggedType) -> None:
    """Store ``entry``'s class under its tag, which another class already holds for
    reading (a script's class imported a second time by its module name)."""
    TAGGED[entry.cls] = entry


def add_name(tag: str, entry: TaggedType) -> None:
    """Read ``tag`` too as ``entry``'s class (an older name), unless it is taken."""
    _BY_TAG.setdefault(tag, entry)


def _ints(fields: object, n: int, what: str) -> list[int]:
    if type(fields) is not list or len(fields) != n or any(type(x) is not int for x in fields):
        raise _BadFields(f"{what} needs a list of {n} ints, got {fields!r:.80}")
    return fields


# --- time zones: exact fixed offsets (UTC included) and IANA zones by key ----------


def _tz_fields(tz: dt.tzinfo | None) -> object:
    if tz is None:
        return None
    if type(tz) is dt.timezone:
        args = tz.__getinitargs__()  # type: ignore[attr-defined]
        off: dt.timedelta = args[0]
        name = args[1] if len(args) > 1 else None
        return ["offset", off.days, off.seconds, off.microseconds, name]
    if type(tz) is zoneinfo.ZoneInfo and tz.key is not None:
        return ["zone", tz.key]
    raise UnsupportedValue(
        f"time zone {tz!r} of type {type(tz).__name__} is not supported (only "
        "datetime.timezone offsets and zoneinfo.ZoneInfo zones with a key)"
    )


def _tz_build(fields: object) -> dt.tzinfo | None:
    if fields is None:
        return None
    if type(fields) is list and len(fields) == 5 and fields[0] == "offset":
        days, secs, us = _ints(fields[1:4], 3, "a time zone offset")
        name = fields[4]
        off = dt.timedelta(days=days, seconds=secs, microseconds=us)
        if name is None:
            return dt.timezone(off)
        if type(name) is not str:
            raise _BadFields(f"a time zone name must be a str, got {name!r:.80}")
        return dt.timezone(off, name)
    if type(fields) is list and len(fields) == 2 and fields[0] == "zone":
        key = fields[1]
        if type(key) is not str or not 0 < len(key) <= 128:
            raise _BadFields(f"invalid time zone key {key!r:.80}")
        try:
            return zoneinfo.ZoneInfo(key)
        except (ValueError, zoneinfo.ZoneInfoNotFoundError) as exc:
            raise _BadFields(f"unknown time zone {key!r}: {exc}") from None
    raise _BadFields(f"invalid time zone fields {fields!r:.80}")


def _datetime_fields(v: dt.datetime) -> object:
    return [
        v.year,
        v.month,
        v.day,
        v.hour,
        v.minute,
        v.second,
        v.microsecond,
        v.fold,
        _tz_fields(v.tzinfo),
    ]


def _datetime_build(f: object) -> object:
    if type(f) is not list or len(f) != 9:
        raise _BadFields(f"datetime needs 9 fields, got {f!r:.80}")
    y, mo, d, h, mi, s, us, fold = _ints(f[:8], 8, "datetime")
    return dt.datetime(y, mo, d, h, mi, s, us, tzinfo=_tz_build(f[8]), fold=fold)


def _time_fields(v: dt.time) -> object:
    return [v.hour, v.minute, v.second, v.microsecond, v.fold, _tz_fields(v.tzinfo)]


def _time_build(f: object) -> object:
    if type(f) is not list or len(f) != 6:
        raise _BadFields(f"time needs 6 fields, got {f!r:.80}")
    h, mi, s, us, fold = _ints(f[:5], 5, "time")
    return dt.time(h, mi, s, us, tzinfo=_tz_build(f[5]), fold=fold)


def _path_entry(cls: type) -> TaggedType:
    def build(f: object) -> object:
        if type(f) is not str:
            raise _BadFields(f"{cls.__name__} needs a str, got {f!r:.80}")
        return cls(f)

    return TaggedType(f"pathlib.{cls.__name__}", cls, str, build)


def _namespace_build(f: object) -> object:
    if type(f) is not dict or any(type(k) is not str for k in f):
        raise _BadFields(f"argparse.Namespace needs a map with str keys, got {f!r:.80}")
    return argparse.Namespace(**f)


for _cls in (
    pathlib.PurePosixPath,
    pathlib.PosixPath,
    pathlib.PureWindowsPath,
    pathlib.WindowsPath,
):
    _add(_path_entry(_cls))
_add(TaggedType("datetime.datetime", dt.datetime, _datetime_fields, _datetime_build))
_add(
    TaggedType(
        "datetime.date",
        dt.date,
        lambda v: [v.year, v.month, v.day],
        lambda f: dt.date(*_ints(f, 3, "date")),
    )
)
_add(TaggedType("datetime.time", dt.time, _time_fields, _time_build))
_add(
    TaggedType(
        "datetime.timedelta",
        dt.timedelta,
        lambda v: [v.days, v.seconds, v.microseconds],
        lambda f: dt.timedelta(*_ints(f, 3, "timedelta")),
    )
)
_add(
    TaggedType("argparse.Namespace", argparse.Namespace, lambda v: dict(vars(v)), _namespace_build)
)
