"""A ``step_N`` folder whose checkpoint records another step (renamed or copied in by
hand) is damage to every reader of a root or a remote: reported with both steps, never
the latest, never kept in place of a good one, never uploaded, no obstacle to a save."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src import cli
from functional_ckpt._src.format.naming import step_name


def _state(step: int) -> dict[str, Any]:
    return {"w": torch.full((3,), float(step)), "step": step}


def _renamed(root: Path, *tiers: Any) -> Path:
    """Steps 1-3 saved, then ``step_3`` renamed by hand to ``step_7``."""
    with fc.CheckpointManager(root, tiers=tiers) as mgr:
        for step in (1, 2, 3):
            mgr.maybe_save(_state(step), step=step)
        if tiers:
            mgr.remote.wait()
    os.rename(root / step_name(3), root / step_name(7))
    return root


def _resumed(root: Path) -> int | None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fc.CheckpointManager(root) as mgr:
            mgr.restore_latest(like=_state(0))
            return mgr.restored_step


def test_verify_reports_a_renamed_step_with_both_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _renamed(tmp_path / "ckpt")
    report = fc.verify(root / step_name(7))
    assert not report.ok and "named for step 7" in str(report) and "records step 3" in str(report)
    assert cli.main(["verify", str(root)]) == 1  # was "3 checkpoints intact"
    out = capsys.readouterr().out
    assert f"DAMAGED  {root / step_name(7)}" in out and "1 of 3 checkpoints damaged" in out
    assert "records step 3" in out


def test_ls_never_calls_a_renamed_step_latest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = _renamed(tmp_path / "ckpt")
    assert cli.main(["ls", str(root), "--json", "--keep-last", "1"]) == 1
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out) if "name" in r}
    renamed = rows[step_name(7)]
    assert renamed["status"] == "damaged" and renamed["kept_by"] == []  # was "ok", "latest"
    assert "named for step 7" in renamed["detail"] and "records step 3" in renamed["detail"]
    assert "latest" in rows[step_name(2)]["kept_by"]


def test_prune_keeps_the_newest_step_a_resume_takes(tmp_path: Path) -> None:
    root = _renamed(tmp_path / "ckpt")
    assert cli.main(["prune", str(root), "--keep-last", "1", "--yes"]) == 0
    assert (root / step_name(2)).is_dir()  # was deleted, step_7 kept in its place
    assert not (root / step_name(1)).exists()
    assert _resumed(root) == 2


def test_a_save_is_not_refused_for_a_renamed_newer_step(tmp_path: Path) -> None:
    root = _renamed(tmp_path / "ckpt")
    with fc.CheckpointManager(root) as mgr:  # was: "step 7 is newer, and a resume would pick it"
        mgr.maybe_save(_state(4), step=4)
    assert _resumed(root) == 4


def test_a_renamed_step_is_never_uploaded(tmp_path: Path) -> None:
    root, remote = tmp_path / "ckpt", tmp_path / "bucket" / "run"
    remote.parent.mkdir()
    _renamed(root)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fc.CheckpointManager(root, tiers=(fc.manager.Remote(remote.as_uri()),)) as mgr:
            mgr.remote.wait()
    assert (remote / step_name(2) / "COMMITTED").is_file()
    assert not (remote / step_name(7)).exists()  # was uploaded as a committed step 7


def test_ls_and_verify_of_a_url_and_of_its_root_report_a_renamed_remote_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    remote = tmp_path / "bucket" / "run"
    remote.parent.mkdir()
    _renamed(tmp_path / "ckpt", fc.manager.Remote(remote.as_uri()))
    os.rename(remote / step_name(3), remote / step_name(7))
    url = remote.as_uri()
    assert cli.main(["ls", str(tmp_path / "ckpt"), "--json"]) == 1  # its local 7 is damaged
    tiers = {r["step"]: r for r in json.loads(capsys.readouterr().out) if r.get("kind") == "tier"}
    assert tiers[2]["tier"] == "both" and tiers[7]["tier"] == "local", tiers  # 7 was "both"
    assert "named for step 7, but the checkpoint records step 3" in tiers[7]["note"], tiers
    assert cli.main(["ls", url, "--json"]) == 1  # was 0, every step "ok"
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows[7]["status"] == "damaged" and "records step 3" in rows[7]["note"]
    assert rows[2]["status"] == "ok"
    assert cli.main(["verify", url]) == 1  # was "3 checkpoints intact"
    out = capsys.readouterr().out
    assert f"DAMAGED  {url}/{step_name(7)}" in out and "records step 3" in out
    assert "1 of 3 checkpoints damaged" in out


def test_a_renamed_step_does_not_stop_the_memory_tier_s_promotion(tmp_path: Path) -> None:
    root, memory = _renamed(tmp_path / "ckpt"), tmp_path / "mem"
    tier = fc.manager.Memory(path=memory, save=fc.every_steps(1), async_save=False)
    with pytest.raises(KeyboardInterrupt), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fc.CheckpointManager(root, save=fc.policy.never(), tiers=(tier,)) as mgr:
            mgr.maybe_save(_state(4), step=4)
            raise KeyboardInterrupt  # a crash: the memory tier's newest is promoted
    assert (root / step_name(4) / "COMMITTED").is_file()  # was not: "step 7 is newer"
    assert _resumed(root) == 4
