"""fc.manager.remove_checkpoint: the public crash-safe delete of one checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.format import naming
from functional_ckpt._src.root import delete, leftovers
from functional_ckpt._src.storage import commit
from functional_ckpt.errors import CheckpointError, CheckpointNotFound


def test_removes_a_checkpoint_and_refuses_anything_else(tmp_path: Path) -> None:
    fc.save(tmp_path / "ck", {"w": torch.arange(3)})
    delete.remove_checkpoint(tmp_path / "ck")
    assert os.listdir(tmp_path) == []

    with pytest.raises(CheckpointNotFound, match="no such checkpoint"):
        delete.remove_checkpoint(tmp_path / "ck")
    delete.remove_checkpoint(tmp_path / "ck", missing_ok=True)

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train.py").write_text("print(1)")
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("x")
    fc.save(tmp_path / "real", {"w": torch.arange(3)})
    (tmp_path / "link").symlink_to(tmp_path / "real")
    for name in ("src", "empty", "file", "link"):
        with pytest.raises(CheckpointError, match="not a checkpoint directory"):
            delete.remove_checkpoint(tmp_path / name)
    assert (tmp_path / "src" / "train.py").read_text() == "print(1)"
    assert (tmp_path / "empty").is_dir() and (tmp_path / "file").is_file()
    assert fc.verify(tmp_path / "real").ok


def test_a_crash_mid_removal_leaves_no_readable_half(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fc.save(tmp_path / "step_000000007", {"w": torch.arange(3)})

    def crash(path: Path) -> None:
        raise KeyboardInterrupt  # the process dies before the files are gone

    monkeypatch.setattr(commit, "remove_tree", crash)
    with pytest.raises(KeyboardInterrupt):
        delete.remove_checkpoint(tmp_path / "step_000000007")
    monkeypatch.undo()
    (left,) = os.listdir(tmp_path)
    assert left.startswith("step_000000007" + naming.TRASH_INFIX)
    assert not (tmp_path / left / naming.COMMIT_MARKER).exists()
    # The next writer of the root finishes the deletion instead of recovering it.
    leftovers.recover_leftovers(tmp_path)
    assert os.listdir(tmp_path) == []
