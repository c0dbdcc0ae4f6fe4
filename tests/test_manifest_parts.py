"""A multi-rank checkpoint's manifest in parts: an index and one part per rank.

A real 2-rank gloo save writes the checkpoint once; each test copies it and reads
it, damages it or forges it, as an attacker or a bug could, in the layout saves
write now (each part lists its rank's files and checks itself) and in the one
versions 2 and 3 wrote (every file and each part's checksum in the index), which
readers still read.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src import codec
from functional_ckpt._src.format import naming
from functional_ckpt._src.format.checksum import crc32
from functional_ckpt._src.format.manifest import Manifest
from functional_ckpt._src.limits import LIMITS
from functional_ckpt._src.save import local
from functional_ckpt._src.storage import committed
from tests.dist_job import full_tensors
from tests.forge import old_layout, read_part, resign, write_part

PART0, PART1 = naming.part_name(0), naming.part_name(1)


@pytest.fixture
def saved(shard_save: Callable[[int], Path]) -> Path:
    return shard_save(2)  # w: Shard(0), e: Shard(1), r: replicated


@pytest.fixture(params=["now", "old"])
def ck(saved: Path, tmp_path: Path, request: pytest.FixtureRequest) -> Path:
    shutil.copytree(saved, tmp_path / "w2")
    if request.param == "old":
        old_layout(tmp_path / "w2")
    return tmp_path / "w2"


@pytest.fixture
def old(saved: Path, tmp_path: Path) -> Path:
    shutil.copytree(saved, tmp_path / "w2")
    old_layout(tmp_path / "w2")
    return tmp_path / "w2"


def test_an_index_with_each_ranks_part_beside_it(ck: Path) -> None:
    assert {PART0, PART1} <= {p.name for p in ck.iterdir()}
    index = committed.read_manifest(ck)
    marker = codec.decode((ck / naming.COMMIT_MARKER).read_bytes())
    if index["version"] == naming.PART_FILES_VERSION:  # each part lists its rank's files
        assert marker["version"] == naming.PART_FILES_VERSION and index["parts"] == 2
        # the index lists the files its own chunks and byte entries name; each part
        # its rank's other files (here none: r and b lie in one, the values in the other)
        named = {b["file"] for b in index["dcp_bytes"]}
        for e in index["entries"]:
            named.update(c["file"] for c in e.get("chunks", ()))
        assert set(index["files"]) == {naming.DCP_METADATA, *named}
        data = {n for n in os.listdir(ck) if naming.parse_shard(n)}
        assert data == set(index["files"]) - {naming.DCP_METADATA}
        for rank, name in enumerate((PART0, PART1)):
            raw = (ck / name).read_bytes()
            assert raw[-4:] == crc32(raw[:-4]).to_bytes(4, "little")
            assert read_part(ck, rank)["created"] == index["created"]
            assert read_part(ck, rank)["files"] == {}
    else:
        assert index["version"] == naming.PARTS_VERSION and index["parts"] == 2
        assert marker["version"] == naming.PARTS_VERSION
        for name in (PART0, PART1):
            raw = (ck / name).read_bytes()
            assert index["files"][name] == {"size": len(raw), "crc32": crc32(raw)}
    assert "ranks" not in index  # each rank's per-rank entries lie in its part
    by_path = {tuple(e["path"]): e for e in index["entries"]}
    assert by_path[("w",)]["split"] == 0 and "chunks" not in by_path[("w",)]
    assert by_path[("e",)]["split"] == 1 and "chunks" not in by_path[("e",)]
    assert len(by_path[("r",)]["chunks"]) == 1  # replicated: written once, in the index
    part = read_part(ck, 1)
    assert part["part"] == 1 and len(part["chunks"]) == 2  # a row for w, one for e
    assert {tuple(e["path"]) for e in part["entries"]} >= {("loader", "pos")}
    assert fc.verify(ck).ok
    assert fc.inspect(ck).world_size == 2


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_every_reader_sees_the_whole_checkpoint(ck: Path) -> None:
    full = full_tensors()
    back = fc.restore(ck, partial=True)
    assert torch.equal(back["w"], full["w"]) and torch.equal(back["e"], full["e"])
    assert torch.equal(back["r"], full["w"] * 2)
    # stock DCP reads the same checkpoint through its one global .metadata
    import torch.distributed.checkpoint as dcp

    into = {"w": torch.zeros(10, 6), "e": torch.zeros(5, 3, 2, dtype=torch.bfloat16)}
    dcp.load(into, checkpoint_id=str(ck), no_dist=True)
    assert torch.equal(into["w"], full["w"]) and torch.equal(into["e"], full["e"])


def test_a_view_reads_only_the_parts_it_is_asked_for(
    ck: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    read: list[int] = []
    original = committed.read_part

    def counting(held: committed.Checkpoint, rank: int) -> object:
        read.append(rank)
        return original(held, rank)

    monkeypatch.setattr(committed, "read_part", counting)
    with committed.open_checkpoint(ck) as held:
        once = committed.parsed(held)
        mine = once.view(1, parts=[1])
        assert read == [1]  # its per-rank entries and its chunks: one part
        (w,) = mine.tensors[("w",)].chunks
        assert (w.offsets, w.sizes) == ((5, 0), (5, 6)) and w.file == naming.shard_name(1)
        assert mine.values[("loader", "pos")] == 100
        assert once.view(0, parts=()).tensors[("e",)].chunks == ()
        whole = once.view(0)
        assert sorted(set(read)) == [0, 1]
        assert [c.offsets for c in whole.tensors[("e",)].chunks] == [(0, 0, 0), (0, 2, 0)]


def test_a_view_of_some_parts_describes_to_dcp_only_what_it_holds(ck: Path) -> None:
    """Rank 0's view holds w's first chunk alone, at the origin: not the whole of w,
    and not to be mistaken for r's one chunk (the same dtype and shape, all of r)."""
    from functional_ckpt._src.format import dcp_metadata

    with committed.open_checkpoint(ck) as held:
        mine = committed.parsed(held).view(0, parts=[0])
    md = dcp_metadata.metadata_for([list(mine.tensors.values())])
    w, r = md.state_dict_metadata["w"], md.state_dict_metadata["r"]
    assert [tuple(c.sizes) for c in w.chunks] == [(5, 6)]  # type: ignore[union-attr]
    assert [tuple(c.sizes) for c in r.chunks] == [(10, 6)]  # type: ignore[union-attr]


def test_a_damaged_part_is_named(ck: Path) -> None:
    raw = bytearray((ck / PART1).read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    (ck / PART1).write_bytes(bytes(raw))
    with pytest.raises(
        fc.errors.CorruptCheckpoint, match=r"manifest\.part-00001\.msgpack.*checksum"
    ):
        fc.restore(ck, partial=True)
    report = fc.verify(ck)
    assert not report.ok and any(PART1 in str(p) for p in report.problems), report.problems


def test_a_deleted_part_is_reported_as_a_missing_file(ck: Path) -> None:
    """``fc.verify`` reports a deleted part like any missing file (it raised the
    opener's ``FileNotFoundError``); a restore names it too."""
    (ck / PART1).unlink()
    report = fc.verify(ck)
    assert not report.ok
    assert any(p.where == PART1 and "missing" in p.detail for p in report.problems), report
    with pytest.raises(fc.errors.CorruptCheckpoint, match=rf"{PART1}: file is missing"):
        fc.restore(ck, partial=True)


def test_a_part_beyond_the_readers_limit_is_refused_before_it_is_read(
    ck: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = (ck / PART0).stat().st_size
    monkeypatch.setattr(
        committed, "LIMITS", dataclasses.replace(LIMITS, manifest_part_bytes=size - 1)
    )
    with pytest.raises(fc.errors.CorruptCheckpoint, match=rf"{PART0}.*{size} bytes.*{size - 1}"):
        fc.restore(ck, partial=True)


def test_a_part_missing_from_the_file_table_is_refused(old: Path) -> None:
    resign(old, lambda m: m["files"].pop(PART1))
    with pytest.raises(fc.errors.CorruptCheckpoint, match=f"does not list {PART1}"):
        fc.restore(old, partial=True)


def test_a_forged_part_is_refused_by_name(ck: Path) -> None:
    """A part re-signed with a row too few: its count, and its name."""
    part = read_part(ck, 1)
    part["chunks"] = part["chunks"][:1]
    write_part(ck, 1, part)
    with pytest.raises(fc.errors.CorruptCheckpoint, match=f"{PART1}: 1 chunk rows for 2 split"):
        fc.restore(ck, partial=True)


def test_a_forged_row_is_checked_as_any_chunk(ck: Path) -> None:
    """A row pointing past the end of its data file: refused before a byte is read."""
    part = read_part(ck, 1)
    part["chunks"][0][2] = 1 << 40  # its blob's length
    write_part(ck, 1, part)
    with pytest.raises(fc.errors.UnsafeCheckpoint, match=f"{PART1} row 0: 'w' declares bytes"):
        fc.restore(ck, partial=True)


@pytest.mark.parametrize(
    ("edit", "error"),
    [
        (lambda p: p.update(created=p["created"] + 1), "a part of another save"),
        (lambda p: p["files"].update({naming.shard_name(0): {"size": 1}}), "only one table"),
        (lambda p: p["files"].update({PART0: {"size": 1}}), "only one table"),
        (lambda p: p["files"].update({"COMMITTED": {"size": 1}}), "may not"),
    ],
)
def test_a_part_of_another_save_or_listing_anothers_file_is_refused(
    saved: Path, tmp_path: Path, edit: Any, error: str
) -> None:
    ck = tmp_path / "w2"
    shutil.copytree(saved, ck)
    part = read_part(ck, 1)
    edit(part)
    write_part(ck, 1, part)
    with pytest.raises(fc.errors.CorruptCheckpoint, match=f"{PART1}: .*{error}"):
        fc.restore(ck, partial=True)
    assert not fc.verify(ck).ok


def test_a_split_that_is_not_the_rule_is_refused(ck: Path) -> None:
    def edit(m: dict[str, object]) -> None:
        for e in m["entries"]:  # type: ignore[attr-defined]
            if e["path"] == ["w"]:
                e["split"] = 5  # w has two dimensions

    resign(ck, edit)
    with pytest.raises(fc.errors.CorruptCheckpoint, match="invalid split 5 of 'w'"):
        fc.restore(ck, partial=True)


def test_a_single_process_checkpoint_is_one_manifest_of_version_1(tmp_path: Path) -> None:
    """What an older reader reads: no parts, and the version it knows."""
    fc.save(tmp_path / "one", {"w": torch.ones(3), "rng": {"seed": 1}})
    assert not [p for p in (tmp_path / "one").iterdir() if naming.parse_part(p.name) is not None]
    assert committed.read_manifest(tmp_path / "one")["version"] == naming.ONE_MANIFEST_VERSION
    marker = codec.decode((tmp_path / "one" / naming.COMMIT_MARKER).read_bytes())
    assert marker["version"] == naming.ONE_MANIFEST_VERSION


def test_a_save_refuses_a_part_beyond_the_readers_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = Manifest(0.0, {}, {}, (), ((), ()))  # two ranks, nothing in them
    assert [name for name, _ in local.encode_parts(manifest, Path("ck"))] == [PART0, PART1]
    monkeypatch.setattr(local, "LIMITS", dataclasses.replace(LIMITS, manifest_part_bytes=8))
    with pytest.raises(fc.errors.UnsupportedValue, match=f"{PART0}, rank 0's part"):
        local.encode_parts(manifest, Path("ck"))


def test_part_names_are_exact() -> None:
    assert naming.part_name(7) == "manifest.part-00007.msgpack"
    assert naming.parse_part("manifest.part-00007.msgpack") == 7
    assert naming.parse_part("manifest.part-7.msgpack") is None
    assert naming.parse_part("manifest.part-000007.msgpack") is None


def test_a_row_is_a_chunk_without_its_box() -> None:
    from functional_ckpt._src.format import parts
    from functional_ckpt._src.format.manifest import Chunk

    assert Chunk._fields[2:] == parts.ROW_FIELDS
    # read by position where a thousand-rank save handles half a million chunks
    assert Chunk._fields[:5] == ("offsets", "sizes", "file", "offset", "length")
    c = Chunk((5, 0), (5, 6), "__1_0.distcp", 64, 300, 128, 120, 7, 9)
    (row,) = parts.rows([c])
    assert row == ["__1_0.distcp", 64, 300, 128, 120, 7, 9]
    assert parts.rows([c, c]) == [row, row]
    plain = parts.row_plain(row, ((5, 0), (5, 6)))
    assert (
        plain is not None
        and Chunk(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in plain.items()}) == c
    )


def test_the_even_split_is_torch_chunks() -> None:
    from functional_ckpt._src.format import parts

    for extent, n in ((10, 2), (10, 4), (4096, 1024), (7, 3), (1000, 7)):
        t = torch.arange(extent)
        got = [parts.split_box((extent, 2), 0, n, i) for i in range(n)]
        want = [((int(c[0]), 0), (len(c), 2)) for c in t.chunk(n)]
        assert (len(want) == n) == parts.is_even_split((extent, 2), 0, n)
        if len(want) == n:
            assert got == want
            assert parts.split_dim((extent, 2), got, n) == 0
            assert list(parts.overlapping(extent, n, 0, extent)) == list(range(n))
    assert parts.split_dim((10, 6), [((0, 0), (5, 6)), ((5, 0), (4, 6))], 2) is None
    assert list(parts.overlapping(10, 4, 3, 4)) == [1, 2]  # rows 3..6 of chunks of 3


def test_split_dim_is_the_rule_box_for_box_for_any_damage() -> None:
    """The fast comparison says what comparing every box with ``split_box`` says:
    the rule's boxes pass, and a box with any one field changed does not."""
    import random

    from functional_ckpt._src.format import parts

    def reference(shape: tuple[int, ...], boxes: list[Any], n: int) -> int | None:
        for dim in range(len(shape)):
            if parts.is_even_split(shape, dim, n) and boxes == [
                parts.split_box(shape, dim, n, i) for i in range(n)
            ]:
                return dim
        return None

    rng = random.Random(7)
    for _ in range(300):
        shape = tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 3)))
        dim, n = rng.randrange(len(shape)), rng.randint(2, 9)
        if not parts.is_even_split(shape, dim, n):
            continue
        boxes = [parts.split_box(shape, dim, n, i) for i in range(n)]
        want = reference(shape, boxes, n)
        assert want is not None and parts.split_dim(shape, boxes, n) == want
        i, which, d = rng.randrange(n), rng.randrange(2), rng.randrange(len(shape))
        box = [list(boxes[i][0]), list(boxes[i][1])]
        box[which][d] += rng.choice((-1, 1))
        damaged = [*boxes[:i], (tuple(box[0]), tuple(box[1])), *boxes[i + 1 :]]
        assert parts.split_dim(shape, damaged, n) == reference(shape, damaged, n), (
            shape,
            dim,
            n,
            damaged,
        )


def test_parts_are_encoded_in_bulk_as_row_by_row() -> None:
    """A part's rows, packed at once, are the bytes the rows packed one by one give:
    plain and compressed chunks (8 fields), integers of every width, per-rank entries,
    each part's files and its trailing CRC32."""
    from functional_ckpt._src.format import manifest as m
    from functional_ckpt._src.format import parts
    from functional_ckpt._src.format.manifest import Chunk, TensorEntry, Tree, ValueEntry, Written

    world = 3
    shapes = {"w": (9, 4), "big": (3 * 70000, 2), "bias": (4,)}
    shared = tuple(TensorEntry(("m", k), f"m.{k}", "float32", s, False) for k, s in shapes.items())
    per_rank = tuple(
        (
            ValueEntry(("rng",), r, codec.encode(r)),
            TensorEntry(("rng_t",), f"rng_t{r}", "uint8", (5,), False),
        )
        for r in range(world)
    )
    written: dict[str, tuple[Chunk, ...]] = {}
    for i, (k, s) in enumerate(shapes.items()):
        step = -(-s[0] // world)
        written[f"m.{k}"] = (
            tuple(
                Chunk(
                    (r * step, *(0,) * (len(s) - 1)),
                    (step, *s[1:]),
                    naming.shard_name(r),
                    offset=2**33 * i + r,  # past 2**32: msgpack's uint64
                    length=300 + 70000 * i,
                    data_offset=128 + r,
                    nbytes=step * 4 * (s[1:] or (1,))[0],
                    crc32=2**32 - 1 - r,
                    hcrc32=r * 255,
                    zstd=int(r == 1),
                )
                for r in range(world)
            )
            if len(s) > 1
            else (Chunk((0,), s, naming.shard_name(0), 4, 16, 4, 16, 1, 2),)
        )
    for r in range(world):
        written[f"rng_t{r}"] = (Chunk((0,), (5,), naming.shard_name(r), 7, 5, 7, 5, r, r),)
    manifest = m.assemble(
        Tree(shared, per_rank), Written(written), {}, created=1.5, metadata={"step": 3}
    )
    assert set(manifest.split) == {("m", "w"), ("m", "big")}
    files = {naming.shard_name(r): {"size": 10**6 + r} for r in range(world)}
    manifest = dataclasses.replace(manifest, files={**files, naming.DCP_METADATA: {"size": 9}})
    for rank in range(world):
        rows = parts.rows([e.chunks[rank] for e in manifest.entries if e.path in manifest.split])
        assert [len(row) for row in rows] == [7 + (rank == 1)] * 2
        head = {"format": naming.FORMAT_NAME, "version": manifest.version, "part": rank}
        name = naming.shard_name(rank)  # rank 0's file holds an index chunk: listed there
        head |= {"created": 1.5, "files": {name: files[name]} if rank else {}}
        body = b"".join(
            (m._map_header(len(head) + 2), m._elements(m._flat(head)), m._pack("entries"))
        )
        body += m._entries(manifest.ranks[rank]) + m._pack("chunks") + m._pack(rows)
        assert manifest.encode_part(rank) == body + crc32(body).to_bytes(4, "little")
