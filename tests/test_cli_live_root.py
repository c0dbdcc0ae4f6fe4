"""A reader of a live root never takes a pruned checkpoint for bad input: every CLI
command that lists a root and then reads what it listed lists again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src import cli


@pytest.fixture
def pruning(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A root of three steps whose trainer prunes steps 1 and 2 right after the first
    checkpoint is listed, before it is read."""
    root = tmp_path / "run"
    with fc.CheckpointManager(root, keep=fc.keep_last(5)) as mgr:
        for step in (1, 2, 3):
            mgr.maybe_save({"w": torch.full((64,), float(step))}, step=step, force=True)
        doomed = [mgr.path(1), mgr.path(2)]
    verify = fc.verify

    def pruned_first(path: Any, *args: Any, **kwargs: Any) -> Any:
        while doomed:
            fc.manager.remove_checkpoint(doomed.pop())
        return verify(path, *args, **kwargs)

    monkeypatch.setattr(fc, "verify", pruned_first)
    return root


@pytest.mark.parametrize("argv", [["verify"], ["ls", "--verify"]])
def test_a_checkpoint_pruned_while_listed_is_skipped(
    pruning: Path, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main([*argv, str(pruning)])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "step_000000003" in out or "1 checkpoint intact" in out
    assert "step_000000001" not in out and "damaged" not in out.lower()
