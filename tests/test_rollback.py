"""Rollback: resume from an older kept step in the same root; newer steps move aside.

The crash test SIGKILLs a real process at every rename of the rollback and reopens
the root: nothing is lost, and the rollback either never started or completes.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.format.naming import step_name
from functional_ckpt._src.root import rollback
from tests import prefork
from tests.exact import assert_exact as _assert_exact
from tests.patience import HANG

REPO = Path(__file__).resolve().parent.parent
LOSSES = {1: 0.9, 2: 0.7, 3: 0.5, 4: 0.6, 5: 0.8}


def small_state(step: int) -> dict[str, Any]:
    return {"w": torch.full((4, 3), float(step)), "b": torch.arange(5) + step, "step": step}


def policy() -> fc.policy.SavePolicy:
    return fc.on_improve("loss") | fc.every_steps(1)


def make_run(root: Path) -> None:
    with fc.CheckpointManager(root, save=policy()) as m:
        for step, loss in LOSSES.items():
            assert m.maybe_save(small_state(step), step=step, metrics={"loss": loss})


def assert_exact(state: Any, expected: dict[str, Any]) -> None:
    _assert_exact(fc.codec.to_python(state), expected)


def names(path: Path) -> list[str]:
    return sorted(os.listdir(path)) if path.exists() else []


def test_rollback_keeps_newer_steps_on_a_branch_and_continues(tmp_path: Path) -> None:
    make_run(tmp_path)
    with fc.CheckpointManager(tmp_path, save=policy()) as mgr:
        assert mgr.restore_latest() is not None and mgr.restored_step == 5
        with pytest.raises(fc.CheckpointError, match=r"step 3: step 5 is newer.*rollback\(step\)"):
            mgr.maybe_save(small_state(3), step=3)
        state = mgr.rollback(3, small_state(0), branch="diverged")
        assert_exact(state, small_state(3))
        assert mgr.restored_step == 3 and mgr.steps() == [1, 2, 3]
        assert mgr.branches() == {"diverged": [4, 5]}
        # The run continues in the same root, with the policy state of step 3.
        assert mgr.maybe_save(small_state(4), step=4, metrics={"loss": 0.55})
        assert mgr.info(4).metadata["manager"]["save"]["state"][0] == {"best": 0.5}
        assert mgr.latest_step() == 4 and mgr.best_step("loss") == 3
        (event,) = mgr.info(4).metadata["rollbacks"]  # the run's history says so
        assert event["to_step"] == 3 and event["newer_steps"] == [4, 5]
        assert event["branch"] == "diverged" and "rollbacks" not in mgr.info(3).metadata
    assert names(tmp_path) == [".lock", "branches", "run.json", step_name(1), step_name(2),
                               step_name(3), step_name(4)]  # fmt: skip
    # The branch is a root of its own; readers of the trunk never see it as latest.
    assert fc.CheckpointManager(tmp_path, read_only=True).latest_step() == 4
    branch = fc.CheckpointManager(tmp_path / "branches" / "diverged", read_only=True)
    assert branch.steps() == [4, 5]
    assert_exact(branch.restore(5, small_state(0)), small_state(5))
    assert_exact(fc.restore(branch.path(4), small_state(0)), small_state(4))


def test_rollback_can_delete_the_newer_steps(tmp_path: Path) -> None:
    make_run(tmp_path)
    with fc.CheckpointManager(tmp_path, save=policy()) as mgr:
        assert_exact(mgr.rollback(2, newer="delete"), small_state(2))
        assert mgr.steps() == [1, 2] and mgr.branches() == {}
        assert mgr.rollback(2) is not None and mgr.steps() == [1, 2]  # nothing newer: no-op
    # no trash, no record (run.json is the root's run)
    assert names(tmp_path) == [".lock", "run.json", step_name(1), step_name(2)]


def test_rollback_default_branch_names_are_distinct(tmp_path: Path) -> None:
    make_run(tmp_path)
    with fc.CheckpointManager(tmp_path, save=policy()) as mgr:
        mgr.rollback(4)
        for step in (5, 6):
            mgr.maybe_save(small_state(step), step=step)
        mgr.rollback(4)
        got = mgr.branches()
    assert sorted(got.values()) == [[5], [5, 6]] and len(got) == 2
    for name in got:
        assert name.startswith(("step_5_before_rollback_to_4", "step_6_before_rollback_to_4"))


def test_rollback_refusals_move_nothing(tmp_path: Path) -> None:
    make_run(tmp_path)
    before = names(tmp_path)
    with fc.CheckpointManager(tmp_path, save=policy()) as mgr:
        with pytest.raises(fc.errors.CheckpointNotFound, match="step 9"):
            mgr.rollback(9)
        with pytest.raises(ValueError, match="newer must be 'branch' or 'delete'"):
            mgr.rollback(3, newer="keep")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="branch name"):
            mgr.rollback(3, branch="../escape")
        with pytest.raises(ValueError, match="needs newer='branch'"):
            mgr.rollback(3, newer="delete", branch="x")
        with pytest.raises(fc.errors.TemplateMismatch):
            mgr.rollback(3, {"other": torch.zeros(2)})
        mgr.rollback(4, branch="b")
        mgr.maybe_save(small_state(5), step=5)
        with pytest.raises(fc.errors.CheckpointExists, match="branch 'b' already exists"):
            mgr.rollback(4, branch="b")
        assert mgr.steps() == [1, 2, 3, 4, 5]
    assert names(tmp_path) == sorted([*before, "branches"])
    with pytest.raises(fc.CheckpointError, match="read-only"):
        fc.CheckpointManager(tmp_path, read_only=True).rollback(2)


def test_rollback_waits_for_an_async_save(tmp_path: Path) -> None:
    with fc.CheckpointManager(tmp_path, async_save=True) as mgr:
        for step in (1, 2, 3):
            mgr.maybe_save(small_state(step), step=step)
        mgr.rollback(1, branch="later")  # step 3 was still being written
        assert mgr.steps() == [1] and mgr.branches() == {"later": [2, 3]}


CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import functional_ckpt as fc

    root, kill_at = sys.argv[1], int(sys.argv[2])
    done = 0
    real_rename, real_replace, real_unlink = os.rename, os.replace, os.unlink

    def die_at(point):
        if point == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    def rename(src, dst, *args, **kwargs):
        global done
        die_at(done)  # killed before the (done+1)-th rename
        real_rename(src, dst, *args, **kwargs)
        done += 1

    def replace(src, dst, *args, **kwargs):  # a rename that may replace: counted the same
        global done
        die_at(done)
        real_replace(src, dst, *args, **kwargs)
        done += 1

    def unlink(path, *args, **kwargs):
        if str(path).endswith("/.rollback"):
            die_at(done)  # every move done, the record not yet removed
        real_unlink(path, *args, **kwargs)

    mgr = fc.CheckpointManager(root, save=fc.on_improve("loss") | fc.every_steps(1))
    os.rename, os.replace, os.unlink = rename, replace, unlink
    mgr.rollback(2, newer=sys.argv[3], branch="b" if sys.argv[3] == "branch" else None)
    print("finished", flush=True)
    """
)


@pytest.mark.parametrize("newer", ["branch", "delete"])
@pytest.mark.parametrize("kill_at", [0, 1, 2, 3, 4, 99])
def test_sigkill_during_rollback_then_reopen(tmp_path: Path, newer: str, kill_at: int) -> None:
    """Renames: 1 the record, then (branch) one per moved step, or (delete) one per step
    to trash; kill_at=k kills before the (k+1)-th rename, or before the record is
    removed once all are done; 99 never kills."""
    root = tmp_path / "run"
    make_run(root)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = prefork.run(
        [sys.executable, "-c", CHILD, str(root), str(kill_at), newer],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    if kill_at == 99:
        assert proc.returncode == 0 and "finished" in proc.stdout, proc.stderr
    else:
        assert proc.returncode == -signal.SIGKILL, proc.stderr
    started = kill_at >= 1  # the record was renamed into place: the rollback will finish
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing found damaged
        with fc.CheckpointManager(root) as mgr:  # a writer opens: finishes the rollback
            trunk = mgr.steps()
            branches = mgr.branches()
    assert not (root / rollback.INTENT_FILE).exists()
    assert [n for n in names(root) if n.startswith(".") and n != ".lock"] == []
    assert [n for n in names(root) if ".tmp-" in n or ".trash-" in n] == []
    if not started:
        assert trunk == [1, 2, 3, 4, 5] and branches == {}
    elif newer == "branch":
        assert trunk == [1, 2] and branches == {"b": [3, 4, 5]}
    else:
        assert trunk == [1, 2] and branches == {}
    # Nothing lost: every step is in the trunk or on the branch, each exactly as saved.
    kept = {s: root / step_name(s) for s in trunk}
    kept |= {s: root / "branches" / "b" / step_name(s) for s in branches.get("b", [])}
    if newer == "branch" or not started:
        assert sorted(kept) == [1, 2, 3, 4, 5]
    for step, path in kept.items():
        assert_exact(fc.restore(path, small_state(0)), small_state(step))
