"""Decoding: hostile bytes back to exactly the value that was encoded.

All the checks a reader needs live here: the unpacker's hooks rebuild tagged
containers inside the one C-level parse and count them against the decode
budget, map keys and set members are vetted for a hash flood before a table is
built, every leaf payload is parsed against the bytes present, and the result is
walked once more for depth and stray types.
"""

from __future__ import annotations

import collections
import gc
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, Final

import msgpack

from functional_ckpt._src.codec.leaves import LEAF_DECODERS, _Corrupt
from functional_ckpt._src.codec.placeholder import Unregistered, placeholder
from functional_ckpt._src.codec.registration import tag_problem, unknown_tag_problem
from functional_ckpt._src.codec.table import (
    CONTAINERS,
    EXT_FROZENSET,
    EXT_ORDERED_DICT,
    EXT_SET,
    EXT_TAGGED,
    EXT_TORCH_SIZE,
    EXT_TUPLE,
    container_budget,
    decoded_leaves,
    flood,
    torch_size_problem,
    type_name,
)
from functional_ckpt._src.codec.tagged import TAGGED, _BadFields, by_tag
from functional_ckpt._src.limits import LIMITS
from functional_ckpt.errors import CheckpointError, CorruptCheckpoint, UnsafeCheckpoint

__all__ = ["check_hashes", "decode", "find_unregistered"]

_MSGPACK_STACK_LIMIT: Final = 1024  # the C unpacker's fixed parse stack
_GC_PAUSE_BYTES: Final = 256 * 1024

_OrderedDict = collections.OrderedDict


class _Marker:
    """Stands in, during one parse, for the ext that opens a container array."""

    __slots__ = ("build", "name")

    def __init__(self, name: str, build: Callable[[list[Any]], object]) -> None:
        self.name = name
        self.build = build

    def __repr__(self) -> str:
        return f"<{self.name} marker>"


class _Unsafe(Exception):
    """Internal: resource limit exceeded, re-raised as UnsafeCheckpoint."""


def _as_keys(keys: Iterable[Any]) -> None:
    """Make the placeholders among ``keys`` (or inside a tuple there) compare by identity,
    before a hash table is built of them (see :mod:`.placeholder`)."""
    stack = list(keys)
    while stack:
        k = stack.pop()
        t = type(k)
        if t is Unregistered:
            k.key_of()
        elif t is tuple:
            stack.extend(k)


#: The containers whose members (every one, or every other for an OrderedDict's
#: flat key-value list) a hash table is built of.
_KEYED: Final = {"set": slice(None), "frozenset": slice(None), "OrderedDict": slice(None, None, 2)}


def _build_tuple(items: list[Any]) -> object:
    return tuple(items)


def _refuse_flood(keys: list[Any], what: str) -> None:
    """Refuse, before a hash table is built, keys whose hashes would make it quadratic."""
    if len(keys) <= LIMITS.equal_hashes:
        return  # at most that many probes per insertion anyway
    shared = flood(keys)  # an unhashable key raises TypeError: not a valid encoding
    if shared > LIMITS.equal_hashes:
        raise _Unsafe(
            f"{shared} {what}s share one hash value (at most {LIMITS.equal_hashes} may): "
            "a hash flood"
        )


def check_hashes(keys: list[Any], *, where: str) -> None:
    """Refuse keys read from a checkpoint that would flood a hash table built from them.

    For hash tables built after decoding (for example from a list of dict keys).

    Raises:
        UnsafeCheckpoint: more keys than ``LIMITS.equal_hashes`` share one hash value.
    """
    try:
        _refuse_flood(keys, "key")
    except _Unsafe as exc:
        raise UnsafeCheckpoint(f"{where}: {exc}") from None


def _build_set(items: list[Any]) -> object:
    _refuse_flood(items, "set member")
    return set(items)


def _build_frozenset(items: list[Any]) -> object:
    _refuse_flood(items, "set member")
    return frozenset(items)


def _build_ordered_dict(items: list[Any]) -> object:
    if len(items) % 2:
        raise _Corrupt("OrderedDict with an odd number of keys and values")
    _refuse_flood(items[::2], "map key")
    it = iter(items)
    return _OrderedDict(zip(it, it, strict=True))


def _build_torch_size(items: list[Any]) -> object:
    problem = torch_size_problem(items)
    if problem is not None:
        raise _Corrupt(problem)
    import torch  # a torch.Size was encoded: the value needs torch

    return torch.Size(items)


_MARKERS: Final[dict[int, _Marker]] = {
    EXT_TUPLE: _Marker("tuple", _build_tuple),
    EXT_SET: _Marker("set", _build_set),
    EXT_FROZENSET: _Marker("frozenset", _build_frozenset),
    EXT_ORDERED_DICT: _Marker("OrderedDict", _build_ordered_dict),
    EXT_TORCH_SIZE: _Marker("torch.Size", _build_torch_size),
}


class _Hooks:
    """The unpacker's hooks for one decode: containers are counted as they finish.

    Every array passes through :meth:`list_hook` and every map through
    :meth:`pairs_hook`, so the count is exact and a budget overrun stops the parse
    after at most ``budget`` containers were built, whatever the input declares.
    Maps get their pairs, not a dict, so their keys are vetted for a hash flood
    before any hash table is built. Every ext passes through :meth:`ext_hook`,
    which keeps an unknown tag as a placeholder only if ``unregistered`` is a set.
    """

    __slots__ = ("budget", "count", "few", "unregistered")

    def __init__(self, budget: int, unregistered: set[str] | None) -> None:
        self.budget = budget
        self.count = 0
        self.few = LIMITS.equal_hashes  # maps this small cannot flood
        self.unregistered = unregistered  # None: an unknown tag is refused

    def _over(self) -> _Unsafe:
        return _Unsafe(
            f"more than {self.budget} containers (decode budget: one per "
            f"{LIMITS.decode_bytes_per_container} bytes beyond "
            f"{LIMITS.decode_free_containers}), a memory bomb"
        )

    def list_hook(self, lst: list[Any]) -> object:
        self.count += 1
        if self.count > self.budget:
            raise self._over()
        if lst and type(lst[0]) is _Marker:
            marker = lst[0]
            del lst[0]
            if self.unregistered is not None and marker.name in _KEYED:
                _as_keys(lst[_KEYED[marker.name]])
            try:
                return marker.build(lst)
            except (_Corrupt, _Unsafe):
                raise
            except Exception as exc:  # e.g. an unhashable set member or key
                raise _Corrupt(f"cannot rebuild {marker.name}: {exc}") from None
        return lst

    def ext_hook(self, code: int, payload: bytes) -> object:
        if code == EXT_TAGGED:
            return _tagged_marker(payload, self.unregistered)
        marker = _MARKERS.get(code)
        if marker is not None:
            if payload:
                raise _Corrupt(f"{marker.name} marker with a payload")
            return marker
        decoder = LEAF_DECODERS.get(code)
        if decoder is None:
            raise _Corrupt(f"unknown ext code {code}")
        return decoder(payload)

    def pairs_hook(self, pairs: list[tuple[Any, Any]]) -> object:
        self.count += 1
        if self.count > self.budget:
            raise self._over()
        if self.unregistered is not None:
            _as_keys(k for k, _ in pairs)
        if len(pairs) > self.few:
            _refuse_flood([k for k, _ in pairs], "map key")
        return dict(pairs)


def _tagged_marker(payload: bytes, unregistered: set[str] | None) -> _Marker:
    """The marker of a tagged value: the tag is looked up in the table, never imported.

    An unknown tag is refused, or with ``unregistered`` kept as a placeholder
    (its tag added to that set) once its fields are well formed.
    """
    try:
        tag = payload.decode("utf-8")
    except UnicodeDecodeError:
        raise _Corrupt(f"tagged value with an invalid tag {payload[:80]!r}") from None
    entry = by_tag(tag)
    if entry is None:
        if unregistered is None:
            raise _Unsafe(unknown_tag_problem(tag[:256]))
        problem = tag_problem(tag)
        if problem is not None:
            raise _Corrupt(f"tagged value with {problem}: {tag[:80]!r}")
        unregistered.add(tag)
        rebuild: Callable[[Any], object] = partial(placeholder, tag)
    else:
        rebuild = entry.build

    def build(items: list[Any]) -> object:
        if len(items) != 1:
            raise _Corrupt(f"tagged value {tag!r} with {len(items)} fields entries instead of 1")
        try:
            return rebuild(items[0])
        except _BadFields as exc:
            raise _Corrupt(f"tagged value {tag!r}: {exc}") from None

    return _Marker(f"tagged value {tag!r}", build)


def _stray(t: type) -> _Corrupt:
    if t is _Marker:
        return _Corrupt("container marker outside the first slot of an array")
    if t is msgpack.Timestamp:
        return _Corrupt("unknown ext code -1 (msgpack timestamp)")
    return _Corrupt(f"unexpected decoded type {type_name(t)}")  # pragma: no cover


def _tagged_fields(t: type, value: object) -> object:
    """The fields below a rebuilt tagged value, walked like any container's children."""
    entry = TAGGED.get(t)
    if entry is None:
        if t is Unregistered:
            return value.fields  # type: ignore[attr-defined]
        raise _stray(t)
    return entry.fields(value)


def find_unregistered(value: object) -> Unregistered | None:
    """The first placeholder in a decoded value (which ``decode`` bounded in depth), if any.

    Breadth first, in the order the value holds its items, so a message names the
    placeholder a reader sees first.
    """
    leaves = decoded_leaves()
    todo = [value]
    i = 0
    while i < len(todo):
        obj = todo[i]
        i += 1
        t = type(obj)
        if t is Unregistered:
            return obj  # type: ignore[return-value]
        if t in leaves:
            continue
        if t is dict or t is _OrderedDict:
            todo += obj.keys()  # type: ignore[attr-defined]
            todo += obj.values()  # type: ignore[attr-defined]
        elif t in CONTAINERS:
            todo += obj  # type: ignore[arg-type]
        else:
            entry = TAGGED.get(t)
            if entry is not None:
                todo.append(entry.fields(obj))
    return None


def _check_decoded(value: object, max_depth: int) -> None:
    """Bound the nesting and make sure only supported types came out.

    The unpacker cannot be told a depth limit (only its fixed 1024-level parse
    stack), and it turns ext -1 into a msgpack Timestamp without consulting
    ``ext_hook``; a stray container marker is also only visible here.
    Iterative, so hostile depth cannot reach Python's recursion limit.
    """
    leaves = decoded_leaves()
    containers = CONTAINERS
    t = type(value)
    if t not in containers:
        if t not in leaves:
            _check_decoded([_tagged_fields(t, value)], max_depth)
        return
    # Level by level rather than a stack of (node, depth) pairs: no per-node
    # allocation, which matters for manifests with tens of thousands of dicts.
    level_nodes: list[Any] = [value]
    level = 1
    while level_nodes:
        if level > max_depth:
            raise _Unsafe(f"nesting deeper than max_depth={max_depth}")
        next_nodes: list[Any] = []
        push = next_nodes.append
        for obj in level_nodes:
            t = type(obj)
            groups = (obj, obj.values()) if t is dict or t is _OrderedDict else (obj,)
            for group in groups:  # a mapping's keys, then its values
                for child in group:
                    tc = type(child)
                    if tc in leaves:
                        continue
                    if tc in containers:
                        push(child)
                    else:
                        push([_tagged_fields(tc, child)])
        level_nodes = next_nodes
        level += 1


def decode(
    data: bytes | memoryview,
    *,
    source: str = "data",
    max_depth: int = LIMITS.decode_depth,
    unregistered: set[str] | None = None,
) -> object:
    """Rebuild exactly the value ``encode`` was given, treating ``data`` as hostile.

    A tagged value whose tag no class is registered under is refused, unless
    ``unregistered`` is given: then it comes back as an ``Unregistered``
    placeholder (its tag added to the set), so a reader that only looks needs
    no user code; its fields are decoded and bounded like any other value, and
    fields no registered class could have (or an impossible tag) stay damage.

    ``data`` may come from a damaged disk or an attacker, so decoding never runs
    code, never recurses in Python, stays linear in ``len(data)`` (no hash
    flood), and holds at most about 20 times ``len(data)`` in containers (the
    decode budget) plus what msgpack's fixed 1024-level parse stack costs.

    Errors are split by what the caller should conclude:

    Raises:
        CorruptCheckpoint: the bytes are not a valid encoding: truncated,
            trailing bytes, invalid UTF-8, unknown ext codes, malformed ext
            payloads, and any declared length (array, map, string, ndarray
            shape) that does not match the bytes actually present. Size bombs
            land here too, because from the bytes alone they are
            indistinguishable from truncation or a flipped length bit.
        UnsafeCheckpoint: a tag no class is registered under (without
            ``unregistered``). Or the bytes are well formed but nest containers deeper
            than ``max_depth`` (or than msgpack's fixed parse stack of 1024), a
            depth bomb aimed at whatever walks the value next; or they hold more
            containers than the decode budget allows (a memory bomb), or keys or
            set members sharing one hash value beyond the limit (a hash flood).
    """
    if isinstance(data, memoryview):
        if not data.c_contiguous:
            data = data.tobytes()
        n = data.nbytes if isinstance(data, memoryview) else len(data)
    elif isinstance(data, (bytes, bytearray)):
        n = len(data)
    else:
        raise TypeError(f"decode() needs bytes or memoryview, not {type_name(type(data))}")
    # Building many containers at once triggers full cyclic-GC passes over the
    # whole process heap (msgpack's own advice is to pause GC); nothing built
    # here can form a cycle, so the pause loses nothing.
    hooks = _Hooks(container_budget(n, LIMITS.decode_free_containers), unregistered)
    pause_gc = n >= _GC_PAUSE_BYTES and gc.isenabled()
    if pause_gc:
        gc.disable()
    try:
        value = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=False,
            unicode_errors="surrogatepass",
            ext_hook=hooks.ext_hook,
            list_hook=hooks.list_hook,
            object_pairs_hook=hooks.pairs_hook,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n // 2,
            max_ext_len=n,
        )
        _check_decoded(value, max_depth)
    except _Unsafe as exc:
        raise UnsafeCheckpoint(f"{source}: {exc}") from None
    except _Corrupt as exc:
        raise CorruptCheckpoint(f"{source}: {exc}") from None
    except msgpack.StackError:
        raise UnsafeCheckpoint(
            f"{source}: nesting deeper than msgpack's parse stack ({_MSGPACK_STACK_LIMIT})"
        ) from None
    except RecursionError:  # pragma: no cover - nothing above recurses; belt and braces
        raise UnsafeCheckpoint(f"{source}: nesting too deep to decode") from None
    except msgpack.ExtraData:
        raise CorruptCheckpoint(f"{source}: trailing bytes after the encoded value") from None
    except UnicodeDecodeError as exc:
        raise CorruptCheckpoint(f"{source}: invalid UTF-8 in a string: {exc}") from None
    except MemoryError:
        raise
    except CheckpointError:  # pragma: no cover - hooks only raise the internal errors
        raise
    except Exception as exc:
        raise CorruptCheckpoint(
            f"{source}: not a valid encoding ({type(exc).__name__}: {exc})"
        ) from None
    finally:
        if pause_gc:
            gc.enable()
    return value
