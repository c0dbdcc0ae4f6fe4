"""Users' classes in the tagged table: :func:`register`, its naming rule and what to say
when a class or tag is not registered, together so that they always agree."""

from __future__ import annotations

import dataclasses
import enum
import functools
import pathlib
import sys
from collections.abc import Callable, Iterable
from typing import Any, Final, TypeVar, overload

from functional_ckpt._src.codec import tagged
from functional_ckpt.errors import UnsupportedValue

_MAX_TAG_LEN: Final = 256


def _dataclass_entry(tag: str, cls: type) -> tagged.TaggedType:
    names = [f.name for f in dataclasses.fields(cls)]
    init = [f.name for f in dataclasses.fields(cls) if f.init]
    later = [f.name for f in dataclasses.fields(cls) if not f.init]

    def fields(v: Any) -> object:
        return {n: getattr(v, n) for n in names}

    def build(f: object) -> object:
        if type(f) is not dict or len(f) != len(names) or set(f) != set(names):
            keys = list(f) if type(f) is dict else f
            raise tagged._BadFields(f"{tag} has the fields {names}, not {keys!r:.200}")
        obj = cls(**{n: f[n] for n in init})
        for n in later:
            object.__setattr__(obj, n, f[n])
        return obj

    return tagged.TaggedType(tag, cls, fields, build)


def _namedtuple_entry(tag: str, cls: type) -> tagged.TaggedType:
    names: tuple[str, ...] = cls._fields  # type: ignore[attr-defined]

    def build(f: object) -> object:
        if type(f) is not list or len(f) != len(names):
            raise tagged._BadFields(f"{tag} has {len(names)} fields {list(names)}, got {f!r:.200}")
        return cls._make(f)  # type: ignore[attr-defined]

    return tagged.TaggedType(tag, cls, list, build)


def _enum_entry(tag: str, cls: type[enum.Enum]) -> tagged.TaggedType:
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
                raise tagged._BadFields(f"{tag} has no member {f!r:.80}")
            return member
        if type(f) is int and issubclass(cls, enum.Flag):
            return cls(f)
        raise tagged._BadFields(f"{tag} needs a member name, got {f!r:.80}")

    return tagged.TaggedType(tag, cls, fields, build)


def _kind_of(cls: type) -> tuple[str, Callable[[str, Any], tagged.TaggedType]] | None:
    """The kind of class ``register`` takes (" dataclass"...) and how it is tagged, or None."""
    if dataclasses.is_dataclass(cls):
        return " dataclass", _dataclass_entry
    if issubclass(cls, tuple) and isinstance(getattr(cls, "_fields", None), tuple):
        return " NamedTuple", _namedtuple_entry
    if issubclass(cls, enum.Enum):
        return "n Enum", _enum_entry
    return None


_SCRIPT_MODULES: Final = ("__main__", "__mp_main__")


def _script_module(module: str) -> str:
    """The module a class of the main script is importable from (``train`` for ``python
    train.py`` or ``-m train``): ``__main__`` would name whatever program runs."""
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
    """One class of the main script, run and also imported by name (``import train``
    within ``python train.py``): the same source, so one tag."""
    if a.__qualname__ != b.__qualname__:
        return False
    for x, y in ((a, b), (b, a)):
        if x.__module__ in _SCRIPT_MODULES and y.__module__ not in _SCRIPT_MODULES:
            return _script_module(x.__module__) == y.__module__
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
    """Let instances of ``cls`` (a dataclass, NamedTuple or Enum) be saved as the tag
    ``name`` (default ``module.qualname``, a script's module for ``__main__``) with plain
    fields, and rebuilt where the class is registered under that tag or one of its
    ``aliases`` (older names, read, never written). A decorator too."""
    if cls is None:
        return functools.partial(register, name=name, aliases=tuple(aliases))
    if not isinstance(cls, type):
        raise UnsupportedValue(f"register() needs a class, got {cls!r:.80}")
    what = f"register({cls.__qualname__})"
    if is_tensorclass(cls):
        raise UnsupportedValue(f"{what}: {_tensorclass_advice(cls)}")
    if isinstance(aliases, str):
        raise UnsupportedValue(f"{what}: aliases must be a list of names, not one str")
    tag, old_names = default_name(cls) if name is None else name, list(aliases)
    for role, t in [("name", tag), *(("alias", alias) for alias in old_names)]:
        if type(t) is not str or tag_problem(t) is not None:
            raise UnsupportedValue(f"{what}: invalid {role} {t!r:.80}")
    kind = _kind_of(cls)
    if kind is None:
        raise UnsupportedValue(f"{what}: only dataclasses, NamedTuples and Enums can be registered")
    entry = kind[1](tag, cls)
    old = tagged.TAGGED.get(cls)
    if old is not None and old.tag != tag:
        raise UnsupportedValue(f"{what}: already registered under the name {old.tag!r}")
    for t in (tag, *old_names):
        taken = tagged.by_tag(t)
        if taken is not None and taken.cls is not cls and not _twins(taken.cls, cls):
            raise UnsupportedValue(
                f"{what}: the name {t!r} is already taken by "
                f"{taken.cls.__module__}.{taken.cls.__qualname__}; pass another name"
            )
    if old is None:
        twin = tagged.by_tag(tag) is not None  # the script's twin: read as the first
        tagged.add(entry, read=not twin)
        if not twin and name is None and cls.__module__ in _SCRIPT_MODULES:
            tagged.add_name(f"__main__.{cls.__qualname__}", entry)  # what it was recorded as before
    else:
        entry = old  # registering twice is harmless
    for alias in old_names:
        tagged.add_name(alias, entry)  # read only: encoding writes entry.tag
    return cls


def is_tensorclass(cls: object) -> bool:
    """A tensordict ``@tensorclass`` or one's instance (a dataclass by its looks, a tree of
    tensors in fact); only a loaded tensordict makes one, so it is never imported here."""
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
    if is_tensorclass(cls):
        return _tensorclass_advice(cls)
    kind = _kind_of(cls)
    if kind is None:
        return None
    return (
        f"{cls.__module__}.{cls.__qualname__} is a{kind[0]} that is not registered; "
        f"register it once (e.g. where it is defined) with "
        f"`functional_ckpt.codec.register({cls.__qualname__})` "
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


def unknown_tag_problem(tag: str) -> str:
    text = (
        f"unknown tagged type {tag!r}: no class is registered under that name in this "
        "process, and nothing is imported from a checkpoint; if it is your dataclass, "
        f"NamedTuple or Enum, call `{registration_line(tag)}` (where the class is "
        "defined) before restoring"
    )
    short = tag.rsplit(".", 1)[-1]  # a class registered under a name ending so: maybe renamed
    for e in [x for x in tagged.TAGGED.values() if x.tag.rsplit(".", 1)[-1] == short][:3]:
        named = "" if e.tag == default_name(e.cls) else f", name={e.tag!r}"
        text += (
            f"; or, if it is the {e.cls.__qualname__} registered here as {e.tag!r}, "
            f"add the old name: `functional_ckpt.codec.register({e.cls.__qualname__}"
            f"{named}, aliases=[{tag!r}])`"
        )
    return text
