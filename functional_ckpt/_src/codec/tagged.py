"""Tagged plain data: paths, datetimes, enums, namespaces, dataclasses, named tuples.

Hyper-parameters routinely hold such values, and a resume must give them back
with their class. They are stored as a (tag, fields) pair whose fields are
ordinary codec values, and rebuilt only through this table: the built-in tags
below, plus the classes a user registers with :func:`register`. A tag read from
a checkpoint is a key into the table, never a module or class name to import, so
a hostile checkpoint can at most build a class the program already chose to
trust, from fields that are checked against that class.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import enum
import pathlib
import sys
import zoneinfo
from collections.abc import Callable
from typing import Any, Final, NamedTuple

from functional_ckpt.errors import UnsupportedValue

__all__ = [
    "TAGGED",
    "_BadFields",
    "TaggedType",
    "by_tag",
    "register",
    "unknown_tag_problem",
    "unregistered_problem",
]

_MAX_TAG_LEN: Final = 256


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

# --- user classes: dataclasses, named tuples, enums ---------------------------------


def _is_namedtuple(cls: type) -> bool:
    return issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple)


def _dataclass_entry(tag: str, cls: type) -> TaggedType:
    names = [f.name for f in dataclasses.fields(cls)]
    init = [f.name for f in dataclasses.fields(cls) if f.init]
    later = [f.name for f in dataclasses.fields(cls) if not f.init]

    def fields(v: Any) -> object:
        return {n: getattr(v, n) for n in names}

    def build(f: object) -> object:
        if type(f) is not dict or len(f) != len(names) or set(f) != set(names):
            keys = list(f) if type(f) is dict else f
            raise _BadFields(f"{tag} has the fields {names}, not {keys!r:.200}")
        obj = cls(**{n: f[n] for n in init})
        for n in later:
            object.__setattr__(obj, n, f[n])
        return obj

    return TaggedType(tag, cls, fields, build)


def _namedtuple_entry(tag: str, cls: type) -> TaggedType:
    names: tuple[str, ...] = cls._fields  # type: ignore[attr-defined]

    def build(f: object) -> object:
        if type(f) is not list or len(f) != len(names):
            raise _BadFields(f"{tag} has {len(names)} fields {list(names)}, got {f!r:.200}")
        return cls._make(f)  # type: ignore[attr-defined]

    return TaggedType(tag, cls, list, build)


def _enum_entry(tag: str, cls: type[enum.Enum]) -> TaggedType:
    def fields(v: enum.Enum) -> object:
        if v._name_ is not None and cls.__members__.get(v._name_) is v:
            return v._name_
        if issubclass(cls, enum.Flag) and type(v._value_) is int:
            return v._value_  # a combination of flags has no single name
        raise UnsupportedValue(f"{v!r} is neither a named member of {tag} nor an int flag")

    def build(f: object) -> object:
        if type(f) is str:
            member = cls.__members__.get(f)
            if member is None:
                raise _BadFields(f"{tag} has no member {f!r:.80}")
            return member
        if type(f) is int and issubclass(cls, enum.Flag):
            return cls(f)
        raise _BadFields(f"{tag} needs a member name, got {f!r:.80}")

    return TaggedType(tag, cls, fields, build)


def _how_to_register(cls: type) -> str:
    return f"functional_ckpt.codec.register({cls.__qualname__})"


def register(cls: type, name: str | None = None) -> type:
    """Let instances of ``cls`` (a dataclass, NamedTuple or Enum) be saved and restored.

    The class is stored by name only, as the tag ``name`` (default
    ``module.qualname``) with its fields as plain values; a reader rebuilds it
    only if the same class is registered under the same tag in the restoring
    process, so register at import time of the module that defines it. Returns
    ``cls``, so it also works as a class decorator.

    Raises:
        UnsupportedValue: ``cls`` is none of the supported kinds, or the tag or
            the class is already registered differently.
    """
    if not isinstance(cls, type):
        raise UnsupportedValue(f"register() needs a class, got {cls!r:.80}")
    if _is_tensorclass(cls):
        raise UnsupportedValue(f"register({cls.__qualname__}): {_tensorclass_advice(cls)}")
    tag = f"{cls.__module__}.{cls.__qualname__}" if name is None else name
    if type(tag) is not str or not 0 < len(tag) <= _MAX_TAG_LEN or not tag.isprintable():
        raise UnsupportedValue(f"register({cls.__qualname__}): invalid name {tag!r:.80}")
    if dataclasses.is_dataclass(cls):
        entry = _dataclass_entry(tag, cls)
    elif _is_namedtuple(cls):
        entry = _namedtuple_entry(tag, cls)
    elif issubclass(cls, enum.Enum):
        entry = _enum_entry(tag, cls)
    else:
        raise UnsupportedValue(
            f"register({cls.__qualname__}): only dataclasses, NamedTuples and Enums can be "
            "registered"
        )
    old = TAGGED.get(cls)
    if old is not None and old.tag == tag:
        return cls  # registering twice is harmless
    if old is not None:
        raise UnsupportedValue(
            f"register({cls.__qualname__}): already registered under the name {old.tag!r}"
        )
    if tag in _BY_TAG:
        taken = _BY_TAG[tag].cls
        raise UnsupportedValue(
            f"register({cls.__qualname__}): the name {tag!r} is already taken by "
            f"{taken.__module__}.{taken.__qualname__}; pass another name=..."
        )
    _add(entry)
    return cls


def _is_tensorclass(cls: type) -> bool:
    """A tensordict ``@tensorclass``: a dataclass by its looks, a tree of tensors in fact.

    Only when tensordict is loaded can a class be one, so plain-value code never
    imports it.
    """
    tensordict = sys.modules.get("tensordict")
    return tensordict is not None and bool(tensordict.is_tensorclass(cls))


def _tensorclass_advice(cls: type) -> str:
    return (
        f"{cls.__module__}.{cls.__qualname__} is a tensorclass: its tensors belong in the "
        "tensor tree, which a registered class (stored as plain values) cannot hold; store "
        "obj.to_tensordict() instead (it keeps the batch size and names) and rebuild after "
        f"restoring with {cls.__qualname__}.from_tensordict(state[...])"
    )


def unregistered_problem(cls: type) -> str | None:
    """Why an instance of ``cls`` is refused, when it is a kind users can register."""
    if _is_tensorclass(cls):
        return _tensorclass_advice(cls)
    if dataclasses.is_dataclass(cls):
        kind = " dataclass"
    elif _is_namedtuple(cls):
        kind = " NamedTuple"
    elif issubclass(cls, enum.Enum):
        kind = "n Enum"
    else:
        return None
    return (
        f"{cls.__module__}.{cls.__qualname__} is a{kind} that is not registered; "
        f"register it once (e.g. where it is defined) with `{_how_to_register(cls)}` "
        "to store it as tagged plain data"
    )


def unknown_tag_problem(tag: str) -> str:
    return (
        f"unknown tagged type {tag!r}: no class is registered under that name in this "
        "process, and nothing is imported from a checkpoint; if it is your dataclass, "
        f"NamedTuple or Enum, call functional_ckpt.codec.register(TheClass, name={tag!r}) "
        "before restoring"
    )
