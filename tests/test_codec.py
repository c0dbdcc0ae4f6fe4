"""The codec must return exactly what it was given, refuse what it cannot, and
survive hostile bytes without crashing, executing anything or allocating big."""

from __future__ import annotations

import collections
import contextlib
import enum
import struct
import warnings
from typing import Any, NamedTuple

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from functional_ckpt._src import codec
from functional_ckpt._src.codec import check_encodable, decode, encode, table
from functional_ckpt.errors import (
    CheckpointError,
    CorruptCheckpoint,
    UnsafeCheckpoint,
    UnsupportedValue,
)
from tests.exact import assert_exact, is_exact, python_values


def roundtrip(value: Any) -> Any:
    out = decode(encode(value))
    assert_exact(value, out)
    return out


def nan_with_payload(bits: int) -> float:
    value: float = struct.unpack("<d", struct.pack("<Q", bits))[0]
    return value


def pack_raw(obj: Any) -> bytes:
    """Hand-built msgpack, to forge inputs the encoder would never produce."""
    return msgpack.packb(obj, use_bin_type=True, strict_types=False)


def ext(code: int, payload: bytes) -> msgpack.ExtType:
    return msgpack.ExtType(code, payload)


def ndarray_ext(code: Any, shape: Any, raw: Any) -> msgpack.ExtType:
    return ext(table.EXT_NDARRAY, pack_raw([code, shape, raw]))


MARK_TUPLE = ext(table.EXT_TUPLE, b"")


# --------------------------------------------------------------------------- property


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(python_values(max_leaves=25))
def test_roundtrip_property(value: Any) -> None:
    check_encodable(value)
    roundtrip(value)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_only_raise_checkpoint_errors(data: bytes) -> None:
    with contextlib.suppress(CheckpointError):
        decode(data)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(python_values(max_leaves=10), st.data())
def test_mutated_encodings_only_raise_checkpoint_errors(value: Any, data: st.DataObject) -> None:
    blob = bytearray(encode(value))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    with contextlib.suppress(CheckpointError):
        decode(bytes(blob))


# --------------------------------------------------------------------------- scalars


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        1,
        -1,
        2**63 - 1,
        2**63,
        2**64 - 1,
        2**64,
        -(2**63),
        -(2**63) - 1,
        2**1000 + 12345,
        -(2**777),
        0.0,
        -0.0,
        1.5,
        float("inf"),
        float("-inf"),
        float("nan"),
        nan_with_payload(0x7FF0000000000001),  # signalling NaN
        nan_with_payload(0xFFF8DEADBEEF0001),  # negative quiet NaN with payload
        5e-324,
        "",
        "plain",
        "unicode ✓ 🎉 \x00",
        "\ud800",
        "\udfff lone low",
        "\ud83d\ude00 separate surrogates",
        b"",
        b"\x00\xff",
        bytearray(),
        bytearray(b"\x00abc"),
    ],
    ids=repr,
)
def test_scalars(value: Any) -> None:
    roundtrip(value)


def test_bool_and_int_keys_keep_their_type() -> None:
    out = roundtrip({1: "a", "1": "c", 2.0: "d", None: "e", b"k": "f"})
    assert [type(k) for k in out] == [int, str, float, type(None), bytes]
    assert type(next(iter(roundtrip({True: 1})))) is bool
    assert type(next(iter(roundtrip({1.0: 1})))) is float


def test_floats_are_doubles() -> None:
    assert len(encode(1.1)) == 9  # float64 marker + 8 bytes, never float32
    assert decode(encode(0.1)) == 0.1


# --------------------------------------------------------------------------- containers


def test_containers() -> None:
    roundtrip([])
    roundtrip(())
    roundtrip({})
    roundtrip(set())
    roundtrip(frozenset())
    roundtrip([1, (2, (3, ())), [()]])
    roundtrip(((),))
    roundtrip({"a": (1, [2, (3,)]), (1, 2): {(3, (4,)): "deep key"}, 7: [{}]})
    roundtrip({1, "a", (1, 2), frozenset({3}), b"x", None})
    roundtrip(frozenset({(1, frozenset({2})), 1.5}))
    roundtrip([bytearray(b"a"), (bytearray(b"b"),), {"c": bytearray(b"c")}])


def test_tuple_keys_and_mixed_keys_keep_order() -> None:
    value = {(1, "x"): 1, "s": 2, 3: 3, ((1,), 2): 4, frozenset({1}): 5, -(2**70): 6}
    out = roundtrip(value)
    assert list(out) == list(value)


def test_ordered_dict() -> None:
    value = collections.OrderedDict([("b", 1), ((1, 2), [collections.OrderedDict()]), (3, ())])
    out = roundtrip(value)
    assert type(out) is collections.OrderedDict


def test_sets_keep_member_types() -> None:
    out = roundtrip({1.0, "x", (1,), np.float32(2.0)})
    assert is_exact(out, {1.0, "x", (1,), np.float32(2.0)})
    assert not is_exact(out, {1, "x", (1,), np.float32(2.0)})


def test_max_encode_depth_roundtrips_with_default_max_depth() -> None:
    for leaf in (1, bytearray(b"deep")):
        value: Any = leaf
        for i in range(table.MAX_ENCODE_DEPTH):
            value = [value] if i % 3 == 0 else (value,) if i % 3 == 1 else {"k": value}
        roundtrip(value)


def test_shared_and_mixed_bytearray_containers() -> None:
    shared = [bytearray(b"a"), 1]
    value = {"x": shared, "y": (shared, collections.OrderedDict(z=shared)), "n": [[], ()]}
    out = roundtrip(value)
    assert out["x"] is not out["y"][0]  # identity is not part of the format
    assert value == {"x": shared, "y": (shared, collections.OrderedDict(z=shared)), "n": [[], ()]}


# --------------------------------------------------------------------------- numpy


@pytest.mark.parametrize(
    "array",
    [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.array([True, False, True]),
        np.array([1, -2, 3], dtype=np.int8),
        np.array([2**64 - 1], dtype=np.uint64),
        np.array([1.5, -0.0, np.inf, np.nan], dtype=np.float16),
        np.array([1 + 2j, np.nan], dtype=np.complex64),
        np.array([1 + 2j], dtype=np.complex128),
        np.array([1, 2], dtype=">i4"),
        np.array([1.5], dtype=">f8"),
        np.array([1, 2], dtype=np.longlong),
        np.array([1, 2], dtype=np.ulonglong),
        np.array(3.25),
        np.array(7, dtype=np.int16),
        np.zeros((0,), dtype=np.float64),
        np.zeros((2, 0, 3), dtype=np.int32),
        np.array(["ab", "c\x00"], dtype="U3"),
        np.array([b"ab", b""], dtype="S2"),
        np.array(["2020-01-01", "NaT"], dtype="M8[ns]"),
        np.array([1, -1], dtype="m8[s]"),
        np.zeros(2, dtype="V3"),
        np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3)),
        np.arange(20, dtype=np.float64).reshape(4, 5)[::2, 1::2],
        np.arange(6, dtype=np.uint16).reshape(2, 3).T,
    ],
    ids=lambda a: f"{a.dtype.str}{a.shape}",
)
def test_ndarrays(array: np.ndarray[Any, Any]) -> None:
    out = decode(encode(array))
    assert_exact(array.copy(order="C"), out)
    assert out.flags.c_contiguous and out.flags.writeable and out.flags.owndata
    assert type(out.dtype) is type(array.dtype) and out.dtype.char == array.dtype.char


def test_ndarray_nan_payload_bits_survive() -> None:
    bits = np.array([0x7FF0000000000001, 0xFFF8DEADBEEF0001], dtype=np.uint64)
    roundtrip(bits.view(np.float64))


@pytest.mark.parametrize(
    "scalar",
    [
        np.float32(1.5),
        np.float64(-0.0),
        np.float16(np.nan),
        np.longdouble(1.25),
        np.int8(-3),
        np.int64(2**62),
        np.longlong(5),
        np.uint64(2**64 - 1),
        np.ulonglong(1),
        np.bool_(True),
        np.complex64(1 - 1j),
        np.datetime64("2021-03-04T05:06"),
        np.datetime64("NaT"),
        np.timedelta64(5, "ms"),
        np.str_("ab\x00"),
        np.str_("\ud800"),
        np.bytes_(b"a\x00"),
    ],
    ids=lambda s: f"{type(s).__name__}-{s!r}",
)
def test_numpy_scalars(scalar: np.generic) -> None:
    out = roundtrip(scalar)
    assert type(out) is type(scalar)


def test_numpy_scalar_as_key() -> None:
    roundtrip({np.int32(1): "a", np.float32(1.5): "b"})


# --------------------------------------------------------------------------- torch


@pytest.mark.parametrize(
    "dtype",
    sorted({d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=str),
    ids=str,
)
def test_torch_dtypes(dtype: torch.dtype) -> None:
    assert decode(encode(dtype)) is dtype


@pytest.mark.parametrize(
    "device",
    [
        torch.device("cpu"),
        torch.device("cpu", 0),
        torch.device("cuda"),
        torch.device("cuda", 1),
        torch.device("meta"),
    ],
    ids=str,
)
def test_torch_devices(device: torch.device) -> None:
    roundtrip(device)
    roundtrip({device: [device]})


def test_torch_size() -> None:
    out = roundtrip(torch.Size([2, 3, 0]))
    assert type(out) is torch.Size
    roundtrip(torch.Size([]))
    roundtrip(torch.Size([-(2**63), 2**63 - 1, -1]))
    _unsupported(torch.Size([2**64 - 1]), "out of the int64 range")
    roundtrip({torch.Size([1]): (torch.Size([4, 5]), torch.bfloat16)})


# --------------------------------------------------------------------------- refusals


class Foo:
    pass


with warnings.catch_warnings():
    warnings.simplefilter("ignore", PendingDeprecationWarning)
    MATRIX = np.matrix([[1]])


class Color(enum.IntEnum):
    RED = 1


class Point(NamedTuple):
    x: int
    y: int


class MyStr(str):
    pass


class MyDict(dict[str, int]):
    pass


def _unsupported(value: Any, *fragments: str, where: str = "value") -> str:
    with pytest.raises(UnsupportedValue) as info:
        encode(value, where=where)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    with pytest.raises(UnsupportedValue) as info2:
        check_encodable(value, where=where)
    assert str(info2.value) == message
    assert isinstance(info.value, TypeError)
    return message


def test_unsupported_names_the_nested_location() -> None:
    value = {"env": {"objs": [1, 2, 3, Foo()]}}
    message = _unsupported(value, "value['env']['objs'][3]: unsupported type", "Foo", "supported:")
    assert message.startswith("value['env']['objs'][3]: unsupported type ")


def test_where_prefix() -> None:
    _unsupported(
        [(1, object())], "state['opt'][0][1]: unsupported type object", where="state['opt']"
    )


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (Color.RED, "an Enum that is not registered; register it once"),
        (Point(1, 2), "a NamedTuple that is not registered; register it once"),
        (MyStr("x"), "subclass of str"),
        (MyDict(a=1), "subclass of dict"),
        (collections.defaultdict(list), "subclass of dict"),
        (collections.Counter("ab"), "subclass of dict"),
        (msgpack.ExtType(1, b""), "a NamedTuple that is not registered"),
        (msgpack.Timestamp(1, 0), "unsupported type msgpack"),
        (memoryview(b"abc"), "memoryview"),
        (lambda: None, "function"),
        (print, "builtin_function_or_method"),
        (Foo, "type"),
        (1j, "complex"),
        (range(3), "range"),
        (Ellipsis, "ellipsis"),
        (np.array([1, None], dtype=object), "dtype('O')"),
        (np.zeros(2, dtype=[("a", "i4"), ("b", "f8")]), "numpy array with dtype"),
        (np.void(b"ab"), "numpy scalar type numpy.void"),
        (np.ma.masked_array([1, 2]), "subclass of numpy.ndarray"),
        (MATRIX, "subclass of numpy.ndarray"),
        (torch.zeros(2), "tensors belong in the tensor tree"),
        (torch.nn.Parameter(torch.zeros(2)), "tensors belong in the tensor tree"),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, str) else v,
)
def test_unsupported_types(value: Any, fragment: str) -> None:
    _unsupported(value, "value: ", fragment)
    _unsupported({"k": [value]}, "value['k'][0]: ", fragment)


def test_unsupported_in_keys_and_members() -> None:
    _unsupported({(1, Color.RED): 1}, "value<key (1, <Color.RED: 1>)>[1]: ", "not registered")
    _unsupported({"s": {1, Foo()}}, "value['s']<member <", "Foo")
    _unsupported(frozenset({Point(1, 2)}), "value<member Point(x=1, y=2)>")
    _unsupported(collections.OrderedDict(a=[torch.ones(1)]), "value['a'][0]: ", "tensor tree")


def test_tensor_inside_tuple_and_set_like() -> None:
    _unsupported((1, (2, torch.zeros(()))), "value[1][1]: torch.Tensor is not supported here")


def test_too_deep_to_encode() -> None:
    value: Any = 0
    for _ in range(table.MAX_ENCODE_DEPTH + 1):
        value = [value]
    _unsupported(value, "nested deeper than")
    very_deep: Any = 0
    for _ in range(100_000):
        very_deep = (very_deep,)
    _unsupported(very_deep, "nested deeper than")


# --------------------------------------------------------------------------- hostile


def _corrupt(data: bytes | memoryview, *fragments: str, **kw: Any) -> str:
    with pytest.raises(CorruptCheckpoint) as info:
        decode(data, source="ckpt/manifest.msgpack", **kw)
    message = str(info.value)
    assert message.startswith("ckpt/manifest.msgpack: "), message
    for fragment in fragments:
        assert fragment in message, message
    return message


def _unsafe(data: bytes, *fragments: str, **kw: Any) -> str:
    with pytest.raises(UnsafeCheckpoint) as info:
        decode(data, source="src", **kw)
    message = str(info.value)
    assert message.startswith("src: "), message
    for fragment in fragments:
        assert fragment in message, message
    return message


VALUE = {
    "a": [1, 2.5, "x", (1, 2)],
    (3, 4): {1, 2},
    "arr": np.arange(4, dtype=np.int16),
    "big": 2**80,
    "ba": bytearray(b"zz"),
    "dt": torch.float16,
    "sz": torch.Size([3]),
    "od": collections.OrderedDict(x=1),
    "np": np.float32(2),
}


def test_every_truncation_is_corrupt() -> None:
    blob = encode(VALUE)
    for end in range(len(blob)):
        _corrupt(blob[:end])


def test_trailing_bytes() -> None:
    _corrupt(encode(VALUE) + b"\x00", "trailing bytes")
    _corrupt(encode(1) + encode(2), "trailing bytes")


def test_empty_input() -> None:
    _corrupt(b"")


def test_deeply_nested_array_bomb() -> None:
    _unsafe(b"\x91" * 100_000 + b"\x00", "nesting deeper")


def test_deeply_nested_map_bomb() -> None:
    _unsafe(b"\x81\x00" * 100_000 + b"\x00", "nesting deeper")


def test_max_depth_is_enforced() -> None:
    value: Any = 0
    for _ in range(20):
        value = [value]
    blob = encode(value)
    assert_exact(decode(blob, max_depth=20), value)
    _unsafe(blob, "max_depth=19", max_depth=19)
    _unsafe(b"\x91" * 600 + b"\x00", "max_depth=512")
    tuples: Any = 0
    for _ in range(20):
        tuples = {"k": (tuples,)}
    _unsafe(encode(tuples), "max_depth=30", max_depth=30)


def test_huge_declared_array_in_tiny_buffer() -> None:
    _corrupt(b"\xdd\x80\x00\x00\x00", "exceeds max_array_len")  # array32 of 2**31
    _corrupt(b"\xdd\xff\xff\xff\xff\x00", "exceeds max_array_len")
    _corrupt(b"\xdf\x80\x00\x00\x00\x00\x00", "exceeds max_map_len")
    _corrupt(b"\xdb\x7f\xff\xff\xff" + b"a" * 8)  # str32
    _corrupt(b"\xc6\x7f\xff\xff\xff" + b"a" * 8)  # bin32
    _corrupt(b"\xc9\x7f\xff\xff\xff\x10" + b"a" * 8)  # ext32


def test_ndarray_shape_bomb() -> None:
    assert np.dtype("f8").str == "<f8"
    good = pack_raw(ndarray_ext("<d", [1], b"\x00" * 8))
    assert_exact(decode(good), np.zeros(1))
    _corrupt(pack_raw(ndarray_ext("<d", [2**40], b"\x00" * 8)), "needs 8796093022208 bytes")
    _corrupt(pack_raw(ndarray_ext("<d", [2**62, 2**62], b"")), "needs")
    _corrupt(pack_raw(ndarray_ext("<d", [2], b"\x00" * 8)), "needs 16 bytes but 8")


@pytest.mark.parametrize(
    ("code", "shape", "raw", "fragment"),
    [
        ("<d", [-1], b"", "invalid numpy array dimension"),
        ("<d", [True], b"\x00" * 8, "invalid numpy array dimension"),
        ("<d", [1.0], b"\x00" * 8, "invalid numpy array dimension"),
        ("<d", [1] * 65, b"\x00" * 8, "invalid numpy array shape"),
        ("<d", 1, b"\x00" * 8, "invalid numpy array shape"),
        ("<d", [1], "x" * 8, "not bytes"),
        ("|O", [1], b"\x00" * 8, "dtype code"),
        ("O", [1], b"\x00" * 8, "dtype code"),
        ("<f8", [1], b"\x00" * 8, "non-canonical"),
        ("(2,)<d", [1], b"\x00" * 16, "dtype code"),
        ("[('a','<i4')]", [1], b"\x00" * 4, "dtype code"),
        ("|V0", [1], b"", "dtype code"),
        ("T", [1], b"\x00" * 16, "dtype code"),
        ("not a dtype", [1], b"", "dtype code"),
        (1, [1], b"", "dtype code"),
    ],
)
def test_malformed_ndarray_payloads(code: Any, shape: Any, raw: Any, fragment: str) -> None:
    _corrupt(pack_raw(ndarray_ext(code, shape, raw)), fragment)


def test_malformed_leaf_payloads() -> None:
    _corrupt(pack_raw(ext(table.EXT_NDARRAY, b"\xc1")), "numpy array payload")
    _corrupt(pack_raw(ext(table.EXT_NDARRAY, pack_raw(["<d", [1]]))), "numpy array payload")
    nested = pack_raw(["<d", [1], ext(table.EXT_BIGINT, b"\x01")])
    _corrupt(pack_raw(ext(table.EXT_NDARRAY, nested)), "malformed numpy array payload")
    scalar = table.EXT_NUMPY_SCALAR
    _corrupt(pack_raw(ext(scalar, pack_raw(["<f", b"\x00" * 8]))), "exactly 4 bytes")
    _corrupt(pack_raw(ext(scalar, pack_raw(["U", b"a"]))), "str_")
    _corrupt(pack_raw(ext(scalar, pack_raw(["S", "a"]))), "bytes_")
    _corrupt(pack_raw(ext(scalar, pack_raw(["<U1", "a"]))), "not part of the format")
    _corrupt(pack_raw(ext(scalar, pack_raw(["|V2", b"ab"]))), "not part of the format")
    _corrupt(pack_raw(ext(table.EXT_TORCH_DTYPE, b"os.system")), "unknown torch dtype")
    _corrupt(pack_raw(ext(table.EXT_TORCH_DTYPE, b"\xff")), "unknown torch dtype")
    _corrupt(pack_raw(ext(table.EXT_TORCH_DEVICE, b"nonsense:x")), "invalid torch device")
    _corrupt(pack_raw(ext(table.EXT_TORCH_DEVICE, b"cuda:00")), "device")
    _corrupt(pack_raw(ext(table.EXT_TORCH_DEVICE, b"c" * 100)), "too long")
    _corrupt(pack_raw(ext(table.EXT_BIGINT, b"")), "big int")


def test_unknown_ext_codes() -> None:
    for code in (0, 7, 15, 22, 100, 127, -2, -128):
        fixext1 = b"\xd4" + struct.pack("b", code) + b"\x00"
        _corrupt(fixext1, f"unknown ext code {code}")
        _corrupt(b"\x91" + fixext1, f"unknown ext code {code}")
    _corrupt(pack_raw([ext(99, b"")]), "unknown ext code 99")
    # code 6 is a tagged value: a tag nobody registered is refused, never looked up
    with pytest.raises(UnsafeCheckpoint, match=r"unknown tagged type 'os\.system'"):
        codec.decode(pack_raw([ext(6, b"os.system"), ["ls"]]))
    with pytest.raises(CorruptCheckpoint, match="invalid tag"):
        codec.decode(pack_raw([ext(6, b"\xff"), 1]))


def test_msgpack_timestamp_is_refused() -> None:
    _corrupt(pack_raw(msgpack.Timestamp(1, 0)), "ext code -1")
    _corrupt(pack_raw({"t": [msgpack.Timestamp(1, 0)]}), "ext code -1")
    _corrupt(b"\xd6\xff\x00", "")  # malformed timestamp


def test_markers_out_of_place() -> None:
    _corrupt(pack_raw(MARK_TUPLE), "marker")
    _corrupt(pack_raw([1, MARK_TUPLE]), "marker")
    _corrupt(pack_raw({"a": MARK_TUPLE}), "marker")
    _corrupt(pack_raw({MARK_TUPLE: 1}), "marker")
    _corrupt(pack_raw([MARK_TUPLE, MARK_TUPLE]), "marker")
    _corrupt(pack_raw([ext(table.EXT_SET, b""), MARK_TUPLE]), "marker")
    _corrupt(pack_raw([ext(table.EXT_TUPLE, b"x"), 1]), "marker with a payload")
    assert decode(pack_raw([MARK_TUPLE, [MARK_TUPLE]])) == ((),)


def test_malformed_containers() -> None:
    _corrupt(pack_raw([ext(table.EXT_SET, b""), [1]]), "cannot rebuild set")
    _corrupt(pack_raw([ext(table.EXT_FROZENSET, b""), {}]), "cannot rebuild frozenset")
    _corrupt(pack_raw([ext(table.EXT_ORDERED_DICT, b""), 1]), "odd number")
    _corrupt(pack_raw([ext(table.EXT_ORDERED_DICT, b""), [1], 2]), "cannot rebuild")
    _corrupt(pack_raw([ext(table.EXT_TORCH_SIZE, b""), 1.5]), "torch.Size")
    _corrupt(pack_raw([ext(table.EXT_TORCH_SIZE, b""), True]), "torch.Size")
    _corrupt(pack_raw([ext(table.EXT_TORCH_SIZE, b""), 2**64 - 1]), "int64 range")
    _corrupt(b"\x81\x91\x00\x00", "not a valid encoding")  # {[0]: 0}: list key


def test_invalid_utf8() -> None:
    _corrupt(b"\xa2\xff\xfe", "UTF-8")
    _corrupt(b"\xa2\xc0\xaf", "UTF-8")  # overlong
    _corrupt(b"\x81\xa1\xff\x00", "UTF-8")  # as a key
    assert decode(b"\xa3\xed\xa0\x80") == "\ud800"  # our own spelling of a lone surrogate


def test_reserved_byte() -> None:
    _corrupt(b"\xc1", "not a valid encoding")
    _corrupt(b"\x92\x01\xc1", "not a valid encoding")


def test_decode_accepts_memoryview_and_checks_type() -> None:
    blob = encode(VALUE)
    assert_exact(decode(memoryview(blob)), VALUE)
    interleaved = bytes(b for c in blob for b in (c, 0))
    strided = memoryview(interleaved)[::2]
    assert not strided.c_contiguous
    assert_exact(decode(strided), VALUE)
    assert_exact(decode(memoryview(blob + b"junk")[: len(blob)]), VALUE)
    with pytest.raises(TypeError):
        decode("text")  # type: ignore[arg-type]


def test_errors_are_checkpoint_errors_with_source() -> None:
    with pytest.raises(CheckpointError, match=r"^my/file: "):
        decode(b"\xc1", source="my/file")


def test_no_pickle_anywhere() -> None:
    import inspect

    source = inspect.getsource(codec)
    assert "import pickle" not in source and "pickle.loads" not in source


# --------------------------------------------------------------------------- scale


def test_ten_thousand_entries() -> None:
    manifest = {
        f"model.layers.{i}.weight": {
            "shape": [i % 7, 64, 3],
            "dtype": "bfloat16",
            "offset": i * 4096,
            "file": f"shard-{i % 13:05d}.safetensors",
            "crc": (i * 2654435761) % 2**32,
            "flags": (i % 2 == 0, None),
        }
        for i in range(10_000)
    }
    blob = encode(manifest, where="manifest")
    out = decode(blob, source="manifest")
    assert_exact(manifest, out)
    assert len(out) == 10_000


def test_a_lone_surrogate_keeps_its_containers_exact() -> None:
    """A string msgpack cannot encode as UTF-8 takes the packer's second path, which
    must keep every container's type as the first does."""
    roundtrip(("\ud800",))
    roundtrip({None: "\ud800", torch.Size([]): None, frozenset({torch.Size([])}): None})
