"""Encoding: refuse what would not come back exactly, then pack. The scan comes first
because msgpack's C packer would quietly write a bytearray as bytes or a subclass as
its base; it also counts the containers a reader's budgets will allow."""

from __future__ import annotations

import collections
import itertools
from functools import partial
from typing import Any, Final, cast

import msgpack
import numpy as np
import torch

from functional_ckpt._src.codec import table
from functional_ckpt._src.codec.registration import unregistered_problem
from functional_ckpt._src.codec.tagged import TAGGED, Unregistered, placeholder_problem
from functional_ckpt._src.limits import LIMITS
from functional_ckpt._src.text import short_repr
from functional_ckpt.errors import CheckpointError, UnsupportedValue

_OrderedDict = collections.OrderedDict


_packb: Final = partial(msgpack.packb, use_bin_type=True, use_single_float=False, strict_types=True)


def _pack_payload(obj: object) -> bytes:
    return _packb(obj, unicode_errors="surrogatepass")  # np.str_ may hold them


def _encode_numpy(x: np.ndarray[Any, Any] | np.generic) -> msgpack.ExtType:
    # text scalars lose trailing NULs through an array, so they travel as Python values
    t = type(x)
    if t is np.str_:
        return msgpack.ExtType(table.EXT_NUMPY_SCALAR, _pack_payload(["U", str.__str__(x)]))
    if t is np.bytes_:
        payload = _pack_payload(["S", bytes(memoryview(cast(bytes, x)))])
        return msgpack.ExtType(table.EXT_NUMPY_SCALAR, payload)
    code = table.dtype_code(x.dtype)
    assert code is not None  # _scan refuses the others first
    if t is np.ndarray:
        return msgpack.ExtType(table.EXT_NDARRAY, _pack_payload([code, list(x.shape), x.tobytes()]))
    return msgpack.ExtType(table.EXT_NUMPY_SCALAR, _pack_payload([code, x.tobytes()]))


_MARKERS: Final = {
    t: msgpack.ExtType(code, b"")
    for t, code in (
        (tuple, table.EXT_TUPLE),
        (set, table.EXT_SET),
        (frozenset, table.EXT_FROZENSET),
    )
} | {torch.Size: msgpack.ExtType(table.EXT_TORCH_SIZE, b"")}
_ORDERED_DICT_EXT: Final = msgpack.ExtType(table.EXT_ORDERED_DICT, b"")


def _default(obj: Any) -> object:
    """The C packer's fallback for every type it does not write natively."""
    t = type(obj)
    marker = _MARKERS.get(t)
    if marker is not None:
        return [marker, *obj]
    if t is int:  # outside the 64-bit range msgpack handles
        data = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
        return msgpack.ExtType(table.EXT_BIGINT, data)
    if t is np.ndarray or t in table.NUMPY_SCALAR_TYPES:
        return _encode_numpy(obj)
    if t is _OrderedDict:
        return [_ORDERED_DICT_EXT, *itertools.chain.from_iterable(obj.items())]
    entry = TAGGED.get(t)
    if entry is not None:
        # A bytearray among the fields would be packed as bin; swap it for its ext.
        marker = msgpack.ExtType(table.EXT_TAGGED, entry.tag.encode("utf-8"))
        return [marker, _wrap_bytearrays(entry.fields(obj))]
    if t is torch.dtype:
        return msgpack.ExtType(
            table.EXT_TORCH_DTYPE, str(obj).removeprefix("torch.").encode("ascii")
        )
    if t is torch.device:
        return msgpack.ExtType(table.EXT_TORCH_DEVICE, str(obj).encode("ascii"))
    # unreachable after _scan (the packer writes the ExtTypes inserted here natively)
    raise UnsupportedValue(f"unsupported type {table.type_name(t)}")  # pragma: no cover


_BASES: Final = (bool, int, float, str, bytes, bytearray, list, tuple, dict, set, frozenset)


def _leaf_problem(obj: object, t: type) -> str | None:
    """Why a non-container value cannot be stored, or None if it can."""
    if t in table.LEAVES:
        if t is torch.Size:
            return table.torch_size_problem(obj)  # type: ignore[arg-type]
        if t is np.ndarray:
            dtype = obj.dtype  # type: ignore[attr-defined]
            if table.dtype_code(dtype) is None:
                return (
                    f"numpy array with dtype {dtype!r} is not supported "
                    "(only plain bool/int/uint/float/complex/datetime/bytes/str dtypes)"
                )
        return None
    if isinstance(obj, torch.Tensor):
        return (
            f"{table.type_name(t)} is not supported here; tensors belong in the tensor tree, "
            "not among plain values"
        )
    if t is Unregistered:
        return placeholder_problem(obj)  # type: ignore[arg-type]
    registrable = unregistered_problem(t)
    if registrable is not None:
        return registrable
    if isinstance(obj, np.generic):
        supported = table.SUPPORTED_TEXT
        return f"unsupported numpy scalar type {table.type_name(t)} (supported: {supported})"
    for base in (*_BASES, np.ndarray):
        if isinstance(obj, base):
            return (
                f"unsupported type {table.type_name(t)}, a subclass of {table.type_name(base)} "
                "(only exact types round-trip, so subclasses are refused rather than converted; "
                f"supported: {table.SUPPORTED_TEXT})"
            )
    return f"unsupported type {table.type_name(t)} (supported: {table.SUPPORTED_TEXT})"


# A node of the scan is (value, level_of_its_container, parent_node, label_format, label).
_ITEM: Final = "[{}]"
_KEY: Final = "<key {}>"
_MEMBER: Final = "<member {}>"
_Node = tuple[object, int, Any, str, object]


def _path(node: _Node | None, where: str) -> str:
    parts: list[str] = []
    while node is not None and node[2] is not None:
        _, _, parent, kind, label = node
        parts.append(kind.format(short_repr(label)))
        node = parent
    parts.reverse()
    if len(parts) > 16:  # a depth error would otherwise print hundreds of "[0]"
        parts[8:-6] = [f"...{len(parts) - 14} levels..."]
    return where + "".join(parts)


def _level(node: _Node, where: str) -> int:
    """The nesting level of ``node``'s children, refused beyond ``MAX_ENCODE_DEPTH``."""
    if node[1] >= table.MAX_ENCODE_DEPTH:
        raise UnsupportedValue(
            f"{_path(node, where)}: nested deeper than {table.MAX_ENCODE_DEPTH} containers"
        )
    return node[1] + 1


def _scan(value: object, where: str) -> tuple[bool, int]:
    """Refuse anything that would not come back exactly; return whether bytearrays
    occur and how many containers ``decode`` will build. Paths are formatted on error only."""
    native = table.NATIVE_LEAVES
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
        if t is dict or t is list or t is tuple or t in table.CONTAINERS:
            containers += 1
            level = _level(node, where)
            if t is not list and t is not tuple and len(obj) > equal_hashes:
                shared = table.flood(obj)
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
        elif t in TAGGED:
            # Written as [marker, fields]: one array, then the fields as any other value.
            containers += 1
            level = _level(node, where)
            try:
                fields = TAGGED[t].fields(obj)
            except UnsupportedValue as exc:
                raise UnsupportedValue(f"{_path(node, where)}: {exc}") from None
            if type(fields) not in native:
                push((fields, level, node, _ITEM, TAGGED[t].tag))
        else:
            problem = _leaf_problem(obj, t)
            if problem is not None:
                raise UnsupportedValue(f"{_path(node, where)}: {problem}")
            if t is bytearray:
                has_bytearray = True
            elif t is torch.Size:
                containers += 1  # written as a marked array
    return has_bytearray, containers


def _check_budget(containers: int, data: bytes, free: int, where: str) -> None:
    budget = table.container_budget(len(data), free)
    if containers > budget:
        raise UnsupportedValue(
            f"{where}: {containers} containers in {len(data)} encoded bytes exceed the decode "
            f"budget ({budget}: one per {LIMITS.decode_bytes_per_container} bytes beyond "
            f"{free}); a reader would refuse it. Store bulk data as a tensor or numpy array"
        )


_REBUILT: Final[frozenset[type]] = frozenset({list, tuple, dict, _OrderedDict})


def _wrap_bytearrays(value: Any) -> Any:
    """A copy with each bytearray as its ext: the packer never offers one to ``default``."""
    if type(value) is bytearray:
        return msgpack.ExtType(table.EXT_BYTEARRAY, bytes(value))
    if type(value) not in _REBUILT:
        return value
    # Each shell: (type, keys or None, child values, parent shell index, slot).
    shells: list[tuple[type, list[Any] | None, list[Any], int, int]] = []
    stack: list[tuple[Any, int, int]] = [(value, -1, 0)]
    while stack:
        obj, parent, slot = stack.pop()
        t = type(obj)
        if t is bytearray:
            shells[parent][2][slot] = msgpack.ExtType(table.EXT_BYTEARRAY, bytes(obj))
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


def encode_checked(value: object, *, where: str = "value") -> bytes:
    """:func:`encode` of plain data around parts that passed :func:`check_encodable`
    without a bytearray: not scanned again (within the limits' headroom)."""
    try:
        try:
            return _packb(value, default=_default)
        except UnicodeEncodeError:  # lone surrogates are valid Python strings: kept exactly
            return _packb(value, default=_default, unicode_errors="surrogatepass")
    except CheckpointError:
        raise
    except (ValueError, TypeError, OverflowError) as exc:
        raise UnsupportedValue(f"{where}: cannot be encoded: {exc}") from exc


def check_encodable(value: object, *, where: str = "value", max_bytes: int | None = None) -> bool:
    """Refuse, naming the leaf, what ``encode`` or a reader's budgets would (or longer than
    ``max_bytes``); whether it holds a bytearray (if not, :func:`encode_checked` may)."""
    has_bytearray, containers = _scan(value, where)
    # Parts of one manifest are checked on their own, so each gets a quarter of the
    # free containers; only a value dense in containers needs its encoded size.
    free = LIMITS.decode_free_containers // 4
    if containers <= free and max_bytes is None:
        return has_bytearray
    data = encode_checked(_wrap_bytearrays(value) if has_bytearray else value, where=where)
    _check_budget(containers, data, free, where)
    if max_bytes is not None and len(data) > max_bytes:
        raise UnsupportedValue(
            f"{where}: encodes to {len(data)} bytes, more than the {max_bytes} the manifest "
            "has room for"
        )
    return has_bytearray


def encode_counted(value: object, *, where: str = "value") -> tuple[bytes, int]:
    """:func:`encode`, and how many containers a decode of the bytes builds."""
    has_bytearray, containers = _scan(value, where)
    if has_bytearray:
        value = _wrap_bytearrays(value)
    data = encode_checked(value, where=where)
    if containers > LIMITS.decode_free_containers:
        _check_budget(containers, data, LIMITS.decode_free_containers, where)
    return data, containers


def encode(value: object, *, where: str = "value") -> bytes:
    """Serialise a non-tensor value so that ``decode`` returns an identical one (type
    at every level, bits); ``UnsupportedValue`` names the location of what cannot."""
    return encode_counted(value, where=where)[0]
