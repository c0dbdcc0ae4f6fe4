"""A multi-rank checkpoint read from one rank: what the remote tier fetches for it,
and what ``fc.inspect`` opens.

A real 3-rank gloo save (a tensor sharded over every rank, each rank's own loader
state) is uploaded to moto's S3 server; each rank's download is
counted object by object: the index, the files the index lists (the data files its
replicated tensors lie in), its own part and the files that part lists, never
another rank's part nor ``.metadata``. A download that verifies fetches everything.
``fc.inspect`` opens the marker, the index and rank 0's part, whatever the world size,
and sums every file's bytes as a reader of every part would.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

import functional_ckpt as fc
from functional_ckpt._src.format import naming
from functional_ckpt._src.remote import protocol
from functional_ckpt._src.remote.fetch import download
from functional_ckpt._src.remote.store import Store
from functional_ckpt._src.storage import committed
from functional_ckpt._src.storage.usage import sharing
from tests.forge import read_part
from tests.test_open_files import _launch, opened_path

WORLD = 3


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("fetch") / "ck"
    _launch(WORLD, str(path), "save")
    return path


def _upload(store: Store, step: int, local: Path) -> None:
    sizes = protocol.expected_sizes(local)
    present = protocol.begin_upload(store, step, local) or {}
    protocol.put_part(store, step, local, [n for n in sizes if n != naming.MANIFEST], present)
    protocol.commit_upload(store, step, local, sizes)


def _fetched(store: Store, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    got: list[str] = []
    real = store.fs.get

    def counting(rpaths: list[str], lpaths: list[str], *args: Any, **kwargs: Any) -> Any:
        got.extend(os.path.basename(p) for p in rpaths)
        return real(rpaths, lpaths, *args, **kwargs)

    monkeypatch.setattr(store.fs, "get", counting)
    return got


def test_each_rank_fetches_its_part_and_files_alone(
    saved: Path, s3: dict[str, Any], bucket: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(bucket, s3["options"])
    _upload(store, 7, saved)
    every = set(protocol.expected_sizes(saved))
    index = committed.read_manifest(saved)
    got = _fetched(store, monkeypatch)
    for rank in range(WORLD):
        got.clear()
        local = download(store, 7, tmp_path / f"rank{rank}", check=False, rank=rank)
        own = set(read_part(saved, rank)["files"])
        listed = set(index["files"]) - {naming.DCP_METADATA}
        assert sorted(got) == sorted({naming.MANIFEST, naming.part_name(rank), *listed, *own})
        assert naming.DCP_METADATA not in got
        assert set(os.listdir(local)) == {naming.COMMIT_MARKER, *got}
        with committed.open_checkpoint(local) as ck:  # what the rank reads is all there
            view = committed.parsed(ck).view(rank, parts=[rank])
            (chunk,) = view.tensors[("w",)].chunks
            assert chunk.file == naming.shard_name(rank) and (local / chunk.file).is_file()
            assert view.values[("loader", "pos")] == rank
    assert all(read_part(saved, r)["files"] for r in range(WORLD))  # each lists its file
    got.clear()
    whole = download(store, 7, tmp_path / "whole")  # verified: every object
    assert sorted(got) == sorted(every)
    assert fc.verify(whole).ok


def test_inspect_opens_the_index_and_one_part_and_sums_every_file(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(saved, ck)
    os.link(ck / naming.shard_name(2), tmp_path / "elsewhere")  # its bytes shared
    every = committed.every_file(ck)
    opened: list[str] = []
    real = os.open

    def counting(name: Any, *args: Any, **kwargs: Any) -> int:
        full = Path(opened_path(name, kwargs.get("dir_fd")))
        if full.parent == ck:  # not a file the previous test's download still flushes
            opened.append(full.name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting)
    summary = fc.inspect(ck)
    monkeypatch.undo()
    assert sorted(opened) == sorted([naming.COMMIT_MARKER, naming.MANIFEST, naming.part_name(0)])
    assert summary.world_size == WORLD and summary.num_tensors == 1
    assert summary.file_bytes == sum(f["size"] for f in every.values())
    shared, added = sharing(ck, every)
    assert shared == (ck / naming.shard_name(2)).stat().st_size
    assert (summary.shared_bytes, summary.added_bytes) == (shared, added)
