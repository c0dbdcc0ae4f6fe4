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
6     tagged marker      the UTF-8 tag; ``[m, fields]`` (see ``tagged``)
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
:data:`functional_ckpt._src.limits.LIMITS`, which ``encode`` enforces too:

* every decode may build at most one container per
  ``decode_bytes_per_container`` input bytes (beyond ``decode_free_containers``),
  counted as each container is finished, so memory stays within a small multiple
  of the input and a flood of tiny containers is refused after a bounded amount
  of work;
* no map or set may have more than ``equal_hashes`` keys or members sharing one
  hash value, counted in linear time before the hash table is built, so hash
  flooding cannot make decoding quadratic.

The package holds one concept per module: ``table`` (what is encodable and the
ext codes), ``encoding`` (scan, then pack), ``decoding`` (the unpacker's hooks,
budgets, hash-flood and depth checks), ``leaves`` (each leaf ext's payload),
``tagged`` (the table of tagged plain data, with paths, datetimes and namespaces),
``registration`` (:func:`register` adds a user's dataclass, NamedTuple or Enum to
it) and ``placeholder`` (:class:`Unregistered` stands for one whose class a
reader has not registered).

``encoding`` (which needs numpy and torch to tell their types apart) is imported
when one of its functions is first named: readers of manifests only decode.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from functional_ckpt._src.codec.decoding import check_hashes, decode, find_unregistered
from functional_ckpt._src.codec.placeholder import Unregistered
from functional_ckpt._src.codec.registration import register, unknown_tag_problem
from functional_ckpt._src.codec.table import (
    EXT_BIGINT,
    EXT_BYTEARRAY,
    EXT_FROZENSET,
    EXT_NDARRAY,
    EXT_NUMPY_SCALAR,
    EXT_ORDERED_DICT,
    EXT_SET,
    EXT_TAGGED,
    EXT_TORCH_DEVICE,
    EXT_TORCH_DTYPE,
    EXT_TORCH_SIZE,
    EXT_TUPLE,
    MAX_ENCODE_DEPTH,
)

if TYPE_CHECKING:
    from functional_ckpt._src.codec.encoding import _default as _default
    from functional_ckpt._src.codec.encoding import (
        check_encodable,
        encode,
        encode_checked,
        encode_counted,
    )

#: The names of ``encoding``, imported on first use.
_ENCODING = frozenset({"_default", "check_encodable", "encode", "encode_checked", "encode_counted"})

__all__ = [
    "EXT_BIGINT",
    "EXT_BYTEARRAY",
    "EXT_FROZENSET",
    "EXT_NDARRAY",
    "EXT_NUMPY_SCALAR",
    "EXT_ORDERED_DICT",
    "EXT_SET",
    "EXT_TAGGED",
    "EXT_TORCH_DEVICE",
    "EXT_TORCH_DTYPE",
    "EXT_TORCH_SIZE",
    "EXT_TUPLE",
    "MAX_ENCODE_DEPTH",
    "Unregistered",
    "check_encodable",
    "check_hashes",
    "decode",
    "encode",
    "encode_checked",
    "encode_counted",
    "find_unregistered",
    "register",
    "unknown_tag_problem",
]


def __getattr__(name: str) -> Any:
    if name not in _ENCODING:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module("functional_ckpt._src.codec.encoding"), name)
    globals()[name] = value  # looked up once; the next access finds it directly
    return value
