"""``.metadata`` written opcode by opcode unpickles to what DCP's objects would be.

The derived file is no longer ``pickle.dumps`` of DCP's ``Metadata``; stock
``pickle.load`` (what ``FileSystemReader.read_metadata`` runs), the hardened
reader and ``fc.verify`` must each get exactly the fields the objects hold.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import functional_ckpt as fc
from functional_ckpt._src.format import dcp_metadata, dcp_pickle, unpickler
from functional_ckpt._src.format.dcp_values import ByteEntry
from functional_ckpt._src.format.manifest import Chunk, TensorEntry


def _entry(
    fqn: str, shape: tuple[int, ...], chunks: list[Chunk], dtype: str = "float32", **kw: Any
) -> TensorEntry:
    return TensorEntry(
        path=tuple(fqn.split(".")),
        fqn=fqn,
        dtype_name=dtype,
        shape=shape,
        requires_grad=False,
        chunks=tuple(chunks),
        **kw,
    )


def _sharded(fqn: str, rows: list[int], cols: int, files: list[str]) -> TensorEntry:
    chunks, at = [], 0
    for r, (n, f) in enumerate(zip(rows, files, strict=True)):
        chunks.append(Chunk((at, 0), (n, cols), f, 1000 * r + 7, n * cols * 4 + 300))
        at += n
    return _entry(fqn, (at, cols), chunks)


_BIG = 1 << 40  # offsets past 4 GiB: LONG1 integers
_LAYOUTS: dict[str, tuple[list[list[TensorEntry]], list[ByteEntry]]] = {
    "one rank": (
        [
            [
                _entry("w", (3, 4), [Chunk((0, 0), (3, 4), "__0_0.distcp", 0, 400)]),
                _entry("b", (4,), [Chunk((0,), (4,), "__0_0.distcp", 400, 300)], "bfloat16"),
                _entry("v", (4,), [Chunk((0,), (4,), "__0_0.distcp", 700, 300)], "bfloat16"),
            ]
        ],
        [],
    ),
    "two ranks sharded": (
        [
            [_sharded("layer.w", [2, 2], 8, ["__0_0.distcp", "__1_0.distcp"])],
            [_sharded("layer.m", [2, 2], 8, ["__0_0.distcp", "__1_0.distcp"])],
        ],
        [],
    ),
    "uneven shards, big offsets": (
        [
            [
                _sharded("u", [3, 3, 1, 0], 5, [f"__{r}_0.distcp" for r in range(4)]),
                _entry("far", (2,), [Chunk((0,), (2,), "__3_0.distcp", _BIG, 70000)]),
                _entry("neg", (1, 1, 1, 1, 1), [Chunk((0,) * 5, (1,) * 5, "é" * 200, 5, 9)]),
            ]
        ],
        [],
    ),
    "many ranks, offsets past 2 GiB": (  # memo indices past 255, LONG1 columns
        [
            [
                _sharded("m.w", [1] * 300, 3, [f"__{r}_0.distcp" for r in range(300)]),
                _entry(
                    "m.b",
                    (300,),
                    [
                        Chunk((r,), (1,), f"__{r}_0.distcp", (_BIG if r % 2 else 5) + r, 300 + r)
                        for r in range(300)
                    ],
                ),
            ]
        ],
        [],
    ),
    "scalars": (
        [
            [
                _entry("opt.state.0.step", (), [Chunk((), (), "__0_0.distcp", 0, 300)]),
                _entry("opt.state.1.step", (), [Chunk((), (), "__0_0.distcp", 300, 300)]),
                _entry("x", (0,), [Chunk((0,), (0,), "__0_0.distcp", 600, 300)], "int64"),
            ]
        ],
        [],
    ),
    "values and planner data": (
        [
            [
                _entry(
                    "model.w",
                    (2,),
                    [Chunk((0,), (2,), "__0_0.distcp", 0, 300)],
                    dcp_path=("model", "w"),
                )
            ]
        ],
        [
            ByteEntry("opt.param_groups.0.lr", ("opt", "param_groups", 0, "lr"), b"", "f", 300, 9),
            ByteEntry("step", ("step",), b"", "__0_0.distcp", 309, 300),
            ByteEntry("flag", ("flag", True), b"", "__0_0.distcp", 609, 30),
        ],
    ),
    "empty": ([], []),
}


@pytest.mark.parametrize("layout", sorted(_LAYOUTS))
def test_the_written_pickle_unpickles_to_the_objects_field_for_field(
    layout: str, tmp_path: Path
) -> None:
    groups, blobs = _LAYOUTS[layout]
    assert dcp_pickle.supported()  # the installed torch takes the opcode path
    dcp_metadata._derived.cache_clear()
    data = dcp_metadata.derive(groups, blobs)
    want = dcp_metadata.metadata_for(groups, blobs)
    old = pickle.dumps(want, protocol=dcp_metadata.PROTOCOL)
    assert data != old  # not the objects' pickle
    got, old_got = pickle.loads(data), pickle.loads(old)
    assert got == want
    assert list(got.state_dict_metadata) == list(want.state_dict_metadata)
    assert got.planner_data == want.planner_data
    assert [type(k) for p in got.planner_data.values() for k in p] == [
        type(k) for p in want.planner_data.values() for k in p
    ]
    for key, info in old_got.storage_data.items():  # what the objects' pickle gives
        (mine,) = [k for k in got.storage_data if k == key]
        assert vars(mine) == vars(key)
        assert vars(got.storage_data[key]) == vars(info)
    for name, smd in want.state_dict_metadata.items():
        assert type(got.state_dict_metadata[name]) is type(smd)
        if hasattr(smd, "properties"):
            assert got.state_dict_metadata[name].properties == smd.properties
            assert type(got.state_dict_metadata[name].size) is torch.Size
    # stock DCP's reader, from the file
    (tmp_path / ".metadata").write_bytes(data)
    assert (
        FileSystemReader(tmp_path).read_metadata().state_dict_metadata == want.state_dict_metadata
    )
    # the hardened reader: stand-ins, and DCP's objects made from them
    assert unpickler.scan_pickle(data, tmp_path) is None
    unpickler.load_standins(data, tmp_path)
    assert unpickler.load_foreign(data, tmp_path) == want


def test_a_saved_checkpoint_is_read_by_stock_dcp_and_verified(tmp_path: Path) -> None:
    state = {
        "w": torch.arange(12.0).reshape(3, 4),
        "step": 7,
        "opt": {"lr": 0.1, "betas": (0.9, 0.99)},
        "s": torch.tensor(3),
    }
    fc.save(tmp_path / "c", state)
    md = FileSystemReader(tmp_path / "c").read_metadata()
    assert md.state_dict_metadata["w"].size == torch.Size([3, 4])
    fc.verify(tmp_path / "c")
    back: dict[str, Any] = {"w": torch.zeros(3, 4), "s": torch.tensor(0)}
    import torch.distributed.checkpoint as dcp

    dcp.load(back, checkpoint_id=tmp_path / "c", no_dist=True)
    assert torch.equal(back["w"], state["w"]) and int(back["s"]) == 3


def test_a_torch_that_pickles_its_classes_otherwise_gets_its_own_pickle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    groups, blobs = _LAYOUTS["two ranks sharded"]
    monkeypatch.setattr(dcp_pickle, "supported", lambda: False)
    dcp_metadata._derived.cache_clear()
    data = dcp_metadata.derive(groups, blobs)
    want = dcp_metadata.metadata_for(groups, blobs)
    assert data == pickle.dumps(want, protocol=dcp_metadata.PROTOCOL)
    dcp_metadata._derived.cache_clear()


def test_a_values_bytes_are_a_pure_function_of_its_exact_encoding() -> None:
    """Equal values share one ``torch.save`` (a cache of a pure function, no module
    dict); values that print alike but differ in type never do."""
    import io

    from functional_ckpt._src import codec
    from functional_ckpt._src.format import dcp_values

    alike = [1, 1.0, True, (1,), [1], b"x", bytearray(b"x"), {1: "a"}, {"1": "a"}, -0.0, 0.0]
    saved = [dcp_values._saved(codec.encode(v)) for v in alike]
    assert len(set(saved)) == len(alike)
    for v, data in zip(alike, saved, strict=True):
        back = torch.load(io.BytesIO(data), weights_only=True)
        assert type(back) is type(v) and repr(back) == repr(v)
    before = dcp_values._saved.cache_info().hits
    encoded = codec.encode([1, 2.5, "a"])
    assert dcp_values._saved(encoded) == dcp_values._saved(codec.encode([1, 2.5, "a"]))
    assert dcp_values._saved.cache_info().hits == before + 1
