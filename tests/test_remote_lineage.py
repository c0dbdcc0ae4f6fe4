"""Uploads and the lineage rule: an upload replaces a remote checkpoint of its step only
where that checkpoint is of the uploading run's lineage; another run's stays, the skip is
reported once, and the local checkpoint stays (it has no remote copy).
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src import cli
from functional_ckpt._src.remote.fetch import download
from functional_ckpt._src.remote.store import Store
from functional_ckpt._src.root.run import read_run
from functional_ckpt.errors import CheckpointError, CheckpointWarning

pytestmark = pytest.mark.usefixtures("fast_retries")


def _state(step: int, bias: float = 0.0) -> dict[str, object]:
    return {"w": torch.full((3,), step + bias), "step": step}


def _run(
    root: Path, url: str, steps: list[int], bias: float = 0.0, **kw: Any
) -> list[warnings.WarningMessage]:
    """A manager on ``root`` resumes what it finds, saves ``steps``, waits for the uploads."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fc.CheckpointManager(root, tiers=(fc.manager.Remote(url),), **kw) as mgr:
            mgr.restore_latest(like=_state(0))
            for s in steps:
                mgr.maybe_save(_state(s, bias), step=s)
                assert mgr.remote is not None
                mgr.remote.wait()
    return list(caught)


def _run_id(path: Path) -> str:
    run: dict[str, str] = fc.inspect(path).metadata["run"]
    return run["id"]


def test_an_old_machine_never_uploads_over_the_newer_runs_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Run A uploads 1-3; a fresh root elsewhere resumes A's 3 as run B and uploads 4
    and 5; A's machine comes back, resumes its own 3 and saves 4 and 6: B's remote 4
    stays B's (reported once), A's 6 is uploaded, A's local 4 is never pruned. A's
    rollback to its 4 is refused, moving nothing: the remote trunk would hold B's 4 for
    it; its delete(4) leaves B's 4. A rolls back to its 3: its 6 leaves the remote
    trunk, B's 4 and 5 (another lineage's to A) stay. B's relaunch, and a fresh root in
    front of the remote, resume B's 5: A's 6 is not of B's lineage, which left A at 3."""
    remote = tmp_path / "bucket" / "run"
    remote.parent.mkdir()
    url = remote.as_uri()
    _run(tmp_path / "machine1", url, [1, 2, 3])
    _run(tmp_path / "machine2", url, [4, 5])
    step4 = remote / "step_000000004"
    run_a, run_b = _run_id(tmp_path / "machine1" / "step_000000003"), _run_id(step4)
    assert run_a != run_b
    assert fc.inspect(step4).metadata["run"]["until"] == {run_a: 3}  # where B left A
    assert getattr(read_run(tmp_path / "machine2"), "until", None) == {run_a: 3}  # for good
    with caplog.at_level(logging.WARNING, logger="functional_ckpt"):
        caught = _run(tmp_path / "machine1", url, [4, 6], 100.0, keep=fc.keep_last(1))
    assert _run_id(step4) == run_b, "run B's remote step 4 was replaced"
    assert float(fc.restore(step4)["w"][0]) == 4.0
    assert float(fc.restore(remote / "step_000000006")["w"][0]) == 106.0
    mine = tmp_path / "machine1" / "step_000000004"  # its only copy: kept
    assert float(fc.restore(mine)["w"][0]) == 104.0
    said = [
        str(w.message)
        for w in caught
        if issubclass(w.category, CheckpointWarning) and "not uploaded" in str(w.message)
    ]
    assert len(said) == 1, said  # once, though each upload round meets it
    for part in ("step 4", f"{url}/step_000000004", run_a, run_b):
        assert part in said[0], (part, said[0])
    logged = [r for r in caplog.records if r.getMessage() == said[0]]
    assert logged and logged[0].levelno == logging.WARNING
    assert logged[0].name.startswith("functional_ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fc.CheckpointManager(tmp_path / "machine1", tiers=(fc.manager.Remote(url),)) as mgr:
            with pytest.raises(CheckpointError, match=rf"rollback\(4\): .*{run_b}.*nothing was"):
                mgr.rollback(4, like=_state(0), branch="old")  # the remote holds B's 4, not A's
            assert mgr.steps() == [4, 6] and (remote / "step_000000006" / "COMMITTED").exists()
            mgr.delete(4)  # A's own 4: B's remote 4 stays
            assert mgr.steps() == [6] and _run_id(step4) == run_b, "B's 4 was deleted"
        download(Store(url), 3, tmp_path / "machine1")  # A's 3 (pruned locally once uploaded)
        with fc.CheckpointManager(tmp_path / "machine1", tiers=(fc.manager.Remote(url),)) as mgr:
            mgr.rollback(3, like=_state(0), branch="old")
    assert (remote / "step_000000005" / "COMMITTED").exists(), "run B's 5 left the trunk"
    assert _run_id(step4) == run_b, "run B's remote step 4 left the trunk"
    assert (remote / "branches" / "old" / "step_000000006" / "COMMITTED").exists()
    for root in (tmp_path / "machine2", tmp_path / "fresh"):
        with fc.CheckpointManager(root, tiers=(fc.manager.Remote(url),)) as mgr:
            got = mgr.restore_latest(like=_state(0))
            assert (mgr.restored_step, float(got["w"][0])) == (5, 5.0), root


def test_a_new_run_on_a_used_prefix_keeps_its_step_the_old_run_holds_there(
    tmp_path: Path, mem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A remote copy counts as this checkpoint's only if it is this checkpoint (same
    marker), and another run's is not uploaded over: the new run's step 2 is neither
    taken for uploaded (and pruned) nor uploaded over the old run's, nor listed by `fckpt
    ls` as held by both. A fresh root in front of the remote, which holds both unrelated
    runs' checkpoints, guesses neither."""
    _run(tmp_path / "a", mem, [1, 2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fc.CheckpointManager(
            tmp_path / "b", keep=fc.keep_last(1), tiers=(fc.manager.Remote(mem),)
        ) as mgr:
            mgr.maybe_save(_state(20), step=2)
            assert mgr.remote is not None and mgr.remote.wait()
            mgr.maybe_save(_state(30), step=3)  # local retention keeps the unuploaded 2
            assert mgr.remote.wait()
    old = fc.restore(download(Store(mem), 2, tmp_path / "fresh"))
    assert float(old["w"][0]) == 2.0, "the old run's remote step 2 was replaced"
    assert float(fc.restore(tmp_path / "b" / "step_000000002")["w"][0]) == 20.0
    assert any("step 2 not uploaded" in str(w.message) for w in caught)
    assert cli.main(["ls", "--json", str(tmp_path / "b")]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out) if r.get("kind") == "tier"}
    assert (rows[2]["tier"], rows[3]["tier"]) == ("local", "both"), rows  # 2 was "both"
    assert rows[2]["note"] == "the remote holds another checkpoint of step 2", rows
    fresh = fc.CheckpointManager(tmp_path / "c", tiers=(fc.manager.Remote(mem),))
    with fresh, pytest.raises(CheckpointError, match=r"unrelated runs .* not guessed"):
        fresh.restore_latest(like=_state(0))


def test_a_copy_of_the_step_of_the_same_lineage_is_replaced(tmp_path: Path, mem: str) -> None:
    """The run's own older checkpoint of a step (its local one lost here) is uploaded
    over by the run's new checkpoint of that step; an ancestor run's saved after the run
    left it is not (it is not of this lineage)."""
    _run(tmp_path / "a", mem, [1, 2, 3, 4])
    shutil.rmtree(tmp_path / "a" / "step_000000004")
    with fc.CheckpointManager(tmp_path / "a", tiers=(fc.manager.Remote(mem),)) as mgr:
        mgr.maybe_save(_state(4, 100.0), step=4)  # the same run: no restore, a new step 4
    got = fc.restore(download(Store(mem), 4, tmp_path / "fresh4"))
    assert float(got["w"][0]) == 104.0
    # run C continues A's step 3 on a root of its own, unuploaded; A uploads 5 first
    shutil.copytree(tmp_path / "a" / "step_000000003", tmp_path / "c" / "step_000000003")
    with fc.CheckpointManager(tmp_path / "c") as mgr:
        mgr.restore_latest(like=_state(0))
        mgr.maybe_save(_state(5, 200.0), step=5)
    _run(tmp_path / "a", mem, [5])
    caught = _run(tmp_path / "c", mem, [])  # C left A at 3: A's 5 is not C's to replace
    got = fc.restore(download(Store(mem), 5, tmp_path / "fresh5"))
    assert float(got["w"][0]) == 5.0
    assert any("step 5 not uploaded" in str(w.message) for w in caught)
