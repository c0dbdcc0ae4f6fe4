"""Symbolic links among a root's steps: nothing is ever deleted, moved or written through one.

A ``step_N`` that is a link names another run's checkpoint. Deleting the step,
pruning it by retention, rolling back past it or removing it must leave what it
points to whole (regression: ``delete`` used to unlink the target's marker through
the link, so the other run's checkpoint no longer restored).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.format.naming import step_name


def _other_run(tmp_path: Path) -> Path:
    """A committed checkpoint of another run, outside the root under test."""
    other = tmp_path / "other" / step_name(5)
    fc.save(other, {"w": torch.arange(4.0)})
    return other


def _intact(path: Path) -> None:
    assert fc.verify(path).ok
    assert torch.equal(fc.restore(path)["w"], torch.arange(4.0))


def _root_with_link(tmp_path: Path, other: Path, step: int = 5) -> Path:
    root = tmp_path / "root"
    with fc.CheckpointManager(root, fc.every_steps(1)) as mgr:
        mgr.maybe_save({"w": torch.zeros(4)}, step=1)
    os.symlink(other, root / step_name(step))
    return root


def test_deleting_a_symlinked_step_removes_the_link_only(tmp_path: Path) -> None:
    other = _other_run(tmp_path)
    root = _root_with_link(tmp_path, other)
    with fc.CheckpointManager(root, fc.every_steps(1)) as mgr:
        mgr.delete(5)
        assert not os.path.lexists(root / step_name(5))
    _intact(other)


def test_a_symlinked_step_is_no_checkpoint_of_the_root(tmp_path: Path) -> None:
    """Listing, retention and resume pass a link by: it is not this root's checkpoint."""
    other = _other_run(tmp_path)
    root = _root_with_link(tmp_path, other, step=0)
    with fc.CheckpointManager(root, fc.every_steps(1), fc.keep_last(1)) as mgr:
        assert mgr.steps() == [1]
        mgr.maybe_save({"w": torch.ones(4)}, step=2)
        mgr.maybe_save({"w": torch.ones(4)}, step=3)
        assert mgr.steps() == [3]
    assert os.path.islink(root / step_name(0))  # left alone, not followed
    _intact(other)


def test_rolling_back_past_a_symlinked_step_leaves_its_target_whole(tmp_path: Path) -> None:
    other = _other_run(tmp_path)
    root = _root_with_link(tmp_path, other, step=7)
    with fc.CheckpointManager(root, fc.every_steps(1)) as mgr:
        mgr.rollback(1)
        assert mgr.steps() == [1]
    _intact(other)


def test_remove_refuses_a_link(tmp_path: Path) -> None:
    other = _other_run(tmp_path)
    link = tmp_path / "link"
    os.symlink(other, link)
    with pytest.raises(fc.CheckpointError, match="symbolic link"):
        fc.manager.remove_checkpoint(link)
    assert os.path.islink(link)
    _intact(other)


@pytest.mark.parametrize("kind", ["checkpoint", "stock DCP", "export", "recording", "file"])
def test_a_root_that_is_a_checkpoint_is_refused(tmp_path: Path, kind: str) -> None:
    """Regression: CheckpointManager("root/step_2") wrote its lock and steps into the
    committed checkpoint, which then failed verification."""
    import torch.distributed.checkpoint as dcp

    root = tmp_path / "root"
    with fc.CheckpointManager(root, fc.every_steps(1)) as mgr:
        mgr.maybe_save({"w": torch.zeros(4)}, step=2)
    wrong = {
        "checkpoint": root / step_name(2),
        "stock DCP": tmp_path / "stock",
        "export": tmp_path / "export",
        "recording": tmp_path / "recording",
        "file": tmp_path / "file",
    }[kind]
    if kind == "stock DCP":
        dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(wrong), no_dist=True)
    elif kind == "export":
        fc.export_safetensors({"model": {"w": torch.zeros(2)}}, wrong)
    elif kind == "recording":
        with fc.recording.Recorder(wrong, every=1) as rec:
            rec.record({"w": torch.zeros(2)}, step=0)
    elif kind == "file":
        wrong.write_text("x")
    before = sorted(p.name for p in wrong.iterdir()) if wrong.is_dir() else None
    with pytest.raises(fc.CheckpointError, match="not a directory of checkpoints"):
        fc.CheckpointManager(wrong, fc.every_steps(1))
    with pytest.raises(fc.CheckpointError, match="not a directory of checkpoints"):
        fc.CheckpointManager(wrong, read_only=True)
    assert (sorted(p.name for p in wrong.iterdir()) if wrong.is_dir() else None) == before
    if kind == "checkpoint":
        assert fc.verify(wrong).ok
        with pytest.raises(fc.CheckpointError, match=f"Did you mean .*{root.name}"):
            fc.CheckpointManager(wrong)
        with pytest.raises(fc.CheckpointError, match="inside"):
            fc.CheckpointManager(wrong / "nested")
