"""Blobs read together in one run are still checked one by one.

Small tensors lying together in a shard are read with one call and copied to
their tensors once checked; damage in the middle of such a run must name exactly
the damaged keys, and everything else must come back bit-identical.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.restore.read import vetted_view
from functional_ckpt._src.storage.shards import read_tensors
from functional_ckpt.errors import CheckpointError, CorruptCheckpoint
from tests.forge import flip, restore_in


def _state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    state = {f"t{i:02d}": torch.randn(64 + i, generator=gen) for i in range(40)}
    state["b16"] = torch.randn(33, generator=gen).to(torch.bfloat16)
    state["big"] = torch.randn(1 << 19, generator=gen)  # 2 MiB: read on its own
    state["empty"] = torch.zeros(0, 3)
    return state


def test_a_run_of_small_blobs_comes_back_bit_identical(tmp_path: Path) -> None:
    state = _state()
    fc.save(tmp_path / "ck", state)
    out = {k: torch.full_like(v, 3) for k, v in state.items()}
    for got in (
        fc.restore(tmp_path / "ck"),
        fc.restore(tmp_path / "ck", {k: v.to("meta") for k, v in state.items()}),
        fc.restore(tmp_path / "ck", out=out),
    ):
        for k, v in state.items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    fresh = fc.restore(tmp_path / "ck")
    assert len({fresh[k].untyped_storage().data_ptr() for k in state if state[k].numel()}) == 42


@pytest.mark.parametrize("mode", ["like", "none", "out"])
def test_damage_in_the_middle_of_a_run_names_only_the_damaged_keys(
    tmp_path: Path, mode: str
) -> None:
    state = _state()
    ck = tmp_path / "ck"
    fc.save(ck, state)
    flip(ck, "t17")
    flip(ck, "t18", header=True)
    flip(ck, "big")
    like = {k: v.to("meta") for k, v in state.items()}
    with pytest.raises(CorruptCheckpoint) as info:
        restore_in(mode, ck, like)
    msg = str(info.value)
    assert "'t17'" in msg and "checksum mismatch" in msg
    assert "'t18'" in msg and "blob headers fail their checksum" in msg
    assert "'big'" in msg
    for k in state:
        if k not in ("t17", "t18", "big"):
            assert f"'{k}'" not in msg, k


def test_a_landing_place_of_the_wrong_size_is_refused(tmp_path: Path) -> None:
    fc.save(tmp_path / "ck", {"a": torch.arange(10)})
    chunk = vetted_view(tmp_path / "ck").tensors[("a",)].chunks[0]
    fd = os.open(tmp_path / "ck" / chunk.file, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointError, match="landing place"):
            read_tensors(fd, [(chunk, torch.empty(9, dtype=torch.int64))])
        with pytest.raises(CheckpointError, match="contiguous"):
            read_tensors(fd, [(chunk, torch.empty(20, dtype=torch.int64)[::2])])
        dest = torch.empty(10, dtype=torch.int64)
        assert read_tensors(fd, [(chunk, dest)]) == [None]
        assert torch.equal(dest, torch.arange(10))
    finally:
        os.close(fd)
