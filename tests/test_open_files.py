"""A restoring rank opens only the files it reads, one at a time, closed once read.

The checkpoint has many files, cheaply and honestly: a chain of incremental saves,
each changing one tensor, leaves every tensor's last bytes in a file of its own
(the base's files are linked into the new checkpoint), so a one-process save
writes a checkpoint of more files than a lowered descriptor limit lets a reader
hold open at once.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.format import naming
from functional_ckpt._src.restore.read import vetted_view
from functional_ckpt._src.storage import committed
from tests.open_files_job import LIMIT, expected
from tests.patience import HANG
from tests.test_dist import launch

COUNT = 100  # tensors, and about as many files
JOB = Path(__file__).with_name("open_files_job.py")


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("many")
    state = {f"t{i:03d}": expected(0) + i * 100 for i in range(COUNT)}
    fc.save(root / "s0", state)
    for k in range(1, COUNT):
        state[f"t{k:03d}"] = expected(k)
        fc.save(root / f"s{k}", state, base=root / f"s{k - 1}")
    last = root / f"s{COUNT - 1}"
    assert len(os.listdir(last)) > LIMIT + 10
    return last


class Opened:
    """Every file a reader opens (``os.open`` wrapped), and the most open at once."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.held: set[int] = set()
        self.peak = 0


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch, many: Path) -> Iterator[Opened]:
    """Counts files under ``many``'s folder alone: a background thread an earlier test
    left in this worker (a download's flush) opens files elsewhere meanwhile."""
    seen = Opened()
    real_open, real_close = os.open, os.close
    inside = os.fspath(many.parent) + os.sep

    def counting_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        fd = real_open(path, flags, *args, **kwargs)
        name = opened_path(path, kwargs.get("dir_fd"))
        if not name.startswith(inside):
            return fd
        seen.names.append(os.path.basename(name))
        seen.held.add(fd)
        seen.peak = max(seen.peak, len(seen.held))
        return fd

    def counting_close(fd: int) -> None:
        seen.held.discard(fd)
        real_close(fd)

    monkeypatch.setattr(os, "open", counting_open)
    monkeypatch.setattr(os, "close", counting_close)
    yield seen


def opened_path(path: Any, dir_fd: int | None) -> str:
    """The absolute name ``os.open(path, dir_fd=)`` opened (a member opened by name)."""
    name = os.fsdecode(path)
    if dir_fd is not None and not os.path.isabs(name):
        return os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), name)
    return os.path.abspath(name)


def _files(names: list[str], path: Path) -> list[str]:
    return sorted(n for n in names if n != path.name)  # the directory itself left out


def test_a_restore_opens_only_the_files_it_reads(many: Path, opened: Opened) -> None:
    """One key: the marker, the manifest and the one file holding it, nothing else."""
    where = vetted_view(many).tensors[("t042",)].chunks[0].file
    opened.names.clear()
    got = fc.restore(many, {"t042": torch.zeros(6, 4)}, partial=True)
    assert torch.equal(got["t042"], expected(42))
    assert _files(opened.names, many) == sorted([naming.COMMIT_MARKER, naming.MANIFEST, where])
    assert opened.peak <= 3  # the directory, the file being read and one spare at most


def test_a_whole_restore_opens_each_data_file_once_and_never_metadata(
    many: Path, opened: Opened
) -> None:
    got = fc.restore(many)
    assert all(torch.equal(got[f"t{i:03d}"], expected(i)) for i in range(COUNT))
    data = sorted(n for n in os.listdir(many) if naming.parse_shard(n) is not None)
    assert _files(opened.names, many) == sorted([naming.COMMIT_MARKER, naming.MANIFEST, *data])
    assert opened.peak <= 3


def test_inspect_opens_the_marker_and_manifest_alone(many: Path, opened: Opened) -> None:
    assert fc.inspect(many).num_tensors == COUNT
    assert _files(opened.names, many) == sorted([naming.COMMIT_MARKER, naming.MANIFEST])


def test_verify_checks_every_file_with_few_open(many: Path, opened: Opened) -> None:
    assert fc.verify(many).ok
    assert naming.DCP_METADATA in opened.names
    assert opened.peak <= 3


def test_held_files_never_exceed_the_bound(many: Path) -> None:
    """Read through one held checkpoint, file after file without releasing: the
    least recently used are closed, never more than ``MAX_OPEN`` held."""
    with committed.open_checkpoint(many) as ck:
        for name in sorted(n for n in os.listdir(many) if naming.parse_shard(n) is not None):
            ck.fd(name)
            assert len(ck.fds) <= committed.MAX_OPEN
        assert len(ck.fds) == committed.MAX_OPEN


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("world", [1, 2, 3])
def test_restore_under_a_descriptor_limit(many: Path, tmp_path: Path, world: int) -> None:
    """Each rank (gloo) limited to 64 descriptors restores a checkpoint of more files
    than that, bit-exact (and one rank alone also without a template, and verifies)."""
    ck = tmp_path / "ck"
    shutil.copytree(many, ck)
    assert _launch(world, str(ck), str(COUNT)) == ["ok"] * world


def test_each_restoring_rank_opens_its_own_part_and_never_metadata(
    shard_save: Callable[[int], Path],
) -> None:
    """Two gloo ranks restore a two-rank save onto its placements, ``os.open`` counted:
    each opens the marker, the index, its own part and its own data file, never
    the other rank's part nor ``.metadata``."""
    for rank, out in enumerate(_launch(2, str(shard_save(2)), "count")):
        names = set(json.loads(out))
        assert {naming.COMMIT_MARKER, naming.MANIFEST, naming.shard_name(rank)} <= names
        assert {n for n in names if naming.parse_part(n) is not None} == {naming.part_name(rank)}
        assert naming.DCP_METADATA not in names


def _launch(world: int, *args: str) -> list[str]:
    """Run open_files_job.py on ``world`` gloo ranks; each rank's output."""
    outs = []
    for p in launch(world, *args, job=JOB):
        out, err = p.communicate(timeout=HANG)
        assert p.returncode == 0, err[-3000:]
        outs.append(out.strip())
    return outs
