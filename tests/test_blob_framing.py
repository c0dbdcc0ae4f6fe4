"""Each tensor's blob holds only what ``torch.load`` reads, and stock readers load it.

A blob is a zip archive that stock DCP's reader hands to ``torch.load``. fc frames
it with the pickle, the version and the data record, about a third of the framing
``torch.save`` writes around a small tensor. Tensors of 2 GiB or more keep
``torch.save``'s framing (zip64): the same path is forced here on small tensors,
and checkpoints written that way (as earlier versions wrote every blob) still read.
"""

from __future__ import annotations

import io
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import functional_ckpt as fc
from functional_ckpt._src.format import blobs
from functional_ckpt._src.format.checksum import crc32
from functional_ckpt.errors import CheckpointError, CorruptCheckpoint

SPECS = [
    (torch.float32, (256,)),
    (torch.float64, (3, 5)),
    (torch.bfloat16, (2, 3, 4)),
    (torch.float16, (1,)),
    (torch.int64, ()),
    (torch.bool, (9,)),
    (torch.uint8, (17,)),
    (torch.complex64, (2, 2)),
    (torch.float8_e4m3fn, (7,)),
    (torch.float32, (0, 4)),
]


def _tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(len(shape) + 31 * sum(shape))
    base = torch.randn(shape, generator=gen, dtype=torch.float64) * 50
    if dtype.is_complex:
        return torch.complex(base, -base).to(dtype)
    return base.to(dtype)


def _blob(tpl: blobs.BlobTemplate, t: torch.Tensor) -> bytes:
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    assert len(raw) == tpl.nbytes
    return tpl.head + raw + tpl.patch(crc32(raw))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    )


@pytest.mark.parametrize(("dtype", "shape"), SPECS)
def test_a_compact_blob_is_a_valid_zip_that_torch_load_reads(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    t = _tensor(dtype, shape)
    blob = _blob(blobs.blob_template(dtype, shape), t)
    with zipfile.ZipFile(io.BytesIO(blob)) as z:
        assert z.testzip() is None  # every CRC32 field agrees with its record
        names = z.namelist()
    expected = ["archive/data.pkl", "archive/version", "archive/data/0"]
    if sys.byteorder != "little":
        expected.insert(2, "archive/byteorder")
    assert names == expected
    assert _same(torch.load(io.BytesIO(blob), weights_only=True), t)


def test_the_compact_framing_is_a_third_of_torch_saves() -> None:
    t = _tensor(torch.float32, (256,))
    tpl = blobs.blob_template(t.dtype, tuple(t.shape))
    framing = len(tpl.head) + len(tpl.tail)
    out = io.BytesIO()
    torch.save(t, out)
    theirs = len(out.getvalue()) - t.nbytes
    assert framing < 600 < 1400 < theirs


def test_the_torch_save_framing_path_builds_loadable_blobs() -> None:
    """The framing a tensor of 2 GiB or more gets, built for small specs."""
    for dtype, shape in SPECS:
        t = _tensor(dtype, shape)
        sink, nbytes = blobs._saved_empty(dtype, shape)
        tpl = blobs._torch_save_template(sink, nbytes)
        blob = _blob(tpl, t)
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            assert z.testzip() is None
            assert ".data/serialization_id" in " ".join(z.namelist())
        assert _same(torch.load(io.BytesIO(blob), weights_only=True), t)


def _state() -> dict[str, torch.Tensor]:
    return {
        f"{dtype}-{i}".replace("torch.", ""): _tensor(dtype, shape)
        for i, (dtype, shape) in enumerate(SPECS)
    }


def _check_readers(path: Path, state: dict[str, torch.Tensor]) -> None:
    report = fc.verify(path)
    assert report.ok, str(report)
    got = fc.restore(path, like=state)
    for k, v in state.items():
        assert _same(got[k], v), k
    target = {k: torch.empty_like(v) for k, v in state.items()}
    dcp.load(target, checkpoint_id=str(path), no_dist=True)
    for k, v in state.items():
        assert _same(target[k], v), k


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_checkpoints_in_either_framing_read_with_fc_and_stock_dcp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = _state()
    fc.save(tmp_path / "compact", state)
    _check_readers(tmp_path / "compact", state)
    with monkeypatch.context() as m:  # every blob framed as torch.save frames it
        m.setattr(blobs, "_COMPACT_LIMIT", 0)
        blobs.blob_template.cache_clear()
        fc.save(tmp_path / "torch-framed", state)
    blobs.blob_template.cache_clear()  # the compact templates again
    assert (tmp_path / "torch-framed" / "__0_0.distcp").stat().st_size > (
        tmp_path / "compact" / "__0_0.distcp"
    ).stat().st_size + 600 * (len(state) - 1)
    _check_readers(tmp_path / "torch-framed", state)


def test_a_damaged_byte_in_the_compact_framing_is_found(tmp_path: Path) -> None:
    state = _state()
    fc.save(tmp_path / "c", state)
    shard = tmp_path / "c" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    tpl = blobs.blob_template(torch.float64, (3, 5))
    start = data.find(tpl.head)  # the second tensor's blob, among others
    assert start > 0
    at = start + tpl.head.index(b"_rebuild_tensor_v2")  # inside its pickle
    data[at] ^= 0x20
    shard.write_bytes(bytes(data))
    report = fc.verify(tmp_path / "c")
    assert not report.ok
    assert "__0_0.distcp" in str(report) and "float64-1" in str(report), str(report)
    with pytest.raises(CorruptCheckpoint, match="float64-1"):
        fc.restore(tmp_path / "c", like=state)


def test_a_large_specs_template_is_built_without_a_buffer_of_its_size() -> None:
    """The records are read from what ``torch.save`` wrote, the data gap never filled."""
    import tracemalloc

    shape = (3, 1 << 26)  # 192 MiB of uint8, a spec no other test builds
    blobs.blob_template.cache_clear()
    tracemalloc.start()
    try:
        tpl = blobs.blob_template(torch.uint8, shape)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak
    assert tpl.nbytes == 3 << 26 and len(tpl.head) + len(tpl.tail) < 600


def test_a_torch_save_zip_of_another_layout_is_a_clear_error() -> None:
    """Records are found by name whatever their prefix; missing ones are named."""
    for names, ok in (
        (("other/data.pkl", "other/version", "other/data/0"), True),
        (("other/data.pkl", "other/.data/version", "other/data/0"), True),
        (("other/data.pkl", "other/data/0"), False),
    ):
        sink = blobs._Sparse()
        with zipfile.ZipFile(sink, "w") as z:  # type: ignore[arg-type]
            for n in names:
                z.writestr(n, b"3\n")
        if ok:
            tpl = blobs._compact_template(sink, 4)
            assert b"archive/data.pkl" in tpl.head
        else:
            with pytest.raises(CheckpointError, match=r"other/data\.pkl"):
                blobs._compact_template(sink, 4)
