"""Tagged plain data: paths, datetimes, namespaces and registered classes stored as (tag,
fields) and rebuilt only through this table: a tag read from a checkpoint is a key,
never a name to import, so a hostile checkpoint can at most build a class the program
chose to trust. The table is module state on purpose; only the functions here fill it."""

from __future__ import annotations

import argparse
import datetime as dt
import pathlib
import zoneinfo
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

from functional_ckpt.errors import UnsupportedValue


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


def add(entry: TaggedType, *, read: bool = True) -> None:
    """Store ``entry``'s class under its tag, and (``read``) read that tag as it; not
    where another class holds the tag (a script's class imported again by its module)."""
    TAGGED[entry.cls] = entry
    if read:
        _BY_TAG[entry.tag] = entry


def add_name(tag: str, entry: TaggedType) -> None:
    """Read ``tag`` too as ``entry``'s class (an older name), unless it is taken."""
    _BY_TAG.setdefault(tag, entry)


def _ints(fields: object, n: int, what: str) -> list[int]:
    if type(fields) is not list or len(fields) != n or any(type(x) is not int for x in fields):
        raise _BadFields(f"{what} needs a list of {n} ints, got {fields!r:.80}")
    return fields


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
    return [v.year, v.month, v.day, *_time_fields(v.timetz())]


def _time_fields(v: dt.time) -> list[object]:
    return [v.hour, v.minute, v.second, v.microsecond, v.fold, _tz_fields(v.tzinfo)]


def _zoned_build(cls: Any, f: object) -> object:
    """A datetime or time: its ints up to ``fold``, then its time zone's fields."""
    n = 9 if cls is dt.datetime else 6
    if type(f) is not list or len(f) != n:
        raise _BadFields(f"{cls.__name__} needs {n} fields, got {f!r:.80}")
    *ints, fold = _ints(f[:-1], n - 1, cls.__name__)
    return cls(*ints, tzinfo=_tz_build(f[-1]), fold=fold)


def _ints_entry(cls: Any, *names: str) -> TaggedType:
    def build(f: object) -> object:
        return cls(*_ints(f, len(names), cls.__name__))

    return TaggedType(
        f"datetime.{cls.__name__}", cls, lambda v: [getattr(v, a) for a in names], build
    )


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


for _cls in (pathlib.PurePosixPath, pathlib.PosixPath, pathlib.PureWindowsPath):
    add(_path_entry(_cls))
add(_path_entry(pathlib.WindowsPath))
for _zoned, _fields in ((dt.datetime, _datetime_fields), (dt.time, _time_fields)):
    add(TaggedType(f"datetime.{_zoned.__name__}", _zoned, _fields, partial(_zoned_build, _zoned)))
add(_ints_entry(dt.date, "year", "month", "day"))
add(_ints_entry(dt.timedelta, "days", "seconds", "microseconds"))
add(TaggedType("argparse.Namespace", argparse.Namespace, lambda v: dict(vars(v)), _namespace_build))


def placeholder_problem(value: Unregistered) -> str:
    return (
        f"{value.tag} is an fc.codec.Unregistered placeholder (read without its class), "
        "which is never saved: register the class and fc.restore the value to save it"
    )


def _fields_problem(fields: object) -> str | None:
    """Why ``fields`` fit no class ``register`` accepts, or None."""
    t = type(fields)
    if t is dict:
        if all(type(k) is str for k in fields):  # type: ignore[attr-defined]
            return None
        return "a map of fields with a key that is not a str"
    if t is list or t is str or t is int:
        return None
    return (
        f"fields of type {t.__name__}, which no registered class has (a dataclass "
        "has a map, a NamedTuple a list, an Enum a member name or int)"
    )


class Unregistered:
    """A tagged value whose class this process has not registered: its tag and fields as
    stored, read-only, never saved. An unknown tag is not damage: a reader that only looks
    (``fc.inspect``, ``fc.verify``, the command line) keeps one; ``fc.restore`` refuses
    it, as a state holding it would fail far from the cause. Compared by tag and fields,
    but by identity in a key's place (a set member, a dict key, a tuple there): without
    the class nobody knows which its instances used, and so the writer's members stay as
    many and none is unhashable."""

    __slots__ = ("_hash", "by_identity", "fields", "tag")

    tag: str  # the name the class was registered under when the value was saved
    fields: object
    _hash: int | None
    by_identity: bool  # it was read in a key's place

    def __init__(self, tag: str, fields: object, *, by_identity: bool = False) -> None:
        object.__setattr__(self, "tag", tag)
        object.__setattr__(self, "fields", fields)
        object.__setattr__(self, "_hash", object.__hash__(self) if by_identity else None)
        object.__setattr__(self, "by_identity", by_identity)

    def key_of(self) -> None:
        """Compare and hash by identity from now on (the decoder, before it is a key)."""
        if self._hash is None:
            object.__setattr__(self, "_hash", object.__hash__(self))
        object.__setattr__(self, "by_identity", True)

    def __setattr__(self, name: str, value: object = None) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")

    __delattr__ = __setattr__

    def __reduce__(self) -> tuple[Any, ...]:  # copies despite read-only slots
        return (partial(Unregistered, by_identity=self.by_identity), (self.tag, self.fields))

    def __eq__(self, other: object) -> bool:
        if type(other) is not Unregistered:
            return NotImplemented
        if self.by_identity or other.by_identity:
            return self is other
        return self.tag == other.tag and self.fields == other.fields

    def __hash__(self) -> int:
        h = self._hash
        if h is None:
            f = self.fields
            key: object = frozenset(f.items()) if type(f) is dict else f
            h = hash((self.tag, tuple(key) if type(key) is list else key))
            object.__setattr__(self, "_hash", h)
        return h

    def __repr__(self) -> str:
        tag, f = self.tag, self.fields
        if type(f) is dict:
            inner = ", ".join(
                f"{k}={v!r}" if type(k) is str and k.isidentifier() else f"**{{{k!r}: {v!r}}}"
                for k, v in f.items()
            )
        elif type(f) is list:
            inner = ", ".join(repr(v) for v in f)
        elif type(f) is str and f.isidentifier():
            return f"{tag}.{f}"
        else:
            inner = repr(f)
        return f"{tag}({inner})"


def placeholder(tag: str, fields: object) -> Unregistered:
    """The placeholder of an unknown tag; ``_BadFields`` if no registered class fits."""
    problem = _fields_problem(fields)
    if problem is not None:
        raise _BadFields(problem)
    return Unregistered(tag, fields)
