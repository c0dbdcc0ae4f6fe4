"""Run checksums (segments): written over each batch of small blobs, read as one check.

A restore of many small tensors reads a segment whole and checks it with one CRC32;
only where that fails does each blob name its own damage. The segments are untrusted
input like every other field of the manifest, and a checkpoint without them (older
writers, multi-rank saves) reads exactly as before.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.format import columns
from functional_ckpt._src.format.naming import shard_name
from functional_ckpt._src.format.segments import FIELD, MIN_SPACING, Segment, parse_segments
from functional_ckpt._src.limits import LIMITS
from functional_ckpt._src.restore.read import vetted_view
from functional_ckpt._src.storage import shards
from functional_ckpt.errors import CorruptCheckpoint
from tests.forge import flip, resign, restore_in

SHARD = shard_name(0)


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(11)
    state: dict[str, Any] = {f"a{i:04d}": torch.randn(200, generator=gen) for i in range(7000)}
    state["big"] = torch.randn(1 << 19, generator=gen)  # 2 MiB: ends a batch, in no segment
    state.update({f"b{i:04d}": torch.randn(7, 3, generator=gen) for i in range(2000)})
    state["half"] = torch.randn(40, generator=gen).half()
    state.update({f"v{i}": [i, f"value {i}", i * 0.25] for i in range(50)})
    return state


def _segments(ck: Path) -> tuple[Segment, ...]:
    return vetted_view(ck).segments[SHARD]


def _assert_exact(got: Any, state: dict[str, Any]) -> None:
    for k, v in state.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    state = _state()
    ck = tmp_path_factory.mktemp("seg") / "ck"
    fc.save(ck, state)
    return ck, state


def _copy(src: Path, dest: Path) -> Path:
    dest.mkdir()
    for p in src.iterdir():
        (dest / p.name).write_bytes(p.read_bytes())
    return dest


def test_a_save_records_a_run_checksum_over_every_batch_of_small_blobs(
    saved: tuple[Path, dict[str, Any]],
) -> None:
    ck, state = saved
    segs = _segments(ck)
    assert len(segs) >= 3  # a full batch, the batch the large tensor ends, the last one
    data = (ck / SHARD).read_bytes()
    for s in segs:
        assert zlib.crc32(data[s.offset : s.end]) == s.crc32
        assert 0 < s.length <= LIMITS.segment_bytes
    tensors = vetted_view(ck).tensors
    for k, v in state.items():
        if not isinstance(v, torch.Tensor):
            continue
        c = tensors[(k,)].chunks[0]
        inside = [s for s in segs if s.offset <= c.offset and c.offset + c.length <= s.end]
        if k == "big":  # written straight from the tensor: no byte of its blob in a segment
            assert not any(s.offset < c.offset + c.length and c.offset < s.end for s in segs)
        else:
            assert len(inside) == 1, k
    assert fc.verify(ck).ok


@pytest.mark.parametrize("mode", ["like", "none", "out"])
def test_damage_inside_a_segment_names_only_the_damaged_tensors(
    tmp_path: Path, saved: tuple[Path, dict[str, Any]], mode: str
) -> None:
    ck = _copy(saved[0], tmp_path / "ck")
    state = saved[1]
    flip(ck, "a1500")  # the middle of the first segment
    flip(ck, "b0999", header=True)  # the middle of another
    tensors = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(CorruptCheckpoint) as info:
        restore_in(mode, ck, state)
    msg = str(info.value)
    assert "'a1500'" in msg and "checksum mismatch" in msg
    assert "'b0999'" in msg and "blob headers fail their checksum" in msg
    named = [k for k in tensors if f"'{k}'" in msg]
    assert named == ["a1500", "b0999"]
    report = fc.verify(ck)  # each damaged blob once, by its key; its segment adds nothing
    assert not report.ok
    assert sorted(p.where for p in report.problems) == ["'a1500'", "'b0999'"]


def test_a_wrong_run_checksum_alone_leaves_every_tensor_exact(
    tmp_path: Path, saved: tuple[Path, dict[str, Any]]
) -> None:
    ck = _copy(saved[0], tmp_path / "ck")

    def edit(m: dict[str, Any]) -> None:
        crcs = columns.unpack(m["files"][SHARD][FIELD]["crc32"], 4, len(_segments(ck)), "t")
        crcs[0] ^= 1
        m["files"][SHARD][FIELD]["crc32"] = columns.pack(crcs, 4)

    resign(ck, edit)
    # every wanted blob is checked on its own and holds: the restore is exact
    _assert_exact(fc.restore(ck, saved[1]), saved[1])
    report = fc.verify(ck)  # while the record that disagrees with the file is reported
    assert not report.ok
    assert [p for p in report.problems if "run checksum" in str(p)]


def test_a_checkpoint_without_run_checksums_reads_and_checks_as_before(
    tmp_path: Path, saved: tuple[Path, dict[str, Any]]
) -> None:
    ck = _copy(saved[0], tmp_path / "ck")
    resign(ck, lambda m: m["files"][SHARD].pop(FIELD))
    assert vetted_view(ck).segments == {}
    _assert_exact(fc.restore(ck, saved[1]), saved[1])
    _assert_exact(fc.restore(ck), saved[1])
    assert fc.verify(ck).ok
    flip(ck, "a0007")
    with pytest.raises(CorruptCheckpoint, match=r"'a0007'.*checksum mismatch"):
        fc.restore(ck, saved[1])


def test_a_restore_of_a_few_tensors_reads_them_alone(
    saved: tuple[Path, dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    ck, state = saved
    reads: list[int] = []
    real = shards.read_into

    def counting(fd: int, offset: int, dest: memoryview) -> int:
        reads.append(len(dest))
        return real(fd, offset, dest)

    monkeypatch.setattr(shards, "read_into", counting)
    got = fc.restore(ck, {"a0100": state["a0100"], "b0001": state["b0001"]}, partial=True)
    assert torch.equal(got["a0100"], state["a0100"]) and torch.equal(got["b0001"], state["b0001"])
    assert reads and max(reads) < 4096  # no segment was read for two small tensors
    reads.clear()
    fc.restore(ck, state)
    assert max(reads) >= min(s.length for s in _segments(ck))  # a whole restore reads segments


def _columns(segs: list[tuple[int, int, int]]) -> dict[str, bytes]:
    return {
        "offset": columns.pack((s[0] for s in segs), 8),
        "length": columns.pack((s[1] for s in segs), 8),
        "crc32": columns.pack((s[2] for s in segs), 4),
    }


FORGED: dict[str, Any] = {
    "beyond the file": _columns([(1 << 40, 10, 0)]),
    "overlapping": _columns([(0, 4096, 0), (4000, 4096, 0)]),
    "out of order": _columns([(8192, 4096, 0), (0, 4096, 0)]),
    "empty": _columns([(0, 0, 0)]),
    "too long": _columns([(0, LIMITS.segment_bytes + 1, 0)]),
    "not a map": [[0, 4096, 0]],
    "a column missing": {"offset": b"\0" * 8, "crc32": b"\0" * 4},
    "a column of another length": {**_columns([(0, 4096, 0)]), "length": b"\0" * 16},
    "a text column": {**_columns([(0, 4096, 0)]), "crc32": "0000"},
}


@pytest.mark.parametrize("how", sorted(FORGED))
def test_forged_run_checksums_are_refused_naming_the_file(
    tmp_path: Path, saved: tuple[Path, dict[str, Any]], how: str
) -> None:
    ck = _copy(saved[0], tmp_path / "ck")

    def edit(m: dict[str, Any]) -> None:
        m["files"][SHARD][FIELD] = FORGED[how]

    resign(ck, edit)
    with pytest.raises(CorruptCheckpoint, match=SHARD):
        fc.restore(ck, saved[1])
    assert not fc.verify(ck).ok


def test_a_file_cannot_declare_more_segments_than_it_has_room_for() -> None:
    size = 10 * MIN_SPACING
    ok = [(i * MIN_SPACING, 16, 0) for i in range(11)]
    assert len(parse_segments(_columns(ok), size + 16, "f")) == 11
    many = [(i * 64, 16, 0) for i in range(12)]
    with pytest.raises(CorruptCheckpoint, match="12 segments"):
        parse_segments(_columns(many), size, "f")


def test_a_multi_batch_shard_is_checked_segment_by_segment(tmp_path: Path) -> None:
    """Segments written by write_shard itself cover its small blobs exactly."""
    tensors = [torch.full((300,), float(i)) for i in range(20_000)]  # about 30 MB of blobs
    out = shards.write_shard(tmp_path / "f", tensors)
    data = (tmp_path / "f").read_bytes()
    assert len(out.segments) >= 3
    assert out.segments[0].offset == 0 and out.segments[-1].end == len(data)
    for a, b in zip(out.segments, out.segments[1:], strict=False):
        assert a.end == b.offset  # only small blobs: one batch after another
    for s in out.segments:
        assert zlib.crc32(data[s.offset : s.end]) == s.crc32
