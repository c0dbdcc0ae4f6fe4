"""CheckpointManager: policies, retention, resume, corruption fallback, locking, forking.

The crash tests use real processes: a forkserver (torch imported once) forks each
run of ``tests/manager_job.py``, which the test SIGKILLs at random moments or which
kills itself inside the commit or prune protocol.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import os
import random
import re
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.format import naming
from functional_ckpt._src.format.naming import parse_step, step_name
from functional_ckpt._src.policy.retention import RetentionPolicy
from functional_ckpt._src.root.listing import StepInfo
from functional_ckpt._src.storage import committed
from functional_ckpt.errors import CheckpointWarning
from tests import manager_job, prefork
from tests.exact import assert_exact
from tests.patience import eventually, finished

REPO = Path(__file__).resolve().parent.parent
JOB = Path(__file__).with_name("manager_job.py")
STEPS = 24


def small_state(step: int, value: float | None = None) -> dict[str, Any]:
    v = float(step) if value is None else value
    return {"w": torch.full((4, 3), v), "b": torch.arange(5) + step, "step": step}


def committed_dirs(root: Path) -> list[Path]:
    if not root.exists():  # killed before the manager created it
        return []
    return sorted(p for p in root.iterdir() if parse_step(p.name) is not None)


def no_warnings() -> contextlib.AbstractContextManager[list[warnings.WarningMessage]]:
    return warnings.catch_warnings(record=True)


# --------------------------------------------------------------------------- policies


def test_step_names_sort_and_parse() -> None:
    assert step_name(7) == "step_000000007"
    assert parse_step("step_000000007") == 7
    assert parse_step("step_7") is None  # only the canonical spelling counts
    assert parse_step("step_000000007.tmp-abc") is None
    assert parse_step("step_000000007.corrupt-abc") is None
    assert parse_step(step_name(10**10)) == 10**10


def test_policy_decides_and_retention_prunes(tmp_path: Path) -> None:
    with fc.CheckpointManager(tmp_path, save=fc.every_steps(2), keep=fc.keep_last(2)) as mgr:
        saved = [mgr.maybe_save(small_state(s), step=s) for s in range(1, 11)]
        assert saved == [s % 2 == 0 for s in range(1, 11)]
        assert mgr.steps() == [8, 10]
        assert mgr.latest_step() == 10
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".lock", "run.json", "step_000000008", "step_000000010"]  # no trash left


def test_force_and_final(tmp_path: Path) -> None:
    with fc.CheckpointManager(tmp_path, save=fc.every_steps(100) | fc.on_final()) as mgr:
        assert not mgr.maybe_save(small_state(1), step=1)
        assert mgr.maybe_save(small_state(2), step=2, force=True)
        assert mgr.maybe_save(small_state(3), step=3, is_final=True)
        assert mgr.steps() == [2, 3]
        assert mgr.info(3).is_final and not mgr.info(2).is_final


class _KeepNothing(RetentionPolicy):  # a user's own policy: no spec of its own
    def _select(self, checkpoints: Any) -> set[int]:
        return set()


def test_newest_and_protected_are_never_deleted(tmp_path: Path) -> None:
    with fc.CheckpointManager(tmp_path, keep=_KeepNothing()) as mgr:
        for s in range(1, 5):
            mgr.maybe_save(small_state(s), step=s)
            assert mgr.steps() == [s]  # the newest survives a policy that keeps nothing
    with fc.CheckpointManager(tmp_path, keep=fc.keep_best(1, "loss")) as mgr:
        mgr.restore_latest()
        mgr.maybe_save(small_state(5), step=5, metrics={"loss": 0.1})
        mgr.maybe_save(small_state(6), step=6, metrics={"loss": 9.0})  # worst, but newest
        assert mgr.steps() == [5, 6]
        mgr.keep = _KeepNothing()
        mgr.maybe_save(small_state(7), step=7)
        assert mgr.steps() == [7]
        mgr.maybe_save(small_state(8), step=8)
        assert mgr._prune(protected={8}) == []  # in flight and newest


def test_listing_info_best(tmp_path: Path) -> None:
    t0 = time.time()
    with fc.CheckpointManager(tmp_path, metadata={"exp": "e1", "lr": 3e-4}) as mgr:
        assert mgr.steps() == [] and mgr.latest_step() is None and mgr.best_step("loss") is None
        losses = {1: 0.5, 2: 0.25, 3: math.nan, 4: 0.25, 5: 0.75}
        for s, loss in losses.items():
            mgr.maybe_save(small_state(s), step=s, epoch=s // 2, metrics={"loss": loss, "acc": s})
        assert mgr.steps() == [1, 2, 3, 4, 5]
        assert mgr.best_step("loss") == 4  # tie with 2 goes to the newer step; NaN ignored
        assert mgr.best_step("acc", mode="max") == 5
        assert mgr.best_step("missing") is None
        info = mgr.info(2)
    assert isinstance(info, StepInfo)
    assert info.step == 2 and info.epoch == 1 and info.path == tmp_path / "step_000000002"
    assert info.metrics == {"loss": 0.25, "acc": 2.0}
    assert t0 - 1 <= info.time <= time.time() + 1
    assert info.size == sum(f.stat().st_size for f in info.path.iterdir())
    meta = info.metadata
    assert meta["exp"] == "e1" and meta["lr"] == 3e-4
    for key in ("hostname", "torch", "functional_ckpt", "pid", "time", "python"):
        assert key in meta, key
    assert meta["manager"]["step"] == 2
    with pytest.raises(fc.errors.CheckpointNotFound, match="step 9"):
        fc.CheckpointManager(tmp_path, read_only=True).info(9)


@pytest.mark.parametrize(
    ("arguments", "error", "message"),
    [
        ({"metadata": {"manager": 1}}, ValueError, r"\(metadata=...\): key 'manager' is reserved"),
        ({"tiers": "disk"}, TypeError, r"CheckpointManager\(tiers='disk'\): expected a tuple"),
        ({"metadata": 3}, TypeError, r"CheckpointManager\(metadata=3\): expected a mapping"),
        ({"per_rank": "rng"}, TypeError, r"CheckpointManager\(per_rank='rng'\): expected"),
        ({"per_rank": ["rng", 1]}, TypeError, r"CheckpointManager\(per_rank=\['rng', 1\]\)"),
        ({"read_only": "no"}, TypeError, r"CheckpointManager\(read_only='no'\)"),
    ],
)
def test_a_bad_constructor_argument_is_named(
    tmp_path: Path, arguments: dict[str, Any], error: type[Exception], message: str
) -> None:
    """``per_rank="rng"`` was the keys 'r', 'n', 'g': ``rng`` saved once for every rank."""
    with pytest.raises(error, match=message):
        fc.CheckpointManager(tmp_path / "run", **arguments)
    assert not (tmp_path / "run").exists()


def _git(cwd: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    out = subprocess.run(
        ["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True
    )
    return out.stdout.strip()


def test_git_commit_recorded_in_a_checkout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "train.py").write_text("print('hi')\n")
    _git(repo, "add", "train.py")
    _git(repo, "commit", "-q", "-m", "init")
    head = _git(repo, "rev-parse", "HEAD")
    monkeypatch.chdir(repo)
    with fc.CheckpointManager(tmp_path / "ckpt") as mgr:
        mgr.maybe_save(small_state(1), step=1)
        assert mgr.info(1).metadata["git_commit"] == head
    elsewhere = tmp_path / "plain"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    with fc.CheckpointManager(tmp_path / "ckpt2") as mgr:
        mgr.maybe_save(small_state(1), step=1)
        assert "git_commit" not in mgr.info(1).metadata


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_every_secs_continues_after_reopen_without_counting_downtime(tmp_path: Path) -> None:
    clock = FakeClock()
    with fc.CheckpointManager(tmp_path, save=fc.every_secs(10), clock=clock) as mgr:
        for step, t in [(1, 0.0), (2, 6.0)]:
            clock.now = t
            assert not mgr.maybe_save(small_state(step), step=step)
        clock.now = 7.0
        assert mgr.maybe_save(small_state(3), step=3, force=True)  # stores 7 s of running time
        assert mgr.info(3).metadata["manager"]["running_time"] == 7.0
    clock2 = FakeClock()  # a new process: unrelated clock origin, long downtime
    clock2.now = 1000.0
    with fc.CheckpointManager(tmp_path, save=fc.every_secs(10), clock=clock2) as mgr:
        assert mgr.restore_latest() is not None
        assert mgr.running_time() == 7.0
        decisions = []
        for step, t in [(4, 1000.0), (5, 1005.0), (6, 1010.0)]:
            clock2.now = t
            decisions.append(mgr.maybe_save(small_state(step), step=step))
        assert mgr.info(6).metadata["manager"]["running_time"] == 17.0
    # downtime did not count (step 4 does not fire); the forced save at 7 s restarted the
    # timer, and 10 s of running time after it step 6 fires
    assert decisions == [False, False, True]


def test_every_secs_and_on_improve_through_the_manager(tmp_path: Path) -> None:
    """Finding 16: ``&`` must advance its children on the combined decision."""
    clock = FakeClock()
    drops = {3: 0.9, 13: 0.75, 23: 0.6, 33: 0.5, 43: 0.41}
    loss, saved = 1.0, {}
    policy = fc.every_secs(10) & fc.on_improve("loss")
    with fc.CheckpointManager(tmp_path, save=policy, clock=clock) as mgr:
        for t in range(51):
            clock.now = float(t)
            loss = drops.get(t, loss)
            if mgr.maybe_save(small_state(t), step=t, metrics={"loss": loss}):
                saved[t] = loss
        record = mgr.info(50).metadata["manager"]
    assert saved == {10: 0.9, 20: 0.75, 30: 0.6, 40: 0.5, 50: 0.41}
    assert record["save"]["spec"] == policy.spec
    assert record["save"]["state"] == [{"since": 50.0}, {"best": 0.41}]


def test_a_state_stored_with_an_older_spec_is_handed_back(tmp_path: Path) -> None:
    """Manifests written before a spec was the configuration form hold ``{"kind": ...}``
    specs: their states still go back to the same policy, and only to it."""
    from functional_ckpt._src.manager.provenance import stored_state

    policy = fc.every_steps(3) | fc.on_improve("loss")
    older = {
        "kind": "any",
        "children": [
            {"kind": "every_steps", "n": 3, "offset": 0},
            {"kind": "on_improve", "metric": "loss", "mode": "min", "min_delta": 0.0},
        ],
    }
    state = [{"last_saved_step": 3}, {"best": 0.5}]
    record = {"save": {"spec": older, "state": state}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert stored_state(policy, record, "save", tmp_path) == state
    with pytest.warns(CheckpointWarning, match="starts fresh"):
        assert stored_state(fc.every_steps(4), record, "save", tmp_path) == {
            "last_saved_step": None
        }


def test_on_improve_remembers_best_after_reopen(tmp_path: Path) -> None:
    with fc.CheckpointManager(tmp_path, save=fc.on_improve("loss")) as mgr:
        got = [mgr.maybe_save(small_state(s), step=s, metrics={"loss": v}) for s, v in
               [(1, 1.0), (2, 0.5), (3, 0.7)]]  # fmt: skip
        assert got == [True, True, False]
    with fc.CheckpointManager(tmp_path, save=fc.on_improve("loss")) as mgr:
        mgr.restore_latest()
        assert mgr.restored_step == 2
        assert not mgr.maybe_save(small_state(3), step=3, metrics={"loss": 0.6})
        assert mgr.maybe_save(small_state(4), step=4, metrics={"loss": 0.4})


def test_changed_policy_warns_and_starts_afresh(tmp_path: Path) -> None:
    with fc.CheckpointManager(tmp_path, save=fc.every_steps(1)) as mgr:
        mgr.maybe_save(small_state(1), step=1)
    policy = fc.every_steps(1) | fc.on_improve("loss")
    with fc.CheckpointManager(tmp_path, save=policy) as mgr:
        with pytest.warns(CheckpointWarning, match="starts fresh"):
            mgr.restore_latest()
        assert mgr.maybe_save(small_state(2), step=2, metrics={"loss": 1.0})


def test_a_stored_state_is_never_reinterpreted_by_another_policy(tmp_path: Path) -> None:
    """Finding 16: a state of the same shape used to be reused, so accuracies were
    compared with the old best loss."""
    with fc.CheckpointManager(tmp_path, save=fc.on_improve("loss")) as mgr:
        assert mgr.maybe_save(small_state(1), step=1, metrics={"loss": 0.5})
    acc = fc.on_improve("acc", mode="max")
    with fc.CheckpointManager(tmp_path, save=acc) as mgr:
        with pytest.warns(CheckpointWarning, match=r"on_improve\('acc', mode='max'\).*fresh"):
            mgr.restore_latest()
        # fresh: the first accuracy saves (0.3 is not compared with the loss 0.5)
        assert mgr.maybe_save(small_state(2), step=2, metrics={"acc": 0.3})
        assert mgr.info(2).metadata["manager"]["save"] == {"spec": acc.spec, "state": {"best": 0.3}}
    # Only arguments changed: still another policy.
    other = fc.on_improve("acc", mode="max", min_delta=0.1)
    with fc.CheckpointManager(tmp_path, save=other) as m, pytest.warns(CheckpointWarning):
        m.restore_latest()
    # The same policy continues silently from its own state.
    with fc.CheckpointManager(tmp_path, save=fc.on_improve("acc", mode="max")) as mgr:
        with no_warnings() as caught:
            mgr.restore_latest()
        assert not [w for w in caught if issubclass(w.category, CheckpointWarning)]
        assert not mgr.maybe_save(small_state(3), step=3, metrics={"acc": 0.25})
        assert mgr.maybe_save(small_state(4), step=4, metrics={"acc": 0.35})


def test_saving_behind_the_newest_step_is_refused(tmp_path: Path) -> None:
    with fc.CheckpointManager(tmp_path) as mgr:
        mgr.maybe_save(small_state(5), step=5)
    with fc.CheckpointManager(tmp_path) as mgr:  # forgot restore_latest()
        with pytest.raises(fc.CheckpointError, match=r"step 1: step 5 is newer") as err:
            mgr.maybe_save(small_state(1), step=1)
        assert str(tmp_path) in str(err.value)
        assert mgr.maybe_save(small_state(5, 42.0), step=5, force=True)  # same step: replaced
        assert float(mgr.restore(5)["w"][0, 0]) == 42.0
        mgr.delete(5)
        assert mgr.steps() == []
        assert mgr.maybe_save(small_state(1), step=1)


def test_read_only_manager(tmp_path: Path) -> None:
    ro = fc.CheckpointManager(tmp_path / "absent", read_only=True)
    assert ro.steps() == [] and ro.restore_latest() is None
    assert not (tmp_path / "absent").exists()
    with fc.CheckpointManager(tmp_path) as mgr:
        mgr.maybe_save(small_state(1), step=1)
    with fc.CheckpointManager(tmp_path, read_only=True) as ro:
        with pytest.raises(fc.CheckpointError, match="read-only"):
            ro.maybe_save(small_state(2), step=2)
        state = ro.restore_latest()
        assert state is not None and state["step"] == 1
    closed = fc.CheckpointManager(tmp_path)
    closed.close()
    closed.close()
    with pytest.raises(fc.CheckpointError, match="closed"):
        closed.maybe_save(small_state(2), step=2)


def test_restore_latest_none_only_without_checkpoints(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "step_000000004.tmp-abc").mkdir()  # stale half-written save
    with fc.CheckpointManager(tmp_path, read_only=True) as ro:
        assert ro.restore_latest() is None
    with fc.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore_latest() is None


def test_template_mismatch_is_not_treated_as_damage(tmp_path: Path) -> None:
    with fc.CheckpointManager(tmp_path) as mgr:
        mgr.maybe_save(small_state(1), step=1)
        mgr.maybe_save(small_state(2), step=2)
    wrong = {"w": torch.zeros(2, 2), "b": torch.zeros(5, dtype=torch.long), "step": 0}
    with fc.CheckpointManager(tmp_path) as mgr, no_warnings() as caught:
        with pytest.raises(fc.errors.TemplateMismatch):
            mgr.restore_latest(like=wrong)
        assert mgr.steps() == [1, 2] and not caught


# --------------------------------------------------------------------------- stale dirs


def test_stale_temporary_dirs_removed_at_open_only_by_writers(tmp_path: Path) -> None:
    with fc.CheckpointManager(tmp_path) as mgr:
        mgr.maybe_save(small_state(1), step=1)
    stale = [
        tmp_path / "step_000000002.tmp-0123456789ab",
        tmp_path / "step_000000001.trash-0123456789ab",
        tmp_path / "exports" / "step_000000002.tmp-0123456789ab",
    ]
    for d in stale:
        d.mkdir(parents=True)
        (d / "manifest.msgpack").write_bytes(b"half")
    (tmp_path / "user.tmp-1").mkdir()  # not ours: never touched
    with fc.CheckpointManager(tmp_path, read_only=True) as ro:
        assert ro.steps() == [1]
        assert all(d.exists() for d in stale)
    with fc.CheckpointManager(tmp_path) as mgr:
        assert mgr.steps() == [1]
    assert not any(d.exists() for d in stale)
    assert (tmp_path / "user.tmp-1").exists()


# --------------------------------------------------------------------------- corruption


def _tensor_bytes(path: Path) -> tuple[str, int, int]:
    """(file, data offset, nbytes) of the first non-empty tensor's data in a checkpoint."""
    manifest = committed.read_manifest(path)
    for e in manifest["entries"]:
        if e["kind"] != "tensor":
            continue
        for piece in e.get("chunks", [e]):  # per-chunk records, or a flat entry
            if piece.get("nbytes"):
                return piece["file"], piece["data_offset"], piece["nbytes"]
    raise AssertionError(f"{path}: no tensor data")


def corrupt(path: Path, how: str) -> None:
    if how == "flipped_byte":
        file, offset, nbytes = _tensor_bytes(path)
        with open(path / file, "r+b") as f:
            f.seek(offset + nbytes // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x40]))
    elif how == "missing_shard":
        (path / _tensor_bytes(path)[0]).unlink()
    elif how == "torn_manifest":
        raw = (path / naming.MANIFEST).read_bytes()
        (path / naming.MANIFEST).write_bytes(raw[: len(raw) // 2])
    elif how == "missing_marker":
        (path / naming.COMMIT_MARKER).unlink()
    else:
        raise AssertionError(how)


HOWS = ["flipped_byte", "missing_shard", "torn_manifest", "missing_marker"]


def _three_checkpoints(root: Path) -> None:
    with fc.CheckpointManager(root, save=fc.on_improve("loss")) as mgr:
        for s in (1, 2, 3):
            mgr.maybe_save(small_state(s), step=s, metrics={"loss": 1.0 / s})


@pytest.mark.parametrize("how", HOWS)
def test_corrupt_newest_falls_back_to_previous(tmp_path: Path, how: str) -> None:
    _three_checkpoints(tmp_path)
    corrupt(tmp_path / "step_000000003", how)
    template = small_state(0)
    with fc.CheckpointManager(tmp_path, save=fc.on_improve("loss")) as mgr:
        with pytest.warns(CheckpointWarning, match=r"step_000000003.*step 3"):
            state = mgr.restore_latest(like=template)
        assert state is not None and state["step"] == 2
        assert torch.equal(state["w"], torch.full((4, 3), 2.0))
        assert mgr.latest_step() == 2 and mgr.restored_step == 2
        # moved aside, not deleted; a new step 3 can be written
        assert len(list(tmp_path.glob("step_000000003.corrupt-*"))) == 1
        assert not mgr.maybe_save(small_state(3), step=3, metrics={"loss": 0.6})  # best is 0.5
        assert mgr.maybe_save(small_state(3), step=3, metrics={"loss": 0.1})
        assert mgr.latest_step() == 3


@pytest.mark.parametrize("how", ["flipped_byte", "missing_shard"])
def test_read_only_follower_skips_corrupt_newest_without_touching_it(
    tmp_path: Path, how: str
) -> None:
    _three_checkpoints(tmp_path)
    corrupt(tmp_path / "step_000000003", how)
    before = sorted(p.name for p in tmp_path.iterdir())
    with fc.CheckpointManager(tmp_path, read_only=True) as ro:
        with pytest.warns(CheckpointWarning, match="step_000000003"):
            state = ro.restore_latest()
        assert state is not None and state["step"] == 2
        assert ro.latest_step() == 2
        with no_warnings() as caught:  # remembered: not reported twice
            warnings.simplefilter("always")
            state = ro.restore_latest()
        assert state is not None and state["step"] == 2 and not caught
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("read_only", [False, True])
def test_all_corrupt_raises_instead_of_starting_fresh(tmp_path: Path, read_only: bool) -> None:
    _three_checkpoints(tmp_path)
    for s, how in zip((1, 2, 3), ("flipped_byte", "torn_manifest", "missing_shard"), strict=True):
        corrupt(tmp_path / step_name(s), how)
    with fc.CheckpointManager(tmp_path, read_only=read_only) as mgr:
        with pytest.warns(CheckpointWarning), pytest.raises(fc.CheckpointError) as err:
            mgr.restore_latest()
        message = str(err.value)
        assert str(tmp_path) in message and "none is readable" in message
        for s in (1, 2, 3):
            assert step_name(s) in message
    with fc.CheckpointManager(tmp_path) as mgr, pytest.raises(fc.CheckpointError):
        mgr.restore_latest()  # still refuses: the damaged ones were moved aside, not lost


# --------------------------------------------------------------------------- processes


@pytest.fixture(scope="module")
def ctx() -> mp.context.ForkServerContext:
    """A forkserver that has imported torch and functional_ckpt once for all runs."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(
        ["tests.manager_job", "torch.distributed.checkpoint", *manager_job.PRELOAD]
    )
    return context


def start(ctx: mp.context.ForkServerContext, root: Path, **kwargs: Any) -> Any:
    proc = ctx.Process(target=manager_job.run, args=(str(root),), kwargs=kwargs)
    proc.start()
    return proc


@contextlib.contextmanager
def holder(root: Path) -> Iterator[prefork.Popen]:
    """A real script process holding the writer lock of ``root`` until killed."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = prefork.Popen(
        [sys.executable, str(JOB), str(root), "--hold"], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == f"locked {proc.pid}\n", line
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_second_writer_refused_in_process(tmp_path: Path) -> None:
    first = fc.CheckpointManager(tmp_path)
    with pytest.raises(fc.CheckpointError) as err:
        fc.CheckpointManager(tmp_path)
    assert str(tmp_path) in str(err.value) and f"pid {os.getpid()}" in str(err.value)
    with fc.CheckpointManager(tmp_path, read_only=True) as ro:
        assert ro.steps() == []
    first.close()
    fc.CheckpointManager(tmp_path).close()


def test_lock_of_a_killed_writer_is_taken_over(tmp_path: Path) -> None:
    with holder(tmp_path) as proc:
        with pytest.raises(fc.CheckpointError) as err:
            fc.CheckpointManager(tmp_path)
        message = str(err.value)
        assert f"pid {proc.pid}" in message and str(tmp_path) in message, message
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with fc.CheckpointManager(tmp_path) as mgr:  # the dead holder's lock is ours now
        mgr.maybe_save(small_state(1), step=1)


def test_follower_lists_and_restores_while_writer_saves(
    ctx: mp.context.ForkServerContext, tmp_path: Path
) -> None:
    writer = start(ctx, tmp_path, steps=10**6, keep=2)
    try:
        ro = fc.CheckpointManager(tmp_path, read_only=True)
        eventually(lambda: ro.latest_step() is not None, "a first step", alive=writer.is_alive)
        seen: set[int] = set()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a skipped "corrupt" checkpoint would fail here
            while len(seen) < 5:  # follow the moving writer over five of its steps
                assert writer.is_alive()
                for step in ro.steps():
                    assert (tmp_path / step_name(step) / naming.COMMIT_MARKER).exists() or (
                        not (tmp_path / step_name(step)).exists()  # pruned meanwhile
                    )
                state = ro.restore_latest()
                assert state is not None
                assert state["step"] == ro.restored_step
                seen.add(ro.restored_step)
        assert writer.is_alive()
    finally:
        writer.kill()
        writer.join()


# --------------------------------------------------------------------------- end to end


@dataclass
class Reference:
    state: Any  # the final checkpoint of an uninterrupted run
    seconds: float  # how long an uninterrupted run takes once the forkserver is warm


@pytest.fixture(scope="module")
def reference(
    ctx: mp.context.ForkServerContext, tmp_path_factory: pytest.TempPathFactory
) -> Reference:
    roots = [tmp_path_factory.mktemp("reference"), tmp_path_factory.mktemp("reference")]
    assert finished(start(ctx, roots[0], steps=STEPS)) == 0  # also warms the forkserver up
    t0 = time.monotonic()
    assert finished(start(ctx, roots[1], steps=STEPS)) == 0
    seconds = time.monotonic() - t0
    states = [fc.restore(r / step_name(STEPS)) for r in roots]
    assert_exact(
        fc.codec.to_python(states[0]), fc.codec.to_python(states[1])
    )  # the job is deterministic
    return Reference(states[0], seconds)


def check_after_crash(root: Path) -> int | None:
    """Nothing half-written is visible, and the newest committed checkpoint restores."""
    visible = committed_dirs(root)
    for d in visible:
        assert (d / naming.COMMIT_MARKER).exists(), f"{d} visible but uncommitted"
    newest = max((parse_step(d.name) for d in visible), default=None)
    with fc.CheckpointManager(root, read_only=True) as ro, warnings.catch_warnings():
        warnings.simplefilter("error")
        state = ro.restore_latest()
    if newest is None:
        assert state is None
        return None
    assert state is not None and ro.restored_step == newest and state["step"] == newest
    return newest


def check_final(root: Path, reference: Reference) -> None:
    final = fc.restore(root / step_name(STEPS))
    assert_exact(fc.codec.to_python(final), fc.codec.to_python(reference.state))
    leftovers = [p.name for p in root.iterdir() if naming.is_temporary_name(p.name)]
    assert not leftovers, leftovers


def test_sigkill_at_random_moments_resumes_bit_identically(
    ctx: mp.context.ForkServerContext, reference: Reference, tmp_path: Path
) -> None:
    """30+ runs killed at random moments (mostly inside save or prune: that is where
    the job spends its time); each lineage is restarted until it finishes."""
    rng = random.Random(20240601)
    longest = 0.6 * max(0.1, reference.seconds)
    killed = lineages = 0
    newest: list[int | None] = []  # what each crash left as the newest checkpoint
    mid_save = 0  # crashes that left a half-written save behind
    while killed < 30:
        lineages += 1
        root = tmp_path / f"run{lineages}"
        for attempt in range(9):
            proc = start(ctx, root, steps=STEPS)
            if attempt < 8:  # then let it finish, however slow the machine
                time.sleep(rng.uniform(0.02, longest))
                proc.kill()
            code = finished(proc)
            if code == 0:
                break
            assert code == -signal.SIGKILL
            killed += 1
            mid_save += any(".tmp-" in p.name for p in root.glob("step_*"))
            newest.append(check_after_crash(root))
        assert check_after_crash(root) == STEPS
        check_final(root, reference)
    assert lineages >= 2
    assert mid_save >= 1 and len(set(newest)) >= 5, (mid_save, newest)  # kills were spread


@pytest.mark.parametrize(
    ("point", "after"), [("marker", 3), ("marker", 8), ("commit", 4), ("prune", 2), ("prune", 6)]
)
def test_sigkill_inside_commit_and_prune_resumes_bit_identically(
    ctx: mp.context.ForkServerContext,
    reference: Reference,
    tmp_path: Path,
    point: str,
    after: int,
) -> None:
    proc = start(ctx, tmp_path, steps=STEPS, kill_point=point, kill_after=after)
    assert finished(proc) == -signal.SIGKILL
    names = [p.name for p in tmp_path.iterdir()]
    if point in ("marker", "prune"):
        assert any(naming.is_temporary_name(n) for n in names), names  # crashed mid-protocol
    check_after_crash(tmp_path)
    assert finished(start(ctx, tmp_path, steps=STEPS)) == 0
    check_final(tmp_path, reference)


# --------------------------------------------------------------------------- fork


def test_fork_records_provenance_and_continues(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    with fc.CheckpointManager(a, metadata={"exp": "A"}, save=fc.on_improve("loss")) as mgr:
        for s in (1, 2, 3):
            mgr.maybe_save(small_state(s), step=s, epoch=1, metrics={"loss": 1.0 / s})
    path = fc.manager.fork(a / step_name(3), b)
    assert path == b / step_name(3)
    with fc.CheckpointManager(b, save=fc.on_improve("loss")) as mgr:
        info = mgr.info(3)
        prov = info.metadata["forked_from"]
        assert prov["path"] == str((a / step_name(3)).resolve()) and prov["step"] == 3
        assert abs(prov["time"] - time.time()) < 60
        assert info.metadata["exp"] == "A" and info.metrics["loss"] == 1.0 / 3 and info.epoch == 1
        assert info.metadata["pid"] == os.getpid()
        state = mgr.restore_latest(like=small_state(0))
        assert state is not None and torch.equal(state["w"], torch.full((4, 3), 3.0))
        # a new run: its policies start afresh (on_improve fires on its first value)
        assert mgr.maybe_save(small_state(4), step=4, metrics={"loss": 5.0})
        assert mgr.steps() == [3, 4]
        assert mgr.info(4).metadata["forked_from"] == prov  # later checkpoints say so too
    assert fc.CheckpointManager(a, read_only=True).steps() == [1, 2, 3]  # source untouched
    with pytest.raises(fc.errors.CheckpointExists, match="already holds"):
        fc.manager.fork(a / step_name(2), b)
    c = fc.manager.fork(b / step_name(4), tmp_path / "c", step=0)
    prov = fc.CheckpointManager(tmp_path / "c", read_only=True).info(0).metadata["forked_from"]
    assert c.name == step_name(0) and prov["step"] == 4 and prov["parent"]["step"] == 3


@pytest.mark.parametrize(("step", "error"), [(-1, ValueError), ("5", TypeError), (True, TypeError)])
def test_fork_refuses_a_step_no_manager_takes(tmp_path: Path, step: Any, error: type) -> None:
    """``step=-1`` wrote ``step_-00000001``, which no manager resumes: the fork began afresh."""
    fc.save(tmp_path / "ck", small_state(1))
    with pytest.raises(error, match=r"fork\(step="):
        fc.manager.fork(tmp_path / "ck", tmp_path / "b", step=step)
    assert not (tmp_path / "b").exists()


# --------------------------------------------------------------------------- docs


def test_docs_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ```python block of docs/manager.md runs, in order, in one namespace."""
    text = (REPO / "docs" / "manager.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert blocks, "docs/manager.md has no python examples"
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "docs_manager"}
    original = signal.getsignal(signal.SIGTERM)
    try:
        for i, block in enumerate(blocks):
            exec(compile(block, f"docs/manager.md[block {i}]", "exec"), namespace)
    finally:
        signal.signal(signal.SIGTERM, original)
        for value in namespace.values():
            if isinstance(value, fc.CheckpointManager):
                value.close()


# --------------------------------------------------------------------------- a root's leftovers


def _committed_copy(root: Path, name: str, state: dict[str, Any]) -> Path:
    """A real committed checkpoint, saved elsewhere then renamed to ``name`` inside ``root``."""
    scratch = root.parent / f"scratch-{len(os.listdir(root))}"
    fc.save(scratch, state)
    os.rename(scratch, root / name)
    return root / name


def test_committed_leftovers_of_an_interrupted_overwrite_are_recovered(tmp_path: Path) -> None:
    """Without RENAME_EXCHANGE an overwrite renames old -> trash, then tmp -> name.

    A crash between the two leaves both committed and no ``step_N``: the next writer
    must put the newest back, keep the other, and delete only what was never committed.
    """
    root = tmp_path / "root"
    root.mkdir()
    name = step_name(3)
    _committed_copy(root, f"{name}.trash-0123456789ab", small_state(3, value=1.0))
    time.sleep(0.01)  # the overwrite is the newer save
    _committed_copy(root, f"{name}.tmp-0123456789ab", small_state(3, value=2.0))
    half = root / f"{step_name(4)}.tmp-0123456789ab"
    half.mkdir()
    (half / naming.MANIFEST).write_bytes(b"half")
    with fc.CheckpointManager(root, read_only=True) as ro:  # a follower changes nothing
        assert ro.steps() == [] and half.exists()
    with pytest.warns(UserWarning, match="recovered"):
        mgr = fc.CheckpointManager(root)
    with mgr:
        assert mgr.steps() == [3]
        restored = mgr.restore_latest()
        assert restored is not None and float(restored["w"][0, 0]) == 2.0
    assert not half.exists()  # never committed: deleted
    assert (root / f"{name}.trash-0123456789ab" / naming.COMMIT_MARKER).exists()  # kept


@pytest.mark.parametrize("cut", [0, 7])
def test_a_leftover_whose_marker_was_cut_is_not_recovered(tmp_path: Path, cut: int) -> None:
    """A save killed while writing its marker leaves an empty or cut ``COMMITTED`` in its
    temporary directory: the next writer must delete it, never make it ``step_N``."""
    root = tmp_path / "root"
    root.mkdir()
    torn = _committed_copy(root, f"{step_name(3)}.tmp-0123456789ab", small_state(3))
    marker = torn / naming.COMMIT_MARKER
    marker.write_bytes(marker.read_bytes()[:cut])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing is recovered, so nothing is said
        mgr = fc.CheckpointManager(root)
    with mgr:
        assert mgr.steps() == [] and mgr.restore_latest() is None
    assert not torn.exists() and not (root / step_name(3)).exists()


_CRASH_BETWEEN_RENAMES = """
import os, signal, sys
import torch
import functional_ckpt as fc
from functional_ckpt._src.format import naming
from functional_ckpt._src.storage import commit
commit._exchange = lambda a, b: False  # as on a filesystem without RENAME_EXCHANGE
real_rename = os.rename
def rename(src, dst):
    real_rename(src, dst)
    if naming.TRASH_INFIX in os.fspath(dst):  # the old one moved aside, the new not yet in
        os.kill(os.getpid(), signal.SIGKILL)
root = sys.argv[1]
with fc.CheckpointManager(root) as mgr:
    mgr.maybe_save({"w": torch.full((4,), 1.0)}, step=5)
    os.rename = rename
    mgr.maybe_save({"w": torch.full((4,), 2.0)}, step=5, force=True)
"""


def test_crash_between_the_renames_of_an_overwrite_loses_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = prefork.run(
        [sys.executable, "-c", _CRASH_BETWEEN_RENAMES, str(tmp_path)], env=env, check=False
    )
    assert proc.returncode == -signal.SIGKILL
    names = sorted(p.name for p in tmp_path.iterdir())
    assert step_name(5) not in names and any(".trash-" in n for n in names), names
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mgr = fc.CheckpointManager(tmp_path)
    with mgr:
        restored = mgr.restore_latest()
        assert restored is not None, "the step was lost"
        assert mgr.restored_step == 5 and float(restored["w"][0]) == 2.0


def test_deletion_leaves_no_committed_trash(tmp_path: Path) -> None:
    """A deleted checkpoint loses its marker at once, so a crash cannot bring it back."""
    from functional_ckpt._src.root import delete

    with fc.CheckpointManager(tmp_path) as mgr:
        mgr.maybe_save(small_state(1), step=1)
        trash = delete.delete(tmp_path, [mgr.path(1)])
        assert len(trash) == 1 and not (trash[0] / naming.COMMIT_MARKER).exists()
        assert mgr.steps() == []
    with fc.CheckpointManager(tmp_path) as mgr:  # the next writer removes, never recovers it
        assert mgr.steps() == [] and not trash[0].exists()


def test_lock_symlink_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    target = tmp_path / "precious.txt"
    target.write_bytes(b"do not truncate me")
    root = tmp_path / "root"
    root.mkdir()
    (root / ".lock").symlink_to(target)
    with pytest.raises(fc.CheckpointError, match="symbolic link"):
        fc.CheckpointManager(root)
    assert target.read_bytes() == b"do not truncate me"


def test_a_template_the_codec_refuses_is_the_callers_error(tmp_path: Path) -> None:
    """A defaultdict in the template is the caller's bug: it raises, nothing moves aside."""
    from collections import defaultdict

    with fc.CheckpointManager(tmp_path) as mgr:
        mgr.maybe_save(small_state(1), step=1)
        mgr.maybe_save(small_state(2), step=2)
    bad = {"w": torch.zeros(4, 3), "b": defaultdict(list, {"x": torch.zeros(5)}), "step": 0}
    with fc.CheckpointManager(tmp_path) as mgr, no_warnings() as caught:
        with pytest.raises(fc.errors.UnsupportedValue):
            mgr.restore_latest(like=bad)
        assert mgr.steps() == [1, 2] and not caught
    assert sorted(p.name for p in tmp_path.iterdir() if ".corrupt-" in p.name) == []


def test_a_malformed_alias_is_damage_and_the_manager_falls_back(tmp_path: Path) -> None:
    """An alias written as ``[["w"]]`` (re-signed) is a corrupt checkpoint, not a TypeError."""
    from tests.forge import resign

    def aliased(step: int) -> dict[str, Any]:
        w = torch.full((3,), float(step))
        return {"w": w, "same": w, "step": step}

    with fc.CheckpointManager(tmp_path) as mgr:
        mgr.maybe_save(aliased(1), step=1)
        mgr.maybe_save(aliased(2), step=2)

    def nest(manifest: dict[str, Any]) -> None:
        for entry in manifest["entries"]:
            if "alias" in entry:
                entry["alias"] = [entry["alias"]]

    newest = tmp_path / step_name(2)
    resign(newest, nest)
    report = fc.verify(newest)
    assert not report.ok
    with pytest.raises(fc.errors.CorruptCheckpoint, match="alias"):
        fc.restore(newest)
    with fc.CheckpointManager(tmp_path) as mgr, pytest.warns(CheckpointWarning, match="alias"):
        restored = mgr.restore_latest()
    assert restored is not None and mgr.restored_step == 1 and restored["same"] is restored["w"]


# --------------------------------------------------------------------------- epochs


@pytest.mark.parametrize("counting", ["completed", "current"])
def test_every_epochs_saves_and_exports_the_end_of_each_epoch_the_last_included(
    tmp_path: Path, counting: str
) -> None:
    """The documented loop: ``epoch_end=True`` on the step that finishes an epoch gives
    the state at the end of each epoch, the last one included, whether the loop holds
    0-based completed epochs or the 1-based current one."""
    steps_per_epoch, epochs = 4, 3
    numbering = range(epochs) if counting == "completed" else range(1, epochs + 1)
    export = fc.manager.Export(fc.every_epochs(1), select="model")
    with fc.CheckpointManager(tmp_path / "a", save=fc.every_epochs(1), export=export) as mgr:
        step = 0
        for epoch in numbering:
            for batch in range(steps_per_epoch):
                step += 1
                state = {"model": {"w": torch.full((2,), float(step))}}
                last = batch == steps_per_epoch - 1
                mgr.maybe_save(state, step=step, epoch=epoch, epoch_end=last)
        mgr.wait_exports()
        assert mgr.steps() == [4, 8, 12]
        assert [mgr.info(s).epoch for s in mgr.steps()] == list(numbering)
        assert fc.restore(mgr.path(12))["model"]["w"].tolist() == [12.0, 12.0]
    exported = sorted(p.name for p in (tmp_path / "a" / naming.EXPORTS_DIR).iterdir())
    assert exported == [step_name(4), step_name(8), step_name(12)]
    # One event per epoch after its last step instead: the same checkpoints.
    with fc.CheckpointManager(tmp_path / "b", save=fc.every_epochs(1)) as mgr:
        step = 0
        for epoch in numbering:
            for _ in range(steps_per_epoch):
                step += 1
                mgr.maybe_save(small_state(step), step=step, epoch=epoch)
            mgr.maybe_save(small_state(step), step=step, epoch=epoch, epoch_end=True)
        assert mgr.steps() == [4, 8, 12]


def test_each_commit_is_reported_to_a_supervisor_that_asks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fckpt run`` names a file in FCKPT_PROGRESS; the manager writes its newest committed
    step there after each commit (durably: a whole file renamed into place)."""
    import json

    from functional_ckpt._src.storage.progress import PROGRESS_ENV, read_progress

    progress = tmp_path / "progress.json"
    monkeypatch.setenv(PROGRESS_ENV, str(progress))
    with fc.CheckpointManager(tmp_path / "root", save=fc.every_steps(2)) as mgr:
        mgr.maybe_save(small_state(1), step=1)
        assert not progress.exists()  # nothing committed yet
        for step in (2, 3, 4):
            mgr.maybe_save(small_state(step), step=step)
        assert json.loads(progress.read_text())["step"] == 4
    with fc.CheckpointManager(tmp_path / "async", async_save=True) as mgr:
        mgr.maybe_save(small_state(7), step=7)
    reported = read_progress(progress)
    assert reported is not None and reported.step == 7
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("progress")] == [progress.name]
    monkeypatch.delenv(PROGRESS_ENV)
    progress.unlink()
    with fc.CheckpointManager(tmp_path / "alone") as mgr:
        mgr.maybe_save(small_state(1), step=1)
    assert not progress.exists()  # no supervisor asked
