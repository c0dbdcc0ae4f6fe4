"""Another run's checkpoint copied into a root is never replaced, rolled back to,
uploaded or pruned; a root whose run is unknown is never resumed or pruned on a guess.

Real roots, real managers, the ``fckpt`` command itself; the rule is docs/tiered.md's.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src import cli
from functional_ckpt._src.format.naming import step_name
from functional_ckpt._src.root.run import RUN_FILE, read_run
from functional_ckpt.errors import CheckpointError, CheckpointExists
from tests.exact import assert_exact
from tests.patience import finished


def state(step: int) -> dict[str, Any]:
    return {"w": torch.full((8, 4), float(step)), "step": step}


def exact(got: Any, step: int) -> None:
    want = state(step)
    assert_exact({k: fc.codec.to_python(got)[k] for k in want}, fc.codec.to_python(want))


def saved(root: Path, *steps: int, tiers: Any = ()) -> str:
    """Save ``steps`` as one run of ``root``; that run's id."""
    with fc.CheckpointManager(root, tiers=tiers) as mgr:
        mgr.restore_latest(like=state(0))
        for step in steps:
            mgr.maybe_save(state(step), step=step)
        if mgr.remote is not None:
            mgr.remote.wait()
    run = read_run(root)
    assert run is not None
    return run.id


def copied_in(other: Path, root: Path, *steps: int) -> None:
    for step in steps:
        shutil.copytree(other / step_name(step), root / step_name(step))


def committed(root: Path) -> list[int]:
    return fc.CheckpointManager(root, read_only=True).steps()


def run_of(root: Path, step: int) -> str:
    run: str = fc.CheckpointManager(root, read_only=True).info(step).metadata["run"]["id"]
    return run


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# --------------------------------------------------------------------------- a save


@pytest.mark.parametrize("how", ["sync", "async", "final", "signal"])
def test_a_save_never_replaces_another_runs_checkpoint_of_the_same_step(
    tmp_path: Path, how: str
) -> None:
    """Whatever path reaches the commit (a policy's save, an async one, the final one,
    the one a signal asks for), it is refused before any byte is written."""
    root, other = tmp_path / "root", tmp_path / "other"
    saved(root, 1)
    theirs = saved(other, 9)
    copied_in(other, root, 9)
    save = {"signal": fc.on_signal(signal.SIGUSR1), "final": fc.on_final()}.get(how)
    with fc.CheckpointManager(root, save=save, async_save=how == "async") as mgr:
        mgr.restore_latest(like=state(0))
        assert mgr.restored_step == 1
        before = sorted(os.listdir(root))
        if how == "signal":
            os.kill(os.getpid(), signal.SIGUSR1)
        with pytest.raises(CheckpointExists) as told:
            mgr.maybe_save(state(9), step=9, is_final=how == "final")
        assert sorted(os.listdir(root)) == before  # nothing written, nothing moved
        message = str(told.value)
        assert str(root / step_name(9)) in message and theirs in message
        assert "fork" in message and "Move it out of the root" in message
        mgr.maybe_save(state(10), step=10, force=True)  # the run goes on past it
    assert run_of(root, 9) == theirs
    exact(fc.restore(root / step_name(9)), 9)
    assert committed(root) == [1, 9, 10]


@pytest.mark.parametrize("theirs", [9, 3])
def test_a_promotion_is_neither_blocked_by_nor_copied_over_another_runs_checkpoint(
    tmp_path: Path, theirs: int
) -> None:
    """The memory tier's newest step is promoted past another run's newer step, and
    another run's step of the same number is left as it is (the next older promoted)."""
    root, other, memory = tmp_path / "root", tmp_path / "other", tmp_path / "mem"
    saved(root, 1)
    their_run = saved(other, theirs)
    copied_in(other, root, theirs)
    tier = fc.manager.Memory(path=memory, async_save=False)  # promotes on a crash
    manager = fc.CheckpointManager(root, save=fc.every_steps(100), tiers=(tier,))
    with pytest.raises(RuntimeError, match="a crash"), manager as mgr:
        mgr.restore_latest(like=state(0))
        for step in (2, 3):
            mgr.maybe_save(state(step), step=step)
        raise RuntimeError("a crash")
    promoted = 3 if theirs == 9 else 2
    assert committed(root) == sorted({1, promoted, theirs})
    exact(fc.restore(root / step_name(promoted)), promoted)
    assert run_of(root, theirs) == their_run
    shutil.rmtree(memory)


def _killed_before_its_first_disk_save(root: str, memory: str) -> None:
    tier = fc.manager.Memory(path=memory, async_save=False, promote_on=())
    mgr = fc.CheckpointManager(root, save=fc.every_steps(100), tiers=(tier,))
    for step in (1, 2, 3):
        mgr.maybe_save(state(step), step=step)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_run_with_checkpoints_only_in_ram_has_begun(tmp_path: Path) -> None:
    """Killed before its first disk save, the run's checkpoints are in RAM alone: it has
    begun, so another run's checkpoint copied into its root is not adopted."""
    root, other, memory = tmp_path / "root", tmp_path / "other", tmp_path / "mem"
    proc = mp.get_context("fork").Process(
        target=_killed_before_its_first_disk_save, args=(str(root), str(memory))
    )
    proc.start()
    assert finished(proc) == -signal.SIGKILL
    saved(other, 9)
    copied_in(other, root, 9)
    tier = fc.manager.Memory(path=memory, promote_on=())
    with fc.CheckpointManager(root, save=fc.every_steps(100), tiers=(tier,)) as mgr:
        exact(mgr.restore_latest(like=state(0)), 3)  # not the other run's step 9
        mgr.maybe_save(state(4), step=4, force=True)  # 9 is no obstacle
    assert committed(root) == [4, 9]


# --------------------------------------------------------------------------- a rollback


def test_a_rollback_to_or_delete_of_another_runs_step_is_refused_before_anything_moves(
    tmp_path: Path,
) -> None:
    root, other = tmp_path / "root", tmp_path / "other"
    saved(root, 1, 2, 4)
    theirs = saved(other, 0, 9)
    copied_in(other, root, 0, 9)
    with fc.CheckpointManager(root) as mgr:
        with pytest.raises(CheckpointError) as told:
            mgr.rollback(0, like=state(0), newer="delete")
        assert mgr.restored_step is None
        with pytest.raises(CheckpointError, match=rf"step_000000009: .*{theirs}.*delete\(9\)"):
            mgr.delete(9)
    message = str(told.value)
    assert "rollback(0)" in message and theirs in message and str(root / step_name(0)) in message
    assert committed(root) == [0, 1, 2, 4, 9]  # nothing deleted
    with fc.CheckpointManager(root) as mgr:
        exact(mgr.restore_latest(like=state(0)), 4)


@pytest.mark.parametrize("how", ["rollback", "delete"])
def test_this_runs_own_deletions_never_make_another_runs_checkpoints_its_own(
    tmp_path: Path, how: str
) -> None:
    """Once a run has had a checkpoint, its lineage is recorded in run.json: deleting
    all of its own (a rollback onto a run-less step, ``delete``) adopts no other run."""
    root, other = tmp_path / "root", tmp_path / "other"
    mine = saved(root, 1, 2)
    saved(other, 9)
    copied_in(other, root, 9)
    fc.save(root / step_name(0), state(0))  # records no run: this lineage's by the rule
    with fc.CheckpointManager(root, keep=fc.keep_last(1)) as mgr:
        if how == "rollback":
            mgr.rollback(0, like=state(0), newer="delete")
        else:
            mgr.delete(2)
            mgr.delete(1)
        assert committed(root) == [0, 9]  # none of this run's left
        exact(mgr.restore_latest(like=state(0)), 0)  # not the other run's step 9
    run = read_run(root)
    assert run is not None and run.id == mine and mine in run.lineage
    with fc.CheckpointManager(root, keep=fc.keep_last(1)) as mgr:  # a relaunch
        exact(mgr.restore_latest(like=state(0)), 0)
        mgr.maybe_save(state(1), step=1)
    assert committed(root) == [1, 9]  # retention left the other run's alone


# --------------------------------------------------------------------------- uploads


def test_no_upload_round_runs_before_the_lineage_is_learnt(tmp_path: Path, mem: str) -> None:
    """The remote tier's first round (at open) chooses what to upload by this root's
    lineage, never by a rule not learnt yet."""
    root, other = tmp_path / "root", tmp_path / "other"
    saved(root, 1, 2, tiers=(fc.manager.Remote(mem),))
    saved(other, 9)
    copied_in(other, root, 9)
    with fc.CheckpointManager(root, tiers=(fc.manager.Remote(mem),)) as mgr:
        assert mgr.remote is not None and mgr.remote.wait()
        assert mgr.remote.steps() == [1, 2]  # the other run's step 9 is not uploaded
        mgr.maybe_save(state(3), step=3)
        assert mgr.remote.wait() and mgr.remote.steps() == [1, 2, 3]


@pytest.mark.parametrize("keep", ["all", "last 2"])
def test_an_ancestors_steps_saved_again_after_the_lineage_left_it_are_not_its(
    tmp_path: Path, keep: str
) -> None:
    """B uploads 1-5; C continues B's 5 (copied in) and saves 6, 7; B rolls back to 3 and
    saves 4 and 5 again, uploaded. C's relaunch with the remote saves 8: B's new 4 and 5,
    saved after C left B, are not on C's path (though at or below its branch step): C
    neither uploads its copy of B's old 5 over them nor prunes them; B's 1-3 are C's."""
    remote, b, c = tmp_path / "bucket", tmp_path / "b", tmp_path / "c"

    def tier(keep: Any = None) -> Any:
        return (fc.manager.Remote(remote.as_uri(), keep=keep or fc.policy.keep_all()),)

    saved(b, 1, 2, 3, 4, 5, tiers=tier())
    copied_in(b, c, 5)
    saved(c, 6, 7)
    with fc.CheckpointManager(b, tiers=tier()) as mgr:
        mgr.restore_latest(like=state(0))
        mgr.rollback(3, like=state(0))
        for step in (4, 5):
            mgr.maybe_save(state(100 + step), step=step)
        assert mgr.remote is not None and mgr.remote.wait()
    saved(c, 8, tiers=tier(fc.policy.keep_all() if keep == "all" else fc.keep_last(2)))
    held = {int(p.parent.name[5:]): p.parent for p in remote.glob("step_*/COMMITTED")}
    got = {s: float(fc.restore(p)["w"][0, 0]) for s, p in held.items() if s <= 5}
    assert got == ({1: 1.0, 2: 2.0, 3: 3.0} if keep == "all" else {}) | {4: 104.0, 5: 105.0}


# --------------------------------------------------------------------------- an unknown run


def test_a_root_of_unrelated_runs_without_run_json_is_never_pruned_or_resumed_on_a_guess(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root, other = tmp_path / "root", tmp_path / "other"
    mine = saved(root, 1, 2, 3)
    theirs = saved(other, 9)
    copied_in(other, root, 9)
    (root / RUN_FILE).unlink()
    assert cli.main(["prune", "--keep-last", "1", "--yes", str(root)]) == 1
    err = capsys.readouterr().err
    assert mine in err and theirs in err and "Move the other runs' checkpoints out" in err
    assert committed(root) == [1, 2, 3, 9]  # nothing deleted
    with fc.CheckpointManager(root, keep=fc.keep_last(1)) as mgr:
        with pytest.raises(CheckpointError, match="not guessed") as told:
            mgr.restore_latest(like=state(0))
        assert mine in str(told.value) and theirs in str(told.value)
    assert committed(root) == [1, 2, 3, 9]
    # One lineage left in the root: it is adopted, by the manager and `fckpt prune` alike.
    shutil.move(root / step_name(9), tmp_path / step_name(9))
    assert cli.main(["prune", "--keep-last", "2", "--yes", str(root)]) == 0
    assert committed(root) == [2, 3]
    with fc.CheckpointManager(root) as mgr:
        exact(mgr.restore_latest(like=state(0)), 3)


def test_fckpt_ls_and_the_manager_learn_the_lineage_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """After this run deleted its own checkpoints, `fckpt ls` still tells the other
    run's checkpoint apart, as the manager does (run.json records the lineage)."""
    root, other = tmp_path / "root", tmp_path / "other"
    saved(root, 1, 2)
    theirs = saved(other, 9)
    copied_in(other, root, 9)
    fc.save(root / step_name(0), state(0))
    with fc.CheckpointManager(root) as mgr:
        mgr.rollback(0, like=state(0), newer="delete")
    assert cli.main(["ls", "--json", "--keep-last", "1", str(root)]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out) if "kind" not in r}
    assert rows[9]["run"] == theirs and "another run" in rows[9]["kept_by"][0]
    assert rows[0]["kept_by"] == ["keep_last(1)", "latest"]


# --------------------------------------------------------------------------- reads


@pytest.mark.parametrize("held", [4, 16])
def test_the_lineage_reads_each_manifest_once_per_manager_however_many_are_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held: int
) -> None:
    """Resume and the saves after it ask the rule many times; each checkpoint's
    manifest is read once per manager (then remembered by its marker), never once per
    question: the reads grow with the checkpoints held, not with checkpoints x calls."""
    from functional_ckpt._src.storage import committed as storage

    root = tmp_path / "root"
    saved(root, *range(1, held + 1))
    read, real = [], storage.read_manifest
    monkeypatch.setattr(storage, "read_manifest", lambda p: read.append(p) or real(p))
    saves = 5
    with fc.CheckpointManager(root, keep=fc.keep_last(held + saves)) as mgr:
        exact(mgr.restore_latest(like=state(0)), held)
        for step in range(held + 1, held + saves + 1):
            mgr.maybe_save(state(step), step=step)
    # 4 held: 10 reads (each held once, each new one once, the resumed one again);
    # a read per checkpoint per question would be 135.
    assert len(read) <= held + 2 * saves + 2, sorted(str(p) for p in read)
