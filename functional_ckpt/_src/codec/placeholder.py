"""The placeholder of a tagged value whose class this process has not registered.

A tag nobody registered in this process is not damage: a reader that only looks
(``fc.inspect``, ``fc.verify``, the command line) asks the decoder to keep it as
an :class:`Unregistered` placeholder, so checkpoints can be inspected and
verified without the code that wrote them; ``fc.restore`` refuses a placeholder,
because a training state silently holding one instead of its class would fail
far from the cause.

Without the class a reader cannot know how its instances compared: by fields
(a frozen dataclass) or by identity (``@dataclass(eq=False)``, whose fields may
hold lists). A placeholder in a key's place (a set or frozenset member, a dict or
OrderedDict key, or inside a tuple there) therefore compares and hashes by
identity: the members the writer had stay as many, whatever their fields, and
none is unhashable. Everywhere else a placeholder compares by tag and fields.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from functional_ckpt._src.codec.tagged import _BadFields

__all__ = ["Unregistered", "placeholder", "placeholder_problem"]


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
    and fields (by identity where it was read in a key's place: see the module),
    and never saved; ``fc.restore`` raises ``UnregisteredType`` instead of
    returning one.
    """

    __slots__ = ("_by_identity", "_fields", "_hash", "_tag")

    _tag: str
    _fields: object
    _hash: int | None
    _by_identity: bool

    def __init__(self, tag: str, fields: object, *, by_identity: bool = False) -> None:
        object.__setattr__(self, "_tag", tag)
        object.__setattr__(self, "_fields", fields)
        object.__setattr__(self, "_hash", object.__hash__(self) if by_identity else None)
        object.__setattr__(self, "_by_identity", by_identity)

    @property
    def tag(self) -> str:
        """The name the class was registered under when the value was saved."""
        return self._tag

    @property
    def fields(self) -> object:
        return self._fields

    @property
    def by_identity(self) -> bool:
        """Whether it compares and hashes by identity: it was read in a key's place."""
        return self._by_identity

    def key_of(self) -> None:
        """Compare and hash by identity from now on (the decoder, before it is a key)."""
        if self._hash is None:
            object.__setattr__(self, "_hash", object.__hash__(self))
        object.__setattr__(self, "_by_identity", True)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __reduce__(self) -> tuple[Any, ...]:  # copies despite read-only slots
        return (partial(Unregistered, by_identity=self._by_identity), (self._tag, self._fields))

    def __eq__(self, other: object) -> bool:
        if type(other) is not Unregistered:
            return NotImplemented
        if self._by_identity or other._by_identity:
            return self is other
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
