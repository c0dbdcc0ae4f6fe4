"""DCP's storage seam under torchrun (gloo, FSDP2): dcp.save/async_save/load through
functional_ckpt.integrations.dcp, round trips with stock DCP and fc both ways, crashes and
damage."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import functional_ckpt as fc
from functional_ckpt._src.format.kind import Kind, classify
from functional_ckpt.integrations.dcp import Reader, Writer
from tests import prefork
from tests.patience import HANG
from tests.test_dist import free_port, wait_all

JOB = Path(__file__).with_name("dcp_job.py")
REPO = JOB.parent.parent


def launch(world: int, *args: str) -> list[prefork.Popen]:
    port = str(free_port())
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    env.update(WORLD_SIZE=str(world), OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env["FCKPT_TIMEOUT"] = "60"
    return [
        prefork.Popen(
            [sys.executable, str(JOB), *args],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]


def run_ok(world: int, *args: str) -> None:
    for rc, out, err in wait_all(launch(world, *args), timeout=HANG):
        assert rc == 0, out + err[-4000:]


def test_fsdp2_saved_on_two_ranks_reads_back_on_three_every_way(tmp_path: Path) -> None:
    """dcp.save, async_save (thread; process with DefaultStager) through the Writer and
    fc.save on 2 ranks; stock dcp.load, dcp.load through the Reader and fc.restore on 3."""
    run_ok(2, "save", str(tmp_path))
    for name in ("sync", "thread", "process", "fc"):
        assert classify(tmp_path / name) is Kind.COMMITTED, name
        assert fc.verify(tmp_path / name).ok, name
    run_ok(3, "load", str(tmp_path))


def test_a_rank_killed_during_a_plugin_save_commits_nothing(tmp_path: Path) -> None:
    results = wait_all(launch(2, "kill", str(tmp_path)), timeout=HANG)
    assert results[1][0] == -9
    rc, out, err = results[0]
    assert rc == 3 and "RAISED" in out, out + err[-3000:]
    assert not (tmp_path / "ck").exists()
    assert not any(classify(p) is Kind.COMMITTED for p in tmp_path.iterdir())


def _state() -> dict[str, object]:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {"w": torch.randn(6, 4, generator=g), "b": torch.arange(5)},
        "optimizer": {"param_groups": [{"lr": 0.1, "params": ["w", "b"]}]},
        "step": 7,
    }


def _zeroed() -> dict[str, object]:
    return {
        "model": {"w": torch.zeros(6, 4), "b": torch.zeros(5, dtype=torch.int64)},
        "optimizer": {"param_groups": [{"lr": 0.0, "params": []}]},
        "step": 0,
    }


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def test_one_process_round_trip_and_overwrite(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    dcp.save(_state(), storage_writer=Writer(), checkpoint_id=ck, no_dist=True)
    assert fc.verify(ck).ok and classify(ck) is Kind.COMMITTED
    back = _zeroed()
    dcp.load(back, storage_reader=Reader(ck), no_dist=True)
    assert torch.equal(back["model"]["w"], _state()["model"]["w"])  # type: ignore[index]
    assert back["optimizer"] == _state()["optimizer"] and back["step"] == 7
    with pytest.raises(BaseException, match="already exists"):  # DCP's CheckpointException
        dcp.save({"step": 8}, storage_writer=Writer(ck), no_dist=True)
    assert fc.codec.to_python(fc.restore(ck))["step"] == 7
    dcp.save({"step": 8}, storage_writer=Writer(ck, overwrite=True), no_dist=True)
    assert fc.codec.to_python(fc.restore(ck))["step"] == 8


def test_the_reader_reports_a_flipped_byte_by_key_and_file(tmp_path: Path) -> None:
    from functional_ckpt._src.storage import committed

    ck = tmp_path / "ck"
    dcp.save(_state(), storage_writer=Writer(ck), no_dist=True)
    with committed.open_checkpoint(ck) as opened:
        entry = next(e for g in committed.parsed(opened).groups() for e in g if e.fqn == "model.w")
    chunk = entry.chunks[0]
    _flip(ck / chunk.file, chunk.data_offset + 5)
    with pytest.raises(BaseException, match=r"damaged tensor data for 'model\.w'.*__0_0\.distcp"):
        dcp.load(_zeroed(), storage_reader=Reader(ck), no_dist=True)
    assert not fc.verify(ck).ok


def test_the_reader_makes_a_values_bytes_only_when_dcp_asks_for_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A value's ``torch.save`` bytes are made from the manifest on the first request for
    them: a load of tensors alone makes none. (Saved in another process, and values no
    other test has, so that no bytes made before are at hand here.)"""
    ck = tmp_path / "ck"
    save = "import sys, torch, functional_ckpt as fc\n"
    save += "fc.save(sys.argv[1], {'w': torch.ones(3), 'lr': 0.271828, 'n': 918273, 'x': [0.5]})"
    done = prefork.run(
        [sys.executable, "-c", save, str(ck)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=HANG,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    made: list[object] = []
    real = torch.save

    def counted(obj: object, *args: Any, **kwargs: Any) -> None:
        made.append(obj)
        real(obj, *args, **kwargs)

    monkeypatch.setattr(torch, "save", counted)
    back: dict[str, Any] = {"w": torch.zeros(3)}
    dcp.load(back, storage_reader=Reader(ck), no_dist=True)
    assert torch.equal(back["w"], torch.ones(3)) and made == []
    back = {"w": torch.zeros(3), "lr": 0.0, "n": 0}
    dcp.load(back, storage_reader=Reader(ck), no_dist=True)
    assert back["lr"] == 0.271828 and back["n"] == 918273
    assert sorted(map(repr, made)) == ["0.271828", "918273"]


def test_a_value_that_needs_pickle_is_refused_by_key(tmp_path: Path) -> None:
    class Opaque:
        pass

    with pytest.raises(BaseException, match="opaque"):
        dcp.save({"opaque": Opaque()}, storage_writer=Writer(tmp_path / "ck"), no_dist=True)
    assert not (tmp_path / "ck").exists()


def test_no_path_is_refused() -> None:
    with pytest.raises(BaseException, match="no checkpoint path"):
        dcp.save({"step": 1}, storage_writer=Writer(), no_dist=True)


def test_a_manager_adopts_a_root_written_through_the_seam(tmp_path: Path) -> None:
    from functional_ckpt._src.format.naming import step_name

    for step in (1, 2):
        dest = tmp_path / step_name(step)
        dcp.save({**_state(), "step": step}, storage_writer=Writer(dest), no_dist=True)
    with fc.CheckpointManager(tmp_path) as mgr:
        assert mgr.steps() == [1, 2]
        latest = mgr.restore_latest(like=fc.codec.from_python(_zeroed()))
    assert latest is not None and fc.codec.to_python(latest)["step"] == 2
