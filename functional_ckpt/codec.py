"""Exact, pickle-free encoding of the non-tensor values of a training state.

A resumed run must be bit-identical to the run that saved it, so a codec that
turns a tuple into a list, an ``int`` key into a ``str``, a ``np.float32`` into a
``float`` or a NaN into another NaN silently breaks the resume in ways nobody
notices until the curves diverge. This module therefore stores every supported
value so that it comes back with exactly the same type at every level and the
same value bit for bit, and refuses everything else loudly instead of
converting it.

The format is msgpack. Types msgpack stores exactly (``None``, ``bool``,
``int`` in the 64-bit range, ``float`` as a double, ``str``, ``bytes``,
``list``, ``dict``) use its native forms, so the C packer and unpacker do the
bulk of the work and a manifest of tens of thousands of entries stays fast.
Everything else is an extension type:

* Containers (tuple, set, frozenset, OrderedDict, torch.Size) are written as a
  native array whose first element is an empty *marker* ext. The unpacker
  rebuilds them in its ``list_hook`` while it is still inside the one C-level
  parse, so decoding them never recurses through Python or through nested
  ``unpackb`` calls (each of which reserves a large parser stack on the C
  stack), and tuples used as dict keys are hashable by the time the map needs
  them.
* Leaves (big ints, bytearray, numpy arrays and scalars, torch dtypes and
  devices) carry their payload inside the ext.

Ext codes (stable; part of the on-disk format):

====  =================  ==================================================
code  kind               payload
====  =================  ==================================================
1     tuple marker       empty; ``[m, *items]``
2     set marker         empty; ``[m, *members]``
3     frozenset marker   empty; ``[m, *members]``
4     OrderedDict marker empty; ``[m, k0, v0, k1, v1, ...]``
5     torch.Size marker  empty; ``[m, *dims]``
16    big int            little-endian two's complement bytes
17    bytearray          the bytes
18    numpy.ndarray      msgpack ``[dtype_code, shape, c_order_bytes]``
19    numpy scalar       msgpack ``[dtype_code, raw_bytes]``, or ``["U", str]`` /
                         ``["S", bytes]`` for ``np.str_`` / ``np.bytes_``
20    torch.dtype        ascii name without ``torch.``, e.g. ``bfloat16``
21    torch.device       ascii ``str(device)``, e.g. ``cuda:0``
====  =================  ==================================================

Decoding treats its input as hostile: no pickle, no import or attribute lookup
driven by the data (dtypes and devices are matched against fixed tables or
parsed and re-checked for a canonical spelling), every declared length is capped
by the bytes actually present before anything is allocated, and nesting is
bounded without Python recursion. Its limits come from
:data:`functional_ckpt.limits.LIMITS`, which ``encode`` enforces too:

* every decode may build at most one container per
  ``decode_bytes_per_container`` input bytes (beyond ``decode_free_containers``),
  counted as each container is finished, so memory stays within a small multiple
  of the input and a flood of tiny containers is refused after a bounded amount
  of work;
* no map or set may have more than ``equal_hashes`` keys or members sharing one
  hash value, counted in linear time before the hash table is built, so hash
  flooding cannot make decoding quadratic.
"""

from __future__ import annotations

import collections
import gc
import itertools
import math
from collections.abc import Callable, Iterable
from typing import Any, Final, cast

import msgpack
import numpy as np
import torch

from functional_ckpt.errors import (
    CheckpointError,
    CorruptCheckpoint,
    UnsafeCheckpoint,
    UnsupportedValue,
)
from functional_ckpt.limits import LIMITS

__all__ = [
    "EXT_BIGINT",
    "EXT_BYTEARRAY",
    "EXT_FROZENSET",
    "EXT_NDARRAY",
    "EXT_NUMPY_SCALAR",
    "EXT_ORDERED_DICT",
    "EXT_SET",
    "EXT_TORCH_DEVICE",
    "EXT_TORCH_DTYPE",
    "EXT_TORCH_SIZE",
    "EXT_TUPLE",
    "MAX_ENCODE_DEPTH",
    "check_encodable",
    "check_hashes",
    "decode",
    "encode",
    "encode_checked",
]

EXT_TUPLE: Final = 1
EXT_SET: Final = 2
EXT_FROZENSET: Final = 3
EXT_ORDERED_DICT: Final = 4
EXT_TORCH_SIZE: Final = 5
EXT_BIGINT: Final = 16
EXT_BYTEARRAY: Final = 17
EXT_NDARRAY: Final = 18
EXT_NUMPY_SCALAR: Final = 19
EXT_TORCH_DTYPE: Final = 20
EXT_TORCH_DEVICE: Final = 21

MAX_ENCODE_DEPTH: Final = LIMITS.encode_depth
"""Deepest container nesting ``encode`` accepts (see :class:`~functional_ckpt.limits.Limits`)."""

_MSGPACK_STACK_LIMIT: Final = 1024  # the C unpacker's fixed parse stack
_MAX_DEVICE_LEN: Final = 64
_GC_PAUSE_BYTES: Final = 256 * 1024

_NoneType = type(None)
_OrderedDict = collections.OrderedDict

# Types the strict C packer writes natively *and* the unpacker returns with the
# same type. bytearray is deliberately absent: msgpack packs it as bin, which
# decodes as bytes.
_NATIVE_LEAVES: Final[frozenset[type]] = frozenset({_NoneType, bool, int, float, str, bytes})

_CONTAINERS: Final[frozenset[type]] = frozenset({list, tuple, dict, _OrderedDict, set, frozenset})

_NUMPY_SCALAR_TYPES: Final[frozenset[type]] = frozenset(
    t for t in set(np.sctypeDict.values()) if t is not np.object_ and t is not np.void
)

_TORCH_DTYPES: Final[dict[str, torch.dtype]] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)
}

_LEAVES: Final[frozenset[type]] = (
    _NATIVE_LEAVES
    | _NUMPY_SCALAR_TYPES
    | {bytearray, np.ndarray, torch.dtype, torch.device, torch.Size}
)

_SUPPORTED_TEXT: Final = (
    "None, bool, int, float, str, bytes, bytearray, list, tuple, dict, "
    "collections.OrderedDict, set, frozenset, numpy.ndarray (non-object dtypes), "
    "numpy scalars, torch.dtype, torch.device, torch.Size"
)

# Array dtype kinds whose raw bytes fully describe the values.
_ARRAY_KINDS: Final = frozenset("biufcMmSUV")
_CHAR_KINDS: Final = frozenset("biufc")


class _Marker:
    """Stands in, during one parse, for the ext that opens a container array."""

    __slots__ = ("build", "name")

    def __init__(self, name: str, build: Callable[[list[Any]], object]) -> None:
        self.name = name
        self.build = build

    def __repr__(self) -> str:
        return f"<{self.name} marker>"


class _Corrupt(Exception):
    """Internal: malformed data, re-raised as CorruptCheckpoint naming the source."""


class _Unsafe(Exception):
    """Internal: resource limit exceeded, re-raised as UnsafeCheckpoint."""


# --------------------------------------------------------------------------- dtypes


def _dtype_code(dt: np.dtype[Any]) -> str | None:
    """Spell a dtype so that parsing it gives back the same dtype *class*.

    ``dtype.str`` alone is not enough: ``longlong`` and ``int64`` share ``<i8``
    but are different scalar types, so fixed-size numeric kinds use byte order
    plus type character instead. Returns None for dtypes we cannot store exactly.
    """
    kind = dt.kind
    if kind not in _ARRAY_KINDS or dt.hasobject or dt.fields is not None:
        return None
    if dt.subdtype is not None or dt.itemsize == 0:
        return None
    code = dt.str[0] + dt.char if kind in _CHAR_KINDS else dt.str
    try:
        back = np.dtype(code)
    except (TypeError, ValueError):  # pragma: no cover - defensive
        return None
    if back != dt or type(back) is not type(dt) or back.char != dt.char:
        return None  # e.g. extension dtypes that only look like void/bytes
    return code


def _parse_dtype(code: object) -> np.dtype[Any]:
    if type(code) is not str or not code or len(code) > 32 or not code.isascii():
        raise _Corrupt(f"invalid numpy dtype code {code!r}")
    try:
        dt = np.dtype(code)
    except Exception:
        raise _Corrupt(f"invalid numpy dtype code {code!r}") from None
    if _dtype_code(dt) != code:
        raise _Corrupt(f"non-canonical or unsupported numpy dtype code {code!r}")
    return dt


# --------------------------------------------------------------------------- encoding


def _pack_payload(obj: object) -> bytes:
    return msgpack.packb(
        obj,
        use_bin_type=True,
        use_single_float=False,
        strict_types=True,
        unicode_errors="surrogatepass",  # np.str_ may hold lone surrogates
    )


def _encode_bigint(n: int) -> msgpack.ExtType:
    return msgpack.ExtType(EXT_BIGINT, n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True))


def _encode_ndarray(a: np.ndarray[Any, Any]) -> msgpack.ExtType:
    code = _dtype_code(a.dtype)
    if code is None:  # pragma: no cover - _scan refuses these first
        raise UnsupportedValue(f"unsupported numpy dtype {a.dtype!r}")
    return msgpack.ExtType(EXT_NDARRAY, _pack_payload([code, list(a.shape), a.tobytes()]))


def _encode_numpy_scalar(x: np.generic) -> msgpack.ExtType:
    # Text scalars lose trailing NULs through an array (and np.str_("") has a
    # zero itemsize), so they travel as their Python value under a bare kind.
    t = type(x)
    if t is np.str_:
        # str() would go through numpy's __str__, which drops trailing NULs.
        return msgpack.ExtType(EXT_NUMPY_SCALAR, _pack_payload(["U", str.__str__(x)]))
    if t is np.bytes_:
        payload = _pack_payload(["S", bytes(memoryview(cast(bytes, x)))])
        return msgpack.ExtType(EXT_NUMPY_SCALAR, payload)
    code = _dtype_code(x.dtype)
    if code is None:  # pragma: no cover - _scan refuses these first
        raise UnsupportedValue(f"unsupported numpy scalar {type(x).__name__}")
    return msgpack.ExtType(EXT_NUMPY_SCALAR, _pack_payload([code, x.tobytes()]))


_TUPLE_EXT: Final = msgpack.ExtType(EXT_TUPLE, b"")
_SET_EXT: Final = msgpack.ExtType(EXT_SET, b"")
_FROZENSET_EXT: Final = msgpack.ExtType(EXT_FROZENSET, b"")
_ORDERED_DICT_EXT: Final = msgpack.ExtType(EXT_ORDERED_DICT, b"")
_TORCH_SIZE_EXT: Final = msgpack.ExtType(EXT_TORCH_SIZE, b"")


def _default(obj: Any) -> object:
    """The C packer's fallback for every type it does not write natively."""
    t = type(obj)
    if t is tuple:
        return [_TUPLE_EXT, *obj]
    if t is int:  # outside the 64-bit range msgpack handles
        return _encode_bigint(obj)
    if t is np.ndarray:
        return _encode_ndarray(obj)
    if t in _NUMPY_SCALAR_TYPES:
        return _encode_numpy_scalar(obj)
    if t is set:
        return [_SET_EXT, *obj]
    if t is frozenset:
        return [_FROZENSET_EXT, *obj]
    if t is _OrderedDict:
        return [_ORDERED_DICT_EXT, *itertools.chain.from_iterable(obj.items())]
    if t is torch.Size:
        return [_TORCH_SIZE_EXT, *obj]
    if t is torch.dtype:
        return msgpack.ExtType(EXT_TORCH_DTYPE, str(obj).removeprefix("torch.").encode("ascii"))
    if t is torch.device:
        return msgpack.ExtType(EXT_TORCH_DEVICE, str(obj).encode("ascii"))
    # Unreachable after _scan, except for the ExtTypes we insert ourselves,
    # which the packer handles natively.
    raise UnsupportedValue(f"unsupported type {_type_name(t)}")  # pragma: no cover


def _type_name(t: type) -> str:
    if t.__module__ == "builtins":
        return t.__qualname__
    return f"{t.__module__}.{t.__qualname__}"


def _short_repr(obj: object, limit: int = 40) -> str:
    try:
        text = repr(obj)
    except Exception:
        text = f"<{_type_name(type(obj))}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


_BASES_OF_SUBCLASSES: Final = (
    bool,
    int,
    float,
    str,
    bytes,
    bytearray,
    list,
    tuple,
    dict,
    set,
    frozenset,
    np.ndarray,
)


def _torch_size_problem(dims: Iterable[object]) -> str | None:
    for d in dims:
        if type(d) is not int:
            return f"torch.Size dimension of type {_type_name(type(d))}"
        if not -(2**63) <= d < 2**63:
            # torch.Size stores such a value but fails when it is read back.
            return f"torch.Size dimension {d} out of the int64 range"
    return None


def _leaf_problem(obj: object, t: type) -> str | None:
    """Why a non-container value cannot be stored, or None if it can."""
    if t in _LEAVES:
        if t is torch.Size:
            return _torch_size_problem(obj)  # type: ignore[arg-type]
        if t is np.ndarray:
            dtype = obj.dtype  # type: ignore[attr-defined]
            if _dtype_code(dtype) is None:
                return (
                    f"numpy array with dtype {dtype!r} is not supported "
                    "(only plain bool/int/uint/float/complex/datetime/bytes/str dtypes)"
                )
        return None
    if isinstance(obj, torch.Tensor):
        return (
            f"{_type_name(t)} is not supported here; tensors belong in the tensor tree, "
            "not among plain values"
        )
    if isinstance(obj, np.generic):
        return f"unsupported numpy scalar type {_type_name(t)} (supported: {_SUPPORTED_TEXT})"
    for base in _BASES_OF_SUBCLASSES:
        if isinstance(obj, base):
            return (
                f"unsupported type {_type_name(t)}, a subclass of {_type_name(base)} "
                "(only exact types round-trip, so subclasses are refused rather than converted; "
                f"supported: {_SUPPORTED_TEXT})"
            )
    return f"unsupported type {_type_name(t)} (supported: {_SUPPORTED_TEXT})"


# A node of the scan is (value, level_of_its_container, parent_node, label_kind, label).
_ITEM: Final = 0
_KEY: Final = 1
_MEMBER: Final = 2
_Node = tuple[object, int, Any, int, object]


def _path(node: _Node | None, where: str) -> str:
    parts: list[str] = []
    while node is not None and node[2] is not None:
        _, _, parent, kind, label = node
        if kind == _ITEM:
            parts.append(f"[{_short_repr(label)}]")
        elif kind == _KEY:
            parts.append(f"<key {_short_repr(label)}>")
        else:
            parts.append(f"<member {_short_repr(label)}>")
        node = parent
    parts.reverse()
    if len(parts) > 16:  # a depth error would otherwise print hundreds of "[0]"
        parts[8:-6] = [f"...{len(parts) - 14} levels..."]
    return where + "".join(parts)


def _flood(keys: Iterable[object]) -> int:
    """How many of ``keys`` share the most common hash value (linear time)."""
    return max(collections.Counter(map(hash, keys)).values(), default=0)


def _scan(value: object, where: str) -> tuple[bool, int]:
    """Refuse anything that would not come back exactly.

    Returns whether bytearrays occur and how many containers ``decode`` will
    build, for its budget. Must run before packing: the C packer would happily
    write a bytearray or a memoryview as bin (which reads back as bytes) and a
    stray ExtType or Timestamp as itself. Iterative, so a deep value cannot
    exhaust the Python stack, and labels are kept as raw keys so paths are only
    formatted on error.
    """
    native = _NATIVE_LEAVES
    has_bytearray = False
    containers = 0
    equal_hashes = LIMITS.equal_hashes
    stack: list[_Node] = [(value, 0, None, _ITEM, None)]
    push = stack.append
    pop = stack.pop
    while stack:
        node = pop()
        obj: Any = node[0]
        t = type(obj)
        if t is dict or t is list or t is tuple or t in _CONTAINERS:
            containers += 1
            level = node[1] + 1
            if level > MAX_ENCODE_DEPTH:
                raise UnsupportedValue(
                    f"{_path(node, where)}: nested deeper than {MAX_ENCODE_DEPTH} containers"
                )
            if t is not list and t is not tuple and len(obj) > equal_hashes:
                shared = _flood(obj)
                if shared > equal_hashes:
                    raise UnsupportedValue(
                        f"{_path(node, where)}: {shared} keys or members share one hash value "
                        f"(at most {equal_hashes} may: a reader refuses more as a hash flood)"
                    )
            if t is dict or t is _OrderedDict:
                for k, v in obj.items():
                    if type(k) not in native:
                        push((k, level, node, _KEY, k))
                    if type(v) not in native:
                        push((v, level, node, _ITEM, k))
            elif t is list or t is tuple:
                for i, v in enumerate(obj):
                    if type(v) not in native:
                        push((v, level, node, _ITEM, i))
            else:
                for m in obj:
                    if type(m) not in native:
                        push((m, level, node, _MEMBER, m))
        elif t in native:
            continue
        else:
            problem = _leaf_problem(obj, t)
            if problem is not None:
                raise UnsupportedValue(f"{_path(node, where)}: {problem}")
            if t is bytearray:
                has_bytearray = True
            elif t is torch.Size:
                containers += 1  # written as a marked array
    return has_bytearray, containers


def _container_budget(nbytes: int, free: int) -> int:
    """How many containers a decode of ``nbytes`` bytes may build."""
    return free + nbytes // LIMITS.decode_bytes_per_container


def _check_budget(containers: int, data: bytes, free: int, where: str) -> None:
    budget = _container_budget(len(data), free)
    if containers > budget:
        raise UnsupportedValue(
            f"{where}: {containers} containers in {len(data)} encoded bytes exceed the decode "
            f"budget ({budget}: one per {LIMITS.decode_bytes_per_container} bytes beyond "
            f"{free}); a reader would refuse it. Store bulk data as a tensor or numpy array"
        )


_REBUILT: Final[frozenset[type]] = frozenset({list, tuple, dict, _OrderedDict})


def _wrap_bytearrays(value: Any) -> Any:
    """Copy the containers above each bytearray, swapping it for its ext.

    Needed because the packer never offers a bytearray to ``default``. Only
    lists, tuples and dict values can hold one (it is unhashable). Iterative
    like _scan: containers are copied into mutable shells top-down, then
    frozen bottom-up, so the Python stack depth does not grow with nesting.
    """
    if type(value) is bytearray:
        return msgpack.ExtType(EXT_BYTEARRAY, bytes(value))
    if type(value) not in _REBUILT:
        return value
    # Each shell: (type, keys or None, child values, parent shell index, slot).
    shells: list[tuple[type, list[Any] | None, list[Any], int, int]] = []
    stack: list[tuple[Any, int, int]] = [(value, -1, 0)]
    while stack:
        obj, parent, slot = stack.pop()
        t = type(obj)
        if t is bytearray:
            shells[parent][2][slot] = msgpack.ExtType(EXT_BYTEARRAY, bytes(obj))
            continue
        if t is dict or t is _OrderedDict:
            keys: list[Any] | None = list(obj.keys())
            children = list(obj.values())
        else:
            keys = None
            children = list(obj)
        index = len(shells)
        shells.append((t, keys, children, parent, slot))
        for i, child in enumerate(children):
            tc = type(child)
            if tc is bytearray or tc in _REBUILT:
                stack.append((child, index, i))
    built: Any = None
    for t, keys, children, parent, slot in reversed(shells):  # children before parents
        built = t(children) if keys is None else t(zip(keys, children, strict=True))
        if parent >= 0:
            shells[parent][2][slot] = built
    return built


def _pack(value: object, where: str) -> bytes:
    try:
        try:
            return msgpack.packb(
                value,
                default=_default,
                use_bin_type=True,
                use_single_float=False,
                strict_types=True,
            )
        except UnicodeEncodeError:
            # Lone surrogates are valid Python strings; carry them exactly.
            return msgpack.packb(
                value,
                default=_default,
                use_bin_type=True,
                use_single_float=False,
                strict_types=True,
                unicode_errors="surrogatepass",
            )
    except CheckpointError:
        raise
    except (ValueError, TypeError, OverflowError) as exc:
        raise UnsupportedValue(f"{where}: cannot be encoded: {exc}") from exc


def check_encodable(value: object, *, where: str = "value", max_bytes: int | None = None) -> bool:
    """Refuse, before any work is written, a value that ``encode`` would refuse.

    Lets a save fail fast, naming the offending leaf, instead of after tensors
    have already been written. Returns whether ``value`` holds a bytearray (when
    it does not, :func:`encode_checked` may encode it, or plain data built around
    it, without scanning it again).

    Also refuses what a reader's budgets would refuse: too many containers for
    the encoded size and, with ``max_bytes``, an encoding longer than that.

    Raises:
        UnsupportedValue: naming the location inside ``value`` (prefixed by
            ``where``) of the first leaf that cannot round-trip exactly.
    """
    has_bytearray, containers = _scan(value, where)
    # Parts of one manifest are checked on their own, so each gets a quarter of the
    # free containers; only a value dense in containers needs its encoded size.
    free = LIMITS.decode_free_containers // 4
    if containers <= free and max_bytes is None:
        return has_bytearray
    data = _pack(_wrap_bytearrays(value) if has_bytearray else value, where)
    _check_budget(containers, data, free, where)
    if max_bytes is not None and len(data) > max_bytes:
        raise UnsupportedValue(
            f"{where}: encodes to {len(data)} bytes, more than the {max_bytes} the manifest "
            "has room for"
        )
    return has_bytearray


def encode_checked(value: object, *, where: str = "value") -> bytes:
    """:func:`encode` of plain data (str, int, bool, float, None, lists, dicts with str
    keys) around parts that each passed :func:`check_encodable` without a bytearray.

    Nothing is scanned again: the parts were, and the plain data around them adds
    at most a few levels of nesting (``encode_depth`` leaves room below the
    packer's and the reader's limits) and many bytes per container (so the
    reader's container budget holds for the whole when it held for each part).
    """
    return _pack(value, where)


def encode(value: object, *, where: str = "value") -> bytes:
    """Serialise a non-tensor value so that ``decode`` returns an identical one.

    Identical means same type at every level (tuples stay tuples, int keys stay
    ints, numpy scalars stay numpy scalars) and same bits (``-0.0``, NaN
    payloads, byte order of arrays). Subclasses of supported types are refused
    rather than quietly converted, because a conversion is exactly the kind of
    silent change a bit-identical resume cannot afford.

    Raises:
        UnsupportedValue: naming the location inside ``value`` (prefixed by
            ``where``), e.g. ``value['env'][3]: unsupported type Foo (...)``.
    """
    has_bytearray, containers = _scan(value, where)
    if has_bytearray:
        value = _wrap_bytearrays(value)
    data = _pack(value, where)
    if containers > LIMITS.decode_free_containers:
        _check_budget(containers, data, LIMITS.decode_free_containers, where)
    return data


# --------------------------------------------------------------------------- decoding


def _build_tuple(items: list[Any]) -> object:
    return tuple(items)


def _refuse_flood(keys: list[Any], what: str) -> None:
    """Refuse, before a hash table is built, keys whose hashes would make it quadratic."""
    if len(keys) <= LIMITS.equal_hashes:
        return  # at most that many probes per insertion anyway
    shared = _flood(keys)  # an unhashable key raises TypeError: not a valid encoding
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
    problem = _torch_size_problem(items)
    if problem is not None:
        raise _Corrupt(problem)
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
    before any hash table is built.
    """

    __slots__ = ("budget", "count", "few")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.count = 0
        self.few = LIMITS.equal_hashes  # maps this small cannot flood

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
            try:
                return marker.build(lst)
            except (_Corrupt, _Unsafe):
                raise
            except Exception as exc:  # e.g. an unhashable set member or key
                raise _Corrupt(f"cannot rebuild {marker.name}: {exc}") from None
        return lst

    def pairs_hook(self, pairs: list[tuple[Any, Any]]) -> object:
        self.count += 1
        if self.count > self.budget:
            raise self._over()
        if len(pairs) > self.few:
            _refuse_flood([k for k, _ in pairs], "map key")
        return dict(pairs)


def _unpack_payload(payload: bytes, what: str) -> list[Any]:
    """Parse the small, flat msgpack header inside a leaf ext; no exts allowed inside."""
    n = len(payload)
    try:
        out = msgpack.unpackb(
            payload,
            raw=False,
            use_list=True,
            strict_map_key=True,
            unicode_errors="surrogatepass",
            ext_hook=_refuse_ext,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n // 2,
            max_ext_len=0,
        )
    except _Corrupt:
        raise
    except Exception as exc:
        raise _Corrupt(f"malformed {what} payload: {exc}") from None
    if type(out) is not list:
        raise _Corrupt(f"malformed {what} payload")
    return out


def _refuse_ext(code: int, data: bytes) -> object:
    raise _Corrupt(f"unexpected ext code {code} inside a leaf payload")


def _decode_ndarray(payload: bytes) -> object:
    header = _unpack_payload(payload, "numpy array")
    if len(header) != 3:
        raise _Corrupt("malformed numpy array payload")
    code, shape, raw = header
    dt = _parse_dtype(code)
    if type(shape) is not list or len(shape) > LIMITS.tensor_ndim:
        raise _Corrupt(f"invalid numpy array shape {_short_repr(shape)}")
    for d in shape:
        if type(d) is not int or d < 0:
            raise _Corrupt(f"invalid numpy array dimension {_short_repr(d)}")
    if type(raw) is not bytes:
        raise _Corrupt("numpy array data is not bytes")
    declared = math.prod(shape) * dt.itemsize
    if declared != len(raw):
        raise _Corrupt(
            f"numpy array of shape {tuple(shape)} and dtype {code} needs {declared} bytes "
            f"but {len(raw)} are present"
        )
    try:
        arr = np.frombuffer(raw, dtype=dt).reshape(shape).copy()
    except Exception as exc:
        raise _Corrupt(f"invalid numpy array: {exc}") from None
    return arr


def _decode_numpy_scalar(payload: bytes) -> object:
    header = _unpack_payload(payload, "numpy scalar")
    if len(header) != 2:
        raise _Corrupt("malformed numpy scalar payload")
    code, body = header
    if code == "U":
        if type(body) is not str:
            raise _Corrupt("numpy str_ scalar without a str value")
        return np.str_(body)
    if code == "S":
        if type(body) is not bytes:
            raise _Corrupt("numpy bytes_ scalar without a bytes value")
        return np.bytes_(body)
    dt = _parse_dtype(code)
    if dt.kind in "USV":
        raise _Corrupt(f"numpy scalar dtype {code} is not part of the format")
    if type(body) is not bytes or len(body) != dt.itemsize:
        raise _Corrupt(f"numpy scalar of dtype {code} needs exactly {dt.itemsize} bytes")
    scalar: object = np.frombuffer(body, dtype=dt)[0]
    return scalar


def _decode_torch_dtype(payload: bytes) -> object:
    try:
        return _TORCH_DTYPES[payload.decode("ascii")]
    except (KeyError, UnicodeDecodeError):
        raise _Corrupt(f"unknown torch dtype {_short_repr(payload)}") from None


def _decode_torch_device(payload: bytes) -> object:
    if len(payload) > _MAX_DEVICE_LEN:
        raise _Corrupt("torch device name too long")
    try:
        text = payload.decode("ascii")
        device = torch.device(text)
    except Exception:
        raise _Corrupt(f"invalid torch device {_short_repr(payload)}") from None
    if str(device) != text:
        raise _Corrupt(f"non-canonical torch device {text!r}")
    return device


def _decode_bigint(payload: bytes) -> object:
    if not payload:
        raise _Corrupt("empty big int payload")
    return int.from_bytes(payload, "little", signed=True)


def _decode_bytearray(payload: bytes) -> object:
    return bytearray(payload)


_LEAF_DECODERS: Final[dict[int, Callable[[bytes], object]]] = {
    EXT_BIGINT: _decode_bigint,
    EXT_BYTEARRAY: _decode_bytearray,
    EXT_NDARRAY: _decode_ndarray,
    EXT_NUMPY_SCALAR: _decode_numpy_scalar,
    EXT_TORCH_DTYPE: _decode_torch_dtype,
    EXT_TORCH_DEVICE: _decode_torch_device,
}


def _ext_hook(code: int, payload: bytes) -> object:
    marker = _MARKERS.get(code)
    if marker is not None:
        if payload:
            raise _Corrupt(f"{marker.name} marker with a payload")
        return marker
    decoder = _LEAF_DECODERS.get(code)
    if decoder is None:
        raise _Corrupt(f"unknown ext code {code}")
    return decoder(payload)


def _stray(t: type) -> _Corrupt:
    if t is _Marker:
        return _Corrupt("container marker outside the first slot of an array")
    if t is msgpack.Timestamp:
        return _Corrupt("unknown ext code -1 (msgpack timestamp)")
    return _Corrupt(f"unexpected decoded type {_type_name(t)}")  # pragma: no cover


def _check_decoded(value: object, max_depth: int) -> None:
    """Bound the nesting and make sure only supported types came out.

    The unpacker cannot be told a depth limit (only its fixed 1024-level parse
    stack), and it turns ext -1 into a msgpack Timestamp without consulting
    ``ext_hook``; a stray container marker is also only visible here.
    Iterative, so hostile depth cannot reach Python's recursion limit.
    """
    leaves = _LEAVES
    containers = _CONTAINERS
    t = type(value)
    if t not in containers:
        if t not in leaves:
            raise _stray(t)
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
            children = obj
            if t is dict or t is _OrderedDict:
                for child in obj:
                    tc = type(child)
                    if tc in leaves:
                        continue
                    if tc in containers:
                        push(child)
                    else:
                        raise _stray(tc)
                children = obj.values()
            for child in children:
                tc = type(child)
                if tc in leaves:
                    continue
                if tc in containers:
                    push(child)
                else:
                    raise _stray(tc)
        level_nodes = next_nodes
        level += 1


def decode(
    data: bytes | memoryview, *, source: str = "data", max_depth: int = LIMITS.decode_depth
) -> object:
    """Rebuild exactly the value ``encode`` was given, treating ``data`` as hostile.

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
        UnsafeCheckpoint: the bytes are well formed but nest containers deeper
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
        raise TypeError(f"decode() needs bytes or memoryview, not {_type_name(type(data))}")
    # Building many containers at once triggers full cyclic-GC passes over the
    # whole process heap (msgpack's own advice is to pause GC); nothing built
    # here can form a cycle, so the pause loses nothing.
    hooks = _Hooks(_container_budget(n, LIMITS.decode_free_containers))
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
            ext_hook=_ext_hook,
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
