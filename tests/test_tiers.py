"""A run's lineage across tiers: which checkpoint a resume takes, and whose it is.

Every checkpoint a manager commits records its root's run; a resume takes the
newest intact step of that run in any tier, walking down past damage, and never a
checkpoint of another run. Crashes are real (a child process SIGKILLs itself).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import stat
import subprocess
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.format.naming import step_name
from functional_ckpt._src.manager.memory import SEARCHED
from functional_ckpt._src.root.run import RUN_FILE, read_run
from functional_ckpt._src.storage.ram import MEMORY_STATUS
from functional_ckpt.errors import CheckpointWarning, MemoryTierWarning
from tests.exact import assert_exact
from tests.forge import flip
from tests.patience import finished


def state(step: int) -> dict[str, Any]:
    return {"w": torch.full((32, 8), float(step)), "b": torch.arange(4) + step, "step": step}


def job(
    root: str,
    memory: str | None,
    die_at: int,
    disk_every: int,
    memory_every: int,
    report: str | None = None,
) -> None:
    """Save steps 1.. on both tiers' policies; SIGKILL once ``die_at`` is saved. With
    ``report``, what the resume read is written there first (``torch.save``)."""
    warnings.simplefilter("ignore")
    tier = fc.manager.Memory(
        path=memory, save=fc.every_steps(memory_every), async_save=False, promote_on=()
    )
    mgr = fc.CheckpointManager(root, save=fc.every_steps(disk_every), tiers=(tier,))
    restored = mgr.restore_latest(like=state(0))
    if report is not None:
        torch.save(None if restored is None else fc.codec.to_python(restored), report)
    step = 0 if restored is None else int(restored["step"])
    while step < die_at:
        step += 1
        mgr.maybe_save(state(step), step=step)
    mgr.wait()
    os.kill(os.getpid(), signal.SIGKILL)


def killed(
    root: Path,
    memory: Path | None,
    die_at: int,
    disk_every: int,
    memory_every: int,
    report: Path | None = None,
) -> None:
    args = (
        str(root),
        None if memory is None else str(memory),
        die_at,
        disk_every,
        memory_every,
        None if report is None else str(report),
    )
    proc = mp.get_context("fork").Process(target=job, args=args)
    proc.start()
    assert finished(proc) == -signal.SIGKILL


def committed(folder: Path) -> list[int]:
    return fc.CheckpointManager(folder, read_only=True).steps() if folder.is_dir() else []


def resumed(root: Path, memory: Path | None, disk_every: int = 4) -> tuple[int | None, Any]:
    tier = fc.manager.Memory(path=memory, promote_on=())
    with fc.CheckpointManager(root, save=fc.every_steps(disk_every), tiers=(tier,)) as mgr:
        got = mgr.restore_latest(like=state(0))
        return mgr.restored_step, got


def exact(got: Any, step: int) -> None:
    want = state(step)
    assert_exact({k: fc.codec.to_python(got)[k] for k in want}, fc.codec.to_python(want))


def default_folder_of(root: Path) -> Path:
    run = read_run(root)
    assert run is not None
    return Path("/dev/shm") / f"fckpt-{os.getuid()}-{run.secret}"


def test_a_damaged_newest_disk_step_does_not_hide_a_newer_memory_step(tmp_path: Path) -> None:
    root, memory = tmp_path / "root", tmp_path / "mem"
    killed(root, memory, die_at=8, disk_every=4, memory_every=3)
    assert committed(root) == [4, 8] and committed(memory) == [3, 6]
    flip(root / step_name(8), "w")
    with pytest.warns(CheckpointWarning, match="step 8 is unreadable"):
        step, got = resumed(root, memory)
    assert step == 6  # not the older disk step 4
    exact(got, 6)


def test_an_intact_newer_disk_step_wins_over_the_memory_tier(tmp_path: Path) -> None:
    root, memory = tmp_path / "root", tmp_path / "mem"
    killed(root, memory, die_at=8, disk_every=4, memory_every=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step, got = resumed(root, memory)
    assert step == 8
    exact(got, 8)


def test_another_runs_memory_checkpoint_is_left_alone(tmp_path: Path) -> None:
    """Another run's step copied into this run's folder is reported, not resumed, and
    outlives this run's retention and close (never deleted: not this run's)."""
    killed(tmp_path / "rA", tmp_path / "mA", die_at=9, disk_every=100, memory_every=1)
    killed(tmp_path / "rC", tmp_path / "mC", die_at=2, disk_every=100, memory_every=1)
    foreign = tmp_path / "mC" / step_name(9)
    shutil.copytree(tmp_path / "mA" / step_name(9), foreign)
    tier = fc.manager.Memory(path=tmp_path / "mC", keep=2, async_save=False, promote_on=())
    with (
        pytest.warns(MemoryTierWarning, match="not of this run") as caught,
        fc.CheckpointManager(tmp_path / "rC", save=fc.every_steps(100), tiers=(tier,)) as mgr,
    ):
        exact(mgr.restore_latest(like=state(0)), 2)
        assert mgr.restored_step == 2
        for step in (3, 4, 5):
            mgr.maybe_save(state(step), step=step)
            assert foreign.is_dir(), step
    assert os.listdir(tmp_path / "mC") == [step_name(9)]  # close removed this run's only
    exact(fc.restore(foreign), 9)
    told = [str(w.message) for w in caught]
    assert sum("leaves them as they are" in m for m in told) == 1, told


@pytest.mark.parametrize("how", ["renamed", "copied from another run"])
def test_a_checkpoint_named_for_another_step_is_not_resumed_as_it(tmp_path: Path, how: str) -> None:
    """A disk ``step_9`` recording step 6 is damage: set aside, and the intact memory
    step 7 resumed (resumed as 9, the run would number on from a step-6 state)."""
    root, memory = tmp_path / "root", tmp_path / "mem"
    killed(root, memory, die_at=7, disk_every=3, memory_every=1)
    assert committed(root) == [3, 6] and committed(memory) == [6, 7]
    if how == "renamed":
        os.rename(root / step_name(6), root / step_name(9))
    else:
        killed(tmp_path / "rA", tmp_path / "mA", die_at=6, disk_every=3, memory_every=1)
        shutil.copytree(tmp_path / "rA" / step_name(6), root / step_name(9))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, got = resumed(root, memory, disk_every=3)
    assert step == 7
    exact(got, 7)
    told = [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]
    assert any("records step 6" in m for m in told), told
    assert not (root / step_name(9)).exists()
    assert [n for n in os.listdir(root) if n.startswith(step_name(9) + ".corrupt-")]


def test_a_run_killed_before_its_first_disk_save_resumes_from_ram(tmp_path: Path) -> None:
    root, umask = tmp_path / "root", os.umask(0o022)  # the usual umask
    killed(root, None, die_at=5, disk_every=100, memory_every=1)
    folder = default_folder_of(root)
    try:
        assert committed(root) == [] and committed(folder) == [4, 5]
        st = os.lstat(folder)  # the default folder: this user's, private, not a link
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        assert st.st_uid == os.getuid()
        for name in (RUN_FILE, MEMORY_STATUS):  # both name the folder: owner-only
            assert stat.S_IMODE(os.stat(root / name).st_mode) == 0o600, name
        os.chmod(root / MEMORY_STATUS, 0o644)  # as an older version left it
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            step, got = resumed(root, None, disk_every=100)
        assert stat.S_IMODE(os.stat(root / MEMORY_STATUS).st_mode) == 0o600  # replaced so
        assert step == 5
        exact(got, 5)
        info = fc.CheckpointManager(folder, read_only=True).info(5) if folder.exists() else None
        assert info is None  # a clean exit removed the tier's folder
    finally:
        os.umask(umask)
        shutil.rmtree(folder, ignore_errors=True)


def test_a_root_emptied_by_hand_starts_a_new_run(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    killed(root, None, die_at=3, disk_every=100, memory_every=1)
    old = default_folder_of(root)
    try:
        assert committed(old) == [2, 3]
        subprocess.run("rm -rf ckpt/*", shell=True, cwd=tmp_path, check=True)
        with pytest.warns(MemoryTierWarning, match=r"steps \[2, 3\]\) of an earlier run"):
            step, got = resumed(root, None, disk_every=100)
        assert step is None and got is None  # not the old run's RAM step
        assert committed(old) == [2, 3]  # reported, never removed
        assert default_folder_of(root) != old
    finally:
        shutil.rmtree(old, ignore_errors=True)


def test_every_checkpoint_records_its_run_and_parent(tmp_path: Path) -> None:
    root, memory = tmp_path / "root", tmp_path / "mem"
    killed(root, memory, die_at=4, disk_every=2, memory_every=1)
    run = read_run(root)
    assert run is not None
    first = fc.CheckpointManager(root, read_only=True).info(2).metadata["run"]
    assert first == {"id": run.id, "parent": None}
    tier = fc.manager.Memory(path=memory, promote_on=())
    with fc.CheckpointManager(root, save=fc.every_steps(2), tiers=(tier,)) as mgr:
        mgr.restore_latest(like=state(0))
        assert mgr.restored_step == 4
        mgr.maybe_save(state(6), step=6)
    meta = fc.CheckpointManager(root, read_only=True).info(6).metadata["run"]
    assert meta["id"] == run.id and meta["parent"]["step"] == 4
    assert meta["parent"]["run"] == run.id and isinstance(meta["parent"]["manifest_crc32"], int)
    assert json.loads((root / RUN_FILE).read_text())["run"] == run.id


def test_fckpt_ls_says_which_run_each_memory_checkpoint_is_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from functional_ckpt._src import cli

    root, memory = tmp_path / "root", tmp_path / "mem"
    killed(root, memory, die_at=2, disk_every=2, memory_every=1)
    run = read_run(root)
    assert run is not None
    shutil.copytree(memory / step_name(1), memory / step_name(9))  # damage: it records 1
    assert cli.main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "RUN" in out and run.id[:8] in out and "another run" not in out  # was, of step 9
    assert "records step 1" in next(x for x in out.splitlines() if x.startswith(step_name(9)))
    assert cli.main(["ls", "--json", str(root)]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r.get("kind") == "memory"]
    assert [(r["step"], r.get("run"), r.get("this_run")) for r in rows] == [
        (1, run.id, True),
        (2, run.id, True),
        (9, None, None),
    ]
    assert "named for step 9, but the checkpoint records step 1" in rows[2]["note"], rows
    shutil.rmtree(memory)
    memory.write_text("a file in the folder's place")
    assert cli.main(["ls", str(root)]) == 0  # the root listed, the folder's problem said
    assert f"{memory}: the checkpoint root is a file" in capsys.readouterr().out


# --------------------------------------------------------------------------- lineage


def saved(root: Path, *steps: int, keep: Any = None) -> None:
    with fc.CheckpointManager(root, keep=keep) as mgr:
        for step in steps:
            mgr.maybe_save(state(step), step=step)


def test_a_checkpoint_copied_in_from_another_run_is_never_resumed_nor_deleted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    from functional_ckpt._src import cli

    root, other = tmp_path / "root", tmp_path / "other"
    saved(root, 1, 2)
    saved(other, 5)
    shutil.copytree(other / step_name(5), root / step_name(5))
    theirs = read_run(other)
    assert theirs is not None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with fc.CheckpointManager(root, keep=fc.keep_last(1)) as mgr:
            exact(mgr.restore_latest(like=state(0)), 2)  # not the other run's step 5
            assert mgr.restored_step == 2
            mgr.maybe_save(state(3), step=3)  # no "step 5 is newer": it is not this run's
            mgr.rollback(3, like=state(0), newer="delete")
    assert committed(root) == [3, 5]  # retention and the rollback left it alone
    exact(fc.restore(root / step_name(5)), 5)
    told = [str(w.message) for w in caught if "not of this run's lineage" in str(w.message)]
    assert len(told) == 1 and theirs.id in told[0], told  # reported once
    records = [r for r in caplog.records if "not of this run's lineage" in r.getMessage()]
    assert records and records[0].levelname == "WARNING"
    assert records[0].name.startswith("functional_ckpt")
    assert cli.main(["ls", "--json", "--keep-last", "1", str(root)]) == 0
    rows = {r["step"]: r for r in json.loads(capsys.readouterr().out) if "kind" not in r}
    assert rows[5]["run"] == theirs.id and "another run" in rows[5]["kept_by"][0]
    assert rows[3]["kept_by"] == ["keep_last(1)", "latest"]
    assert cli.main(["prune", "--keep-last", "1", "--yes", str(root)]) == 0
    assert committed(root) == [3, 5]


def test_a_fork_keeps_its_parents_checkpoints_and_no_others(tmp_path: Path) -> None:
    """A fork records its parent's run: the parent's checkpoints are this lineage's
    (resumed, and deleted by retention); an unrelated run's are neither."""
    root, other, fork = tmp_path / "root", tmp_path / "other", tmp_path / "fork"
    saved(root, 1, 4)
    saved(other, 2)
    fc.manager.fork(root / step_name(4), fork)
    for src in (root / step_name(1), other / step_name(2)):
        shutil.copytree(src, fork / src.name)
    flip(fork / step_name(4), "w")  # the fork's own step is damaged
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fc.CheckpointManager(fork, keep=fc.keep_last(1)) as mgr:
            exact(mgr.restore_latest(like=state(0)), 1)  # its parent's, not the other run's
            mgr.maybe_save(state(5), step=5)
    assert committed(fork) == [2, 5]  # the parent's step 1 pruned, the other run's kept
    meta = fc.CheckpointManager(fork, read_only=True).info(5).metadata["run"]
    parent = read_run(root)
    assert parent is not None and meta["ancestors"] == [parent.id]


def test_checkpoints_without_a_run_are_this_runs(tmp_path: Path) -> None:
    """Saved by ``fc.save`` (or before run ids, or adopted from DCP): resumed as ever."""
    root = tmp_path / "root"
    saved(root, 1)
    fc.save(root / step_name(3), state(3))
    with fc.CheckpointManager(root) as mgr:
        exact(mgr.restore_latest(like=state(0)), 3)


def test_a_remote_checkpoint_of_another_run_is_never_resumed(tmp_path: Path, mem: str) -> None:
    root, other = tmp_path / "root", tmp_path / "other"
    with fc.CheckpointManager(root, tiers=(fc.manager.Remote(mem),)) as mgr:
        mgr.maybe_save(state(1), step=1)
        assert mgr.remote is not None and mgr.remote.wait()
    with fc.CheckpointManager(other, tiers=(fc.manager.Remote(mem),)) as mgr:
        mgr.maybe_save(state(6), step=6)  # another run writes the same remote root
        assert mgr.remote is not None and mgr.remote.wait() and mgr.remote.steps() == [1, 6]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fc.CheckpointManager(
            root, tiers=(fc.manager.Remote(mem, keep=fc.keep_last(1)),)
        ) as mgr:
            exact(mgr.restore_latest(like=state(0)), 1)
            mgr.maybe_save(state(2), step=2)
            assert mgr.remote is not None and mgr.remote.wait()
            assert mgr.remote.steps() == [2, 6]  # its retention left the other run's alone
    assert not (root / step_name(6)).exists()  # nor was it downloaded


# --------------------------------------------------------------------------- crash means crash


def test_an_exception_leaving_the_manager_keeps_the_memory_tier(tmp_path: Path) -> None:
    root, memory = tmp_path / "root", tmp_path / "mem"
    tier = fc.manager.Memory(path=memory, async_save=False, promote_on=())
    manager = fc.CheckpointManager(root, save=fc.every_steps(10), tiers=(tier,))
    with pytest.raises(RuntimeError, match="a crash"), manager as mgr:
        for step in (1, 2, 3):
            mgr.maybe_save(state(step), step=step)
        raise RuntimeError("a crash")
    assert committed(memory) == [2, 3] and committed(root) == []  # kept, nothing promoted
    step, got = resumed(root, memory, disk_every=10)
    assert step == 3
    exact(got, 3)
    assert not memory.exists()  # a clean exit removes it


def test_an_exception_promotes_where_a_signal_would(tmp_path: Path) -> None:
    root, memory = tmp_path / "root", tmp_path / "mem"
    tier = fc.manager.Memory(path=memory, async_save=False)  # promote_on=(SIGTERM,)
    manager = fc.CheckpointManager(root, save=fc.every_steps(10), tiers=(tier,))
    with pytest.raises(RuntimeError, match="a crash"), manager as mgr:
        for step in (1, 2, 3):
            mgr.maybe_save(state(step), step=step)
        raise RuntimeError("a crash")
    assert committed(root) == [3] and committed(memory) == [2, 3]
    exact(fc.restore(root / step_name(3)), 3)
    shutil.rmtree(memory)


def test_a_promotion_waits_for_the_disk_save_of_the_same_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from functional_ckpt._src.storage import shards

    root, memory = tmp_path / "root", tmp_path / "mem"
    real, release = shards.write_shard, threading.Event()

    def slow(path: Path, *args: Any, **kwargs: Any) -> Any:
        if path.parent.parent == root:
            release.wait()  # the disk save of step 2 is still being written
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shards, "write_shard", slow)
    tier = fc.manager.Memory(path=memory, async_save=False)
    with fc.CheckpointManager(root, save=fc.every_steps(2), async_save=True, tiers=(tier,)) as mgr:
        mgr.maybe_save(state(1), step=1)
        mgr.maybe_save(state(2), step=2)  # on both tiers; the disk's off the training thread
        threading.Timer(0.5, release.set).start()
        assert mgr.memory is not None and mgr.memory.promote(60.0) is None  # the disk has it
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mgr.maybe_save(state(3), step=3)
            mgr.maybe_save(state(4), step=4)  # no CheckpointExists from the save of step 2
    assert committed(root) == [2, 4]
    exact(fc.restore(root / step_name(2)), 2)


# --------------------------------------------------------------------------- a planted folder

NOBODY = 65534


def as_another_user(action: Any) -> None:
    """Run ``action()`` in a forked child that has become another local user."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()
            code = 0
        except BaseException as e:
            print(f"as another user: {type(e).__name__}: {e}", flush=True)
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a second user needs root to become")


@pytest.fixture
def shared_tmp() -> Any:
    """A directory both users reach (pytest's own is this user's only)."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="fckpt-two-users-"))
    os.chmod(base, 0o777)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@needs_root
def test_a_default_folder_planted_by_another_user_is_never_used(shared_tmp: Path) -> None:
    tmp_path = shared_tmp
    root = tmp_path / "root"
    killed(root, None, die_at=2, disk_every=100, memory_every=1)
    mine = default_folder_of(root)
    shutil.rmtree(mine)  # the machine restarted: /dev/shm is empty, the name known
    planted = tmp_path / "planted"

    fc.save(planted, fc.capture(**state(99)))  # weights of another user's choosing

    def plant() -> None:  # where this run's folder would be
        mine.mkdir(mode=0o777)
        shutil.copytree(planted, mine / step_name(99))

    try:
        as_another_user(plant)
        assert os.stat(mine).st_uid == NOBODY
        with pytest.warns(MemoryTierWarning, match="belongs to another user"):
            step, got = resumed(root, None, disk_every=100)
        assert step is None and got is None  # never the planted weights; the job starts
        assert default_folder_of(root) != mine and committed(mine) == [99]  # left alone
    finally:
        shutil.rmtree(mine, ignore_errors=True)


@needs_root
def test_an_explicit_folder_of_another_user_or_open_to_others_is_refused(
    shared_tmp: Path,
) -> None:
    tmp_path = shared_tmp
    theirs = tmp_path / "theirs"
    as_another_user(lambda: theirs.mkdir(mode=0o700))
    with pytest.raises(fc.CheckpointError, match="belongs to another user"):
        fc.CheckpointManager(tmp_path / "a", tiers=(fc.manager.Memory(path=theirs),))
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(fc.CheckpointError, match="open to other users"):
        fc.CheckpointManager(tmp_path / "b", tiers=(fc.manager.Memory(path=shared),))
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(fc.CheckpointError, match="is a link"):
        fc.CheckpointManager(tmp_path / "c", tiers=(fc.manager.Memory(path=tmp_path / "link"),))
    with fc.CheckpointManager(tmp_path / "d", tiers=(fc.manager.Memory(path=tmp_path / "m"),)):
        assert stat.S_IMODE(os.stat(tmp_path / "m").st_mode) == 0o700


def test_a_folder_inside_or_around_a_root_is_refused(tmp_path: Path) -> None:
    for other in (tmp_path / "other", tmp_path / "ram" / "a" / "b" / "other"):
        with fc.CheckpointManager(other) as mgr:  # a root of another run, at any depth
            mgr.maybe_save(state(7), step=7)
    for folder in (tmp_path / "other" / "ram", tmp_path, tmp_path / "ram"):
        with pytest.raises(fc.CheckpointError, match="apart from the disk root"):
            fc.CheckpointManager(tmp_path / "r", tiers=(fc.manager.Memory(path=folder),))
    for n in range(SEARCHED):  # a tree too large to search is refused
        (tmp_path / "big" / str(n)).mkdir(parents=True)
    with pytest.raises(fc.CheckpointError, match=rf"Memory\(path=.*big'\): more than {SEARCHED}"):
        fc.CheckpointManager(tmp_path / "r", tiers=(fc.manager.Memory(path=tmp_path / "big"),))
    assert committed(tmp_path / "ram" / "a" / "b" / "other") == [7]  # nothing lost


def test_the_memory_tier_keeps_by_a_retention_policy(tmp_path: Path) -> None:
    tier = fc.manager.Memory(path=tmp_path / "mem", keep=fc.keep_last(1), async_save=False)
    assert tier.held == 1 and fc.manager.Memory(keep=2).held == 2
    with fc.CheckpointManager(tmp_path / "root", save=fc.every_steps(10), tiers=(tier,)) as mgr:
        for step in (1, 2, 3):
            mgr.maybe_save(state(step), step=step)
        assert mgr.memory is not None and mgr.memory.steps() == [3]
    with pytest.raises(ValueError, match=r"Memory\(keep=keep_best.*keep_last\(1\)"):
        fc.manager.Memory(keep=fc.keep_best(1, "loss"))
    with pytest.raises(ValueError, match=r"Memory\(keep=keep_last\(3\)\)"):
        fc.manager.Memory(keep=fc.keep_last(3))


# --------------------------------------------------------------------------- the property


class Model:
    """What each tier holds of one root's run, as the rules say: ``{step: intact}``."""

    def __init__(self, disk_every: int, memory_every: int) -> None:
        self.disk_every, self.memory_every = disk_every, memory_every
        self.disk: dict[int, bool] = {}
        self.memory: dict[int, bool] = {}

    def resume(self) -> int | None:
        """The step a resume takes, walking past damage as it does (damage it meets goes:
        removed from the memory tier, moved aside on disk)."""
        found = None
        for step in sorted(self.memory, reverse=True):
            if self.memory[step]:
                found = step
                break
            del self.memory[step]
        for step in sorted(self.disk, reverse=True):
            if found is not None and step <= found:
                break
            if self.disk[step]:
                return step
            del self.disk[step]
        return found

    def run(self, die_at: int) -> int | None:
        start = self.resume()
        for step in range((start or 0) + 1, die_at + 1):
            if step % self.disk_every == 0:
                self.disk[step] = True
            if step % self.memory_every == 0:
                older = sorted(s for s in self.memory if s < step)
                self.memory = {s: self.memory[s] for s in older[-1:]}  # keep=2 counts the new
                self.memory[step] = True
        return start


@pytest.mark.parametrize("seed", range(3))
def test_a_resume_takes_the_newest_intact_step_of_this_run(tmp_path: Path, seed: int) -> None:
    """Random saves, kills, damaged checkpoints and wiped roots: every relaunch resumes
    the newest intact state of this run, bit for bit, whichever tier holds it."""
    import random

    rng = random.Random(seed)
    root = tmp_path / "ckpt"
    model = Model(disk_every=rng.choice([3, 4, 5]), memory_every=rng.choice([1, 2]))
    folders: set[Path] = set()
    step = 0
    try:
        for launch in range(6):
            report = tmp_path / f"resumed-{launch}.pt"
            step += rng.randint(1, 6)
            want = model.run(step)
            killed(root, None, step, model.disk_every, model.memory_every, report)
            folders.add(default_folder_of(root))
            got = torch.load(report, weights_only=False)
            if want is None:
                assert got is None, (launch, got)
            else:
                assert got is not None and got["step"] == want, (launch, want, got)
                exact(got, want)
            step = max([step, *model.disk, *model.memory])
            assert sorted(model.disk) == committed(root), (launch, model.disk)
            assert sorted(model.memory) == committed(default_folder_of(root)), model.memory
            what = rng.random()
            if what < 0.2:  # the root emptied by hand: a new run
                subprocess.run("rm -rf ckpt/*", shell=True, cwd=tmp_path, check=True)
                model.disk, model.memory = {}, {}
                step = 0
            elif what < 0.7:  # one checkpoint damaged, never the last intact one
                tiers = [(model.disk, root), (model.memory, default_folder_of(root))]
                kept = [(t, f, s) for t, f in tiers for s, ok in t.items() if ok]
                if len(kept) > 1:
                    tier, folder, victim = rng.choice(kept)
                    flip(folder / step_name(victim), "w")
                    tier[victim] = False
    finally:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)


# --------------------------------------------------------------------------- one protocol


class FakeTier:
    """A fourth tier, fastest first, that only answers the tier protocol's questions."""

    durable = False
    local = True

    def __init__(self, root: Path) -> None:
        self.root, self.held, self.closed = root, {}, []  # type: ignore[var-annotated]

    def put(self, step: int) -> None:
        path = self.root / step_name(step)
        fc.save(path, state(step), metadata={"run": {"id": "fake", "parent": None}})
        self.held[step] = path

    def steps(self) -> list[int]:
        return sorted(self.held)

    def infos(self) -> list[Any]:
        from functional_ckpt._src.root.listing import read_info

        return [read_info(self.held[s], s) for s in self.steps()]

    def newest(self, read: Any, above: int | None) -> Any:
        from functional_ckpt._src.root.listing import read_info

        for step in reversed(self.steps()):
            if above is None or step > above:
                return read_info(self.held[step], step), read(self.held[step])
        return None

    def open(self, step: int) -> Path:
        return self.held[step]  # type: ignore[no-any-return]

    def copy_in(self, source: Any, within: float) -> Path | None:
        newer = [s for s in source.steps() if s > max(self.steps(), default=-1)]
        if not newer:
            return None
        self.held[newer[-1]] = self.root / step_name(newer[-1])
        shutil.copytree(source.open(newer[-1]), self.held[newer[-1]])
        return self.held[newer[-1]]  # type: ignore[no-any-return]

    def delete(self, steps: Any) -> None:
        for step in steps:
            shutil.rmtree(self.held.pop(step))

    def wait(self) -> None:
        pass

    def close(self, *, crashed: bool) -> None:
        self.closed.append(crashed)


def test_a_tier_is_only_asked_the_protocol_and_the_manager_decides(tmp_path: Path) -> None:
    from functional_ckpt._src.manager.tiers import retain

    root, fake = tmp_path / "root", FakeTier(tmp_path / "fake")
    with fc.CheckpointManager(root) as mgr:
        for step in (1, 2):
            mgr.maybe_save(state(step), step=step)
    for step in (1, 3, 4):
        fake.put(step)
    mgr = fc.CheckpointManager(root)
    mgr.tiers.insert(0, fake)  # no other change: resume, deletion and close go through it
    back = mgr.restore_latest(like=state(0))
    assert mgr.restored_step == 4 and back is not None
    exact(back, 4)
    mgr.delete(1)  # from every tier that holds it
    assert fake.steps() == [3, 4] and mgr.steps() == [2]
    assert retain(fake, fc.keep_last(1)) == [3] and fake.steps() == [4]  # one retention rule
    mgr.rollback(2, like=state(0), newer="delete")  # a tier of copies drops the newer steps
    assert fake.steps() == []
    mgr.close()
    assert fake.closed == [False]


def test_a_fourth_tier_takes_part_in_promotion_with_no_other_change(tmp_path: Path) -> None:
    from functional_ckpt._src.manager.tiers import promote

    root, fake, behind = tmp_path / "root", FakeTier(tmp_path / "fake"), FakeTier(tmp_path / "b")
    behind.durable = True  # type: ignore[misc]
    fake.put(5)
    with fc.CheckpointManager(root) as mgr:
        mgr.maybe_save(state(3), step=3)
        mgr.tiers.insert(0, fake)  # faster than the disk, not durable: promoted into it
        assert promote(mgr.tiers, fake, 60.0) == root / step_name(5)
        assert mgr.steps() == [3, 5] and promote(mgr.tiers, fake, 60.0) is None  # held now
        exact(fc.restore(root / step_name(5)), 5)
        mgr.tiers.append(behind)  # durable, behind the disk: each commit is copied in
        mgr.maybe_save(state(7), step=7)
        assert behind.steps() == [7]
        exact(fc.restore(behind.open(7)), 7)
    assert fake.closed == behind.closed == [False]


def test_a_fork_starts_a_new_run_whose_parent_is_the_forked_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from functional_ckpt._src import cli
    from functional_ckpt._src.storage.committed import check_committed

    root = tmp_path / "root"
    with fc.CheckpointManager(root) as mgr:
        mgr.maybe_save(state(3), step=3)
    parent = read_run(root)
    forked = fc.manager.fork(root / step_name(3), tmp_path / "fork")
    child = read_run(tmp_path / "fork")
    assert parent is not None and child is not None and child.id != parent.id
    meta = fc.CheckpointManager(tmp_path / "fork", read_only=True).info(3).metadata
    crc = check_committed(root / step_name(3))["manifest_crc32"]
    assert meta["run"] == {
        "id": child.id,
        "parent": {"run": parent.id, "step": 3, "manifest_crc32": crc},
        "ancestors": [parent.id],  # the parent's checkpoints are this lineage's
        "until": {parent.id: 3},  # up to the step the fork left it at
        "until_time": {parent.id: fc.inspect(root / step_name(3)).metadata["time"]},  # its save
    }
    assert forked == tmp_path / "fork" / step_name(3)
    for where, run in ((root, parent), (tmp_path / "fork", child)):
        assert cli.main(["ls", "--json", str(where)]) == 0
        rows = [r for r in json.loads(capsys.readouterr().out) if "kind" not in r]
        assert [r["run"] for r in rows] == [run.id]
        assert cli.main(["ls", str(where)]) == 0
        out = capsys.readouterr().out
        assert "RUN" in out and run.id[:8] in out


def test_fckpt_ls_of_a_remote_says_which_run_each_checkpoint_is_of(
    tmp_path: Path, mem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from functional_ckpt._src import cli

    root = tmp_path / "root"
    with fc.CheckpointManager(root, tiers=(fc.manager.Remote(mem),)) as mgr:
        mgr.maybe_save(state(1), step=1)
        assert mgr.remote is not None and mgr.remote.wait()
    run = read_run(root)
    assert run is not None
    assert cli.main(["ls", "--json", mem]) == 0
    assert [r["run"] for r in json.loads(capsys.readouterr().out)] == [run.id]
    assert cli.main(["ls", mem]) == 0
    out = capsys.readouterr().out
    assert "RUN" in out and run.id[:8] in out


def test_no_tier_module_decides_resume_retention_or_progress_itself() -> None:
    """Which checkpoint a resume takes, what retention deletes and the progress told to
    ``fckpt run`` are decided in manager/tiers.py only, over every tier alike."""
    import functional_ckpt._src.manager as pkg

    deciders = ("plan_deletions(", "newest_readable(", "report_progress(", ".select(")
    found = {
        (path.name, name)
        for path in Path(pkg.__file__).parent.glob("*.py")
        if path.name != "tiers.py"
        for name in deciders
        if name in path.read_text()
    }
    assert found == set()
    remote = Path(pkg.__file__).parent.parent / "remote"
    assert not [p.name for p in remote.glob("*.py") if "keep.select(" in p.read_text()]
    tiers = (Path(pkg.__file__).parent / "tiers.py").read_text()
    assert "isinstance(" not in tiers  # a tier says what it is: ``local``, ``durable``


def test_a_root_emptied_by_hand_and_reopened_without_the_memory_tier_names_its_folder(
    tmp_path: Path,
) -> None:
    """The old run's RAM is no one's now: whichever tiers the new run has, the folder is
    named with how to free it (and left: it may hold the only copy of its steps)."""
    root = tmp_path / "ckpt"
    killed(root, None, die_at=3, disk_every=100, memory_every=1)
    old = default_folder_of(root)
    try:
        subprocess.run("rm -rf ckpt/*", shell=True, cwd=tmp_path, check=True)
        earlier = r"steps \[2, 3\]\) of an earlier run"
        with (
            pytest.warns(MemoryTierWarning, match=earlier) as told,
            fc.CheckpointManager(root, save=fc.every_steps(100)) as mgr,
        ):
            assert mgr.restore_latest(like=state(0)) is None
        assert f"rm -rf {old}" in str(told[0].message), told[0].message
        assert committed(old) == [2, 3]
    finally:
        shutil.rmtree(old, ignore_errors=True)


def test_a_run_record_whose_secret_names_no_folder_is_refused_naming_it(tmp_path: Path) -> None:
    """The secret names the default folder in RAM: one edited into a path is refused,
    naming run.json and the field, before any folder is made."""
    root = tmp_path / "root"
    with fc.CheckpointManager(root):
        pass
    record = json.loads((root / RUN_FILE).read_text())
    for secret in ("../../tmp/elsewhere", "a/b"):
        (root / RUN_FILE).write_text(json.dumps({**record, "secret": secret}))
        with pytest.raises(fc.CheckpointError) as err:
            fc.CheckpointManager(root, tiers=(fc.manager.Memory(),))
        said = str(err.value)
        assert str(root / RUN_FILE) in said and '"secret"' in said and repr(secret) in said, said
    with fc.CheckpointManager(root) as mgr:  # the refused manager let go of the root
        assert mgr.steps() == []


def test_a_folder_holding_a_directory_that_cannot_be_searched_is_refused(
    shared_tmp: Path,
) -> None:
    """Whether a root lies below the memory tier's folder is not known where a directory
    there cannot be read: refused, naming it, never taken for none."""
    folder, sealed = shared_tmp / "ram", shared_tmp / "ram" / "a" / "sealed"

    def check() -> None:
        sealed.mkdir(parents=True)
        os.chmod(sealed, 0)
        try:
            with pytest.raises(fc.CheckpointError, match="cannot be searched") as err:
                fc.CheckpointManager(shared_tmp / "root", tiers=(fc.manager.Memory(path=folder),))
            assert f"{sealed} cannot be searched" in str(err.value), err.value
        finally:
            os.chmod(sealed, 0o700)

    as_another_user(check) if os.geteuid() == 0 else check()  # root reads it all the same


@pytest.mark.parametrize(
    "cuts", ["[3, 4]", "[[3, 4], [5]]", '[["3", null]]', "[[1, 2.5]]", "[[-5, null]]", "[[4, 3]]"]
)
def test_a_damaged_record_of_the_trunks_cuts_is_refused_naming_it(
    tmp_path: Path, cuts: str
) -> None:
    """A hand-edited or damaged ``"cuts"`` is never read as none (every move of the trunk
    undone): the manager refuses to open, naming run.json and the field, and the root's
    checkpoints and lock are left as they were."""
    root = tmp_path / "root"
    with fc.CheckpointManager(root, save=fc.every_steps(1)) as mgr:
        mgr.maybe_save({"w": torch.ones(3)}, step=1)
    doc = json.loads((root / "run.json").read_text())
    doc["cuts"] = json.loads(cuts)
    (root / "run.json").write_text(json.dumps(doc))
    with pytest.raises(fc.errors.CheckpointError, match=r'run\.json: "cuts" is .* not a list'):
        fc.CheckpointManager(root, save=fc.every_steps(1))
    doc["cuts"] = []
    (root / "run.json").write_text(json.dumps(doc))
    with fc.CheckpointManager(root, save=fc.every_steps(1)) as mgr:  # the lock was released
        assert mgr.restore_latest() is not None and mgr.restored_step == 1


@pytest.mark.parametrize("step", ["3", 3.0, None, True, -1])
def test_a_step_that_is_no_step_number_is_refused_by_delete_and_rollback_naming_it(
    tmp_path: Path, step: Any
) -> None:
    """Not a format error from deep inside, nor ``True`` taken for step 1: the argument
    named, before anything is deleted or moved."""
    with fc.CheckpointManager(tmp_path / "root", save=fc.every_steps(1)) as mgr:
        for s in (1, 2):
            mgr.maybe_save({"w": torch.full((3,), float(s))}, step=s)
        for call in (mgr.delete, mgr.rollback):
            with pytest.raises(TypeError, match=rf"{call.__name__}\(step={step!r}\): expected"):
                call(step)
        assert mgr.steps() == [1, 2]
