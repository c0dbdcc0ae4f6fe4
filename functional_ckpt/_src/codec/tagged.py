"""Tagged plain data: paths, datetimes, enums, namespaces, dataclasses, named tuples.

Hyper-parameters routinely hold such values, and a resume must give them back
with their class. They are stored as a (tag, fields) pair whose fields are
ordinary codec values, and rebuilt only through this table: the built-in tags
below, plus the classes a user registers with :func:`register`. A tag read from
a checkpoint is a key into the table, never a module or class name to import, so
a hostile checkpoint can at most build a class the program already chose to
trust, from fields that are checked against that class.

A tag nobody registered in this process is not damage: a reader that only looks
(``fc.inspect``, ``fc.verify``, the command line) asks the decoder to keep it as
an :class:`Unregistered` placeholder, so checkpoints can be inspected and
verified without the code that wrote them; ``fc.restore`` refuses a placeholder,
because a training state silently holding one instead of its class would fail
far from the cause.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import enum
import pathlib
import sys
import zoneinfo
from collections.abc import Callable, Iterable
from typing import Any, Final, NamedTuple, TypeVar, overload

from functional_ckpt.errors import UnsupportedValue

__all__ = [
    "TAGGED",
    "_BadFields",
    "TaggedType",
    "Unregistered",
    "by_tag",
    "default_name",
    "placeholder",
    "placeholder_problem",
    "register",
    "registration_line",
    "tag_problem",
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


_SCRIPT_MODULES: Final = ("__main__", "__mp_main__")


def _script_module(module: str) -> str:
    """The module a class of the program's main script is importable from.

    ``__main__`` names whatever program runs (and ``__mp_main__`` the same script
    in a spawned worker), so a tag naming it would change with how the script is
    started and never match the class imported by another program: the script's
    own module name is used instead (``-m`` gives it; ``python train.py`` is
    importable as ``train``). A main without a script file (an interactive
    session, ``python -c``) has no other name.
    """
    main = sys.modules.get(module)
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", None)
    if type(name) is str and name and name not in _SCRIPT_MODULES:
        return name
    file = getattr(main, "__file__", None)
    if type(file) is str and file.endswith(".py"):
        stem = pathlib.PurePath(file).stem
        if stem.isidentifier():
            return stem
    return module


def _twins(a: type, b: type) -> bool:
    """Are ``a`` and ``b`` one class of the main script, run and also imported by name?

    A script that is imported by its module name as well (``import train`` from
    within ``python train.py``) defines each class twice; both are the same
    source, so they share one tag instead of failing at import.
    """
    if a.__qualname__ != b.__qualname__:
        return False
    if a.__module__ in _SCRIPT_MODULES and b.__module__ not in _SCRIPT_MODULES:
        return _script_module(a.__module__) == b.__module__
    if b.__module__ in _SCRIPT_MODULES and a.__module__ not in _SCRIPT_MODULES:
        return _script_module(b.__module__) == a.__module__
    return False


def default_name(cls: type) -> str:
    """The tag of ``cls`` registered without ``name=``: its module and qualified name."""
    module = cls.__module__
    if module in _SCRIPT_MODULES:
        module = _script_module(module)
    return f"{module}.{cls.__qualname__}"


_T = TypeVar("_T", bound=type)


@overload
def register(cls: _T, name: str | None = None, *, aliases: Iterable[str] = ()) -> _T: ...


@overload
def register(
    cls: None = None, *, name: str | None = None, aliases: Iterable[str] = ()
) -> Callable[[_T], _T]: ...


def register(
    cls: _T | None = None, name: str | None = None, *, aliases: Iterable[str] = ()
) -> _T | Callable[[_T], _T]:
    """Let instances of ``cls`` (a dataclass, NamedTuple or Enum) be saved and restored.

    The class is stored by name only, as the tag ``name`` with its fields as plain
    values; a reader rebuilds it only if the same class is registered under the
    same tag in the restoring process, so register at import time of the module
    that defines it. The default name is ``module.qualname``, where a class of the
    main script takes the script's module name (``train.Cfg`` for ``python
    train.py`` or ``python -m train``) and also reads the ``__main__.Cfg`` of
    older checkpoints; pass ``name=`` to keep a name when the class moves.
    ``aliases`` are older names the class was saved under: read, never written
    (registering a class again with more aliases adds them). Returns ``cls``, so
    it also works as a class decorator (``@register(name=...)`` too).

    Raises:
        UnsupportedValue: ``cls`` is none of the supported kinds, or the tag, an
            alias or the class is already registered differently.
    """
    if cls is None:
        chosen, more = name, tuple(aliases)

        def decorate(c: _T) -> _T:
            return register(c, chosen, aliases=more)

        return decorate
    if not isinstance(cls, type):
        raise UnsupportedValue(f"register() needs a class, got {cls!r:.80}")
    what = f"register({cls.__qualname__})"
    if _is_tensorclass(cls):
        raise UnsupportedValue(f"{what}: {_tensorclass_advice(cls)}")
    tag = default_name(cls) if name is None else name
    if type(tag) is not str or tag_problem(tag) is not None:
        raise UnsupportedValue(f"{what}: invalid name {tag!r:.80}")
    if isinstance(aliases, str):
        raise UnsupportedValue(f"{what}: aliases must be a list of names, not one str")
    old_names = list(aliases)
    for alias in old_names:
        if type(alias) is not str or tag_problem(alias) is not None:
            raise UnsupportedValue(f"{what}: invalid alias {alias!r:.80}")
    if dataclasses.is_dataclass(cls):
        entry = _dataclass_entry(tag, cls)
    elif _is_namedtuple(cls):
        entry = _namedtuple_entry(tag, cls)
    elif issubclass(cls, enum.Enum):
        entry = _enum_entry(tag, cls)
    else:
        raise UnsupportedValue(f"{what}: only dataclasses, NamedTuples and Enums can be registered")
    old = TAGGED.get(cls)
    if old is not None and old.tag != tag:
        raise UnsupportedValue(f"{what}: already registered under the name {old.tag!r}")
    for t in (tag, *old_names):
        taken = _BY_TAG.get(t)
        if taken is not None and taken.cls is not cls and not _twins(taken.cls, cls):
            raise UnsupportedValue(
                f"{what}: the name {t!r} is already taken by "
                f"{taken.cls.__module__}.{taken.cls.__qualname__}; pass another name"
            )
    if old is None and tag in _BY_TAG:
        TAGGED[cls] = entry  # the script's twin: saved under its name, read as the first
    elif old is None:
        _add(entry)
        legacy = f"__main__.{cls.__qualname__}"
        if name is None and cls.__module__ in _SCRIPT_MODULES and legacy not in _BY_TAG:
            _BY_TAG[legacy] = entry  # what this script's class was recorded as before
    else:
        entry = old  # registering twice is harmless
    for alias in old_names:
        _BY_TAG.setdefault(alias, entry)  # read only: encoding writes entry.tag
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


def tag_problem(tag: str) -> str | None:
    """Why ``tag`` can be no class's tag (``register`` refuses it), or None."""
    if not 0 < len(tag) <= _MAX_TAG_LEN:
        return f"a tag of {len(tag)} characters (1 to {_MAX_TAG_LEN})"
    if not tag.isprintable():
        return "a tag with unprintable characters"
    return None


def registration_line(tag: str) -> str:
    """The line that registers a class under ``tag``, its name guessed from the tag."""
    short = tag.rsplit(".", 1)[-1]
    cls = short if short.isidentifier() else "TheClass"
    return f"functional_ckpt.codec.register({cls}, name={tag!r})"


def _namesakes(tag: str) -> list[TaggedType]:
    """Registered classes whose name ends like ``tag``: maybe the same class, renamed."""
    short = tag.rsplit(".", 1)[-1]
    return [e for e in TAGGED.values() if e.tag.rsplit(".", 1)[-1] == short][:3]


def unknown_tag_problem(tag: str) -> str:
    text = (
        f"unknown tagged type {tag!r}: no class is registered under that name in this "
        "process, and nothing is imported from a checkpoint; if it is your dataclass, "
        f"NamedTuple or Enum, call `{registration_line(tag)}` (where the class is "
        "defined) before restoring"
    )
    for e in _namesakes(tag):
        named = "" if e.tag == default_name(e.cls) else f", name={e.tag!r}"
        text += (
            f"; or, if it is the {e.cls.__qualname__} registered here as {e.tag!r}, "
            f"add the old name: `functional_ckpt.codec.register({e.cls.__qualname__}"
            f"{named}, aliases=[{tag!r}])`"
        )
    return text


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
    """A tagged value whose class this process has not registered: its tag and fields.

    What a reader that only looks (``fc.inspect``, ``fc.verify``, the command line)
    gets for such a value, since nothing is ever imported from a checkpoint. Its
    ``fields`` are the decoded fields as stored: a dataclass's map of field names
    to values, a NamedTuple's list of values, an Enum's member name (or the int
    of a combination of ``Flag`` members). Read-only, compared and hashed by tag
    and fields, and never saved; ``fc.restore`` raises ``UnregisteredType``
    instead of returning one.
    """

    __slots__ = ("_fields", "_hash", "_tag")

    _tag: str
    _fields: object
    _hash: int | None

    def __init__(self, tag: str, fields: object) -> None:
        object.__setattr__(self, "_tag", tag)
        object.__setattr__(self, "_fields", fields)
        object.__setattr__(self, "_hash", None)

    @property
    def tag(self) -> str:
        """The name the class was registered under when the value was saved."""
        return self._tag

    @property
    def fields(self) -> object:
        return self._fields

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __reduce__(self) -> tuple[type[Unregistered], tuple[str, object]]:
        return (Unregistered, (self._tag, self._fields))  # copies despite read-only slots

    def __eq__(self, other: object) -> bool:
        if type(other) is not Unregistered:
            return NotImplemented
        return self._tag == other._tag and self._fields == other._fields

    def __hash__(self) -> int:
        h = self._hash
        if h is None:
            f = self._fields
            key: object = frozenset(f.items()) if type(f) is dict else f
            h = hash((self._tag, tuple(key) if type(key) is list else key))
            object.__setattr__(self, "_hash", h)
        return h

    def __repr__(self) -> str:
        tag, f = self._tag, self._fields
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
    """The placeholder of an unknown tag, if its fields are well formed.

    Raises:
        _BadFields: ``fields`` fit no class that could have been registered.
    """
    problem = _fields_problem(fields)
    if problem is not None:
        raise _BadFields(problem)
    return Unregistered(tag, fields)
