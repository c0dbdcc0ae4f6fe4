"""Power loss at every point of a save, a prune, an overwrite, an incremental save, an
export and a rollback (``tests/crash_operations.py``): every crash state the file
system may leave keeps the commit protocol's promises (``tests/crash_explorer.py``
says which states and which promises).

The explorer must also be able to fail: a commit broken on purpose is caught, and a
write the recording cannot see refuses the recording instead of passing unchecked.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import functional_ckpt as fc
from functional_ckpt._src.format import naming
from functional_ckpt._src.storage import commit
from tests.crash_explorer import Oracle
from tests.crash_operations import OPERATIONS, record, run, state
from tests.crash_record import Recorder, RecordingGap
from tests.crash_tree import META, Op, scan


@pytest.mark.parametrize("name", list(OPERATIONS))
def test_every_crash_state_keeps_what_was_committed(tmp_path: Path, name: str) -> None:
    rec, report = run(name, tmp_path)
    print(report.line())
    assert report.distinct > len(rec.ops) // 2, report.line()  # it explored, not just ran
    assert not report.failures, f"{report.line()}\n\n" + "\n\n".join(report.failures[:3])


def _fsynced_between(rec: Recorder, directory: int, start: int, end: int) -> bool:
    return any(op.kind == "fsync" and op.ino == directory for op in rec.ops[start:end])


def _in(directory: int) -> Callable[[Op], bool]:
    """Whether an op changes an entry of ``directory``."""
    return lambda op: op.kind in META and any(d == directory for d, _, _ in op.changes)


@pytest.mark.parametrize("name", ["save (manager)", "incremental save (hard links)"])
def test_the_marker_is_created_only_once_every_other_entry_is_durable(
    tmp_path: Path, name: str
) -> None:
    """Else a crash keeps the marker's entry and loses a shard's, and the leftover
    recovery renames the torn temporary directory into place as a checkpoint."""
    rec = record(tmp_path, name)
    marker = next(
        i for i, op in enumerate(rec.ops) if op.kind == "create" and op.changes[0][1] == "COMMITTED"
    )
    tmp = rec.ops[marker].changes[0][0]
    last = max(i for i, op in enumerate(rec.ops[:marker]) if _in(tmp)(op))
    assert _fsynced_between(rec, tmp, last, marker), "\n".join(op.text for op in rec.ops)


def test_a_deletion_makes_the_marker_unlink_durable_before_removing_the_rest(
    tmp_path: Path,
) -> None:
    """Else a crash keeps the marker and loses a shard, and the leftover recovery renames
    the half-deleted checkpoint back into place."""
    rec = record(tmp_path, "delete (root/delete)")
    gone = next(
        i for i, op in enumerate(rec.ops) if op.kind == "unlink" and op.changes[0][1] == "COMMITTED"
    )
    trash = rec.ops[gone].changes[0][0]
    rest = next(i for i, op in enumerate(rec.ops) if i > gone and _in(trash)(op))
    assert _fsynced_between(rec, trash, gone, rest), "\n".join(op.text for op in rec.ops)


def _marker_not_fsynced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The marker renamed into place before its bytes are durable."""
    real = commit.write_commit_marker

    def unsynced(*args: Any, **kwargs: Any) -> None:
        real(*args, **{**kwargs, "sync": False})

    monkeypatch.setattr(commit, "write_commit_marker", unsynced)


def _no_directory_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The temporary directory renamed before its entries are durable, the parent never
    fsynced: the rename and the new files may be lost, or the rename kept without them."""
    monkeypatch.setattr(commit, "fsync_dir", lambda path: None)


@pytest.mark.parametrize("breaking", [_marker_not_fsynced, _no_directory_fsync])
def test_a_broken_commit_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, breaking: object
) -> None:
    assert callable(breaking)
    breaking(monkeypatch)
    _, report = run("save (manager)", tmp_path)
    print(report.line())
    assert report.failures, "a commit that is not durable passed the explorer"
    first = report.failures[0]
    assert "step_000000003" in first and "crash after op" in first
    assert "rename(" in first and "fsync(" in first  # the operation sequence is printed


def test_a_write_the_recording_cannot_see_refuses_the_recording(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with pytest.raises(RecordingGap, match="do not rebuild"), Recorder(root):
        (root / naming.COMMIT_MARKER).write_bytes(b"written around the os module")


def test_a_checkpoint_moved_and_lost_is_caught(tmp_path: Path) -> None:
    """Each name alone may be empty before or after a move; the checkpoint may not be
    gone from both."""
    root = tmp_path / "root"
    with fc.CheckpointManager(root) as mgr:
        for step in (1, 2):
            mgr.maybe_save(state(step), step=step, force=True)
    before = scan(root)
    (root / "branches" / "b").mkdir(parents=True)
    moved = root / "branches" / "b" / "step_000000002"
    (root / "step_000000002").rename(moved)
    oracle = Oracle(before, scan(root))
    assert oracle.check(root) == []
    shutil.rmtree(moved)
    assert any("nowhere" in p for p in oracle.check(root))
