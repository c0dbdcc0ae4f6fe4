"""What the codec can store: the ext codes (part of the format) and the type tables the
encoder and the decoder both check, so what one writes the other accepts. The numpy
and torch tables are built on first use: a manifest reader may need neither."""

from __future__ import annotations

import collections
import functools
import sys
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Final

from functional_ckpt._src.limits import LIMITS

if TYPE_CHECKING:
    import numpy as np
    import torch

EXT_TUPLE: Final = 1
EXT_SET: Final = 2
EXT_FROZENSET: Final = 3
EXT_ORDERED_DICT: Final = 4
EXT_TORCH_SIZE: Final = 5
EXT_TAGGED: Final = 6
EXT_BIGINT: Final = 16
EXT_BYTEARRAY: Final = 17
EXT_NDARRAY: Final = 18
EXT_NUMPY_SCALAR: Final = 19
EXT_TORCH_DTYPE: Final = 20
EXT_TORCH_DEVICE: Final = 21

MAX_ENCODE_DEPTH: Final = LIMITS.encode_depth
"""Deepest container nesting ``encode`` accepts (see :class:`~.limits.Limits`)."""

_NoneType = type(None)
_OrderedDict = collections.OrderedDict

# Types the strict C packer writes natively and the unpacker returns as the same type
# (not bytearray: msgpack packs it as bin, which decodes as bytes).
NATIVE_LEAVES: Final[frozenset[type]] = frozenset({_NoneType, bool, int, float, str, bytes})

CONTAINERS: Final[frozenset[type]] = frozenset({list, tuple, dict, _OrderedDict, set, frozenset})

#: Every torch dtype the format knows by name, with its element size, read without torch
#: (``inspect``, ``verify``); ``tests/test_codec_types.py`` checks it against torch.
DTYPE_SIZES: Final[Mapping[str, int]] = MappingProxyType(
    {
        "bfloat16": 2, "bits16": 2, "bits1x8": 1, "bits2x4": 1, "bits4x2": 1, "bits8": 1,
        "bool": 1, "complex128": 16, "complex32": 4, "complex64": 8, "float16": 2,
        "float32": 4, "float4_e2m1fn_x2": 1, "float64": 8, "float8_e4m3fn": 1,
        "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
        "int1": 1, "int2": 1, "int3": 1, "int4": 1, "int5": 1, "int6": 1, "int7": 1,
        "int8": 1, "int16": 2, "int32": 4, "int64": 8, "qint32": 4, "qint8": 1,
        "quint2x4": 1, "quint4x2": 1, "quint8": 1, "uint1": 1, "uint2": 1, "uint3": 1,
        "uint4": 1, "uint5": 1, "uint6": 1, "uint7": 1, "uint8": 1, "uint16": 2,
        "uint32": 4, "uint64": 8,
    }
)  # fmt: skip

#: torch's other names of dtypes (``torch.float`` is ``torch.float32``).
DTYPE_ALIASES: Final[Mapping[str, str]] = MappingProxyType(
    {
        "bit": "uint1", "cdouble": "complex128", "cfloat": "complex64", "chalf": "complex32",
        "double": "float64", "float": "float32", "half": "float16", "int": "int32",
        "long": "int64", "short": "int16",
    }
)  # fmt: skip

NUMPY_SCALAR_TYPES: frozenset[type]  # built on first use (``__getattr__``)
TORCH_DTYPES: dict[str, torch.dtype]  # built on first use, from DTYPE_SIZES
LEAVES: frozenset[type]  # built on first use


def _numpy_scalar_types() -> frozenset[type]:
    import numpy as np

    return frozenset(
        t for t in set(np.sctypeDict.values()) if t is not np.object_ and t is not np.void
    )


def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {n: d for n in DTYPE_SIZES if isinstance(d := getattr(torch, n, None), torch.dtype)}


@functools.cache
def _leaves_with(numpy: bool, torch: bool) -> frozenset[type]:
    found = NATIVE_LEAVES | {bytearray}
    if numpy:
        import numpy as np

        found |= _numpy_scalar_types() | {np.ndarray}
    if torch:
        import torch as th

        found |= {th.dtype, th.device, th.Size}
    return found


_LAZY: Final[dict[str, Callable[[], object]]] = {
    "NUMPY_SCALAR_TYPES": _numpy_scalar_types,
    "TORCH_DTYPES": _torch_dtypes,
    "LEAVES": lambda: _leaves_with(True, True),
}


def __getattr__(name: str) -> Any:
    """The numpy and torch tables, built (and their library imported) when first named."""
    build = _LAZY.get(name)
    if build is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = build()  # built once; the next lookup finds it directly
    return value


def decoded_leaves() -> frozenset[type]:
    """:data:`LEAVES`, less the numpy or torch types while that library is not loaded."""
    modules = sys.modules
    return _leaves_with("numpy" in modules, "torch" in modules)


SUPPORTED_TEXT: Final = (
    "None, bool, int, float, str, bytes, bytearray, list, tuple, dict, "
    "collections.OrderedDict, set, frozenset, numpy.ndarray (non-object dtypes), "
    "numpy scalars, torch.dtype, torch.device, torch.Size, pathlib paths, datetime.datetime/"
    "date/time/timedelta, argparse.Namespace, and registered dataclasses, NamedTuples and Enums"
)

# Array dtype kinds whose raw bytes fully describe the values.
_ARRAY_KINDS: Final = frozenset("biufcMmSUV")
_CHAR_KINDS: Final = frozenset("biufc")


def dtype_code(dt: np.dtype[Any]) -> str | None:
    """A dtype's spelling that parses back to the same dtype *class* (``longlong`` and
    ``int64`` share ``<i8``, so byte order plus type character); None: not stored exactly."""
    kind = dt.kind
    if kind not in _ARRAY_KINDS or dt.hasobject or dt.fields is not None:
        return None
    if dt.subdtype is not None or dt.itemsize == 0:
        return None
    code = dt.str[0] + dt.char if kind in _CHAR_KINDS else dt.str
    import numpy as np

    try:
        back = np.dtype(code)
    except (TypeError, ValueError):  # pragma: no cover - defensive
        return None
    if back != dt or type(back) is not type(dt) or back.char != dt.char:
        return None  # e.g. extension dtypes that only look like void/bytes
    return code


def type_name(t: type) -> str:
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def torch_size_problem(dims: Iterable[object]) -> str | None:
    for d in dims:
        if type(d) is not int:
            return f"torch.Size dimension of type {type_name(type(d))}"
        if not -(2**63) <= d < 2**63:
            # torch.Size stores such a value but fails when it is read back.
            return f"torch.Size dimension {d} out of the int64 range"
    return None


def flood(keys: Iterable[object]) -> int:
    """How many of ``keys`` share the most common hash value (linear time)."""
    return max(collections.Counter(map(hash, keys)).values(), default=0)


def container_budget(nbytes: int, free: int) -> int:
    """How many containers a decode of ``nbytes`` bytes may build."""
    return free + nbytes // LIMITS.decode_bytes_per_container
