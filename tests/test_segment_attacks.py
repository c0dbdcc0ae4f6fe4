"""Attacks on run checksums (segments), the template fast paths and the prefaulter.

Each test forges or damages a real checkpoint (``tests.forge``), or drives a restore
the way a careless caller would, and checks what the reader returns: exact tensors in
new memory, or a ``CorruptCheckpoint`` that names the damage.
"""

from __future__ import annotations

import os
import threading
import zlib
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.format import columns
from functional_ckpt._src.format.naming import shard_name
from functional_ckpt._src.format.segments import FIELD, Segment
from functional_ckpt._src.restore.read import vetted_view
from functional_ckpt._src.state import allocation
from functional_ckpt._src.storage import shards
from functional_ckpt.errors import CorruptCheckpoint
from tests.forge import flip, resign
from tests.patience import HANG, eventually

SHARD = shard_name(0)


def _small_state(n: int = 400) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    return {f"a{i:04d}": torch.randn(64, generator=gen) for i in range(n)}


def _segments(ck: Path) -> tuple[Segment, ...]:
    return vetted_view(ck).segments[SHARD]


def _pack(segs: list[tuple[int, int, int]]) -> dict[str, bytes]:
    return {
        "offset": columns.pack((s[0] for s in segs), 8),
        "length": columns.pack((s[1] for s in segs), 8),
        "crc32": columns.pack((s[2] for s in segs), 4),
    }


def _set_segments(ck: Path, segs: list[tuple[int, int, int]]) -> None:
    def edit(m: dict[str, Any]) -> None:
        m["files"][SHARD][FIELD] = _pack(segs)

    resign(ck, edit)


def _recomputed(ck: Path) -> list[tuple[int, int, int]]:
    """The file's segments with their CRC32 recomputed over the bytes now on disk."""
    data = (ck / SHARD).read_bytes()
    return [(s.offset, s.length, zlib.crc32(data[s.offset : s.end])) for s in _segments(ck)]


def _exact(got: Any, state: dict[str, Any]) -> None:
    for k, v in state.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].detach(), v.detach()), k


# --- a run checksum never stands in for a tensor's own ----------------------------


def test_a_run_checksum_that_holds_does_not_stand_in_for_a_blob_that_fails_its_own(
    tmp_path: Path,
) -> None:
    """A manifest whose segment CRC matches the damaged file, but whose chunk checksums
    do not: each tensor's bytes are held to their own checksum inside a segment that
    holds, so the restore refuses what fc.verify reports (and what a checkpoint
    without segments refuses)."""
    state = _small_state()
    ck = tmp_path / "ck"
    fc.save(ck, state)
    flip(ck, "a0123")  # damage one tensor's data...
    _set_segments(ck, _recomputed(ck))  # ...and a manifest whose run checksum agrees
    report = fc.verify(ck)
    assert [p.where for p in report.problems] == ["'a0123'"]  # verify: the blob is damaged
    with pytest.raises(CorruptCheckpoint, match=r"'a0123'.*checksum mismatch"):
        fc.restore(ck, state)


def test_a_chunk_repointed_inside_its_segment_is_not_read_unchecked(tmp_path: Path) -> None:
    """A chunk's data offset moved by a few bytes inside its blob: the untouched
    segment still holds, and the shifted bytes fail the chunk's own CRC32."""
    state = _small_state()
    ck = tmp_path / "ck"
    fc.save(ck, state)
    view = vetted_view(ck)
    victim = view.tensors[("a0200",)].chunks[0]

    def edit(m: dict[str, Any]) -> None:
        for e in m["entries"]:
            if e.get("kind") == "tensors":  # a tensor table (version 3)
                keys, rows = e["keys"], columns.unpack(e["data_offset"], 8, len(e["fqn"]), "t")
                at = keys.index("a0200")
                rows[at] += 4
                e["data_offset"] = columns.pack(rows, 8)
                return
            if e.get("path") == ["a0200"]:
                e["chunks"][0]["data_offset"] += 4
                return
        raise AssertionError("a0200 not found")

    resign(ck, edit)
    assert vetted_view(ck).tensors[("a0200",)].chunks[0].data_offset == victim.data_offset + 4
    assert not fc.verify(ck).ok
    with pytest.raises(CorruptCheckpoint, match="'a0200'"):
        fc.restore(ck, state)


# --- forgeries and careless calls that are refused or harmless ----------------------


def test_without_segments_the_same_forgeries_are_refused(tmp_path: Path) -> None:
    """The same damage in a checkpoint without segments: checked blob by blob."""
    state = _small_state()
    ck = tmp_path / "ck"
    fc.save(ck, state)
    resign(ck, lambda m: m["files"][SHARD].pop(FIELD))
    flip(ck, "a0123")
    with pytest.raises(CorruptCheckpoint, match=r"'a0123'.*checksum mismatch"):
        fc.restore(ck, state)


def test_a_segment_forged_over_a_damaged_large_blob_does_not_excuse_it(tmp_path: Path) -> None:
    """A segment stretched over a large blob, its CRC matching the damaged bytes: the
    large blob is still read and checked on its own."""
    gen = torch.Generator().manual_seed(4)
    state: dict[str, Any] = {f"s{i}": torch.randn(50, generator=gen) for i in range(40)}
    state["big"] = torch.randn(1 << 19, generator=gen)  # 2 MiB
    ck = tmp_path / "ck"
    fc.save(ck, state)
    big = vetted_view(ck).tensors[("big",)].chunks[0]
    flip(ck, "big")
    data = (ck / SHARD).read_bytes()
    end = big.offset + big.length
    _set_segments(ck, [(0, end, zlib.crc32(data[:end]))])
    with pytest.raises(CorruptCheckpoint, match=r"'big'.*checksum mismatch"):
        fc.restore(ck, state)
    with pytest.raises(CorruptCheckpoint, match="'big'"):
        fc.restore(ck)


def test_a_segment_ending_inside_a_damaged_blob_does_not_cover_it(tmp_path: Path) -> None:
    """A segment whose end cuts a damaged blob in two, its CRC matching the bytes it
    covers: the cut blob lies in no segment and is checked on its own."""
    state = _small_state(40)
    ck = tmp_path / "ck"
    fc.save(ck, state)
    c = vetted_view(ck).tensors[("a0030",)].chunks[0]
    flip(ck, "a0030")
    data = (ck / SHARD).read_bytes()
    cut = c.data_offset + c.nbytes - 4  # after the flipped byte, before the blob's end
    _set_segments(ck, [(0, cut, zlib.crc32(data[:cut]))])
    with pytest.raises(CorruptCheckpoint, match=r"'a0030'.*checksum mismatch"):
        fc.restore(ck, state)


def test_a_segment_over_another_file_or_the_values_changes_nothing_read(tmp_path: Path) -> None:
    """Segments on ``.metadata``, or a wrong one over the values at the end of the shard:
    no tensor is read through them, the restore is exact."""
    state: dict[str, Any] = {**_small_state(40), "v": [1, "two", 3.0]}
    ck = tmp_path / "ck"
    fc.save(ck, state)
    size = vetted_view(ck).file_sizes[".metadata"]

    def edit(m: dict[str, Any]) -> None:
        m["files"][".metadata"][FIELD] = _pack([(0, size, 0)])

    resign(ck, edit)
    got = fc.restore(ck)
    _exact(got, {k: v for k, v in state.items() if k != "v"})
    assert fc.codec.to_python(got["v"]) == [1, "two", 3.0]


def test_restores_with_unusual_templates_are_exact_and_never_share_memory(
    tmp_path: Path,
) -> None:
    """like= leaves that are Parameters, need grad, conjugate or negative views,
    non-contiguous, with odd strides on size-1 dims, or meta: new, exact tensors; the
    template is neither written nor aliased (the empty_like fast path included)."""
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(4, 3, generator=gen)
    state: dict[str, Any] = {
        "param": torch.randn(5, generator=gen),
        "grad": torch.randn(6, generator=gen),
        "z": torch.randn(3, dtype=torch.complex64, generator=gen),
        "neg": torch.randn(7, generator=gen),
        "t": torch.randn(3, 4, generator=gen),
        "odd": torch.randn(2, 1, 3, generator=gen),
        "w": w,
        "tie": w,
        "i": torch.arange(9),
        "meta": torch.randn(3, generator=gen),
    }
    ck = tmp_path / "ck"
    fc.save(ck, state)
    tw = torch.full((4, 3), 7.0)
    like: dict[str, Any] = {
        "param": torch.nn.Parameter(torch.full((5,), 7.0)),
        "grad": torch.full((6,), 7.0, requires_grad=True),
        "z": torch.full((3,), 7 + 1j, dtype=torch.complex64).conj(),
        "neg": torch._neg_view(torch.full((7,), 7.0)),
        "t": torch.full((4, 3), 7.0).t(),
        "odd": torch.full((6,), 7.0).as_strided((2, 1, 3), (3, 100, 1)),
        "w": tw,
        "tie": tw,
        "i": torch.full((9,), 7),
        "meta": torch.empty(3, device="meta"),
    }
    before = {k: v.detach().clone() for k, v in like.items() if not v.is_meta}
    got = fc.restore(ck, like)
    _exact(got, state)
    assert got["param"].requires_grad and got["grad"].requires_grad
    assert not got["z"].is_conj() and not got["neg"].is_neg()
    assert got["w"].data_ptr() == got["tie"].data_ptr()  # the tie is kept, in new memory
    mine = {v.untyped_storage().data_ptr() for v in like.values() if not v.is_meta}
    for k in state:
        assert got[k].untyped_storage().data_ptr() not in mine, k
    for k, v in before.items():
        assert torch.equal(like[k].detach(), v), k


def test_an_incremental_save_reuses_files_without_run_checksums(tmp_path: Path) -> None:
    """Files reused from a base carry no segments (their bytes are not this save's
    batches); the save's own file does; both restore exact and verify clean."""
    state = _small_state(200)
    state["big"] = torch.randn(1 << 20)
    fc.save(tmp_path / "base", state)
    changed = {**state, "a0007": torch.zeros(64)}
    fc.save(tmp_path / "next", changed, base=tmp_path / "base")
    view = vetted_view(tmp_path / "next")
    files = set(view.file_sizes) - {".metadata"}
    assert len(files) >= 2  # something was reused
    assert set(view.segments) <= {SHARD}
    _exact(fc.restore(tmp_path / "next", changed), changed)
    assert fc.verify(tmp_path / "next").ok


def test_verify_reports_a_forged_run_checksum_beside_damage_elsewhere(tmp_path: Path) -> None:
    """A wrong run checksum is reported even when another segment holds a damaged blob."""
    gen = torch.Generator().manual_seed(6)
    state: dict[str, Any] = {f"s{i}": torch.randn(50, generator=gen) for i in range(20)}
    state["big"] = torch.randn(1 << 19, generator=gen)  # ends the first segment
    state.update({f"t{i}": torch.randn(50, generator=gen) for i in range(20)})
    ck = tmp_path / "ck"
    fc.save(ck, state)
    segs = _recomputed(ck)
    assert len(segs) == 2
    segs[1] = (segs[1][0], segs[1][1], segs[1][2] ^ 1)
    _set_segments(ck, segs)
    flip(ck, "s3")  # in the first segment
    where = sorted(p.where for p in fc.verify(ck).problems)
    assert where == ["'s3'", SHARD]
    with pytest.raises(CorruptCheckpoint) as info:
        fc.restore(ck, state)
    assert "'s3'" in str(info.value) and "'t" not in str(info.value)


# --- the prefaulter's thread -------------------------------------------------------


def _large_state(n: int = 3) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    return {f"w{i}": torch.randn((3 << 20) + i, generator=gen) for i in range(n)}  # 12 MiB


class _Recorded(allocation.Prefaulter):
    made: ClassVar[list[allocation.Prefaulter]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _Recorded.made.append(self)


def test_an_error_in_the_middle_of_the_reads_stops_the_prefaulter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from functional_ckpt._src.restore import read

    state = _large_state()
    fc.save(tmp_path / "ck", state)
    _Recorded.made = []
    monkeypatch.setattr(read, "Prefaulter", _Recorded)
    real = shards.read_tensors

    def failing(fd: int, jobs: Any, segments: Any = (), *, ready: Any = None) -> Any:
        calls = {"n": 0}

        def once_then_fail(address: int, end: int) -> None:
            calls["n"] += 1
            if calls["n"] > 1:
                raise OSError("the disk went away")
            ready(address, end)

        return real(fd, jobs, segments, ready=once_then_fail)

    monkeypatch.setattr(shards, "read_tensors", failing)
    with pytest.raises(OSError, match="went away"):
        fc.restore(tmp_path / "ck", {k: v.to("meta") for k, v in state.items()})
    assert len(_Recorded.made) == 1
    fut = _Recorded.made[0]._future
    assert fut is not None and fut.done() and fut.exception() is None


def test_concurrent_restores_share_the_fault_thread_without_deadlock(tmp_path: Path) -> None:
    state = _large_state()
    fc.save(tmp_path / "ck", state)
    results: list[Any] = []
    errors: list[BaseException] = []

    def one() -> None:
        try:
            for _ in range(3):
                results.append(fc.restore(tmp_path / "ck"))
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG)
        assert not t.is_alive(), "a restore hung"
    assert not errors
    assert len(results) == 9
    for got in results:
        _exact(got, state)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_child_forked_after_a_restore_restores_with_a_fault_thread_of_its_own(
    tmp_path: Path,
) -> None:
    state = _large_state()
    fc.save(tmp_path / "ck", state)
    fc.restore(tmp_path / "ck")  # the parent's fault thread exists
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only for an exact restore
        code = 1
        try:
            got = fc.restore(tmp_path / "ck")  # compared without torch's OpenMP team,
            # which a forked child of a process that used it cannot start again
            same = all(got[k].numpy().tobytes() == v.numpy().tobytes() for k, v in state.items())
            code = 0 if same else 2
        finally:
            os._exit(code)
    status = 0

    def child_done() -> bool:
        nonlocal status
        done, status = os.waitpid(pid, os.WNOHANG)
        return done != 0

    try:
        eventually(child_done, "the forked child's restore")
    except AssertionError:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        raise
    assert os.waitstatus_to_exitcode(status) == 0
