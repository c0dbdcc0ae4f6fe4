"""The memory tier: checkpoints in RAM every step, so that a crash costs one step.

Real processes are killed for real: a SIGKILLed run resumes from the memory tier and
ends bit-identical to an uninterrupted run; a SIGTERMed one leaves its newest memory
checkpoint on disk. The rest is the tier's hygiene: its budget, its folder's lock,
what a crashed run left there, a damaged memory checkpoint.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src import cli
from functional_ckpt._src.format import naming
from functional_ckpt._src.format.naming import parse_step, step_name
from functional_ckpt._src.manager.memory import MARK_FILE
from functional_ckpt._src.storage.ram import MEMORY_STATUS
from functional_ckpt.errors import LeftoverWarning, MemoryTierWarning
from tests import manager_job, prefork
from tests.exact import assert_exact
from tests.patience import eventually, finished

REPO = Path(__file__).resolve().parent.parent
STEPS = 24
DISK_EVERY = 10


def small_state(step: int) -> dict[str, Any]:
    return {"w": torch.full((64, 16), float(step)), "b": torch.arange(5) + step, "step": step}


def committed(folder: Path) -> list[int]:
    if not folder.is_dir():
        return []
    steps = (parse_step(p.name) for p in folder.iterdir())
    return sorted(
        s
        for s in steps
        if s is not None and (folder / step_name(s) / naming.COMMIT_MARKER).exists()
    )


def corrupt(path: Path) -> None:
    """Flip one byte in the middle of the checkpoint's largest data file."""
    data = max(
        (p for p in path.iterdir() if p.name.startswith("__")), key=lambda p: p.stat().st_size
    )
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    os.chmod(data, 0o644)
    data.write_bytes(bytes(raw))


# --------------------------------------------------------------------------- processes


@pytest.fixture(scope="module")
def ctx() -> mp.context.ForkServerContext:
    """A forkserver that has imported torch and functional_ckpt once for all runs."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(["tests.manager_job", *manager_job.PRELOAD])
    return context


def start(ctx: mp.context.ForkServerContext, root: Path, memory: Path, **kwargs: Any) -> Any:
    proc = ctx.Process(target=manager_job.run_memory, args=(str(root), str(memory)), kwargs=kwargs)
    proc.start()
    return proc


@contextlib.contextmanager
def running(ctx: mp.context.ForkServerContext, root: Path, memory: Path) -> Iterator[Any]:
    """A job training for ever, once its memory tier holds a checkpoint; killed on exit."""
    proc = start(ctx, root, memory, steps=10**6, disk_every=10**6)
    try:
        eventually(lambda: committed(memory), "a memory checkpoint", alive=proc.is_alive)
        yield proc
    finally:
        proc.kill()
        proc.join()


@pytest.fixture(scope="module")
def reference(ctx: mp.context.ForkServerContext, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The final state of an uninterrupted run with a memory tier."""
    base = tmp_path_factory.mktemp("reference")
    assert finished(start(ctx, base / "root", base / "mem", steps=STEPS)) == 0
    assert not (base / "mem").exists()  # close() removed the tier's folder
    return fc.restore(base / "root" / step_name(STEPS))


def check_final(root: Path, reference: Any) -> None:
    final = fc.restore(root / step_name(STEPS))
    assert_exact(fc.codec.to_python(final), fc.codec.to_python(reference))


def test_sigkill_resumes_from_the_memory_tier_bit_identically(
    ctx: mp.context.ForkServerContext,
    reference: Any,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    root, memory = tmp_path / "root", tmp_path / "mem"
    assert finished(start(ctx, root, memory, steps=STEPS, die_at=13)) == -signal.SIGKILL
    assert committed(root) == [10]  # the disk tier saves every 10 steps
    assert committed(memory) == [12, 13]  # the memory tier every step, the newest two
    assert fc.verify(memory / step_name(13)).ok  # the ordinary format, checksummed
    assert cli.main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"memory tier ({memory}, left by pid" in out, out
    assert step_name(12) in out and step_name(13) in out
    assert cli.main(["ls", "--json", str(root)]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r.get("kind") == "memory"]
    assert [r["step"] for r in rows] == [12, 13]
    with fc.CheckpointManager(root, read_only=True) as ro, warnings.catch_warnings():
        warnings.simplefilter("error")
        state = ro.restore_latest(like=None)
        assert state is not None and ro.restored_step == 10  # a reader sees the disk only
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        manager_job.run_memory(str(root), str(memory), steps=STEPS)  # resumes at 13
    check_final(root, reference)
    assert not memory.exists()


def test_sigkill_at_random_moments_resumes_bit_identically(
    ctx: mp.context.ForkServerContext, reference: Any, tmp_path: Path
) -> None:
    """Each run is killed at a random moment after its memory tier reached a random
    step: mostly inside the next memory save (the job saves one every step)."""
    rng = random.Random(20261202)
    root, memory = tmp_path / "root", tmp_path / "mem"
    kills = 0
    newest = 0
    while newest < STEPS - 4:
        target = rng.randint(newest + 1, newest + 4)
        # A step of 20 ms: the run outlasts the kill's random delay (at most 50 ms) by
        # at least four steps, however fast the saves are.
        proc = start(ctx, root, memory, steps=STEPS, step_time=0.02)

        def reached(target: int = target, proc: Any = proc) -> bool:
            return max(committed(memory), default=0) >= target or not proc.is_alive()

        eventually(reached, f"memory step {target}")
        time.sleep(rng.uniform(0.0, 0.05))
        proc.kill()
        code = finished(proc)
        if code == 0:
            break
        assert code == -signal.SIGKILL
        kills += 1
        for folder in (root, memory):
            for step in committed(folder):
                assert fc.verify(folder / step_name(step)).ok
        newest = max(committed(memory), default=newest)
    assert finished(start(ctx, root, memory, steps=STEPS)) == 0
    assert kills >= 3
    check_final(root, reference)


def test_sigterm_promotes_the_newest_memory_checkpoint_to_disk(
    ctx: mp.context.ForkServerContext, tmp_path: Path
) -> None:
    root, memory = tmp_path / "root", tmp_path / "mem"
    with running(ctx, root, memory) as proc:
        assert committed(root) == []  # the disk tier never saves on its own here
        proc.terminate()  # SIGTERM
        assert finished(proc) == -signal.SIGTERM  # promoted, then the signal took its course
    on_disk = committed(root)
    assert len(on_disk) == 1, on_disk
    step = on_disk[0]
    assert step >= 1 and step in committed(memory)
    assert fc.verify(root / step_name(step)).ok
    assert_exact(
        fc.codec.to_python(fc.restore(root / step_name(step))),
        fc.codec.to_python(fc.restore(memory / step_name(step))),
    )
    leftovers = [p.name for p in root.iterdir() if naming.is_temporary_name(p.name)]
    assert not leftovers, leftovers


def test_forked_workers_signalled_with_their_parent_never_promote(tmp_path: Path) -> None:
    """One writer per step: a process group's SIGTERM reaches a DataLoader's forked workers
    too; they inherit the handler but only the manager's process promotes."""
    import subprocess
    import sys

    from tests.patience import HANG

    job = Path(__file__).with_name("forked_worker_job.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = subprocess.run(
        [sys.executable, str(job), str(tmp_path), "3"],
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG,
        start_new_session=True,  # a process group of its own, signalled whole
    )
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-3000:])
    assert "LIVED" not in done.stdout, done.stdout  # every process ended by the signal
    root = tmp_path / "root"
    assert committed(root) == [3] and fc.verify(root / step_name(3)).ok
    assert not [p.name for p in root.iterdir() if naming.is_temporary_name(p.name)]
    assert "Warning" not in done.stderr, done.stderr[-3000:]  # no second promotion of step 3


def test_a_second_run_is_refused_on_a_folder_in_use(
    ctx: mp.context.ForkServerContext, tmp_path: Path
) -> None:
    memory = tmp_path / "mem"
    with running(ctx, tmp_path / "root", memory) as proc:
        with pytest.raises(fc.CheckpointError) as err:
            fc.CheckpointManager(tmp_path / "other", tiers=(fc.manager.Memory(path=memory),))
        message = str(err.value)
        assert str(memory) in message and f"pid {proc.pid}" in message, message
        with fc.CheckpointManager(tmp_path / "other") as other:  # its disk lock was released
            assert other.steps() == []


def test_a_damaged_memory_checkpoint_falls_back_to_disk(
    ctx: mp.context.ForkServerContext, reference: Any, tmp_path: Path
) -> None:
    root, memory = tmp_path / "root", tmp_path / "mem"
    assert finished(start(ctx, root, memory, steps=STEPS, die_at=13)) == -signal.SIGKILL
    for step in committed(memory):
        corrupt(memory / step_name(step))
    with pytest.warns(MemoryTierWarning, match="unreadable") as caught:
        manager_job.run_memory(str(root), str(memory), steps=STEPS)  # resumes at 10
    told = " ".join(str(w.message) for w in caught)
    assert step_name(12) in told and step_name(13) in told, told
    check_final(root, reference)


# --------------------------------------------------------------------------- one process


def test_saves_every_step_into_ram_and_restores_from_there(tmp_path: Path) -> None:
    """The default folder is under /dev/shm, one per root; it goes when the manager closes."""
    root = tmp_path / "root"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mgr = fc.CheckpointManager(root, save=fc.every_steps(5), tiers=(fc.manager.Memory(),))
        assert mgr.memory is not None
        folder = mgr.memory.folder
        assert folder.parent == Path("/dev/shm") and folder.is_dir()
        for s in range(1, 8):
            mgr.maybe_save(small_state(s), step=s)
            mgr.wait_staged()
        mgr.wait()
        assert mgr.steps() == [5] and mgr.memory.steps() == [6, 7]
        assert fc.verify(folder / step_name(7)).ok
        state = mgr.restore_latest()
        assert state is not None and mgr.restored_step == 7 and state["step"] == 7
        assert torch.equal(state["w"], small_state(7)["w"])
        with fc.CheckpointManager(root, read_only=True, tiers=(fc.manager.Memory(),)) as ro:
            assert ro.memory is None  # a reader follows the disk and remote tiers only
            assert ro.restore_latest() is not None and ro.restored_step == 5
        mgr.close()
    assert not folder.exists()
    assert fc.CheckpointManager(root, read_only=True).steps() == [5]


def test_a_damaged_memory_step_goes_with_the_folder_at_close(tmp_path: Path) -> None:
    """A step the folder holds damaged (a copy of step 1 named step_9) and never saves
    again is no one's: a clean close() removes it with the folder."""
    memory = tmp_path / "mem"
    with fc.CheckpointManager(tmp_path / "root", tiers=(fc.manager.Memory(path=memory),)) as mgr:
        mgr.maybe_save(small_state(1), step=1)
        mgr.wait()
        shutil.copytree(memory / step_name(1), memory / step_name(9))
        assert mgr.memory is not None and mgr.memory.steps() == [1]
    assert not memory.exists(), sorted(os.listdir(memory))


def test_a_memory_save_is_one_copy_into_ram_and_staged_once_there(tmp_path: Path) -> None:
    """The tier writes the live tensors straight into its files (no staging buffers);
    the loop's in-place update right after ``wait_staged`` reaches no checkpoint."""
    state = {"w": {f"t{i}": torch.full((1 << 20,), float(i)) for i in range(8)}, "step": 0}
    tier = fc.manager.Memory(path=tmp_path / "mem", keep=2)
    with fc.CheckpointManager(tmp_path / "root", save=fc.policy.never(), tiers=(tier,)) as mgr:
        assert mgr.memory is not None
        for s in range(1, 6):
            state["step"] = s
            mgr.maybe_save(state, step=s)
            mgr.wait_staged()
            for t in state["w"].values():
                t.add_(1.0)  # the optimizer step
        mgr.wait()
        assert mgr.memory.writes.stager.allocations == 0
        assert mgr.memory.steps() == [4, 5]
        back = fc.restore(mgr.memory.view.path(5))
        assert back["step"] == 5
        assert all(bool((back["w", f"t{i}"] == float(i + 4)).all()) for i in range(8))


def test_keep_one_holds_a_single_checkpoint(tmp_path: Path) -> None:
    tier = fc.manager.Memory(path=tmp_path / "mem", keep=1, async_save=False)
    with fc.CheckpointManager(tmp_path / "root", save=fc.policy.never(), tiers=(tier,)) as mgr:
        for s in range(1, 5):
            mgr.maybe_save(small_state(s), step=s)
            assert committed(tmp_path / "mem") == [s]


def test_a_pruned_step_is_removed_off_the_training_thread_before_the_next_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Freeing a checkpoint's RAM takes as long as copying it: not on the training thread,
    and done before the next save writes a file (the folder stays within ``keep``)."""
    from functional_ckpt._src.manager import writes
    from functional_ckpt._src.storage import shards

    events: list[tuple[str, str]] = []
    remove_all, write_shard = writes.remove_all, shards.write_shard

    def removing(paths: Any) -> None:
        remove_all(paths)
        events.append(("removed", threading.current_thread().name))

    def writing(*args: Any, **kwargs: Any) -> Any:
        events.append(("write", threading.current_thread().name))
        return write_shard(*args, **kwargs)

    monkeypatch.setattr(writes, "remove_all", removing)
    monkeypatch.setattr(shards, "write_shard", writing)
    folder = tmp_path / "mem"
    tier = fc.manager.Memory(path=folder, keep=1)
    with fc.CheckpointManager(tmp_path / "root", save=fc.policy.never(), tiers=(tier,)) as mgr:
        for s in range(1, 5):
            mgr.maybe_save(small_state(s), step=s)
            mgr.wait()
            assert committed(folder) == [s]
    main = threading.main_thread().name
    removals = [i for i, (what, _) in enumerate(events) if what == "removed"]
    assert len(removals) == 3 and all(events[i][1] != main for i in removals)
    for i in removals:  # the save that pruned it wrote only after the removal
        assert [w for w, _ in events[i + 1 : i + 2]] == ["write"]


def test_the_memory_tier_has_its_own_policy(tmp_path: Path) -> None:
    tier = fc.manager.Memory(path=tmp_path / "mem", save=fc.every_steps(2))
    with fc.CheckpointManager(tmp_path / "root", save=fc.every_steps(3), tiers=(tier,)) as mgr:
        for s in range(1, 8):
            mgr.maybe_save(small_state(s), step=s)
            mgr.wait_staged()
        mgr.wait()
        assert mgr.steps() == [3, 6] and committed(tmp_path / "mem") == [4, 6]


def test_a_save_over_the_budget_is_skipped_and_said_once(tmp_path: Path) -> None:
    size, room = 1 << 20, 64 << 10  # a weight, and room for what a checkpoint holds beside it
    tier = fc.manager.Memory(path=tmp_path / "mem", budget=2 * (size + room), async_save=False)
    small_state = lambda s: {"w": torch.full((size // 4,), float(s)), "step": s}  # noqa: E731
    grown = lambda s: {**small_state(s), "m": torch.zeros(size // 4)}  # noqa: E731  # Adam's moments
    with fc.CheckpointManager(tmp_path / "root", tiers=(tier,)) as mgr:
        mgr.maybe_save(small_state(1), step=1)  # two of these fit
        assert committed(tmp_path / "mem") == [1]
        with pytest.warns(MemoryTierWarning, match=r"Memory\(budget=") as said:
            mgr.maybe_save(grown(2), step=2)
            mgr.maybe_save(grown(3), step=3)
        assert len(said) == 1 and "2 checkpoint(s)" in str(said[0].message)
        assert str(tmp_path / "mem") in str(said[0].message)
        assert committed(tmp_path / "mem") == [1]  # skipped before anything was written
        assert mgr.steps() == [1, 2, 3]  # the disk tier goes on
    one = fc.manager.Memory(path=tmp_path / "mem", budget=size + room, keep=1)
    with fc.CheckpointManager(tmp_path / "root2", tiers=(one,)) as mgr:
        mgr.maybe_save(small_state(1), step=1)
        mgr.wait()
        with pytest.warns(MemoryTierWarning, match=r"Memory\(budget="):  # values count too
            mgr.maybe_save({**small_state(2), "v": np.zeros(size // 4, np.float32)}, step=2)
            mgr.maybe_save({**small_state(3), "v": bytes(size)}, step=3)
            mgr.wait()
        assert committed(tmp_path / "mem") == [1]


def test_a_state_of_many_small_leaves_counts_their_entries_against_the_budget(
    tmp_path: Path,
) -> None:
    """20,000 scalars are 120 KB of values but megabytes of what a checkpoint holds for
    them (entries in the manifest and .metadata, each tensor's framing): the budget counts
    that, so a save that would not fit is skipped, and one that fits is made."""
    state = {
        "t": {f"k{i}": torch.tensor(float(i)) for i in range(10_000)},
        "v": {f"k{i}": float(i) for i in range(10_000)},
    }
    fc.save(tmp_path / "alone", state)
    held = sum(p.stat().st_size for p in (tmp_path / "alone").iterdir())
    assert held > 10 * 120_000, held
    for budget, fits in ((held - 1, False), (2 * held, True)):
        memory = tmp_path / f"mem-{fits}"
        tier = fc.manager.Memory(path=memory, budget=budget, keep=1, async_save=False)
        with (
            warnings.catch_warnings(record=True) as told,
            fc.CheckpointManager(tmp_path / f"root-{fits}", tiers=(tier,)) as mgr,
        ):
            warnings.simplefilter("always")
            mgr.maybe_save(state, step=1)
            assert committed(memory) == ([1] if fits else []), (budget, held)
        said = [str(w.message) for w in told if "Memory(budget=" in str(w.message)]
        assert len(said) == (0 if fits else 1), said


def test_a_budget_beyond_the_memory_there_is_refused_at_open(tmp_path: Path) -> None:
    tier = fc.manager.Memory(path=tmp_path / "mem", budget=1 << 62)
    with pytest.raises(fc.CheckpointError, match=r"Memory\(budget=\d+\): .* can take at most"):
        fc.CheckpointManager(tmp_path / "root", tiers=(tier,))
    with fc.CheckpointManager(tmp_path / "root") as mgr:  # the refused manager let go of it
        assert mgr.steps() == []


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("keep", 3, "keep=3"),
        ("keep", True, "keep=True"),
        ("budget", 0, "budget=0"),
        ("budget", 1.5, "budget=1.5"),
        ("budget", "1G", "budget='1G'"),
        ("save", "every step", "save='every step'"),
        ("path", 3, "path=3"),
        ("promote_on", (signal.SIGKILL,), "promote_on="),
        ("promote_within", 0, "promote_within=0"),
        ("async_save", 1, "async_save=1"),
        ("replicas", 0, "replicas=0"),
        ("replicas", True, "replicas=True"),
        ("domain", 3, "domain=3"),
    ],
)
def test_bad_options_name_the_argument(field: str, value: Any, match: str) -> None:
    with pytest.raises((TypeError, ValueError), match=match.replace("(", r"\(")):
        fc.manager.Memory(**{field: value})


def test_a_manager_refuses_what_is_not_a_memory_option(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"tiers\[0\]='/dev/shm'\): expected fc.manager.Memory"):
        fc.CheckpointManager(tmp_path, tiers=("/dev/shm",))  # type: ignore[arg-type]


def test_a_folder_inside_the_root_is_refused(tmp_path: Path) -> None:
    with pytest.raises(fc.CheckpointError, match="must be apart"):
        fc.CheckpointManager(tmp_path, tiers=(fc.manager.Memory(path=tmp_path / "ram"),))


def test_leftovers_of_a_crashed_run_are_recovered_or_removed(tmp_path: Path) -> None:
    root, memory = tmp_path / "root", tmp_path / "mem"
    with fc.CheckpointManager(
        root, tiers=(fc.manager.Memory(path=memory, async_save=False),)
    ) as mgr:
        mgr.maybe_save(small_state(1), step=1)
        mgr.maybe_save(small_state(2), step=2)
        # As a crash leaves them: the newest moved out of sight mid-replacement, and an
        # unfinished save.
        os.rename(memory / step_name(2), memory / f"{step_name(2)}{naming.TMP_INFIX}abc")
        (memory / f"{step_name(3)}{naming.TMP_INFIX}def").mkdir()
        mgr.memory._lock.release()  # type: ignore[union-attr]  # as the kernel does for the dead
        mgr.memory._lock = None  # type: ignore[union-attr]
    with pytest.warns(LeftoverWarning, match="recovered"):
        mgr = fc.CheckpointManager(root, tiers=(fc.manager.Memory(path=memory),))
    with mgr:
        names = sorted(os.listdir(memory))
        assert names == [".lock", MARK_FILE, step_name(1), step_name(2)], names
        state = mgr.restore_latest()
        assert state is not None and mgr.restored_step == 2


def test_a_folder_left_by_another_root_is_refused_never_emptied(tmp_path: Path) -> None:
    memory = tmp_path / "mem"
    with fc.CheckpointManager(tmp_path / "a", tiers=(fc.manager.Memory(path=memory),)) as mgr:
        mgr.maybe_save(small_state(1), step=1)
        mgr.wait()
        mgr.memory._lock.release()  # type: ignore[union-attr]  # a crash: the folder stays
        mgr.memory._lock = None  # type: ignore[union-attr]
    assert committed(memory) == [1]
    unfinished = memory / f"{step_name(2)}{naming.TMP_INFIX}abc"  # its save cut short
    unfinished.mkdir()
    with pytest.raises(
        fc.errors.CheckpointError, match=r"holds checkpoints \(steps \[1\]\) of run"
    ):
        fc.CheckpointManager(tmp_path / "b", tiers=(fc.manager.Memory(path=memory),))
    assert committed(memory) == [1]  # another run's: left as it is
    assert unfinished.is_dir()  # its leftovers too
    with fc.CheckpointManager(
        tmp_path / "b", tiers=(fc.manager.Memory(path=tmp_path / "m2"),)
    ) as mgr:
        assert mgr.restore_latest() is None


def test_what_the_tier_did_not_write_outlives_its_saves_and_close(tmp_path: Path) -> None:
    """A directory named like a step that is no checkpoint (the user's) is reported and
    left: the tier deletes only this run's checkpoints and temporaries."""
    memory = tmp_path / "mem"
    (memory / step_name(1)).mkdir(parents=True)
    data = memory / step_name(1) / "data.bin"
    data.write_text("user data, not a checkpoint")
    (memory / "notes.txt").write_text("keep me")
    tier = fc.manager.Memory(path=memory, keep=1, async_save=False)
    with (
        pytest.warns(MemoryTierWarning) as caught,
        fc.CheckpointManager(tmp_path / "root", tiers=(tier,)) as mgr,
    ):
        for step in (1, 2, 3):
            mgr.maybe_save(small_state(step), step=step)
        assert committed(memory) == [3]
    assert data.read_text() == "user data, not a checkpoint"
    assert sorted(os.listdir(memory)) == ["notes.txt", step_name(1)]
    told = [str(w.message) for w in caught]
    assert sum("not checkpoints of this run" in m for m in told) == 1, told


def test_an_incremental_save_builds_on_this_runs_checkpoints_only(tmp_path: Path) -> None:
    """A checkpoint of no run put in the tier's folder, holding the very bytes this run
    saves next, is never the base of its incremental save: none of its files is taken
    into this run's checkpoint (the base is this run's, as for retention and resume)."""
    memory = tmp_path / "mem"
    tier = fc.manager.Memory(path=memory, async_save=False, promote_on=())
    with fc.CheckpointManager(tmp_path / "root", save=fc.policy.never(), tiers=(tier,)) as mgr:
        mgr.maybe_save(small_state(1), step=1)
        foreign = memory / step_name(9)
        fc.save(foreign, small_state(2))
        with pytest.warns(MemoryTierWarning, match="not checkpoints of this run"):
            mgr.maybe_save(small_state(2), step=2)
        theirs = {os.stat(p).st_ino for p in foreign.iterdir()}
        ours = {os.stat(p).st_ino for p in (memory / step_name(2)).iterdir()}
        assert not theirs & ours
        assert committed(memory) == [1, 2, 9]  # keep=2 counts this run's checkpoints
        assert_exact(
            fc.codec.to_python(fc.restore(memory / step_name(2))),
            fc.codec.to_python(small_state(2)),
        )
    assert committed(memory) == [9] and fc.verify(foreign).ok  # not this run's: left


def test_another_runs_checkpoint_in_the_folder_is_never_saved_over_nor_deleted(
    tmp_path: Path,
) -> None:
    """Another run's checkpoint copied into the folder of a run that then crashes: the
    relaunch resumes past it, its memory save of that step is refused before any byte (the
    disk tier's save of the step goes on), and retention and close() leave it. A copy of
    this run's step 1 named step_6 is damage, not another run's: the save of 6 replaces it."""
    with fc.CheckpointManager(tmp_path / "theirs") as mgr:
        mgr.maybe_save({**small_state(5), "w": torch.full((64, 16), 999.0)}, step=5)
    root, memory = tmp_path / "root", tmp_path / "mem"
    tier, every = fc.manager.Memory(path=memory, promote_on=()), fc.policy.every_steps(1)
    with (
        contextlib.suppress(KeyboardInterrupt),
        fc.CheckpointManager(root, save=every, tiers=(tier,)) as mgr,
    ):
        for step in (1, 2):
            mgr.maybe_save(small_state(step), step=step)
        mgr.wait()
        shutil.copytree(tmp_path / "theirs" / step_name(5), memory / step_name(5))
        shutil.copytree(memory / step_name(1), memory / step_name(6))  # records step 1
        raise KeyboardInterrupt  # a crash keeps the folder
    theirs = memory / step_name(5)
    with (
        pytest.warns(MemoryTierWarning) as caught,
        fc.CheckpointManager(root, save=every, tiers=(tier,)) as mgr,
    ):
        assert mgr.restore_latest(like=small_state(0)) is not None
        assert mgr.restored_step == 2
        for step in (3, 4, 5, 6):
            mgr.maybe_save(small_state(step), step=step)
        mgr.wait()
        assert float(fc.restore(theirs)["w"][0, 0]) == 999.0, "replaced"
        assert float(fc.restore(memory / step_name(6))["w"][0, 0]) == 6.0  # not the renamed 1
        assert committed(memory) == [4, 5, 6]  # keep=2 of this run's, beside theirs
        assert float(fc.restore(root / step_name(5))["w"][0, 0]) == 5.0  # the disk's own
    told = [str(w.message) for w in caught]
    assert sum(f"{theirs}: not a checkpoint of this run" in m for m in told) == 1, told
    assert not [m for m in told if "step 6 failed" in m], told
    assert sorted(os.listdir(memory)) == [step_name(5)]  # close() removed only this run's
    assert float(fc.restore(theirs)["w"][0, 0]) == 999.0


def test_a_failed_memory_save_warns_and_training_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from functional_ckpt._src.storage import shards

    real = shards.write_shard

    def full(path: Path, *args: Any, **kwargs: Any) -> Any:
        if path.parent.parent == tmp_path / "ram":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shards, "write_shard", full)
    tier = fc.manager.Memory(path=tmp_path / "ram")
    with fc.CheckpointManager(tmp_path / "root", tiers=(tier,)) as mgr:
        mgr.maybe_save(small_state(1), step=1)
        with pytest.warns(MemoryTierWarning, match="step 1 failed"):
            mgr.maybe_save(small_state(2), step=2)  # the failure of step 1 surfaces here
        with pytest.warns(MemoryTierWarning, match="step 2 failed"):
            mgr.wait()
        assert mgr.steps() == [1, 2]  # the disk tier is unaffected
        monkeypatch.setattr(shards, "write_shard", real)
        mgr.maybe_save(small_state(3), step=3)
        mgr.wait()
        assert committed(tmp_path / "ram") == [3]


def test_rollback_and_delete_reach_the_memory_tier(tmp_path: Path) -> None:
    tier = fc.manager.Memory(path=tmp_path / "mem", async_save=False)
    with fc.CheckpointManager(tmp_path / "root", save=fc.every_steps(2), tiers=(tier,)) as mgr:
        for s in range(1, 6):
            mgr.maybe_save(small_state(s), step=s)
        assert committed(tmp_path / "mem") == [4, 5]
        mgr.rollback(2, newer="delete")
        assert committed(tmp_path / "mem") == []  # 4 and 5 are no longer the run's
        mgr.maybe_save(small_state(3), step=3, force=True)
        assert committed(tmp_path / "mem") == [3]
        mgr.delete(3)
        assert committed(tmp_path / "mem") == []
        assert mgr.restore_latest() is not None and mgr.restored_step == 2


def test_a_step_only_ram_holds_is_deleted_out_of_sight(tmp_path: Path) -> None:
    """A step of this run is one any tier holds: one not yet on disk is deletable too."""
    memory = tmp_path / "mem"
    tier = fc.manager.Memory(path=memory, async_save=False)
    with fc.CheckpointManager(tmp_path / "root", save=fc.every_steps(2), tiers=(tier,)) as mgr:
        for s in (1, 2, 3):
            mgr.maybe_save(small_state(s), step=s)
        assert committed(memory) == [2, 3] and mgr.steps() == [2]
        mgr.delete(3)
        assert committed(memory) == [2] and mgr.steps() == [2]
        assert not os.path.lexists(memory / step_name(3))  # renamed away, then removed
        assert mgr.restore_latest() is not None and mgr.restored_step == 2
        with pytest.raises(
            fc.errors.CheckpointNotFound, match=r"no checkpoint for step 7 in any tier"
        ):
            mgr.delete(7)


def ram_ahead(root: Path, memory: Path, **kwargs: Any) -> fc.CheckpointManager:
    """A manager whose disk saves every other step, and RAM every step (its newest two)."""
    tier = fc.manager.Memory(
        path=memory, async_save=False, save=kwargs.pop("ram", fc.every_steps(1))
    )
    return fc.CheckpointManager(root, save=fc.every_steps(2), tiers=(tier,), **kwargs)


def test_a_rollback_to_a_step_only_ram_holds_makes_it_the_head(tmp_path: Path) -> None:
    """Step 3, in RAM only, older than the disk's 4 and 6: the newer ones branch off, and
    step 3 is the trunk's head on disk (a copy, durable before anything moved)."""
    root, memory = tmp_path / "root", tmp_path / "mem"
    with ram_ahead(root, memory, ram=fc.every_steps(3)) as mgr:
        for s in range(1, 7):
            mgr.maybe_save(small_state(s), step=s)
        assert mgr.steps() == [2, 4, 6] and committed(memory) == [3, 6]
        state = mgr.rollback(3, branch="old")
        assert state["step"] == 3 and mgr.restored_step == 3
        assert mgr.steps() == [2, 3] and mgr.branches() == {"old": [4, 6]}
        assert committed(memory) == [3]
        assert fc.verify(root / step_name(3)).ok
    with fc.CheckpointManager(root, save=fc.every_steps(2)) as mgr:
        assert mgr.restore_latest() is not None and mgr.restored_step == 3


def test_a_branch_rollback_keeps_the_steps_only_ram_holds_on_the_branch(tmp_path: Path) -> None:
    """The disk's newer steps and RAM's alike: none is deleted by a rollback to a branch."""
    root, memory = tmp_path / "root", tmp_path / "mem"
    with ram_ahead(root, memory) as mgr:
        for s in range(1, 6):
            mgr.maybe_save(small_state(s), step=s)
        assert mgr.steps() == [2, 4] and committed(memory) == [4, 5]
        mgr.rollback(2, branch="b")
        assert mgr.steps() == [2] and committed(memory) == []
        assert mgr.branches() == {"b": [4, 5]}
        assert fc.restore(root / "branches" / "b" / step_name(5))["step"] == 5


def test_a_rollback_on_degradation_branches_the_steps_only_ram_holds(tmp_path: Path) -> None:
    rule = fc.policy.on_degrade("reward", mode="max", patience=1)
    root, memory = tmp_path / "root", tmp_path / "mem"
    with ram_ahead(root, memory, rollback=rule) as mgr:
        for s, reward in ((1, 10.0), (2, 10.0), (3, 9.5)):
            mgr.maybe_save(small_state(s), step=s, metrics={"reward": reward})
        result = mgr.maybe_save(small_state(4), step=4, metrics={"reward": 1.0})
        assert result.rollback is not None and result.rollback.to_step == 2
        assert result.rollback.state["step"] == 2
        assert mgr.steps() == [2] and committed(memory) == []
        assert mgr.branches() == {result.rollback.branch: [3, 4]}


def test_the_root_records_where_its_memory_tier_is(tmp_path: Path) -> None:
    tier = fc.manager.Memory(path=tmp_path / "mem")
    with fc.CheckpointManager(tmp_path / "root", tiers=(tier,)):
        doc = json.loads((tmp_path / "root" / MEMORY_STATUS).read_text())
        assert doc["path"] == str(tmp_path / "mem") and doc["open"] is True
    doc = json.loads((tmp_path / "root" / MEMORY_STATUS).read_text())
    assert doc["open"] is False


@pytest.mark.parametrize("policy_first", [True, False])
def test_sigterm_beside_on_signal_promotes_and_the_run_goes_on(
    tmp_path: Path, policy_first: bool
) -> None:
    """With ``fc.on_signal`` handling SIGTERM too (installed before the manager or after
    it) the run is not ended: the newest memory checkpoint is on disk at once, and the
    policy saves the next event."""
    original = signal.getsignal(signal.SIGTERM)
    root = tmp_path / "root"
    tier = fc.manager.Memory(path=tmp_path / "mem", async_save=False)
    try:
        preempted = fc.on_signal(signal.SIGTERM) if policy_first else None
        disk = preempted if preempted is not None else fc.policy.never()
        with fc.CheckpointManager(root, save=disk, tiers=(tier,)) as mgr:
            later = None if policy_first else fc.on_signal(signal.SIGTERM)
            for s in (1, 2, 3):
                mgr.maybe_save(small_state(s), step=s)
            assert mgr.steps() == []
            os.kill(os.getpid(), signal.SIGTERM)  # handled at once, on this thread
            assert mgr.steps() == [3]  # promoted, and this process still runs
            assert fc.verify(root / step_name(3)).ok
            mgr.maybe_save(small_state(4), step=4)
            assert mgr.steps() == ([3, 4] if policy_first else [3])
            assert later is None or later.decide(None, mgr_event(4))
    finally:
        signal.signal(signal.SIGTERM, original)


def mgr_event(step: int) -> Any:
    from functional_ckpt._src.policy.base import Event

    return Event(step=step)


def test_replicas_in_one_process_are_refused(tmp_path: Path) -> None:
    """One process is one failure domain: its replicas would die with it."""
    tier = fc.manager.Memory(path=tmp_path / "mem", replicas=2)
    with pytest.raises(fc.CheckpointError, match=r"Memory\(replicas=2\): one process is one"):
        fc.CheckpointManager(tmp_path / "root", tiers=(tier,))
    assert not (tmp_path / "mem").exists()
    with fc.CheckpointManager(tmp_path / "root", tiers=(fc.manager.Memory(replicas=1),)) as mgr:
        assert mgr.memory is not None and mgr.memory.replicas is None


def test_beside_a_remote_tier_the_newest_of_all_three_is_restored(tmp_path: Path) -> None:
    pytest.importorskip("fsspec")
    url = f"memory://bucket/{tmp_path.name}"
    root, memory = tmp_path / "root", tmp_path / "mem"

    def manager(at: Path) -> fc.CheckpointManager:
        return fc.CheckpointManager(
            at,
            save=fc.every_steps(2),
            keep=fc.keep_last(1),
            tiers=(fc.manager.Memory(path=memory), fc.manager.Remote(url)),
        )

    with manager(root) as mgr:
        for s in (1, 2, 3):
            mgr.maybe_save(small_state(s), step=s)
            mgr.wait_staged()
        mgr.wait()
        assert mgr.remote is not None and mgr.remote.wait()
        state = mgr.restore_latest()  # memory: 3; disk and remote: 2
        assert state is not None and mgr.restored_step == 3
        for s in (4, 5, 6):
            mgr.maybe_save(small_state(s), step=s, force=s == 6)
        mgr.wait()
        mgr.remote.wait()
    with manager(tmp_path / "fresh") as mgr:  # another machine: an empty disk, no folder
        state = mgr.restore_latest()
        assert state is not None and mgr.restored_step == 6  # from the remote tier


# --------------------------------------------------------------------------- the trunk


def crashed_run(root: Path, memory: Path, steps: int) -> None:
    """Steps 1.. ``steps`` saved to RAM (the newest two held) and every second one to disk,
    then the process crashes: an exception leaves the block, the folder stays (nothing
    promoted)."""
    tier = fc.manager.Memory(path=memory, async_save=False, promote_on=())
    mgr = fc.CheckpointManager(root, save=fc.every_steps(2), tiers=(tier,))
    with contextlib.suppress(RuntimeError), mgr:
        for s in range(1, steps + 1):
            mgr.maybe_save(small_state(s), step=s)
        raise RuntimeError("the run crashes")
    assert committed(memory) == [steps - 1, steps]


def resume_with_ram(root: Path, memory: Path) -> tuple[int | None, Any, list[int], str]:
    """What a relaunch with the original memory tier resumes: the step, its state, what
    RAM holds then and what the memory tier said."""
    tier = fc.manager.Memory(path=memory, async_save=False)
    with warnings.catch_warnings(record=True) as told:
        warnings.simplefilter("always")
        with fc.CheckpointManager(root, save=fc.every_steps(2), tiers=(tier,)) as mgr:
            state = mgr.restore_latest()
            held = committed(memory)
    said = " ".join(str(w.message) for w in told if w.category is MemoryTierWarning)
    return mgr.restored_step, state, held, said


@pytest.mark.parametrize("how", ["rollback", "rollback-other-ram", "delete"])
def test_a_move_of_the_trunk_without_the_memory_tier_is_never_undone_by_ram(
    tmp_path: Path, how: str
) -> None:
    """The trunk moves in a manager opened without the run's memory tier (or with another
    folder): RAM's copies of the steps that left it are dropped, never resumed."""
    root, memory = tmp_path / "root", tmp_path / "mem"
    crashed_run(root, memory, steps=4 if how == "delete" else 5)  # disk 2 4, RAM 3 4 / 4 5
    other = fc.manager.Memory(path=tmp_path / "other")
    tiers = (other,) if how == "rollback-other-ram" else ()
    with fc.CheckpointManager(root, save=fc.every_steps(2), tiers=tiers) as mgr:
        if how == "delete":
            mgr.delete(4)
        else:
            mgr.rollback(2, newer="delete")
    step, state, held, said = resume_with_ram(root, memory)
    if how == "delete":  # step 3 stays on the trunk, step 4 does not
        assert (step, held, int(state["step"])) == (3, [3], 3)
    else:
        assert (step, held, int(state["step"])) == (2, [], 2)
    assert f"steps {[4] if how == 'delete' else [4, 5]} are off this run's trunk" in said, said


def test_a_resume_of_an_older_step_then_saves_is_never_undone_by_ram(tmp_path: Path) -> None:
    """A run restored from step 4 by name (with another memory folder) and saved on: the
    original folder's older step 5 loses to the trunk's step 5, its tie."""
    root, memory = tmp_path / "root", tmp_path / "mem"
    crashed_run(root, memory, steps=5)  # disk 2 4, RAM 4 5
    other = fc.manager.Memory(path=tmp_path / "other", async_save=False)
    with fc.CheckpointManager(root, save=fc.every_steps(2), tiers=(other,)) as mgr:
        mgr.restore(4)
        mgr.maybe_save(small_state(50), step=5, force=True)
    step, state, held, said = resume_with_ram(root, memory)
    assert (step, float(state["w"][0, 0]), held) == (5, 50.0, [4])  # 4 is on the trunk
    assert "steps [5] are off this run's trunk" in said, said


def test_a_memory_save_after_restoring_an_older_step_is_refused_and_cuts_nothing(
    tmp_path: Path,
) -> None:
    """Disk 2 4 6: a restore of step 2 followed by a memory-only save would have the disk's
    later steps taken off the trunk while the disk still refuses to save behind step 6.
    Every tier keeps the disk's order: the save is refused naming ``rollback``, and the next
    run resumes step 6 as before."""
    root, memory = tmp_path / "root", tmp_path / "mem"
    crashed_run(root, memory, steps=6)  # disk 2 4 6, RAM 5 6
    tier = fc.manager.Memory(path=memory, async_save=False, promote_on=())
    with fc.CheckpointManager(root, save=fc.every_steps(2), tiers=(tier,)) as mgr:
        mgr.restore(2)
        with pytest.raises(fc.errors.CheckpointError, match=r"step 6 is newer.*rollback"):
            mgr.maybe_save(small_state(3), step=3)  # RAM's alone: 3 is odd
        assert committed(memory) == [5, 6]  # nothing written, nothing removed
    assert (
        "cuts" not in json.loads((root / "run.json").read_text())
        or not json.loads((root / "run.json").read_text())["cuts"]
    )
    step, state, _, _ = resume_with_ram(root, memory)
    assert (step, int(state["step"])) == (6, 6)


@pytest.mark.parametrize("wait", [True, False])
def test_saving_the_newest_step_again_on_disk_leaves_no_older_copy_in_ram(
    tmp_path: Path, wait: bool
) -> None:
    """``force=True`` saves step 8 again on disk while the memory tier's policy is done
    with step 8: RAM's copy is the older save, and a tie goes to the faster tier, so it
    goes (its save in flight or not); a crash then resumes the disk's new step 8."""
    root, memory = tmp_path / "root", tmp_path / "mem"
    tier = fc.manager.Memory(path=memory, promote_on=())
    with (
        contextlib.suppress(RuntimeError),
        fc.CheckpointManager(root, save=fc.every_steps(1), tiers=(tier,)) as mgr,
    ):
        for s in range(1, 9):
            mgr.maybe_save(small_state(s), step=s)
        if wait:
            mgr.wait()
        mgr.maybe_save(small_state(888), step=8, force=True)
        mgr.wait()
        assert 8 not in committed(memory)
        raise RuntimeError("the run crashes")
    step, state, _, _ = resume_with_ram(root, memory)
    assert (step, float(state["w"][0, 0])) == (8, 888.0)


def test_a_stale_ram_step_never_wins_the_tie_with_the_trunks(tmp_path: Path) -> None:
    """RAM holds step 5 of the history a rollback left; the disk a new step 5: a resume
    takes the disk's (the trunk's), whatever the step numbers say."""
    root, memory = tmp_path / "root", tmp_path / "mem"
    crashed_run(root, memory, steps=5)
    with fc.CheckpointManager(root, save=fc.every_steps(2)) as mgr:
        mgr.rollback(2, newer="branch")
        for s in (3, 4, 5):
            mgr.maybe_save(small_state(100 + s), step=s, force=True)
    step, state, held, said = resume_with_ram(root, memory)
    assert (step, float(state["w"][0, 0]), held) == (5, 105.0, [])
    assert "steps [4, 5] are off this run's trunk" in said, said


def dying_rollback(root: str, memory: str | None, kill_at: int) -> None:
    """Roll ``root`` back to step 2, SIGKILLed before its (``kill_at``+1)-th rename (RAM's
    and the disk's), or before the rollback's record goes once every move is done."""
    tiers = () if memory is None else (fc.manager.Memory(path=memory, async_save=False),)
    mgr = fc.CheckpointManager(root, save=fc.every_steps(2), tiers=tiers)
    done = [0]
    real_rename, real_unlink = os.rename, os.unlink

    def rename(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if done[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        real_rename(src, dst, *args, **kwargs)
        done[0] += 1

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if str(path).endswith("/.rollback") and done[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        real_unlink(path, *args, **kwargs)

    os.rename, os.unlink = rename, unlink  # type: ignore[assignment]
    mgr.rollback(2, newer="delete")
    os.rename, os.unlink = real_rename, real_unlink  # type: ignore[assignment]
    mgr.close()


@pytest.mark.parametrize("with_ram", [True, False])
@pytest.mark.parametrize("kill_at", [0, 1, 2, 3, 4, 99])
def test_sigkill_during_a_rollback_never_lets_ram_undo_it(
    ctx: mp.context.ForkServerContext, tmp_path: Path, with_ram: bool, kill_at: int
) -> None:
    """A rollback SIGKILLed anywhere either has not happened (the trunk whole: RAM may
    resume it) or completes at the next open, and then RAM's dropped steps are never resumed."""
    root, memory = tmp_path / "root", tmp_path / "mem"
    crashed_run(root, memory, steps=5)  # disk 2 4, RAM 4 5
    args = (str(root), str(memory) if with_ram else None, kill_at)
    proc = ctx.Process(target=dying_rollback, args=args)
    proc.start()
    code = finished(proc)
    assert code in ((0,) if kill_at == 99 else (0, -signal.SIGKILL))  # (fewer renames: done)
    step, state, held, _ = resume_with_ram(root, memory)
    assert int(state["step"]) == step
    if committed(root) == [2]:  # the rollback happened
        assert step == 2 and held == []
    else:  # it did not: nothing moved on disk, RAM may hold its newer steps still
        assert committed(root) == [2, 4] and step in (4, 5), (step, held)


def test_a_run_that_adopted_the_remote_lineage_resumes_its_ram_steps_after_sigkill(
    ctx: mp.context.ForkServerContext, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An empty root in front of a remote tier adopts the remote's run and resumes its step
    4; killed before its first disk save, its steps 6 and 7 are in RAM alone. Relaunched, it
    resumes step 7, the step it came from still of its lineage: where the RAM steps are
    lost too, step 4 is taken, never a fresh start."""
    pytest.importorskip("fsspec")
    for name, lost in (("intact", False), ("lost", True)):
        base = tmp_path / name
        url = (base / "bucket").as_uri()
        manager_job.run_memory(str(base / "a"), str(base / "ma"), steps=4, disk_every=2, remote=url)
        root, memory = base / "root", base / "mem"
        job = start(ctx, root, memory, steps=STEPS, disk_every=10**6, die_at=7, remote=url)
        assert finished(job) == -signal.SIGKILL
        assert committed(root) == [4] and committed(memory) == [6, 7]
        if lost:
            for step in (6, 7):
                corrupt(memory / step_name(step))
        capsys.readouterr()
        with warnings.catch_warnings(record=True) as told:
            warnings.simplefilter("always")
            manager_job.run_memory(str(root), str(memory), steps=8, disk_every=10**6, remote=url)
        assert f"resumed {4 if lost else 7}\n" in capsys.readouterr().out, name
        strangers = [str(w.message) for w in told if "not of this run's lineage" in str(w.message)]
        assert not strangers, strangers


def sigterm_job(base: Path, *args: str) -> Any:
    """tests/sigterm_job.py in a process group of its own, which it signals whole."""
    import subprocess
    import sys

    from tests.patience import HANG

    job = Path(__file__).with_name("sigterm_job.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    return subprocess.run(
        [sys.executable, str(job), str(base), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG,
        start_new_session=True,
    )


@pytest.mark.parametrize("user", [False, True])
def test_sigterm_promotes_every_manager_and_takes_its_course_once(
    tmp_path: Path, user: bool
) -> None:
    """Two managers in one process: both promote, then the signal does what it did
    before them, once: the default action ends the process; a handler of the user's is
    called once, and the process goes on."""
    done = sigterm_job(tmp_path, "two", *(["--user"] if user else []))
    assert done.returncode == (0 if user else -signal.SIGTERM), (done.returncode, done.stderr)
    assert done.stdout.count("USER") == (1 if user else 0), done.stdout
    assert ("LIVED" in done.stdout) == user, done.stdout
    for name in "ab":
        assert committed(tmp_path / name) == [3], (name, done.stderr[-3000:])
        assert fc.verify(tmp_path / name / step_name(3)).ok


def test_sigterm_uploads_the_promoted_step(tmp_path: Path, s3: dict[str, Any], bucket: str) -> None:
    """A step promoted on SIGTERM is a disk commit like any other: the remote tier
    uploads it before the process ends, so a preempted machine's disk is not its only copy."""
    from functional_ckpt._src.remote.store import Store

    done = sigterm_job(tmp_path, "remote", bucket, s3["endpoint"])
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-3000:])
    assert committed(tmp_path / "root") == [3]
    listing = Store(bucket, s3["options"]).listing()
    assert sorted(s for s, r in listing.items() if r.committed) == [3], done.stderr[-3000:]
    remote = fc.manager.Remote(bucket, storage_options=s3["options"])
    fresh = fc.CheckpointManager(tmp_path / "fresh", save=fc.policy.never(), tiers=(remote,))
    with fresh as mgr:  # another machine
        assert mgr.restore_latest() is not None and mgr.restored_step == 3


@pytest.mark.parametrize("sync", [False, True])
def test_sigterm_during_the_save_that_replaces_the_only_kept_step(
    tmp_path: Path, sync: bool
) -> None:
    """With ``keep=1`` a memory save makes room first: while it is written the folder
    holds no step. A SIGTERM then promotes the step once it is committed."""
    done = sigterm_job(tmp_path, "keep1", *(["--sync"] if sync else []))
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-3000:])
    assert "LIVED" not in done.stdout
    root = tmp_path / "root"
    assert committed(root) == [4], done.stderr[-3000:]
    assert fc.verify(root / step_name(4)).ok
    assert not [p.name for p in root.iterdir() if naming.is_temporary_name(p.name)]


def test_sigterm_during_a_memory_save_s_collective_is_handled_at_once(tmp_path: Path) -> None:
    """A signal while a memory save waits (for the previous one, or for the other ranks
    in a collective, which a dead node never joins) is not held back: the newest
    committed step is promoted and the signal takes its course. Only between making
    room and the write's start would it wait."""
    done = sigterm_job(tmp_path, "collective")
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-3000:])
    assert "LIVED" not in done.stdout
    assert committed(tmp_path / "root") == [3], done.stderr[-3000:]
    assert committed(tmp_path / "mem") == [3]  # the save of step 4 never started


def test_sigterm_while_the_remote_tier_s_lock_is_held_promotes(tmp_path: Path) -> None:
    """The handler runs on the training thread, which the signal may interrupt while it
    holds the remote tier's lock: promoting takes no lock that thread may hold."""
    pytest.importorskip("fsspec")
    done = sigterm_job(tmp_path, "locked", f"memory://bucket/{tmp_path.name}")
    assert "DEADLOCK" not in done.stdout, done.stdout
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-3000:])
    assert committed(tmp_path / "root") == [3], done.stderr[-3000:]


def test_a_handler_left_in_a_chain_serves_the_next_tier_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``fc.on_signal`` installed above a memory tier's handler keeps it in its chain
    after that tier closes: a tier opened next is served by it, one promotion a signal."""
    from functional_ckpt._src.manager.memory_tier import MemoryTier

    calls: list[int] = []
    real = MemoryTier.promote_now
    monkeypatch.setattr(MemoryTier, "promote_now", lambda t: calls.append(1) or real(t))
    original = signal.getsignal(signal.SIGTERM)
    tier = fc.manager.Memory(path=tmp_path / "mem", async_save=False)
    try:
        with fc.CheckpointManager(tmp_path / "a", save=fc.policy.never(), tiers=(tier,)):
            policy = fc.on_signal(signal.SIGTERM)
        with fc.CheckpointManager(tmp_path / "b", save=fc.policy.never(), tiers=(tier,)) as mgr:
            mgr.maybe_save(small_state(1), step=1)
            os.kill(os.getpid(), signal.SIGTERM)
            assert calls == [1] and mgr.steps() == [1]
            assert policy.decide(None, mgr_event(2))
    finally:
        signal.signal(signal.SIGTERM, original)


def test_sigterm_beside_a_disk_save_that_does_not_finish_in_time(tmp_path: Path) -> None:
    """The disk's save in flight is waited for at most ``promote_within``: past that the
    signal still takes its course, and its step is not written a second time meanwhile."""
    done = sigterm_job(tmp_path, "slowdisk")
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stdout, done.stderr[-3000:])
    assert "RAISED" not in done.stdout and "LIVED" not in done.stdout, done.stdout
    assert committed(tmp_path / "root") == []  # step 3 has one writer: the save, cut short


_KILLED_IN_A_RAM_ROLLBACK = """
import os, signal, sys
import torch
import functional_ckpt as fc
from functional_ckpt._src.manager import manager
from functional_ckpt._src.storage import commit
root, memory, at = sys.argv[1:]
def kill(*a, **k):
    os.kill(os.getpid(), signal.SIGKILL)
tier = fc.manager.Memory(path=memory, async_save=False)
mgr = fc.CheckpointManager(root, save=fc.every_steps(2), tiers=(tier,))
for s in range(1, 6):
    mgr.maybe_save({"w": torch.full((4,), float(s)), "step": s}, step=s)
if at == "copy":  # the step's files copied, its commit not made
    commit.commit_checkpoint = kill
else:  # copied into the disk, nothing moved yet
    manager.plan_newer = kill
mgr.rollback(2, branch="b")
"""


@pytest.mark.parametrize("at", ["copy", "plan"])
def test_a_rollback_killed_as_it_copies_the_ram_steps_loses_none(tmp_path: Path, at: str) -> None:
    """SIGKILL while a branch rollback makes RAM's newer steps durable: it has not begun,
    every step is where a resume finds it, and the rollback done again keeps them all."""
    root, memory = tmp_path / "root", tmp_path / "mem"
    script = [sys.executable, "-c", _KILLED_IN_A_RAM_ROLLBACK, str(root), str(memory), at]
    proc = prefork.run(script, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == -signal.SIGKILL
    assert not (root / "branches").exists() and committed(memory) == [4, 5]
    assert committed(root) == ([2, 4] if at == "copy" else [2, 4, 5])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mgr = ram_ahead(root, memory)
    recovered = [w for w in seen if w.category is LeftoverWarning and "recovered" in str(w.message)]
    assert len(recovered) == (at == "copy")  # whole but for its rename: step 5 again
    with mgr:
        assert mgr.restore_latest() is not None and mgr.restored_step == 5
        mgr.rollback(2, branch="b")
        assert mgr.steps() == [2] and mgr.branches() == {"b": [4, 5]}


def rollback_then_clock_back(root: str, memory: str) -> None:
    """A rollback to step 2 with the memory tier; then the clock jumps an hour back (NTP,
    another machine's) and steps 3-5 are saved (RAM 4 5, disk 4); then a crash."""
    tier = fc.manager.Memory(path=memory, async_save=False, promote_on=())
    mgr = fc.CheckpointManager(root, save=fc.every_steps(2), tiers=(tier,))
    with contextlib.suppress(RuntimeError), mgr:
        mgr.rollback(2, newer="delete")
        real = time.time
        time.time = lambda: real() - 3600.0
        for s in (3, 4, 5):
            mgr.maybe_save(small_state(100 + s), step=s)
        raise RuntimeError("the run crashes")


def test_a_clock_that_goes_back_after_a_rollback_never_cuts_the_new_history(
    ctx: mp.context.ForkServerContext, tmp_path: Path
) -> None:
    """The saves after a rollback are on the trunk whatever their clock says: RAM's new
    step 5 (saved "before" the rollback by the clock) is resumed, nothing of it removed."""
    root, memory = tmp_path / "root", tmp_path / "mem"
    crashed_run(root, memory, steps=5)  # disk 2 4, RAM 4 5
    proc = ctx.Process(target=rollback_then_clock_back, args=(str(root), str(memory)))
    proc.start()
    assert finished(proc) == 0
    step, state, held, said = resume_with_ram(root, memory)
    assert (step, float(state["w"][0, 0]), held) == (5, 105.0, [4, 5]), said
    assert "off this run's trunk" not in said, said


def dying_delete(root: str, kill: str) -> None:
    """``delete(4)`` without the memory tier, SIGKILLed just ``kill`` the disk's copy goes."""
    mgr = fc.CheckpointManager(root, save=fc.every_steps(2))
    real = mgr.disk.delete

    def delete(steps: list[int]) -> None:
        if kill == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        real(steps)
        os.kill(os.getpid(), signal.SIGKILL)

    mgr.disk.delete = delete  # type: ignore[method-assign]
    mgr.delete(4)


@pytest.mark.parametrize("kill", ["before", "after"])
def test_sigkill_during_a_delete_never_lets_ram_resume_the_deleted_step(
    ctx: mp.context.ForkServerContext, tmp_path: Path, kill: str
) -> None:
    """A delete records its cut before any tier deletes: SIGKILLed as the disk's copy goes,
    the memory folder it never reached drops its copy, neither tier resumes the step, and
    the delete completes as the root opens."""
    root, memory = tmp_path / "root", tmp_path / "mem"
    crashed_run(root, memory, steps=4)  # disk 2 4, RAM 3 4
    proc = ctx.Process(target=dying_delete, args=(str(root), kill))
    proc.start()
    assert finished(proc) == -signal.SIGKILL
    assert committed(root) == ([2, 4] if kill == "before" else [2])
    step, state, held, said = resume_with_ram(root, memory)
    assert (step, int(state["step"]), held) == (3, 3, [3]), said
    assert "steps [4] are off this run's trunk" in said, said
    assert committed(root) == [2]  # the delete completed as the root opened
    assert json.loads((root / "run.json").read_text())["cuts"][0] == [3, 4]  # recorded first


def test_a_branch_rollback_keeps_rams_intact_step_over_a_torn_copy_on_disk(
    tmp_path: Path,
) -> None:
    """The disk's step 8 torn (a data file cut short), RAM's intact: the branch gets
    RAM's, and the torn copy is moved aside, never the only one kept."""
    root, memory = tmp_path / "root", tmp_path / "mem"
    with ram_ahead(root, memory) as mgr:
        for s in range(1, 9):
            mgr.maybe_save(small_state(s), step=s)
        assert mgr.steps() == [2, 4, 6, 8] and committed(memory) == [7, 8]
        data = max((root / step_name(8)).rglob("*"), key=lambda p: p.stat().st_size)
        os.truncate(data, data.stat().st_size // 2)
        mgr.rollback(6, branch="b")
        assert mgr.branches() == {"b": [7, 8]} and committed(memory) == []
        kept = fc.restore(root / "branches" / "b" / step_name(8))
        assert torch.equal(kept["w"], small_state(8)["w"]) and kept["step"] == 8
    aside = [p.name for p in root.iterdir() if naming.QUARANTINE_INFIX in p.name]
    assert [n.startswith(step_name(8)) for n in aside] == [True], aside


def test_a_branch_rollback_never_drops_rams_step_for_another_lineages(tmp_path: Path) -> None:
    """RAM's step 8 is this run's, the disk's 8 another run's (copied in): a rollback
    would leave that one where it is and drop RAM's, so it is refused, nothing moved."""
    root, memory, other = tmp_path / "root", tmp_path / "mem", tmp_path / "other"
    with fc.CheckpointManager(other, save=fc.every_steps(1)) as theirs:
        theirs.maybe_save(small_state(8), step=8)
    tier = fc.manager.Memory(path=memory, async_save=False)
    with fc.CheckpointManager(root, save=fc.every_steps(3), tiers=(tier,)) as mgr:
        for s in range(1, 9):
            mgr.maybe_save(small_state(s), step=s)
        assert mgr.steps() == [3, 6] and committed(memory) == [7, 8]
        shutil.copytree(other / step_name(8), root / step_name(8))
        with pytest.raises(fc.errors.CheckpointError, match=r"rollback\(6\) would drop RAM's"):
            mgr.rollback(6, branch="b")
        assert committed(memory) == [7, 8] and mgr.branches() == {}
