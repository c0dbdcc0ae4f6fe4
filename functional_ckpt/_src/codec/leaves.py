"""Decoding the payload of each leaf ext: sizes checked against the bytes present before
anything is allocated, dtypes and devices in a canonical spelling only; numpy and
torch are imported only when a value of theirs is met."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import msgpack

from functional_ckpt._src.codec import table
from functional_ckpt._src.codec.table import dtype_code
from functional_ckpt._src.limits import LIMITS
from functional_ckpt._src.text import short_repr

if TYPE_CHECKING:
    import numpy as np


_MAX_DEVICE_LEN: Final = 64


class _Corrupt(Exception):
    """Internal: malformed data, re-raised as CorruptCheckpoint naming the source."""


def _parse_dtype(code: object) -> np.dtype[Any]:
    if type(code) is not str or not code or len(code) > 32 or not code.isascii():
        raise _Corrupt(f"invalid numpy dtype code {code!r}")
    import numpy as np

    try:
        dt = np.dtype(code)
    except Exception:
        raise _Corrupt(f"invalid numpy dtype code {code!r}") from None
    if dtype_code(dt) != code:
        raise _Corrupt(f"non-canonical or unsupported numpy dtype code {code!r}")
    return dt


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
    header = _unpack_payload(payload, "numpy scalar")
    if len(header) != 2:
        raise _Corrupt("malformed numpy scalar payload")
    code, body = header
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
    scalar: object = np.frombuffer(body, dtype=dt)[0]
    return scalar


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
