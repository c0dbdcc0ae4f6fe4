"""Decoding: hostile bytes back to exactly the value that was encoded, nothing allocated
before the bytes present justify it, dtypes and devices in a canonical spelling only;
numpy and torch are imported only when a value of theirs is met."""

from __future__ import annotations

import collections
import gc
import math
from collections.abc import Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any, Final, NamedTuple

import msgpack

from functional_ckpt._src.codec import table
from functional_ckpt._src.codec.registration import tag_problem, unknown_tag_problem
from functional_ckpt._src.codec.tagged import TAGGED, Unregistered, _BadFields, by_tag, placeholder
from functional_ckpt._src.limits import LIMITS
from functional_ckpt._src.text import short_repr
from functional_ckpt.errors import CorruptCheckpoint, UnsafeCheckpoint

if TYPE_CHECKING:
    import numpy as np

_MSGPACK_STACK_LIMIT: Final = 1024  # the C unpacker's fixed parse stack
_GC_PAUSE_BYTES: Final = 256 * 1024
_MAX_DEVICE_LEN: Final = 64

_OrderedDict = collections.OrderedDict


class _Marker(NamedTuple):
    """Stands in, during one parse, for the ext that opens a container array."""

    name: str
    build: Callable[[list[Any]], object]


class _Unsafe(Exception):
    """Internal: resource limit exceeded, re-raised as UnsafeCheckpoint."""


class _Corrupt(Exception):
    """Internal: malformed data, re-raised as CorruptCheckpoint naming the source."""


def _unpackb(data: Any, n: int, *, ext: int, **hooks: Any) -> Any:
    """msgpack's C parse of ``n`` bytes, no length declared in them beyond what they hold."""
    return msgpack.unpackb(
        data,
        raw=False,
        use_list=True,
        unicode_errors="surrogatepass",
        max_str_len=n,
        max_bin_len=n,
        max_array_len=n,
        max_map_len=n // 2,
        max_ext_len=ext,
        **hooks,
    )


def _parse_dtype(code: object) -> np.dtype[Any]:
    if type(code) is not str or not code or len(code) > 32 or not code.isascii():
        raise _Corrupt(f"invalid numpy dtype code {code!r}")
    import numpy as np

    try:
        dt = np.dtype(code)
    except Exception:
        raise _Corrupt(f"invalid numpy dtype code {code!r}") from None
    if table.dtype_code(dt) != code:
        raise _Corrupt(f"non-canonical or unsupported numpy dtype code {code!r}")
    return dt


def _unpack_payload(payload: bytes, what: str, fields: int) -> list[Any]:
    """A leaf ext's small, flat msgpack header: a list of ``fields`` values, no ext inside."""
    try:
        out = _unpackb(payload, len(payload), strict_map_key=True, ext_hook=_refuse_ext, ext=0)
    except _Corrupt:
        raise
    except Exception as exc:
        raise _Corrupt(f"malformed {what} payload: {exc}") from None
    if type(out) is not list or len(out) != fields:
        raise _Corrupt(f"malformed {what} payload")
    return out


def _refuse_ext(code: int, data: bytes) -> object:
    raise _Corrupt(f"unexpected ext code {code} inside a leaf payload")


def _decode_ndarray(payload: bytes) -> object:
    code, shape, raw = _unpack_payload(payload, "numpy array", 3)
    dt = _parse_dtype(code)
    if type(shape) is not list or len(shape) > LIMITS.tensor_ndim:
        raise _Corrupt(f"invalid numpy array shape {short_repr(shape)}")
    for d in shape:
        if type(d) is not int or d < 0:
            raise _Corrupt(f"invalid numpy array dimension {short_repr(d)}")
    if type(raw) is not bytes:
        raise _Corrupt("numpy array data is not bytes")
    declared = math.prod(shape) * dt.itemsize
    if declared != len(raw):
        raise _Corrupt(
            f"numpy array of shape {tuple(shape)} and dtype {code} needs {declared} bytes "
            f"but {len(raw)} are present"
        )
    import numpy as np

    try:
        return np.frombuffer(raw, dtype=dt).reshape(shape).copy()
    except Exception as exc:
        raise _Corrupt(f"invalid numpy array: {exc}") from None


def _decode_numpy_scalar(payload: bytes) -> object:
    code, body = _unpack_payload(payload, "numpy scalar", 2)
    import numpy as np

    if code in ("U", "S"):  # text travels as its Python value (see encoding)
        value, make = (str, np.str_) if code == "U" else (bytes, np.bytes_)
        if type(body) is not value:
            raise _Corrupt(f"numpy {make.__name__} scalar without a {value.__name__} value")
        return make(body)
    dt = _parse_dtype(code)
    if dt.kind in "USV":
        raise _Corrupt(f"numpy scalar dtype {code} is not part of the format")
    if type(body) is not bytes or len(body) != dt.itemsize:
        raise _Corrupt(f"numpy scalar of dtype {code} needs exactly {dt.itemsize} bytes")
    return np.frombuffer(body, dtype=dt)[0]


def _decode_torch_dtype(payload: bytes) -> object:
    try:
        return table.TORCH_DTYPES[payload.decode("ascii")]
    except (KeyError, UnicodeDecodeError):
        raise _Corrupt(f"unknown torch dtype {short_repr(payload)}") from None


def _decode_torch_device(payload: bytes) -> object:
    if len(payload) > _MAX_DEVICE_LEN:
        raise _Corrupt("torch device name too long")
    import torch

    try:
        text = payload.decode("ascii")
        device = torch.device(text)
    except Exception:
        raise _Corrupt(f"invalid torch device {short_repr(payload)}") from None
    if str(device) != text:
        raise _Corrupt(f"non-canonical torch device {text!r}")
    return device


def _decode_bigint(payload: bytes) -> object:
    if not payload:
        raise _Corrupt("empty big int payload")
    return int.from_bytes(payload, "little", signed=True)


LEAF_DECODERS: Final[dict[int, Callable[[bytes], object]]] = {
    table.EXT_BIGINT: _decode_bigint,
    table.EXT_BYTEARRAY: bytearray,
    table.EXT_NDARRAY: _decode_ndarray,
    table.EXT_NUMPY_SCALAR: _decode_numpy_scalar,
    table.EXT_TORCH_DTYPE: _decode_torch_dtype,
    table.EXT_TORCH_DEVICE: _decode_torch_device,
}


def _as_keys(keys: Iterable[Any]) -> None:
    """Make the placeholders among ``keys`` (or in a tuple there) compare by identity."""
    stack = list(keys)
    while stack:
        k = stack.pop()
        t = type(k)
        if t is Unregistered:
            k.key_of()
        elif t is tuple:
            stack.extend(k)


#: The members of each container that a hash table is built of.
_KEYED: Final = {"set": slice(None), "frozenset": slice(None), "OrderedDict": slice(None, None, 2)}


def _refuse_flood(keys: list[Any], what: str) -> None:
    """Refuse, before a hash table is built, keys whose hashes would make it quadratic."""
    if len(keys) <= LIMITS.equal_hashes:
        return  # at most that many probes per insertion anyway
    shared = table.flood(keys)  # an unhashable key raises TypeError: not a valid encoding
    if shared > LIMITS.equal_hashes:
        raise _Unsafe(
            f"{shared} {what}s share one hash value (at most {LIMITS.equal_hashes} may): "
            "a hash flood"
        )


def check_hashes(keys: list[Any], *, where: str) -> None:
    """``UnsafeCheckpoint`` if keys read from a checkpoint would flood a hash table."""
    try:
        _refuse_flood(keys, "key")
    except _Unsafe as exc:
        raise UnsafeCheckpoint(f"{where}: {exc}") from None


def _set_of(kind: type[set[Any]] | type[frozenset[Any]], items: list[Any]) -> object:
    _refuse_flood(items, "set member")
    return kind(items)


def _build_ordered_dict(items: list[Any]) -> object:
    if len(items) % 2:
        raise _Corrupt("OrderedDict with an odd number of keys and values")
    _refuse_flood(items[::2], "map key")
    it = iter(items)
    return _OrderedDict(zip(it, it, strict=True))


def _build_torch_size(items: list[Any]) -> object:
    problem = table.torch_size_problem(items)
    if problem is not None:
        raise _Corrupt(problem)
    import torch  # a torch.Size was encoded: the value needs torch

    return torch.Size(items)


_MARKERS: Final[dict[int, _Marker]] = {
    table.EXT_TUPLE: _Marker("tuple", tuple),
    table.EXT_SET: _Marker("set", partial(_set_of, set)),
    table.EXT_FROZENSET: _Marker("frozenset", partial(_set_of, frozenset)),
    table.EXT_ORDERED_DICT: _Marker("OrderedDict", _build_ordered_dict),
    table.EXT_TORCH_SIZE: _Marker("torch.Size", _build_torch_size),
}


class _Hooks:
    """The unpacker's hooks for one decode: every array and map counts as it finishes,
    so an overrun stops the parse whatever the input declares."""

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
        if code == table.EXT_TAGGED:
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
    """The marker of a tagged value, its tag looked up (never imported); an unknown one
    refused, or kept as a placeholder (added to ``unregistered``)."""
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
    return _Corrupt(f"unexpected decoded type {table.type_name(t)}")  # pragma: no cover


def _tagged_fields(t: type, value: object) -> object:
    """The fields below a rebuilt tagged value, walked like any container's children."""
    entry = TAGGED.get(t)
    if entry is None:
        if t is Unregistered:
            return value.fields  # type: ignore[attr-defined]
        raise _stray(t)
    return entry.fields(value)


def find_unregistered(value: object) -> Unregistered | None:
    """The first placeholder in a decoded value, breadth first (the one a reader sees first)."""
    leaves = table.decoded_leaves()
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
        elif t in table.CONTAINERS:
            todo += obj  # type: ignore[arg-type]
        else:
            entry = TAGGED.get(t)
            if entry is not None:
                todo.append(entry.fields(obj))
    return None


def _check_decoded(value: object, max_depth: int) -> None:
    """Bound the nesting (the unpacker takes no depth limit) and refuse stray types (a
    Timestamp, from ext -1; a misplaced marker)."""
    leaves = table.decoded_leaves()
    containers = table.CONTAINERS
    t = type(value)
    if t not in containers:
        if t not in leaves:
            _check_decoded([_tagged_fields(t, value)], max_depth)
        return
    # level by level: no per-node allocation (manifests hold tens of thousands of dicts)
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
    """Rebuild exactly the value ``encode`` was given, treating ``data`` as hostile: no
    code run, no Python recursion, linear time, containers within the budget. An
    unregistered tag is refused unless ``unregistered`` is a set (then it is a placeholder,
    its tag added). ``CorruptCheckpoint``: not a valid encoding (a size bomb looks the
    same); ``UnsafeCheckpoint``: an unknown tag, too deep, over budget, or a hash flood."""
    if isinstance(data, memoryview) and not data.c_contiguous:
        data = data.tobytes()
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"decode() needs bytes or memoryview, not {table.type_name(type(data))}")
    n = data.nbytes if isinstance(data, memoryview) else len(data)
    # many new containers trigger full GC passes over the heap; nothing here makes a cycle
    hooks = _Hooks(table.container_budget(n, LIMITS.decode_free_containers), unregistered)
    pause_gc = n >= _GC_PAUSE_BYTES and gc.isenabled()
    if pause_gc:
        gc.disable()
    try:
        value = _unpackb(
            data,
            n,
            ext=n,
            strict_map_key=False,
            ext_hook=hooks.ext_hook,
            list_hook=hooks.list_hook,
            object_pairs_hook=hooks.pairs_hook,
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
    except msgpack.ExtraData:
        raise CorruptCheckpoint(f"{source}: trailing bytes after the encoded value") from None
    except UnicodeDecodeError as exc:
        raise CorruptCheckpoint(f"{source}: invalid UTF-8 in a string: {exc}") from None
    except MemoryError:
        raise
    except Exception as exc:
        raise CorruptCheckpoint(
            f"{source}: not a valid encoding ({type(exc).__name__}: {exc})"
        ) from None
    finally:
        if pause_gc:
            gc.enable()
    return value
