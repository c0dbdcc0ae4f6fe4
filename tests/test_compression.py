"""``compression="zstd"``: tensors stored as DCP's own ``stream.zstd/1`` frames.

* Stock ``dcp.load`` reads such a checkpoint bit for bit (``.metadata`` names the
  transform and the stored length); ``fc.restore`` does too, with and without a
  template and in place.
* The checksums cover the stored bytes: ``fc.verify`` names a flipped byte without
  decompressing; ``fc.restore`` names it too.
* A frame that decodes to anything but its declared blob (garbage, truncated, or
  far larger) is a CheckpointError naming key and file, never zstd's own exception,
  and is never decompressed past the declared size.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.storage import committed
from functional_ckpt._src.storage import zstd as zstd_blobs
from functional_ckpt.errors import CheckpointError, CorruptCheckpoint
from tests.forge import flip, resign, restore_in

zstandard = pytest.importorskip("zstandard")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(256, 512, generator=g).to(torch.bfloat16),  # a large blob
        "m": torch.randn(300_000, generator=g),  # over a megabyte: the large-blob path
        "b": torch.arange(10),
        "z": torch.zeros(3, 0),
        "step": 7,
        "name": "run",
    }


def _same(got: Any, want: dict[str, Any]) -> None:
    assert sorted(got.keys()) == sorted(want)
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def _chunk(ck: Path, key: str) -> Any:
    from functional_ckpt._src.restore.read import vetted_view

    return vetted_view(ck).tensors[(key,)].chunks[0]


@pytest.mark.parametrize("mode", ["like", "none", "out"])
def test_round_trip_in_every_restore_mode(tmp_path: Path, mode: str) -> None:
    state = _state()
    fc.save(tmp_path / "ck", state, compression="zstd")
    assert all(_chunk(tmp_path / "ck", k).zstd == 1 for k in ("w", "m", "b"))
    _same(restore_in(mode, tmp_path / "ck", state), state)
    assert fc.verify(tmp_path / "ck").ok


def test_stock_dcp_load_reads_the_frames(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    state = _state()
    fc.save(tmp_path / "ck", state, compression="zstd:3")
    reader = dcp.FileSystemReader(tmp_path / "ck")
    md = reader.read_metadata()
    infos = [v for k, v in md.storage_data.items() if k.fqn == "w"]
    chunk = _chunk(tmp_path / "ck", "w")
    assert [(i.transform_descriptors, i.length) for i in infos] == [
        (["stream.zstd/1"], chunk.length)
    ]
    assert chunk.length < chunk.nbytes  # stored compressed
    into = {k: torch.full_like(v, 3) for k, v in state.items() if isinstance(v, torch.Tensor)}
    into["step"], into["name"] = 0, ""
    dcp.load(into, storage_reader=dcp.FileSystemReader(tmp_path / "ck"), no_dist=True)
    _same(into, state)


def test_model_and_optimizer_through_stock_dcp(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    fc.save(tmp_path / "ck", fc.capture(model=model, optimizer=opt), compression="zstd")
    fresh = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    fresh(torch.randn(3, 8)).sum().backward()
    fresh_opt.step()
    msd, osd = get_state_dict(fresh, fresh_opt)
    dcp.load({"model": msd, "optimizer": osd}, checkpoint_id=tmp_path / "ck", no_dist=True)
    for k, v in model.state_dict().items():
        assert torch.equal(msd[k], v), k
    want, got = get_state_dict(model, opt)[1]["state"], osd["state"]
    for k, v in want.items():
        for name, t in v.items():
            assert torch.equal(got[k][name], t), (k, name)


@pytest.mark.parametrize("key", ["w", "m", "b"])
def test_flipped_stored_byte_is_named_by_verify_and_restore(
    tmp_path: Path, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = tmp_path / "ck"
    fc.save(ck, _state(), compression="zstd")
    c = _chunk(ck, key)
    fd = os.open(ck / c.file, os.O_RDWR)
    try:
        at = c.offset + c.length // 2
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x5A]), at)
    finally:
        os.close(fd)

    def no_decompression(*_: Any) -> None:
        raise AssertionError("fc.verify decompressed a frame")

    with monkeypatch.context() as m:
        m.setattr(zstd_blobs, "read_blob", no_decompression)
        report = fc.verify(ck)
    assert not report.ok
    assert [(p.where, p.file) for p in report.problems] == [(f"'{key}'", c.file)], report
    assert "stored (compressed)" in str(report)
    with pytest.raises(CorruptCheckpoint, match=rf"'{key}' in {c.file}: stored \(compressed\)"):
        fc.restore(ck)


def _replace_frame(ck: Path, key: str, frame: bytes) -> None:
    """Put ``frame`` where ``key``'s frame is and record it (length, stored CRC32) in a
    re-signed manifest: only the frame's content is wrong."""
    c = _chunk(ck, key)
    assert len(frame) <= c.length
    fd = os.open(ck / c.file, os.O_RDWR)
    try:
        os.pwrite(fd, frame, c.offset)
    finally:
        os.close(fd)

    def edit(manifest: dict[str, Any]) -> None:
        for e in manifest["entries"]:
            if e.get("path") == [key]:
                e["chunks"][0]["length"] = len(frame)
                e["chunks"][0]["hcrc32"] = zlib.crc32(frame)

    resign(ck, edit)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda n: os.urandom(n), id="garbage"),
        pytest.param(
            lambda n: zstandard.ZstdCompressor().compress(os.urandom(4 * n))[: n // 2],
            id="truncated",
        ),
        pytest.param(lambda n: zstandard.ZstdCompressor().compress(bytes(256 << 20)), id="bomb"),
        pytest.param(lambda n: zstandard.ZstdCompressor().compress(bytes(1000)), id="short"),
    ],
)
def test_a_frame_that_decodes_wrongly_names_key_and_file(tmp_path: Path, make: Any) -> None:
    ck = tmp_path / "ck"
    state = _state()
    fc.save(ck, state, compression="zstd")
    c = _chunk(ck, "m")
    _replace_frame(ck, "m", make(c.length))
    with pytest.raises(CheckpointError, match=rf"'m' in {c.file}: the zstd frame") as err:
        fc.restore(ck, state)
    assert not isinstance(err.value, zstandard.ZstdError)


def test_incremental_shares_unchanged_frames(tmp_path: Path) -> None:
    state = _state()
    fc.save(tmp_path / "a", state, compression="zstd")
    state["b"] = state["b"] + 1
    fc.save(tmp_path / "b", state, base=tmp_path / "a", compression="zstd")
    before, after = _chunk(tmp_path / "a", "w"), _chunk(tmp_path / "b", "w")
    assert after.zstd and after.file != _chunk(tmp_path / "b", "b").file
    assert (before.offset, before.length, before.hcrc32) == (
        after.offset,
        after.length,
        after.hcrc32,
    )
    _same(fc.restore(tmp_path / "b", state), state)
    assert fc.verify(tmp_path / "b").ok
    plain = tmp_path / "c"  # a plain save on a compressed base keeps the shared frames
    state["b"] = state["b"] + 1
    fc.save(plain, state, base=tmp_path / "b")
    assert _chunk(plain, "w").zstd and not _chunk(plain, "b").zstd
    _same(fc.restore(plain, state), state)


@pytest.mark.parametrize("staging", ["copy", "write", "none"])
def test_async_save_compresses(tmp_path: Path, staging: Any) -> None:
    state = _state()
    fc.save_async(tmp_path / "ck", state, staging=staging, compression="zstd").result()
    assert _chunk(tmp_path / "ck", "w").zstd
    _same(fc.restore(tmp_path / "ck", state), state)


@pytest.mark.parametrize("bad", ["gzip", "zstd:0", "zstd:x", 3, "zstd:20"])
def test_bad_compression_argument_is_named(tmp_path: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match=r"fc.save\(compression="):
        fc.save(tmp_path / "ck", _state(), compression=bad)
    assert not (tmp_path / "ck").exists()


def test_flip_helper_still_damages_plain_blobs(tmp_path: Path) -> None:
    fc.save(tmp_path / "ck", _state())
    flip(tmp_path / "ck", "w")
    assert not fc.verify(tmp_path / "ck").ok


def test_manager_and_remote_tier_store_frames(tmp_path: Path, mem: str) -> None:
    state = _state()
    disk = fc.manager.Disk(compression="zstd")
    with fc.CheckpointManager(tmp_path / "a", tiers=(disk,), async_save=True) as mgr:
        mgr.maybe_save(state, step=1)
    assert _chunk(tmp_path / "a" / "step_000000001", "w").zstd
    remote = fc.manager.Remote(mem)
    with fc.CheckpointManager(tmp_path / "b", tiers=(remote, disk)) as mgr:
        mgr.maybe_save(state, step=1)
        assert mgr.remote is not None and mgr.remote.wait()
    assert _chunk(tmp_path / "b" / "step_000000001", "w").zstd
    with fc.CheckpointManager(tmp_path / "c", tiers=(remote,)) as mgr:  # from the remote copy
        got = mgr.restore_latest(like=state)
        assert got is not None and mgr.restored_step == 1
        _same(got, state)
    with pytest.raises(ValueError, match=r"Disk\(compression='lz4'\)"):
        fc.manager.Disk(compression="lz4")


def test_dcp_plugin_writes_and_reads_frames(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from functional_ckpt.integrations.dcp import Reader, Writer

    state = _state()
    sd = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    dcp.save(sd, storage_writer=Writer(tmp_path / "ck", compression="zstd"), no_dist=True)
    assert _chunk(tmp_path / "ck", "w").zstd
    for reader in (Reader(tmp_path / "ck"), dcp.FileSystemReader(tmp_path / "ck")):
        into = {k: torch.zeros_like(v) for k, v in sd.items()}
        dcp.load(into, storage_reader=reader, no_dist=True)
        _same(into, sd)
    with pytest.raises(ValueError, match=r"Writer\(compression='zstd:99'\)"):
        Writer(tmp_path / "x", compression="zstd:99")


class _Evil:
    def __reduce__(self) -> Any:
        return (os.mkdir, (os.environ["FC_EVIL_DIR"],))


def _forge_value(ck: Path, key: str, data: bytes) -> None:
    """Point ``key``'s DCP byte entry at ``data`` appended to its file, re-signed."""
    manifest = committed.read_manifest(ck)
    (entry,) = [b for b in manifest["dcp_bytes"] if b["fqn"] == key]
    with open(ck / entry["file"], "ab") as f:  # the forged value after the file's end
        at = f.tell()
        f.write(data)

    def edit(m: dict[str, Any]) -> None:
        (b,) = [b for b in m["dcp_bytes"] if b["fqn"] == key]
        b.update(offset=at, length=len(data), crc32=zlib.crc32(data))
        m["files"][entry["file"]]["size"] = at + len(data)

    resign(ck, edit)


def _pickled(value: Any) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def test_the_dcp_reader_never_hands_stored_pickle_to_dcp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCP's planner runs ``torch.load(weights_only=False)`` on every value it is handed:
    ``Reader`` hands it bytes made from the manifest's value, never the stored ones."""
    import torch.distributed.checkpoint as dcp

    from functional_ckpt.integrations.dcp import Reader

    ck = tmp_path / "ck"
    fc.save(ck, {"w": torch.ones(2), "note": "plain"})
    marker = tmp_path / "ran"
    monkeypatch.setenv("FC_EVIL_DIR", str(marker))
    _forge_value(ck, "note", _pickled(_Evil()))
    into: dict[str, Any] = {"w": torch.zeros(2), "note": ""}
    dcp.load(into, storage_reader=Reader(ck), no_dist=True)
    assert into["note"] == "plain"
    assert not marker.exists()
    fc.save(tmp_path / "ok", {"w": torch.ones(2), "note": "plain"})
    dcp.load(into, storage_reader=Reader(tmp_path / "ok"), no_dist=True)
    assert into["note"] == "plain"


def test_the_dcp_reader_serves_the_manifests_value_not_the_stored_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stored value that unpickles to something else (a plain value the restricted
    loader accepts) is never read: the authenticated manifest decides, and no stored
    byte reaches any unpickler."""
    import torch.distributed.checkpoint as dcp

    from functional_ckpt.integrations.dcp import Reader

    ck = tmp_path / "ck"
    fc.save(ck, {"w": torch.ones(2), "note": "plain", "opt": {"lr": 0.5, "betas": (0.9, 0.99)}})
    _forge_value(ck, "note", _pickled("forged"))
    _forge_value(ck, "opt.lr", _pickled(9.0))
    loaded: list[bytes] = []
    real = torch.load

    def spy(f: Any, *args: Any, **kwargs: Any) -> Any:
        loaded.append(f.getvalue() if hasattr(f, "getvalue") else b"")
        return real(f, *args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    into: dict[str, Any] = {"w": torch.zeros(2), "note": "", "opt": {"lr": 0.0, "betas": ()}}
    dcp.load(into, storage_reader=Reader(ck), no_dist=True)
    assert into["note"] == "plain" and into["opt"] == {"lr": 0.5, "betas": (0.9, 0.99)}
    assert _pickled("forged") not in loaded and _pickled(9.0) not in loaded
    assert into["note"] == "plain"


def test_two_ranks_compress_their_own_files(tmp_path: Path) -> None:
    """A 2-rank gloo save (a sharded DTensor, per-rank values): each rank's file holds
    its frames; every rank restores its own view, stock ``dcp.load`` the whole."""
    import torch.distributed.checkpoint as dcp

    from functional_ckpt._src.restore.read import vetted_view
    from tests.test_dist_ranks import run

    assert run(tmp_path, "zstd") == ["ok", "ok"]
    ck = tmp_path / "a"
    assert fc.verify(ck).ok
    chunks = vetted_view(ck).tensors[("w",)].chunks
    assert sorted(c.file for c in chunks) == ["__0_0.distcp", "__1_0.distcp"]
    assert all(c.zstd for c in chunks)
    into = {"w": torch.zeros(6, 4)}
    dcp.load(into, storage_reader=dcp.FileSystemReader(ck), no_dist=True)
    assert torch.equal(into["w"], torch.arange(24, dtype=torch.float32).reshape(6, 4))


def test_a_stock_dcp_checkpoint_with_transforms_is_refused_clearly(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._extension import ZStandard

    sd = {"w": torch.randn(10, 10), "step": 3}
    writer = dcp.FileSystemWriter(tmp_path / "ck", _extensions=[ZStandard()])
    dcp.save(sd, storage_writer=writer, no_dist=True)
    like = {"w": torch.zeros(10, 10), "step": 0}
    with pytest.raises(CheckpointError, match=r"__0_0.distcp: stored with DCP's transforms"):
        fc.restore(tmp_path / "ck", like=like)


def test_part_rows_carry_the_frame_flag_only_where_set() -> None:
    from functional_ckpt._src.format import parts
    from functional_ckpt._src.format.manifest import Chunk

    plain = Chunk((0,), (2,), "__1_0.distcp", 0, 9, 1, 8, 3, 4)
    packed = plain._replace(zstd=1)
    assert parts.rows([plain, packed]) == [
        ["__1_0.distcp", 0, 9, 1, 8, 3, 4],
        ["__1_0.distcp", 0, 9, 1, 8, 3, 4, 1],
    ]
    box = ((0,), (2,))
    assert parts.row_plain(parts.rows([packed])[0], box) == {**packed.to_plain()}
    assert parts.row_plain(parts.rows([plain])[0], box) == plain.to_plain()


@pytest.mark.parametrize(
    "change", [{"zstd": 2}, {"zstd": -1}, {"data_offset": 1 << 20}], ids=["two", "neg", "head"]
)
def test_an_invalid_frame_record_is_named(tmp_path: Path, change: dict[str, int]) -> None:
    ck = tmp_path / "ck"
    fc.save(ck, _state(), compression="zstd")

    def edit(manifest: dict[str, Any]) -> None:
        for e in manifest["entries"]:
            if e.get("path") == ["m"]:
                c = e["chunks"][0]
                c.update(
                    {k: c["offset"] + v if k == "data_offset" else v for k, v in change.items()}
                )

    resign(ck, edit)
    with pytest.raises(CheckpointError, match=r"'m'|invalid transform"):
        fc.restore(ck)
    assert not fc.verify(ck).ok


def test_a_value_listed_for_dcp_but_not_in_the_manifest_is_refused_by_key(
    tmp_path: Path,
) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from functional_ckpt.integrations.dcp import Reader

    ck = tmp_path / "ck"
    fc.save(ck, {"w": torch.ones(2), "note": "plain"})

    def edit(m: dict[str, Any]) -> None:
        (b,) = [b for b in m["dcp_bytes"] if b["fqn"] == "note"]
        m["dcp_bytes"].append({**b, "fqn": "ghost", "path": ["ghost"]})

    resign(ck, edit)
    with pytest.raises(CheckpointException) as err:
        dcp.load({"ghost": ""}, storage_reader=Reader(ck), no_dist=True)
    assert "lists the value 'ghost', which the manifest does not hold" in str(err.value.failures)


@pytest.mark.parametrize("bad", ["zstd:", "zstd:\uff13", "zstd:\u0663", "zstd:03x", "zstd: 3"])
def test_a_level_that_is_not_ascii_digits_is_refused_everywhere(tmp_path: Path, bad: str) -> None:
    """``"zstd:N"`` is level N in ASCII digits: an empty level or another script's digit
    is a mistake, refused by every entry point naming the argument."""
    from functional_ckpt.integrations.dcp import Writer

    state = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match=r"save\(compression="):
        fc.save(tmp_path / "a", state, compression=bad)
    with pytest.raises(ValueError, match=r"compression="):
        fc.save_async(tmp_path / "b", state, compression=bad).result()
    with pytest.raises(ValueError, match=r"Disk\(compression="):
        fc.manager.Disk(compression=bad)
    with pytest.raises(ValueError, match=r"Writer\(compression="):
        Writer(tmp_path / "c", compression=bad)
    assert not any(tmp_path.iterdir())
