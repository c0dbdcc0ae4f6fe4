"""Paths, datetimes, enums, namespaces, dataclasses and named tuples as tagged plain data.

Each comes back with its exact class through a real save and restore; classes a
user did not register are refused at save with the line that registers them, and
a checkpoint naming a tag nobody registered, or fields that do not fit, is refused
by restore and verify without importing or calling anything it names.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import enum
import os
import pathlib
import warnings
import zoneinfo
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src import codec
from functional_ckpt._src.format import naming
from functional_ckpt._src.limits import LIMITS
from functional_ckpt.errors import CorruptCheckpoint, UnsupportedValue
from tests import forge


@dataclasses.dataclass(frozen=True)
class Cfg:
    alpha: int
    layers: tuple[int, ...] = (1, 2)
    name: str = "x"
    seen: list[str] = dataclasses.field(default_factory=list, init=False)


class Mode(enum.Enum):
    A = "a"
    B = "b"


class Bits(enum.IntFlag):
    R = 1
    W = 2


class Pair(NamedTuple):
    left: int
    right: Any


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


codec.register(Cfg)
codec.register(Mode, name="tests.Mode")
codec.register(Bits)
codec.register(Pair)
codec.register(Level)


@dataclasses.dataclass
class Unregistered:
    x: int


class Secret(NamedTuple):
    a: int


def exact(a: object, b: object) -> None:
    assert type(a) is type(b), (a, b)
    assert a == b, (a, b)
    if isinstance(a, (dt.datetime, dt.time)):
        assert type(a.tzinfo) is type(b.tzinfo)  # type: ignore[union-attr]
        assert a.tzinfo == b.tzinfo  # type: ignore[union-attr]
        if a.tzinfo is not None:
            assert a.tzname() == b.tzname()  # type: ignore[union-attr]
            assert a.utcoffset() == b.utcoffset()  # type: ignore[union-attr]
        assert a.fold == b.fold  # type: ignore[union-attr]


def roundtrip(tmp_path: Path, value: object) -> object:
    fc.save(tmp_path / "ck", {"v": value})
    return fc.codec.to_python(fc.restore(tmp_path / "ck"))["v"]


VALUES: list[object] = [
    pathlib.PurePosixPath("a/b"),
    pathlib.PosixPath("/tmp/run/out"),
    pathlib.PureWindowsPath(r"C:\runs\x"),
    dt.datetime(2024, 5, 6, 7, 8, 9, 123456),
    dt.datetime(2024, 5, 6, 7, 8, 9, tzinfo=dt.timezone.utc),
    dt.datetime(2024, 5, 6, 7, 8, 9, tzinfo=dt.timezone(dt.timedelta(hours=5, minutes=30))),
    dt.datetime(2024, 5, 6, tzinfo=dt.timezone(-dt.timedelta(hours=3), "BRT")),
    dt.datetime(2024, 11, 3, 1, 30, tzinfo=zoneinfo.ZoneInfo("America/New_York"), fold=1),
    dt.date(1999, 12, 31),
    dt.time(23, 59, 58, 7),
    dt.time(1, 2, tzinfo=dt.timezone(dt.timedelta(minutes=-90))),
    dt.timedelta(days=-3, seconds=5, microseconds=7),
    Mode.B,
    Level.HIGH,
    Bits.R | Bits.W,
    argparse.Namespace(lr=0.1, betas=(0.9, 0.99), out=pathlib.PosixPath("x")),
    Cfg(3, (4, 5), "y"),
    Pair(1, {"k": (2, 3)}),
]


@pytest.mark.parametrize("value", VALUES, ids=lambda v: type(v).__name__)
def test_each_type_round_trips_exactly(tmp_path: Path, value: object) -> None:
    exact(roundtrip(tmp_path, value), value)


def test_nested_and_as_keys_round_trip(tmp_path: Path) -> None:
    cfg = Cfg(1)
    object.__setattr__(cfg, "seen", ["a", "b"])  # a field outside __init__ comes back too
    value = {
        "ns": argparse.Namespace(inner=argparse.Namespace(p=pathlib.PurePosixPath("q"))),
        "keys": {Mode.A: 1, pathlib.PurePosixPath("k"): 2, Pair(1, 2): 3, dt.date(2020, 1, 1): 4},
        "set": {Level.LOW, dt.timedelta(1)},
        "cfg": cfg,
        "bytes": argparse.Namespace(b=bytearray(b"\x00x")),
    }
    back: Any = roundtrip(tmp_path, value)
    assert back == value
    assert back["cfg"].seen == ["a", "b"]
    assert type(back["bytes"].b) is bytearray
    assert type(back["ns"].inner.p) is pathlib.PurePosixPath
    assert {type(k) for k in back["keys"]} == {Mode, pathlib.PurePosixPath, Pair, dt.date}


def test_a_lightning_checkpoint_dict_saves_and_restores(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    ckpt = {
        "state_dict": model.state_dict(),
        "epoch": 3,
        "hyper_parameters": {
            "args": argparse.Namespace(lr=1e-3, batch_size=32, tags=["a"]),
            "out": pathlib.Path("/tmp/runs/exp1"),
            "cfg": Cfg(7, (8,), "tiny"),
            "mode": Mode.A,
            "when": dt.datetime(2025, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc),
            "pair": Pair(1, "two"),
        },
    }
    fc.save(tmp_path / "ck", ckpt)
    assert fc.verify(tmp_path / "ck").ok
    back: Any = fc.codec.to_python(fc.restore(tmp_path / "ck"))
    for key, want in ckpt["hyper_parameters"].items():  # type: ignore[attr-defined]
        exact(back["hyper_parameters"][key], want)
    assert torch.equal(back["state_dict"]["weight"], model.weight)


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (Unregistered(1), " dataclass"),
        (Secret(1), " NamedTuple"),
        (enum.Enum("E", "X").X, "n Enum"),
    ],
    ids=["dataclass", "namedtuple", "enum"],
)
def test_an_unregistered_class_is_refused_with_how_to_register(
    tmp_path: Path, value: object, kind: str
) -> None:
    name = type(value).__qualname__
    with pytest.raises(UnsupportedValue) as info:
        fc.save(tmp_path / "ck", {"hp": {"x": value}})
    msg = str(info.value)
    assert "('hp', 'x')" in msg and f"is a{kind} that is not registered" in msg
    assert f"functional_ckpt.codec.register({name})" in msg
    assert not (tmp_path / "ck").exists()


def test_unsupported_time_zone_is_refused_at_save(tmp_path: Path) -> None:
    class Odd(dt.tzinfo):
        def utcoffset(self, d: object) -> dt.timedelta:
            return dt.timedelta(0)

    with pytest.raises(UnsupportedValue, match=r"'when'.*time zone"):
        fc.save(tmp_path / "ck", {"when": dt.datetime(2020, 1, 1, tzinfo=Odd())})


def test_register_refuses_what_it_cannot_store() -> None:
    with pytest.raises(UnsupportedValue, match="only dataclasses, NamedTuples and Enums"):
        codec.register(dict)

    @dataclasses.dataclass
    class Other:
        y: int

    with pytest.raises(UnsupportedValue, match="already taken"):
        codec.register(Other, name="tests.Mode")
    with pytest.raises(UnsupportedValue, match="already taken"):
        codec.register(Other, name="datetime.datetime")
    assert codec.register(Cfg) is Cfg  # the same registration again is harmless
    with pytest.raises(UnsupportedValue, match="already registered"):
        codec.register(Cfg, name="another")


def edit_raw(path: Path, old: bytes, new: bytes) -> None:
    """Replace bytes inside the manifest and re-sign it, as an attacker could."""
    raw = (path / naming.MANIFEST).read_bytes()
    assert raw.count(old) == 1 and len(old) == len(new)
    raw = raw.replace(old, new)
    (path / naming.MANIFEST).write_bytes(raw)
    os.unlink(path / naming.COMMIT_MARKER)
    forge.sign(path, raw)


def test_a_forged_unknown_tag_is_refused_and_never_imported(tmp_path: Path) -> None:
    fc.save(tmp_path / "ck", {"hp": {"mode": Mode.A}})
    edit_raw(tmp_path / "ck", b"tests.Mode", b"os.system_")
    with pytest.raises(fc.errors.UnregisteredType) as info:
        fc.restore(tmp_path / "ck")
    msg = str(info.value)
    assert "unknown tagged type 'os.system_'" in msg
    assert "functional_ckpt.codec.register(system_, name='os.system_')" in msg
    # a tag nobody registered is no damage: verify and inspect need no class
    assert not fc.errors.is_damage(info.value)
    assert fc.verify(tmp_path / "ck").ok
    shown = fc.inspect(tmp_path / "ck").tree["hp"]["mode"]
    assert shown == fc.codec.Unregistered("os.system_", "A") and repr(shown) == "os.system_.A"


@pytest.mark.parametrize(
    ("value", "old", "new", "match"),
    [
        (Cfg(1), b"alpha", b"alphx", r"has the fields \['alpha', 'layers', 'name', 'seen'\]"),
        (Mode.A, b"\xa1A", b"\xa1C", "has no member 'C'"),
        (dt.date(2020, 1, 1), b"\x01\x01", b"\x0d\x01", "cannot rebuild .*datetime.date.*month"),
        (Pair(1, 2), b"\x92\x01\x02", b"\x92\x01\xc0", None),
    ],
    ids=["dataclass-field", "enum-member", "date-month", "namedtuple-ok-none"],
)
def test_forged_fields_are_corrupt_never_a_type_error(
    tmp_path: Path, value: object, old: bytes, new: bytes, match: str | None
) -> None:
    fc.save(tmp_path / "ck", {"hp": {"v": value}})
    edit_raw(tmp_path / "ck", old, new)
    if match is None:  # any value is a valid field of a NamedTuple
        assert fc.codec.to_python(fc.restore(tmp_path / "ck"))["hp"]["v"] == Pair(1, None)
        return
    with pytest.raises(CorruptCheckpoint, match=match):
        fc.restore(tmp_path / "ck")
    assert not fc.verify(tmp_path / "ck").ok


def test_wrong_field_count_and_shape_are_corrupt() -> None:
    for value, tail in [
        (Pair(1, 2), b"\x92\x01"),
        (dt.timedelta(1), b"\x93\x01\x00"),
        (argparse.Namespace(a=1), b"\x81\xa1a"),
    ]:
        raw = codec.encode(value)
        broken = raw.replace(tail, b"\x90", 1) if tail in raw else raw[:-1]
        with pytest.raises(CorruptCheckpoint):
            codec.decode(broken)
    raw = codec.encode(Mode.A)  # [marker, "A"] -> [marker, "A", "A"]
    assert raw[0] == 0x92
    with pytest.raises(CorruptCheckpoint, match="2 fields entries"):
        codec.decode(b"\x93" + raw[1:] + b"\xa1A")


def test_budgets_and_hash_floods_still_apply() -> None:
    p = 2**61 - 1
    flood = {Pair(i * p, 0): 0 for i in range(LIMITS.equal_hashes + 1)}
    assert len({hash(k) for k in flood}) == 1
    with pytest.raises(UnsupportedValue, match="share one hash value"):
        codec.encode(flood)
    deep: object = 0
    for _ in range(LIMITS.encode_depth):
        deep = argparse.Namespace(x=deep)
    with pytest.raises(UnsupportedValue, match="nested deeper than"):
        codec.encode(deep)
    bomb = argparse.Namespace(x=[[]] * (LIMITS.decode_free_containers * 2))  # fields are counted
    with pytest.raises(UnsupportedValue, match="decode budget"):
        codec.encode(bomb)


def test_the_dtype_table_is_torchs() -> None:
    """The one table of dtypes (read without torch) names every torch dtype, sized as torch
    sizes it, and torch's other names for them; a torch that adds one fails here."""
    from functional_ckpt._src.codec import table

    dtypes = {n: d for n in dir(torch) if isinstance(d := getattr(torch, n), torch.dtype)}
    canonical = {n: d for n, d in dtypes.items() if str(d) == f"torch.{n}"}
    assert dict(table.DTYPE_SIZES) == {n: d.itemsize for n, d in canonical.items()}
    aliases = {n: str(d).removeprefix("torch.") for n, d in dtypes.items() if n not in canonical}
    assert dict(table.DTYPE_ALIASES) == aliases
    assert canonical == table.TORCH_DTYPES


def _every_dtype() -> list[torch.dtype]:
    found = (getattr(torch, n) for n in sorted(dir(torch)))
    return list(dict.fromkeys(d for d in found if isinstance(d, torch.dtype)))


@pytest.mark.parametrize("dtype", _every_dtype(), ids=str)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_torch_dtype_round_trips_or_is_refused_naming_the_key(
    tmp_path: Path, dtype: torch.dtype, mode: str
) -> None:
    """A tensor of any dtype torch has either comes back with its dtype and bytes, or is
    refused as an ``UnsupportedValue`` naming its key before anything is written
    (sub-byte dtypes such as ``uint4`` have no storage torch can copy or serialise)."""
    with warnings.catch_warnings():  # quantized and complex32 tensors warn when made
        warnings.simplefilter("ignore")
        try:
            t = torch.zeros(3, dtype=dtype)  # bool bytes other than 0 and 1 are not kept
        except (RuntimeError, NotImplementedError):
            t = torch.empty(3, dtype=dtype)
    dest = tmp_path / "ck"
    state = {"weights": t}
    try:
        if mode == "sync":
            fc.save(dest, state)
        else:
            fc.save_async(dest, state).result()
    except UnsupportedValue as e:
        assert "state['weights']" in str(e), e
        assert list(tmp_path.iterdir()) == []  # nothing written, no temporary left
        return
    back = fc.restore(dest)["weights"]
    assert back.dtype == dtype
    assert bytes(back.untyped_storage()) == bytes(t.untyped_storage())
