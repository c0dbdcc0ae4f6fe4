"""Test helpers for "came back exactly": same type at every level, same bits.

``==`` is too weak for checkpoint tests: ``1 == 1.0 == True``, ``(1,) != [1]``
is easy to miss inside containers, ``nan != nan`` and ``0.0 == -0.0``. These
helpers compare the way a bit-identical resume needs.
"""

from __future__ import annotations

import collections
import struct
from typing import Any

import hypothesis.strategies as st
import numpy as np
import torch
from hypothesis.extra import numpy as hnp

try:  # tensordict is optional for the codec tests
    from tensordict import NonTensorData, TensorDictBase
except Exception:  # pragma: no cover - depends on the environment
    NonTensorData = None
    TensorDictBase = None

__all__ = ["assert_exact", "is_exact", "python_values"]

_PLAIN = (type(None), bool, int, str, bytes, bytearray)


def _float_bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    t = t.resolve_conj().resolve_neg()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    try:
        return t.reshape(-1).view(torch.uint8).numpy().tobytes()
    except (RuntimeError, TypeError):
        storage = t.untyped_storage()
        size = t.element_size()
        start = t.storage_offset() * size
        return bytes(storage[start : start + t.numel() * size].tolist())


def _fail(path: str, msg: str) -> None:
    raise AssertionError(f"{path}: {msg}")


def assert_exact(a: Any, b: Any, path: str = "root") -> None:
    """Assert ``a`` and ``b`` have the same type at every level and the same bits."""
    ta, tb = type(a), type(b)
    if ta is not tb:
        _fail(path, f"type {ta.__qualname__} != {tb.__qualname__} ({a!r:.60} vs {b!r:.60})")
    if ta is float:
        if _float_bits(a) != _float_bits(b):
            _fail(path, f"float bits differ: {a!r} ({_float_bits(a).hex()}) vs {b!r}")
    elif ta in _PLAIN:
        if a != b:
            _fail(path, f"{a!r:.80} != {b!r:.80}")
    elif ta is np.ndarray:
        _assert_dtype(a.dtype, b.dtype, path)
        if a.shape != b.shape:
            _fail(path, f"shape {a.shape} != {b.shape}")
        if a.tobytes() != b.tobytes():
            _fail(path, "array bytes differ")
    elif isinstance(a, np.generic):
        _assert_dtype(a.dtype, b.dtype, path)
        if ta is np.str_ or ta is np.bytes_:
            # Their tobytes() pads to the itemsize; compare the Python value.
            # str() of an np.str_ drops trailing NULs; str.__str__ does not.
            plain = str.__str__ if ta is np.str_ else lambda v: bytes(memoryview(v))
            if plain(a) != plain(b):
                _fail(path, f"{a!r} != {b!r}")
        elif a.tobytes() != b.tobytes():
            _fail(path, f"numpy scalar bytes differ: {a!r} vs {b!r}")
    elif isinstance(a, torch.Tensor):
        _assert_tensor(a, b, path)
    elif TensorDictBase is not None and isinstance(a, TensorDictBase):
        _assert_tensordict(a, b, path)
    elif isinstance(a, (list, tuple)):  # includes torch.Size
        if len(a) != len(b):
            _fail(path, f"length {len(a)} != {len(b)}")
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_exact(x, y, f"{path}[{i}]")
    elif isinstance(a, dict):
        if len(a) != len(b):
            _fail(path, f"{len(a)} keys != {len(b)} keys")
        for i, ((ka, va), (kb, vb)) in enumerate(zip(a.items(), b.items(), strict=True)):
            assert_exact(ka, kb, f"{path}<key #{i}>")
            assert_exact(va, vb, f"{path}[{ka!r:.40}]")
    elif isinstance(a, (set, frozenset)):
        _assert_same_members(a, b, path)
    elif ta in (torch.dtype, torch.device):
        if a != b:
            _fail(path, f"{a!r} != {b!r}")
    else:
        if a != b:
            _fail(path, f"{a!r:.80} != {b!r:.80}")


def is_exact(a: Any, b: Any) -> bool:
    """Boolean form of :func:`assert_exact`."""
    try:
        assert_exact(a, b)
    except AssertionError:
        return False
    return True


def _assert_dtype(a: np.dtype[Any], b: np.dtype[Any], path: str) -> None:
    if a != b or a.str != b.str or a.char != b.char or type(a) is not type(b):
        _fail(path, f"dtype {a!r} ({a.str}, {a.char}) != {b!r} ({b.str}, {b.char})")


def _assert_same_members(a: Any, b: Any, path: str) -> None:
    if len(a) != len(b):
        _fail(path, f"{len(a)} members != {len(b)} members")
    # Members equal by hash may still differ in type (1, 1.0, True), and NaNs
    # never match by lookup, so pair them up by exact comparison instead.
    remaining = list(b)
    for x in a:
        for i, y in enumerate(remaining):
            if is_exact(x, y):
                del remaining[i]
                break
        else:
            _fail(path, f"member {x!r:.60} has no exact counterpart")


def _assert_tensor(a: torch.Tensor, b: torch.Tensor, path: str) -> None:
    if a.dtype != b.dtype:
        _fail(path, f"tensor dtype {a.dtype} != {b.dtype}")
    if a.shape != b.shape:
        _fail(path, f"tensor shape {tuple(a.shape)} != {tuple(b.shape)}")
    if a.device != b.device:
        _fail(path, f"tensor device {a.device} != {b.device}")
    if a.layout != b.layout:
        _fail(path, f"tensor layout {a.layout} != {b.layout}")
    if a.device.type == "meta":
        return
    if _tensor_bytes(a) != _tensor_bytes(b):
        _fail(path, "tensor bytes differ")


def _assert_tensordict(a: Any, b: Any, path: str) -> None:
    if a.batch_size != b.batch_size:
        _fail(path, f"batch_size {a.batch_size} != {b.batch_size}")
    if a.device != b.device:
        _fail(path, f"device {a.device} != {b.device}")
    keys_a, keys_b = set(a.keys()), set(b.keys())
    if keys_a != keys_b:
        _fail(path, f"keys differ: only left {keys_a - keys_b}, only right {keys_b - keys_a}")
    for key in sorted(keys_a, key=repr):
        va, vb = a.get(key), b.get(key)
        if NonTensorData is not None and isinstance(va, NonTensorData):
            va = va.data
        if NonTensorData is not None and isinstance(vb, NonTensorData):
            vb = vb.data
        assert_exact(va, vb, f"{path}[{key!r}]")


# --------------------------------------------------------------------------- strategies

_ARRAY_DTYPES = [
    np.dtype("?"),
    np.dtype("i1"),
    np.dtype("u2"),
    np.dtype(">i4"),
    np.dtype("q"),
    np.dtype("i8"),
    np.dtype("u8"),
    np.dtype("f2"),
    np.dtype("f4"),
    np.dtype(">f8"),
    np.dtype("c8"),
    np.dtype("c16"),
    np.dtype("M8[ns]"),
    np.dtype("U3"),
    np.dtype("S2"),
]

_SCALAR_DTYPES = [
    np.dtype(c) for c in ("?", "b", "B", "h", "H", "i", "I", "l", "L", "q", "Q", "e", "f", "d")
] + [np.dtype("F"), np.dtype("D"), np.dtype("M8[s]"), np.dtype("m8[us]")]

_TORCH_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
]

_DEVICES = [
    torch.device("cpu"),
    torch.device("cuda", 0),
    torch.device("cuda:3"),
    torch.device("meta"),
]


def _big_ints() -> st.SearchStrategy[int]:
    return st.one_of(
        st.integers(),
        st.integers(min_value=-(2**64), max_value=2**64),
        st.integers(min_value=-(2**300), max_value=2**300),
    )


def _texts() -> st.SearchStrategy[str]:
    # exclude_categories=() lets lone surrogates through.
    return st.text(st.characters(exclude_categories=()), max_size=8)


def _arrays() -> st.SearchStrategy[np.ndarray[Any, Any]]:
    base = st.sampled_from(_ARRAY_DTYPES).flatmap(
        lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3))
    )
    layouts = st.sampled_from(["c", "f", "t", "step"])

    def relayout(a: np.ndarray[Any, Any], how: str) -> np.ndarray[Any, Any]:
        if how == "f":
            return np.asfortranarray(a)
        if how == "t":
            return a.T
        if how == "step" and a.ndim:
            return a[::2]
        return a

    return st.builds(relayout, base, layouts)


def _numpy_scalars() -> st.SearchStrategy[Any]:
    numeric = st.sampled_from(_SCALAR_DTYPES).flatmap(
        lambda dt: hnp.arrays(dt, ()).map(lambda a: a[()])
    )
    return st.one_of(
        numeric,
        _texts().map(np.str_),
        st.binary(max_size=4).map(np.bytes_),
        st.just(np.longlong(-3)),
        st.just(np.ulonglong(2**64 - 1)),
    )


def _hashable_leaves() -> st.SearchStrategy[Any]:
    return st.one_of(
        st.none(),
        st.booleans(),
        _big_ints(),
        st.floats(width=64),
        st.sampled_from([0.0, -0.0, float("inf"), float("-inf"), float("nan")]),
        _texts(),
        st.binary(max_size=8),
        _numpy_scalars(),
        st.sampled_from(_TORCH_DTYPES),
        st.sampled_from(_DEVICES),
        st.lists(st.integers(0, 2**40), max_size=4).map(torch.Size),
    )


def _hashables() -> st.SearchStrategy[Any]:
    return st.recursive(
        _hashable_leaves(),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3).map(tuple),
            st.frozensets(inner, max_size=3),
        ),
        max_leaves=6,
    )


def python_values(max_leaves: int = 30) -> st.SearchStrategy[Any]:
    """Random nested trees of every non-tensor type the codec supports."""
    keys = _hashables()
    leaves = st.one_of(
        _hashable_leaves(),
        st.binary(max_size=8).map(bytearray),
        _arrays(),
    )

    def extend(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
        return st.one_of(
            st.lists(inner, max_size=4),
            st.lists(inner, max_size=4).map(tuple),
            st.dictionaries(keys, inner, max_size=4),
            st.dictionaries(keys, inner, max_size=4).map(
                lambda d: collections.OrderedDict(reversed(d.items()))
            ),
            st.sets(keys, max_size=4),
            st.frozensets(keys, max_size=4),
        )

    return st.recursive(leaves, extend, max_leaves=max_leaves)
